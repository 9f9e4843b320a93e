"""Packed (padding-free) batches in the text conformance suite: every head of every text architecture, given several
documents concatenated in one row in each of the three forms of transformers' ``DataCollatorWithFlattening``, gives
every document what its own forward gives (or, for an architecture that cannot attend within documents, refuses with
a ``ValueError`` that says why). Mixed into :class:`tests.conformance.TextModelConformance`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening

# The collator's three ways of marking where documents start.
PACKING_FORMS = {
    "position_ids": dict(),  # restarting positions alone: the model infers the boundaries
    "seq_idx": dict(return_seq_idx=True),
    "cu_seq_lens": dict(return_flash_attn_kwargs=True),
}
PACKING_FORM_PARAMS = [pytest.param(form, id=form) for form in PACKING_FORMS]


def _document(length: int, seed: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(5, vocab, (length,), generator=g)
    ids[0], ids[-1] = 0, 2  # <s> ... </s>, as a tokenizer gives them
    return ids


class PackingConformance:
    """Packed-batch tests; the host class provides ``heads``, ``make_model``, ``make_config``, ``device``, ``atol``."""

    # Whether the architecture packs; one that does not sets the regex its refusal must match.
    packing_refusal: str | None = None
    # Lengths of the documents packed into one row: shorter and longer than the tiny windows, blocks and chunks.
    packing_lengths: tuple[int, ...] = (10, 23, 7)
    # Config overrides for the packing tests (BigBird: random blocks fixed, so that training draws what eval does).
    packing_config: dict = {}

    # ----- helpers -------------------------------------------------------------------------------
    def packing_position_start(self, model) -> int:
        """The position id of a document's first token (``DataCollatorWithFlattening(position_ids_start=...)``)."""
        base = getattr(model, model.base_model_prefix, model)
        return getattr(getattr(base, "embeddings", None), "position_offset", 0)

    def packing_documents(self) -> list[torch.Tensor]:
        vocab = self.make_config().vocab_size
        return [_document(n, i, vocab) for i, n in enumerate(self.packing_lengths)]

    def pack(self, model, documents: list[torch.Tensor], form: str, **per_document) -> dict:
        """The collator's packed row of ``documents`` in ``form``, on the test's device."""
        collator = DataCollatorWithFlattening(
            position_ids_start=self.packing_position_start(model), **PACKING_FORMS[form]
        )
        batch = collator([{"input_ids": d.tolist()} for d in documents])
        batch.pop("labels", None)  # the collator copies input_ids into labels; tests give their own
        for key, values in per_document.items():
            batch[key] = values
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def solo(self, model, document: torch.Tensor, **extra):
        return model(input_ids=document[None].to(self.device), **extra)

    def _spans(self):
        start = 0
        for n in self.packing_lengths:
            yield slice(start, start + n)
            start += n

    def _packable_heads(self):
        if self.packing_refusal is not None:
            pytest.skip("this architecture refuses packed batches (test_packed_batch_is_refused)")
        return [name for name in self.heads if name != "AutoModelForMultipleChoice"]

    # ----- tests ---------------------------------------------------------------------------------
    @pytest.mark.parametrize("form", PACKING_FORM_PARAMS)
    @pytest.mark.parametrize("mode", ["eval", "train"])
    def test_packed_documents_match_their_own_forwards(self, form, mode):
        """Every head, every boundary form: each document's outputs and the loss equal those of its own forward."""
        documents = self.packing_documents()
        num_docs = len(documents)
        for auto_name in self._packable_heads():
            model = self.make_model(auto_name, **self.packing_config)
            model.train(mode == "train")  # the tiny configs have every dropout at 0
            extra, solo_extra, counts = {}, [{} for _ in documents], None
            if auto_name in ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModelForTokenClassification"):
                g = torch.Generator().manual_seed(7)
                labels = []
                for i, d in enumerate(documents):
                    if auto_name == "AutoModelForTokenClassification":
                        lab = torch.randint(0, model.config.num_labels, d.shape, generator=g)
                    else:
                        lab = d.masked_fill(torch.rand(d.shape, generator=g) > 0.5, -100)
                    if auto_name == "AutoModelForCausalLM":
                        lab = d.clone()
                    solo_extra[i]["labels"] = lab[None].to(self.device)
                    labels.append(lab)
                extra["labels"] = torch.cat(labels)[None]
                if auto_name == "AutoModelForCausalLM":
                    counts = [d.numel() - 1 for d in documents]
                else:
                    counts = [int((lab != -100).sum()) for lab in labels]
            elif auto_name == "AutoModelForSequenceClassification":
                labels = torch.arange(num_docs) % model.config.num_labels
                extra["labels"] = labels
                for i in range(num_docs):
                    solo_extra[i]["labels"] = labels[i : i + 1].to(self.device)
            elif auto_name == "AutoModelForQuestionAnswering":
                starts, ends = torch.tensor([1, 3, 2][:num_docs]), torch.tensor([4, 9, 5][:num_docs])
                extra.update(start_positions=starts, end_positions=ends)
                for i in range(num_docs):
                    solo_extra[i].update(
                        start_positions=starts[i : i + 1].to(self.device), end_positions=ends[i : i + 1].to(self.device)
                    )
            # Reseeded before every forward: in training, Reformer draws its LSH rotations afresh each call (same
            # shape whatever the length, so the same draw when the generator is in the same state).
            torch.manual_seed(0)
            packed = model(**self.pack(model, documents, form, **extra))
            solos = []
            for i, d in enumerate(documents):
                torch.manual_seed(0)
                solos.append(self.solo(model, d, **solo_extra[i]))
            self._compare(auto_name, packed, solos, documents, counts)

    def _compare(self, auto_name, packed, solos, documents, counts) -> None:
        atol = self.atol
        if getattr(packed, "ponder_loss", None) is not None:
            # The Universal Transformer adds its ponder loss, a mean over every real token of the batch (as a padded
            # batch computes it): the length-weighted mean of the documents' own. The task loss is compared below.
            lengths = [d.numel() for d in documents]
            expected = sum(s.ponder_loss * n for s, n in zip(solos, lengths)) / sum(lengths)
            torch.testing.assert_close(packed.ponder_loss, expected, atol=atol, rtol=1e-5)
            if getattr(packed, "loss", None) is not None:
                packed.loss = packed.loss - packed.ponder_loss
                for s in solos:
                    s.loss = s.loss - s.ponder_loss
        if auto_name == "AutoModel":
            for span, solo in zip(self._spans(), solos):
                torch.testing.assert_close(
                    packed.last_hidden_state[0, span], solo.last_hidden_state[0], atol=atol, rtol=0
                )
            if getattr(packed, "pooler_output", None) is not None:
                torch.testing.assert_close(
                    packed.pooler_output, torch.cat([s.pooler_output for s in solos]), atol=atol, rtol=0
                )
            return
        if auto_name == "AutoModelForSequenceClassification":
            torch.testing.assert_close(packed.logits, torch.cat([s.logits for s in solos]), atol=atol, rtol=0)
            expected_loss = torch.stack([s.loss for s in solos]).mean()
        elif auto_name == "AutoModelForQuestionAnswering":
            assert packed.start_logits.shape == (len(documents), max(self.packing_lengths))
            for i, solo in enumerate(solos):
                n = documents[i].numel()
                torch.testing.assert_close(packed.start_logits[i, :n], solo.start_logits[0], atol=atol, rtol=0)
                torch.testing.assert_close(packed.end_logits[i, :n], solo.end_logits[0], atol=atol, rtol=0)
            expected_loss = torch.stack([s.loss for s in solos]).mean()
        else:  # token-level heads keep the packed row
            assert packed.logits.shape[:2] == (1, sum(self.packing_lengths)), auto_name
            for span, solo in zip(self._spans(), solos):
                torch.testing.assert_close(packed.logits[0, span], solo.logits[0], atol=atol, rtol=0)
            # The loss is the mean over the scored tokens of all documents, as a padded batch's.
            expected_loss = sum(s.loss * c for s, c in zip(solos, counts)) / sum(counts)
        torch.testing.assert_close(packed.loss, expected_loss, atol=atol, rtol=1e-5)

    def test_packed_multiple_choice_matches_unpacked(self):
        """Multiple choice on a packed row of (context, choice) documents: logits ``(examples, choices)`` and the
        loss of the unpacked forwards."""
        if "AutoModelForMultipleChoice" not in self.heads or self.packing_refusal is not None:
            pytest.skip("no multiple-choice head, or packing refused")
        model = self.make_model("AutoModelForMultipleChoice", **self.packing_config)
        documents = self.packing_documents() + self.packing_documents()[:1]  # 2 examples x 2 choices
        labels = torch.tensor([1, 0])
        packed = model(**self.pack(model, documents, "seq_idx", labels=labels, num_choices=2))
        solo = torch.stack([self.solo(model, d[None]).logits.reshape(()) for d in documents]).view(
            2, 2
        )  # each choice alone, (1, 1, len)
        torch.testing.assert_close(packed.logits, solo, atol=self.atol, rtol=0)
        torch.testing.assert_close(
            packed.loss, F.cross_entropy(solo, labels.to(self.device)), atol=self.atol, rtol=1e-5
        )
        with pytest.raises(ValueError, match="num_choices"):
            model(**self.pack(model, documents, "seq_idx"))

    def test_packed_batch_is_refused(self):
        """An architecture that cannot keep documents apart says so instead of mixing them."""
        if self.packing_refusal is None:
            pytest.skip("this architecture packs")
        documents = self.packing_documents()
        for auto_name in self.heads:
            if auto_name == "AutoModelForMultipleChoice":
                continue
            model = self.make_model(auto_name, **self.packing_config)
            for form in PACKING_FORMS:
                with pytest.raises(ValueError, match=self.packing_refusal):
                    model(**self.pack(model, documents, form))

    def test_packed_positions_from_zero_raise_for_offset_tables(self):
        """0-based restarting positions on a RoBERTa-style table (first position 2) would shift every position:
        a ValueError names ``position_ids_start``."""
        if self.packing_refusal is not None:
            pytest.skip("packing refused")
        model = self.make_model("AutoModel", **self.packing_config)
        start = self.packing_position_start(model)
        if start == 0:
            pytest.skip("positions start at 0")
        batch = self.pack(model, self.packing_documents(), "seq_idx")
        batch["position_ids"] = batch["position_ids"] - start
        with pytest.raises(ValueError, match=f"position_ids_start={start}"):
            model(**batch)
