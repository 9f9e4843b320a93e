"""The input contract (issue 46): what each model checks before any kernel runs, and the error that names the fix.

Every row of ``hf_xformers.ops.input_checks.INPUT_CONTRACT`` (the table of ``docs/input-contract.md``) is triggered
here on every model it names; the findings that are no table row (Longformer's default global token from
``inputs_embeds``, Reformer's compiled ``seq_idx`` batch, Performer's compiled redraw) have their own tests.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_xformers import (
    HfxLongformerConfig,
    HfxLongformerForMultipleChoice,
    HfxLongformerForQuestionAnswering,
    HfxLongformerForSequenceClassification,
)
from hf_xformers.models import ARCHITECTURES
from hf_xformers.ops.input_checks import INPUT_CONTRACT, as_if_on_accelerator

# The conformance suites' tiny config (hidden 32, 2 layers, 3 labels) and ids between <s> (0) and </s> (2).
from .conformance import _TINY as TINY
from .conformance import VOCAB
from .conformance import _ids as token_ids

# ----- finding 3: Longformer's default global token from inputs_embeds ------------------------------------------------


def longformer(head: type = HfxLongformerForSequenceClassification):
    torch.manual_seed(0)
    return head(HfxLongformerConfig(**TINY, attention_window=4, type_vocab_size=1)).eval()


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator-form"])
def test_longformer_classification_from_embeddings_keeps_first_token_global(accelerator):
    model = longformer()
    ids = token_ids(2, 19)
    embeds = model.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with as_if_on_accelerator() if accelerator else torch.enable_grad():
        got = model(inputs_embeds=embeds).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_longformer_packed_embeddings_match_each_document_alone():
    model = longformer()
    docs = [token_ids(1, n, seed=n) for n in (7, 12)]
    embed = model.get_input_embeddings()
    with torch.no_grad():
        alone = torch.cat([model(inputs_embeds=embed(d)).logits for d in docs])
        positions = torch.cat([torch.arange(2, 2 + d.shape[1]) for d in docs])[None]
        seq_idx = torch.cat([torch.full((d.shape[1],), i) for i, d in enumerate(docs)])[None]
        packed = model(inputs_embeds=embed(torch.cat(docs, 1)), position_ids=positions, seq_idx=seq_idx).logits
        from_ids = torch.cat([model(input_ids=d).logits for d in docs])
    torch.testing.assert_close(alone, from_ids, rtol=0, atol=1e-6)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("head", [HfxLongformerForQuestionAnswering, HfxLongformerForMultipleChoice])
def test_longformer_separator_tasks_from_embeddings_ask_for_global_mask(head):
    model = longformer(head)
    ids = token_ids(2, 11)
    ids[:, 4:6] = 2
    if head is HfxLongformerForMultipleChoice:
        ids = ids[None]
    embeds = model.get_input_embeddings()(ids).detach()
    with pytest.raises(ValueError, match="pass `global_attention_mask`"):
        model(inputs_embeds=embeds)
    glob = torch.zeros(ids.shape, dtype=torch.long)
    glob[..., :4] = 1
    with torch.no_grad():
        out = model(inputs_embeds=embeds, global_attention_mask=glob)
        ref = model(input_ids=ids, global_attention_mask=glob)
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-6)


# ----- finding 6: a collator batch with seq_idx and cu_seq_lens compiles on Reformer ------------------------------------


def test_reformer_compiles_a_collator_batch_that_carries_seq_idx_too():
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``: the boundaries are read from
    ``cu_seq_lens`` (whose shape gives the number of documents a traced graph needs), so masked-LM training compiles
    with ``fullgraph=True`` and gives eager mode's loss and gradients."""
    from transformers import DataCollatorWithFlattening

    from hf_xformers import HfxReformerConfig, HfxReformerForMaskedLM

    config = HfxReformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=37,
        attn_layers=["local", "lsh"], local_attn_chunk_length=4, lsh_attn_chunk_length=8, num_buckets=4,
        axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16], max_position_embeddings=64, pad_token_id=1,
        eos_token_id=None, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0, hash_seed=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = HfxReformerForMaskedLM(config).train()
    docs = [token_ids(1, n, seed=n)[0].tolist() for n in (9, 14, 5)]
    collator = DataCollatorWithFlattening(position_ids_start=0, return_flash_attn_kwargs=True, return_seq_idx=True)
    batch = collator([{"input_ids": d} for d in docs])
    assert {"seq_idx", "cu_seq_lens_q", "position_ids"} <= set(batch)

    def step(fn):
        model.zero_grad()
        loss = fn(**batch).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    torch._dynamo.reset()
    compiled_loss, compiled_grads = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    eager_loss, eager_grads = step(model)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=1e-6)
    for got, expected in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


