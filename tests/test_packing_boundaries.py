"""Only explicit boundaries mark the documents of a packed batch (issue 51): ``seq_idx`` or ``cu_seq_lens_q/k``.

``position_ids`` are positions and nothing more, as in transformers' own encoders under SDPA and eager attention, so
an ordinary batch (padded, generating, numbered from anywhere) never changes shape nor is refused because of them
(point 13 and transformers' own generation and common tests). Where a packed batch lost its boundaries the model says
so where it can (point 15), and Longformer's accelerator form fails instead of cutting documents when ``max_length_q``
understates them (point 14).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_xformers.ops import packing
from hf_xformers.ops.input_checks import as_if_on_accelerator
from hf_xformers.registration import REGISTRY

from .host_reads import HostReadCounter
from .packing_conformance import _document

# The conformance suites of the packing architectures (their tiny configs and packing helpers).
from .test_packing_faithful import SUITES

# transformers' testers' tiny text config (scripts/transformers_tests/test_hfx_models.py).
TESTER = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
              max_position_embeddings=64)  # fmt: skip
ATOL = 1e-5


def build(arch: str, head: str = "AutoModel"):
    suite = SUITES[arch]()
    torch.manual_seed(0)
    return suite, suite.make_model(head, **suite.packing_config).eval()


def first_position(suite, model) -> int:
    return suite.packing_position_start(model)


def segments(suite, lengths, seed: int = 0) -> list[torch.Tensor]:
    vocab = suite.make_config().vocab_size
    return [_document(n, seed + i, vocab) for i, n in enumerate(lengths)]


@pytest.fixture
def fresh_warning(monkeypatch):
    """The unmarked-restarts warning warns once per process: armed again for this test."""
    monkeypatch.setattr(packing, "_WARNED_UNMARKED_RESTARTS", False)


# ----- point 13: positions never mark documents -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["bigbird", "universal"])
def test_right_padded_batch_numbered_by_its_mask_is_one_answer_per_row(arch):
    """A right-padded batch of 2 with ``position_ids = arange * mask`` and no ``attention_mask``: two rows of logits
    (479aea5 read every padding token as a document: 4 or 5 rows)."""
    suite, model = build(arch, "AutoModelForSequenceClassification")
    ids = torch.stack(segments(suite, (6, 6)))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    ids[1, 4:] = model.config.pad_token_id
    positions = torch.arange(6)[None] * mask + first_position(suite, model) * mask
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions).logits
        rows = torch.cat([model(input_ids=ids[r : r + 1], position_ids=positions[r : r + 1]).logits for r in (0, 1)])
    assert logits.shape == (2, model.config.num_labels)
    torch.testing.assert_close(logits, rows, rtol=0, atol=ATOL)


def test_one_row_of_two_numbered_segments_is_one_sequence(fresh_warning):
    """One Longformer row whose two segments are each numbered from the start: one answer, the row read as one
    sequence (its segments see each other), and a warning that positions do not mark documents."""
    suite, model = build("longformer", "AutoModelForSequenceClassification")
    row = torch.cat(segments(suite, (5, 7)))[None]
    start = first_position(suite, model)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None] + start
    with torch.no_grad(), pytest.warns(UserWarning, match="positions never mark documents.*`seq_idx`"):
        logits = model(input_ids=row, position_ids=positions).logits
    assert logits.shape == (1, model.config.num_labels)
    seq_idx = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        packed = model(input_ids=row, position_ids=positions, seq_idx=seq_idx).logits
    assert packed.shape == (2, model.config.num_labels)  # the same row with its boundaries: one answer per document


@pytest.mark.parametrize("arch", ["bigbird", "universal", "longformer"])
def test_constant_positions_are_one_sequence(arch):
    """Constant positions: one answer per row, and every token attends to the others (479aea5 made each token a
    document that saw only itself: 12 answers for one row)."""
    suite, model = build(arch, "AutoModelForSequenceClassification")
    row = segments(suite, (12,))[0][None]
    positions = torch.full((1, 12), first_position(suite, model))
    with torch.no_grad():
        assert model(input_ids=row, position_ids=positions).logits.shape == (1, model.config.num_labels)
        encoder = model.base_model
        hidden = encoder(input_ids=row, position_ids=positions).last_hidden_state
        changed = row.clone()
        changed[0, 5] = (changed[0, 5] + 1 - 5) % (model.config.vocab_size - 5) + 5
        other = encoder(input_ids=changed, position_ids=positions).last_hidden_state
    moved = (other - hidden).abs().amax(-1)[0]
    assert float(moved[4]) > 1e-4 and float(moved[6]) > 1e-4, "token 5 does not reach its neighbours"


def test_longformer_takes_robertas_own_positions_without_a_mask():
    """RoBERTa's positions (padding at ``padding_idx``, real tokens from ``padding_idx + 1``), as the model computes
    them itself when ``position_ids`` is omitted, and no mask: the same answer as without ``position_ids`` (479aea5
    refused it: "positions must start at 2")."""
    suite, model = build("longformer", "AutoModelForSequenceClassification")
    ids = torch.stack(segments(suite, (6, 6)))
    pad = model.config.pad_token_id
    ids[1, 4:] = pad
    real = (ids != pad).long()
    positions = real.cumsum(-1) * real + pad
    with torch.no_grad():
        given = model(input_ids=ids, position_ids=positions).logits
        computed = model(input_ids=ids).logits
    assert given.shape == (2, model.config.num_labels)
    torch.testing.assert_close(given, computed, rtol=0, atol=0)


GENERATORS = {
    "HfxPerformer": ("hfx-performer", dict(num_random_features=16, type_vocab_size=1)),
    "HfxUniversal": ("hfx-universal", {}),
    "HfxUniversalFixedSteps": ("hfx-universal", dict(use_act=False)),
}


@pytest.mark.parametrize("name", GENERATORS)
def test_generate_with_holes_in_the_mask_answers(name):
    """transformers' generation tests: a prompt whose mask holds zeros (its last token padding), decoded without a
    cache, so that every step passes ``generate()``'s positions (the new token's follows the padding's): an answer
    per step (479aea5: "positions must start at 0 / 2")."""
    model_type, overrides = GENERATORS[name]
    config_class, heads = REGISTRY[model_type]
    torch.manual_seed(0)
    model = heads["AutoModelForCausalLM"](config_class(**TESTER, **overrides, is_decoder=True, pad_token_id=1)).eval()
    ids = torch.randint(5, 99, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 1, 1, 1]])
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=3, do_sample=False, use_cache=False, pad_token_id=1,
        eos_token_id=None, return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    assert out.sequences.shape == (2, 11) and len(out.scores) == 3


EMBEDDERS = {
    "HfxLinformer": ("hfx-linformer", dict(linformer_k=8, type_vocab_size=1, max_position_embeddings=18)),
    "HfxLongformer": ("hfx-longformer", dict(attention_window=4, type_vocab_size=1)),
    "HfxPerformer": ("hfx-performer", dict(num_random_features=16, type_vocab_size=1)),
}


@pytest.mark.parametrize("name", EMBEDDERS)
def test_inputs_embeds_match_input_ids_with_holes_in_the_mask(name):
    """``test_inputs_embeds_matches_input_ids``' inputs: a mask with holes and positions counted over every token
    (as RoBERTa counts ids without padding): ids and embeddings answer alike (479aea5 refused both)."""
    model_type, overrides = EMBEDDERS[name]
    config_class, heads = REGISTRY[model_type]
    torch.manual_seed(0)
    model = heads["AutoModel"](config_class(**{**TESTER, **overrides})).eval()
    ids = torch.randint(5, 99, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1]]).expand(3, -1)
    positions = torch.arange(16)[None].expand(3, -1) + model.embeddings.position_offset
    with torch.no_grad():
        from_ids = model(input_ids=ids, attention_mask=mask, position_ids=positions)[0]
        from_embeds = model(
            inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask, position_ids=positions
        )[0]
    torch.testing.assert_close(from_embeds, from_ids)


# ----- point 15: where the boundaries were dropped -------------------------------------------------------------------


def collator_row(suite, model, lengths) -> dict:
    """``DataCollatorWithFlattening``'s default row: restarting ``position_ids`` and no boundaries."""
    from transformers import DataCollatorWithFlattening

    docs = segments(suite, lengths)
    batch = DataCollatorWithFlattening(position_ids_start=first_position(suite, model))(
        [{"input_ids": d.tolist()} for d in docs]
    )
    batch.pop("labels")
    return batch