# ----- finding 10 and the table: every row of INPUT_CONTRACT on every model it names -------------------------------------

# Tiny configurations of the text architectures (hidden 32, 2 layers), by folder name.
REFORMER = dict(
    hidden_size=32, num_attention_heads=2, attention_head_size=8, feed_forward_size=37, attn_layers=["local", "lsh"],
    local_attn_chunk_length=4, lsh_attn_chunk_length=8, num_buckets=4, axial_pos_shape=[8, 8],
    axial_pos_embds_dim=[16, 16], pad_token_id=1, eos_token_id=None, hash_seed=3,
)  # fmt: skip
TRANSFO_XL = dict(cutoffs=[20, 50], d_model=32, n_head=4, d_inner=37, n_layer=2, div_val=2, mem_len=8, clamp_len=0)
CONFIGS = {
    "longformer": dict(TINY, attention_window=4, type_vocab_size=1),
    "bigbird": dict(TINY, block_size=4, num_random_blocks=1, sep_token_id=2),
    "linformer": dict(TINY, linformer_k=16, type_vocab_size=1),
    "performer": dict(TINY, num_random_features=32, type_vocab_size=1),
    "reformer": dict(REFORMER, vocab_size=VOCAB, max_position_embeddings=64, num_labels=3),
    "universal": dict(TINY, act_max_steps=2),
    "transfo_xl": dict(TRANSFO_XL, vocab_size=VOCAB, num_labels=3),
}
DECLARATIONS = {arch.config_class.__module__.split(".")[2]: arch for arch in ARCHITECTURES}


@functools.cache
def build(arch: str, auto: str = "AutoModel"):
    """A tiny model of ``arch`` in eval mode, built once (the refused calls change nothing in it)."""
    torch.manual_seed(0)
    declaration = DECLARATIONS[arch]
    return declaration.auto_classes[auto](declaration.config_class(**CONFIGS[arch])).eval()


class KernelRecorder(TorchDispatchMode):
    """Records the aten ops that run; the checks must refuse before any of the model's kernels (an embedding lookup,
    a matrix product) runs."""

    KERNELS = ("embedding", "mm", "addmm", "bmm", "linear", "matmul", "scaled_dot_product")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))

    def kernels(self) -> list[str]:
        return [op for op in self.ops if op.split(".")[0] in self.KERNELS]


def refused(key: str, call) -> None:
    """``call()`` raises row ``key``'s ValueError (its fix ends the message) before any kernel of the model runs."""
    recorder = KernelRecorder()
    with pytest.raises(ValueError, match=re.escape(INPUT_CONTRACT[key].fix)), torch.no_grad(), recorder:
        call()
    assert not recorder.kernels(), f"{key}: {recorder.kernels()} ran before the refusal"


def first_position(model) -> int:
    """The position id of a sequence's first token (RoBERTa-style tables start at 2)."""
    return getattr(getattr(model, "embeddings", None), "position_offset", 0)


def position_table(model) -> int | None:
    """The number of positions the model covers (None: sinusoidal positions, unbounded)."""
    config = model.config
    if getattr(config, "position_embedding_type", "absolute") == "sinusoidal":
        return None
    table = getattr(getattr(model, "embeddings", None), "position_embeddings", None)
    if isinstance(table, torch.nn.Embedding):
        return table.num_embeddings
    return config.max_position_embeddings


def trigger_ids_or_embeds(arch: str) -> None:
    model = build(arch)
    ids = token_ids(2, 8)
    embeds = model.get_input_embeddings()(ids).detach()
    refused("ids_or_embeds", lambda: model())
    refused("ids_or_embeds", lambda: model(input_ids=ids, inputs_embeds=embeds))


def trigger_token_id_dtype(arch: str) -> None:
    model = build(arch)
    refused("token_id_dtype", lambda: model(input_ids=token_ids(2, 8).float()))
    refused("token_id_dtype", lambda: model(input_ids=token_ids(2, 8).bool()))


def trigger_token_id_range(arch: str) -> None:
    model = build(arch)
    for bad in (-100, model.config.vocab_size):
        ids = token_ids(2, 8)
        ids[1, 3] = bad
        refused("token_id_range", lambda ids=ids: model(input_ids=ids))


def trigger_empty_batch(arch: str) -> None:
    model = build(arch)
    refused("empty_batch", lambda: model(input_ids=token_ids(2, 8)[:0]))
    refused("empty_batch", lambda: model(input_ids=token_ids(2, 8)[:, :0]))


def trigger_embeds_width(arch: str) -> None:
    model = build(arch)
    embeds = model.get_input_embeddings()(token_ids(2, 8)).detach()
    refused("embeds_width", lambda: model(inputs_embeds=torch.cat([embeds, embeds[..., :1]], -1)))
    refused("embeds_width", lambda: model(inputs_embeds=embeds[..., :-1]))


def trigger_position_ids_shape(arch: str) -> None:
    model = build(arch)
    ids = token_ids(2, 8)
    start = first_position(model)
    refused("position_ids_shape", lambda: model(input_ids=ids, position_ids=torch.arange(start, start + 7)[None]))
    refused("position_ids_shape", lambda: model(input_ids=ids, position_ids=torch.arange(start, start + 8)))
    refused(
        "position_ids_shape", lambda: model(input_ids=ids, position_ids=torch.arange(start, start + 8).repeat(3, 1))
    )


def trigger_position_ids_range(arch: str) -> None:
    model = build(arch)
    ids = token_ids(2, 8)
    refused("position_ids_range", lambda: model(input_ids=ids, position_ids=torch.arange(-1, 7).expand(2, -1)))
    table = position_table(model)
    if table is not None:
        past = torch.arange(table - 7, table + 1).expand(2, -1)
        refused("position_ids_range", lambda: model(input_ids=ids, position_ids=past))


def trigger_label_range(arch: str) -> None:
    model = build(arch, "AutoModelForSequenceClassification")
    ids = token_ids(2, 8)
    for bad in (-1, 3):
        refused("label_range", lambda bad=bad: model(input_ids=ids, labels=torch.tensor([bad, 0])))
    if "AutoModelForMultipleChoice" in DECLARATIONS[arch].auto_classes:
        choice = build(arch, "AutoModelForMultipleChoice")
        ids = token_ids(4, 8).view(2, 2, 8)
        for bad in (-1, 2):
            refused("label_range", lambda bad=bad: choice(input_ids=ids, labels=torch.tensor([0, bad])))


def padded_packed_row(arch: str, width: int = 32) -> tuple[dict, list[torch.Tensor]]:
    """The collator's packed row of three documents with ``cu_seq_lens``, padded after packing to ``width``."""
    from transformers import DataCollatorWithFlattening

    model = build(arch)
    docs = [token_ids(1, n, seed=n)[0] for n in (9, 6, 11)]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, position_ids_start=first_position(model))
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    total = batch["input_ids"].shape[1]
    pad = width - total
    pad_id = model.config.pad_token_id
    batch["input_ids"] = torch.cat([batch["input_ids"], torch.full((1, pad), pad_id)], 1)
    batch["position_ids"] = torch.cat([batch["position_ids"], torch.full((1, pad), first_position(model))], 1)
    batch["attention_mask"] = (torch.arange(width) < total).long()[None]
    return batch, docs