@pytest.mark.parametrize("head", ["AutoModelForSequenceClassification", "AutoModelForQuestionAnswering"])
def test_per_document_targets_without_boundaries_name_them(head):
    """Per-document labels (or QA positions) on a row whose boundaries were dropped: a ValueError that names
    ``seq_idx`` / ``cu_seq_lens`` and ``remove_unused_columns=False``, not torch's batch-size error."""
    suite, model = build("longformer", head)
    batch = collator_row(suite, model, (6, 9, 5))
    if head == "AutoModelForSequenceClassification":
        batch["labels"] = torch.tensor([0, 1, 2])
    else:
        batch["start_positions"] = batch["end_positions"] = torch.tensor([1, 2, 1])
    with pytest.raises(ValueError, match=r"marks no documents.*`seq_idx`.*remove_unused_columns=False"):
        model(**batch)


def test_packed_multiple_choice_without_boundaries_names_them():
    suite, model = build("longformer", "AutoModelForMultipleChoice")
    batch = collator_row(suite, model, (6, 9, 5, 7))
    with pytest.raises(ValueError, match=r"marks no documents.*`cu_seq_lens_q/k`.*remove_unused_columns=False"):
        model(**batch, num_choices=2, labels=torch.tensor([0, 1]))


def test_restarting_positions_without_boundaries_warn_once(fresh_warning):
    """The collator's default row (no boundaries): answered as one sequence, with one warning per process."""
    suite, model = build("performer", "AutoModelForMaskedLM")
    batch = collator_row(suite, model, (6, 9, 5))
    with torch.no_grad(), pytest.warns(UserWarning, match="positions never mark documents"):
        out = model(**batch)
    assert out.logits.shape[:2] == batch["input_ids"].shape
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batch)  # once only


@pytest.mark.parametrize("arch", list(SUITES))
def test_ordinary_positions_do_not_warn(arch, fresh_warning):
    """``generate()``'s positions (left padding and a hole, counted over the mask), RoBERTa's and constant ones:
    no warning (the warning compares each real token with the previous *real* token)."""
    suite, model = build(arch)
    ids = segments(suite, (9,))[0][None]
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1, 1]])
    generated = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    start = first_position(suite, model)
    roberta = mask.cumsum(-1) * mask + max(start - 1, 0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for positions in (generated, roberta, torch.full_like(ids, start)):
            model(input_ids=ids, attention_mask=mask, position_ids=positions)


def test_accelerator_training_step_of_an_unmarked_row_reads_nothing(fresh_warning):
    """The warning reads positions only where reads are free: an accelerator's training step of the collator's
    default row makes no host read for it."""
    suite, model = build("performer", "AutoModelForMaskedLM")
    model.train()
    batch = collator_row(suite, model, (6, 9, 5))
    batch["labels"] = batch["input_ids"].clone()
    with as_if_on_accelerator(), HostReadCounter() as counter, warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batch).loss.backward()
    assert counter.total_reads == 0, dict(counter.reads)


# ----- point 14: an understated max_length_q in the accelerator form -------------------------------------------------


def test_longformer_classification_fails_on_an_understated_max_length_in_the_accelerator_form():
    """Sequence classification's global ``<s>`` rows are sized by ``max_length_q``: said 7 where a document has 22
    tokens, a training step that reads nothing back fails at run time naming ``max_length_q`` (479aea5: logits off
    by up to 6.8e-3, no error), as question answering does."""
    suite, model = build("longformer", "AutoModelForSequenceClassification")
    model.train()
    batch = suite.pack(model, segments(suite, (6, 22, 5)), "cu_seq_lens", labels=torch.tensor([0, 1, 2]))
    batch["max_length_q"] = batch["max_length_k"] = 7
    with as_if_on_accelerator(), pytest.raises(RuntimeError, match=r"`max_length_q/k` \(7\) understate"):
        model(**batch)
    with pytest.raises(ValueError, match=r"`max_length_q/k` say the longest document .* 7 tokens, but one has 22"):
        model(**batch)  # the CPU form reads the lengths
    batch["max_length_q"] = batch["max_length_k"] = 22
    with as_if_on_accelerator():
        logits = model(**batch).logits
    with torch.no_grad():
        solos = torch.cat([model(input_ids=d[None]).logits for d in segments(suite, (6, 22, 5))])
    torch.testing.assert_close(logits.detach(), solos, rtol=0, atol=ATOL)