def trigger_cu_seq_lens_padded(arch: str) -> None:
    model = build(arch)
    batch, _ = padded_packed_row(arch)
    refused("cu_seq_lens_padded", lambda: model(**batch))


def trigger_input_rank(arch: str) -> None:
    model = build(arch)
    ids = token_ids(2, 8)
    refused("input_rank", lambda: model(input_ids=ids[0]))
    refused("input_rank", lambda: model(input_ids=ids[None]))


def trigger_sequence_too_long(arch: str) -> None:
    model = build(arch)
    limit = getattr(model.embeddings, "max_tokens", model.config.max_position_embeddings)
    refused("sequence_too_long", lambda: model(input_ids=token_ids(1, limit + 1)))


def trigger_mask_shape(arch: str) -> None:
    model = build(arch)
    ids = token_ids(2, 8)
    refused("mask_shape", lambda: model(input_ids=ids, attention_mask=torch.ones(2, 7, dtype=torch.long)))
    refused("mask_shape", lambda: model(input_ids=ids, attention_mask=torch.ones(3, 8, dtype=torch.long)))
    if arch == "longformer":
        refused("mask_shape", lambda: model(input_ids=ids, global_attention_mask=torch.ones(2, 7, dtype=torch.long)))


def trigger_no_global_attention(arch: str) -> None:
    ids = token_ids(2, 8)
    glob = torch.zeros_like(ids)
    glob[:, 0] = 1
    if arch != "universal":  # its base model takes no `global_attention_mask` at all (a TypeError)
        refused("no_global_attention", lambda: build(arch)(input_ids=ids, global_attention_mask=glob))
    head = build(arch, "AutoModelForSequenceClassification")
    refused("no_global_attention", lambda: head(input_ids=ids, global_attention_mask=glob))


def trigger_token_type_shape(arch: str) -> None:
    model = build(arch)
    refused("token_type_shape", lambda: model(input_ids=token_ids(2, 8), token_type_ids=torch.zeros(2, 7).long()))


def trigger_token_type_range(arch: str) -> None:
    model = build(arch)
    ids = token_ids(2, 8)
    if arch == "reformer":  # no token types at all
        refused("token_type_range", lambda: model(input_ids=ids, token_type_ids=torch.zeros_like(ids)))
        return
    for bad in (-1, model.config.type_vocab_size):
        refused("token_type_range", lambda bad=bad: model(input_ids=ids, token_type_ids=torch.full_like(ids, bad)))


def trigger_global_default_needs_ids(arch: str) -> None:
    ids = token_ids(2, 11)
    ids[:, 4:6] = 2
    qa = build(arch, "AutoModelForQuestionAnswering")
    embeds = qa.get_input_embeddings()(ids).detach()
    refused("global_default_needs_ids", lambda: qa(inputs_embeds=embeds))
    choice = build(arch, "AutoModelForMultipleChoice")
    refused("global_default_needs_ids", lambda: choice(inputs_embeds=embeds[None]))


def trigger_global_default_needs_separator(arch: str) -> None:
    ids = token_ids(2, 11)
    ids[:, -1] = 7  # no separator anywhere
    refused("global_default_needs_separator", lambda: build(arch, "AutoModelForQuestionAnswering")(input_ids=ids))
    choice = build(arch, "AutoModelForMultipleChoice")
    refused("global_default_needs_separator", lambda: choice(input_ids=ids[None]))


def trigger_packed_position_start(arch: str) -> None:
    from transformers import DataCollatorWithFlattening

    model = build(arch)
    docs = [token_ids(1, n, seed=n)[0].tolist() for n in (5, 7)]
    for start in (first_position(model) + 1, first_position(model) + 3):
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, position_ids_start=start)(
            [{"input_ids": d} for d in docs]
        )
        batch.pop("labels")
        refused("packed_position_start", lambda batch=batch: model(**batch))


TRIGGERS = {
    "ids_or_embeds": trigger_ids_or_embeds,
    "input_rank": trigger_input_rank,
    "sequence_too_long": trigger_sequence_too_long,
    "mask_shape": trigger_mask_shape,
    "no_global_attention": trigger_no_global_attention,
    "token_type_shape": trigger_token_type_shape,
    "token_type_range": trigger_token_type_range,
    "global_default_needs_ids": trigger_global_default_needs_ids,
    "global_default_needs_separator": trigger_global_default_needs_separator,
    "packed_position_start": trigger_packed_position_start,
    "token_id_dtype": trigger_token_id_dtype,
    "token_id_range": trigger_token_id_range,
    "empty_batch": trigger_empty_batch,
    "embeds_width": trigger_embeds_width,
    "position_ids_shape": trigger_position_ids_shape,
    "position_ids_range": trigger_position_ids_range,
    "label_range": trigger_label_range,
    "cu_seq_lens_padded": trigger_cu_seq_lens_padded,
}


def test_docs_table_is_the_contract():
    """docs/input-contract.md shows exactly the rows the models raise from (regenerate it with contract_table())."""
    from pathlib import Path

    from hf_xformers.ops.input_checks import contract_table

    repo = Path(__file__).resolve().parents[1]
    page = (repo / "docs" / "input-contract.md").read_text(encoding="utf-8")
    match = re.search(
        r"<!-- contract table: generated from INPUT_CONTRACT -->\n(.*?)<!-- end of contract table -->", page, re.S
    )
    assert match, "docs/input-contract.md lost its table markers"
    assert match.group(1).strip() == contract_table().strip()
    assert "input-contract.md" in (repo / "mkdocs.yml").read_text(encoding="utf-8")


def test_every_row_of_the_contract_has_a_trigger():
    assert set(TRIGGERS) == set(INPUT_CONTRACT)
    for check in INPUT_CONTRACT.values():
        assert set(check.models) <= set(CONFIGS), check.key


@pytest.mark.parametrize("key, arch", [(check.key, arch) for check in INPUT_CONTRACT.values() for arch in check.models])
def test_contract_row(key, arch):
    TRIGGERS[key](arch)


def test_cu_seq_lens_padded_fix_gives_each_documents_own_output():
    """What the refusal says to change works: the row's length appended to ``cu_seq_lens`` and the padding masked
    give every document what the unpadded row gives it."""
    model = build("longformer")
    batch, docs = padded_packed_row("longformer")
    total = sum(d.numel() for d in docs)
    fixed = dict(batch, cu_seq_lens_q=torch.cat([batch["cu_seq_lens_q"], torch.tensor([32])]))
    fixed["cu_seq_lens_k"] = fixed["cu_seq_lens_q"]
    unpadded = {k: v[:, :total] if k in ("input_ids", "position_ids") else v for k, v in batch.items()}
    unpadded.pop("attention_mask")
    with torch.no_grad():
        got = model(**fixed).last_hidden_state[:, :total]
        expected = model(**unpadded).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16])
def test_integer_labels_of_any_width_score_as_long(dtype):
    ids = token_ids(2, 8)
    cases = [
        (build("performer", "AutoModelForSequenceClassification"), ids, torch.tensor([2, 0])),
        (build("performer", "AutoModelForMultipleChoice"), token_ids(4, 8).view(2, 2, 8), torch.tensor([1, 0])),
        (build("performer", "AutoModelForTokenClassification"), ids, torch.randint(0, 3, (2, 8))),
        (build("performer", "AutoModelForMaskedLM"), ids, ids.masked_fill(ids > 50, -100)),
    ]
    for model, inputs, labels in cases:
        with torch.no_grad():
            expected = model(input_ids=inputs, labels=labels).loss
            got = model(input_ids=inputs, labels=labels.to(dtype)).loss
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_packed_batch_and_num_choices_are_keyword_only():
    """The collator's ``seq_idx`` was once the 10th / 11th positional argument; now it cannot bind to
    ``packed_batch`` or ``num_choices`` by position: a TypeError instead of an AttributeError or ZeroDivisionError."""
    import inspect

    for arch in CONFIGS:
        for auto, model_class in DECLARATIONS[arch].auto_classes.items():
            parameters = inspect.signature(model_class.forward).parameters
            for name in ("packed_batch", "num_choices"):
                if name in parameters:
                    assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, (arch, auto, name)
    ids = token_ids(1, 8)
    with pytest.raises(TypeError, match="positional argument"):
        build("longformer")(ids, *[None] * 8, torch.zeros_like(ids))
    with pytest.raises(TypeError, match="positional argument"):
        build("longformer", "AutoModelForMultipleChoice")(ids[None], *[None] * 9, torch.zeros_like(ids))


# ----- finding 9: Performer's scheduled redraw compiles, once --------------------------------------------------------


def test_performer_scheduled_redraw_compiles_into_one_graph():
    """``feature_redraw_interval`` under ``torch.compile(fullgraph=True)``: the redraw (a counter buffer, counter-based
    Gaussians: no generator made inside ``forward``) traces, six training calls compile one graph, and the losses,
    projections and draw counters equal eager mode's."""
    from hf_xformers import HfxPerformerConfig, HfxPerformerForMaskedLM

    config = HfxPerformerConfig(**dict(TINY, num_random_features=12, type_vocab_size=1, feature_redraw_interval=2))
    ids = token_ids(2, 12)

    def run(compiled: bool):
        torch.manual_seed(0)
        model = HfxPerformerForMaskedLM(config).train()
        graphs = []

        def counting_backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        step = torch.compile(model, fullgraph=True, backend=counting_backend) if compiled else model
        losses = []
        for _ in range(6):
            loss = step(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        layers = [layer.attention.self for layer in model.performer.encoder.layer]
        return losses, [a.projection_matrix.clone() for a in layers], [int(a.num_redraws) for a in layers], graphs

    torch._dynamo.reset()
    compiled_losses, compiled_projections, compiled_draws, graphs = run(True)
    eager_losses, eager_projections, eager_draws, _ = run(False)
    assert len(graphs) == 1
    assert compiled_draws == eager_draws == [2, 2]  # redrawn before calls 2 and 4
    torch.testing.assert_close(torch.stack(compiled_losses), torch.stack(eager_losses), rtol=0, atol=1e-6)
    for got, expected in zip(compiled_projections, eager_projections, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_seeded_features_are_orthogonal_blocks_of_gaussian_rows():
    """The counter-based draw behind every projection: a function of its key alone, different per key, orthogonal
    within each block of ``head_dim`` rows, and built from standard normal numbers."""
    from hf_xformers.attention.favor_features import counter_normals, draw_key, seeded_random_features

    keys = torch.stack([draw_key(0, 0, 0), draw_key(0, 0, 1), draw_key(0, 1, 0)])
    assert len({tuple(key) for key in keys.tolist()}) == 3
    rows = seeded_random_features(40, 16, keys)
    assert rows.shape == (3, 40, 16)
    torch.testing.assert_close(rows, seeded_random_features(40, 16, keys), rtol=0, atol=0)
    assert (rows[0] - rows[1]).abs().min() > 0 and (rows[0] - rows[2]).abs().max() > 0.1
    block = rows[0, :16] / rows[0, :16].norm(dim=-1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(16), rtol=0, atol=1e-5)
    normals = counter_normals(keys[:1], (200_000,))[0]
    assert abs(float(normals.mean())) < 0.01 and abs(float(normals.std()) - 1) < 0.01
    assert abs(float((normals**4).mean()) - 3) < 0.1  # the kurtosis of a Gaussian, not merely its first moments
