"""Packed (padding-free) batches in the text conformance suite: every head of every text architecture, given several
documents concatenated in one row in each of the three forms of transformers' ``DataCollatorWithFlattening``, gives
every document what its own forward gives (or, for an architecture that cannot attend within documents, refuses with
a ``ValueError`` that says why). Mixed into :class:`tests.conformance.TextModelConformance`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening

# The collator's forms: restarting positions alone (its default), and its two ways of marking where documents start.
PACKING_FORMS = {
    "position_ids": dict(),  # positions only: an ordinary row of one sequence (tests/test_packing_boundaries.py)
    "seq_idx": dict(return_seq_idx=True),
    "cu_seq_lens": dict(return_flash_attn_kwargs=True),
}
# The forms that mark documents.
MARKING_FORMS = ("seq_idx", "cu_seq_lens")
PACKING_FORM_PARAMS = [pytest.param(form, id=form) for form in MARKING_FORMS]


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
            for form in MARKING_FORMS:
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

    # ----- one packed batch, resolved once (issue 40) ----------------------------------------------
    def _classifier(self, **overrides):
        if "AutoModelForSequenceClassification" not in self.heads:
            pytest.skip("no sequence-classification head")
        return self.make_model("AutoModelForSequenceClassification", **{**self.packing_config, **overrides})

    def _packed_batch(self, model, lengths, form="cu_seq_lens", **per_document) -> dict:
        vocab = self.make_config().vocab_size
        documents = [_document(n, i, vocab) for i, n in enumerate(lengths)]
        return self.pack(model, documents, form, **per_document)

    def _packed_step(self, model, lengths, form="cu_seq_lens", batch=None, **per_document):
        if batch is None:
            batch = self._packed_batch(model, lengths, form, **per_document)
        torch.manual_seed(0)
        out = model(**batch)
        out.loss.backward()
        return out

    def test_packed_training_step_makes_no_host_reads(self):
        """A packed training step (forward and backward) whose batch carries what the layout needs from the host
        (``cu_seq_lens`` + ``max_length``, the collator's flash form) reads nothing back from the device, and its
        number of operators (the kernels a GPU launches) does not grow with the number of documents."""
        if self.packing_refusal is not None:
            pytest.skip("packing refused")
        from hf_xformers.ops.input_checks import as_if_on_accelerator

        from .host_reads import HostReadCounter

        model = self._classifier().train()
        ops = {}
        for lengths in ((10, 23, 7), (10, 5, 8, 6, 4, 9, 3, 5, 12, 8, 6, 7)):
            labels = torch.arange(len(lengths)) % model.config.num_labels
            # Built outside the counter: the collator's input is host data (``tolist`` of CPU tensors), not a read.
            batch = self._packed_batch(model, lengths, labels=labels)
            self._packed_step(model, lengths, batch=batch)  # warm-up: lazily built state, first-call work
            with as_if_on_accelerator(), HostReadCounter() as counter:
                self._packed_step(model, lengths, batch=batch)
            assert counter.total_reads == 0, f"{len(lengths)} documents: host reads {dict(counter.reads)}"
            ops[len(lengths)] = counter.ops
        assert ops[12] == ops[3], f"operators per step grow with the number of documents: {ops}"

    def test_padding_is_never_a_document(self):
        """``seq_idx`` rows with padding: padding runs are not documents (right padding: one logit row per real
        document; left padding that shares document 0's label: document 0 pooled from its own tokens)."""
        if self.packing_refusal is not None:
            pytest.skip("packing refused")
        model = self._classifier()
        vocab = self.make_config().vocab_size
        docs = [_document(n, i, vocab) for i, n in enumerate((6, 5, 7, 4))]
        start = self.packing_position_start(model)
        pad = model.config.pad_token_id or 1
        width = 14
        rows, masks, seqs, positions = [], [], [], []
        for left, (a, b) in ((False, (docs[0], docs[1])), (True, (docs[2], docs[3]))):
            real = torch.cat([a, b])
            fill = width - real.numel()
            ids = torch.cat([torch.full((fill,), pad), real]) if left else torch.cat([real, torch.full((fill,), pad)])
            mask = torch.ones(width, dtype=torch.long)
            seq = torch.cat([torch.zeros(a.numel()), torch.ones(b.numel())]).long()
            pos = torch.cat([torch.arange(a.numel()), torch.arange(b.numel())]) + start
            if left:  # the padding shares document 0's label, as a collator padding seq_idx with its first value
                mask[:fill] = 0
                seq, pos = torch.cat([torch.zeros(fill).long(), seq]), torch.cat([torch.full((fill,), start), pos])
            else:
                mask[real.numel() :] = 0
                seq = torch.cat([seq, torch.full((fill,), 2)])
                pos = torch.cat([pos, torch.full((fill,), start)])
            rows.append(ids), masks.append(mask), seqs.append(seq), positions.append(pos)
        batch = {
            "input_ids": torch.stack(rows), "attention_mask": torch.stack(masks), "seq_idx": torch.stack(seqs),
            "position_ids": torch.stack(positions),
        }  # fmt: skip
        batch = {k: v.to(self.device) for k, v in batch.items()}
        labels = torch.tensor([0, 1, 2, 0]) % model.config.num_labels
        out = model(**batch, labels=labels.to(self.device))
        assert out.logits.shape == (4, model.config.num_labels)
        solos = torch.cat([self.solo(model, d).logits for d in docs])
        torch.testing.assert_close(out.logits, solos, atol=self.atol, rtol=0)

    def test_bad_boundaries_and_counts_raise(self):
        """An empty or non-increasing ``cu_seq_lens``, and per-document inputs that do not count the documents,
        raise a ValueError naming documents and the fix."""
        if self.packing_refusal is not None:
            pytest.skip("packing refused")
        model = self._classifier()
        documents = self.packing_documents()
        batch = self.pack(model, documents, "cu_seq_lens")
        total = sum(self.packing_lengths)
        for bad in ([0, 3, 3, total], [0, 9, 4, total], [0, 5, total + 1]):
            cu = torch.tensor(bad, dtype=torch.int32, device=self.device)
            with pytest.raises(ValueError, match="cu_seq_lens"):
                model(**{**batch, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu})
        with pytest.raises(ValueError, match=f"holds {len(documents)} documents"):
            model(**batch, labels=torch.tensor([0], device=self.device))
        regression = self._classifier(num_labels=1)
        with pytest.raises(ValueError, match=f"holds {len(documents)} documents"):
            regression(**batch, labels=torch.tensor([0.5], device=self.device))
        if "AutoModelForQuestionAnswering" in self.heads:
            qa = self.make_model("AutoModelForQuestionAnswering", **self.packing_config)
            positions = torch.tensor([1, 2], device=self.device)
            with pytest.raises(ValueError, match="start_positions"):
                qa(**batch, start_positions=positions, end_positions=positions)
        if "AutoModelForMultipleChoice" in self.heads:
            mc = self.make_model("AutoModelForMultipleChoice", **self.packing_config)
            six = self.pack(mc, documents + documents, "cu_seq_lens")
            with pytest.raises(ValueError, match="6 .*documents"):
                mc(**six, labels=torch.tensor([0, 1, 0, 1], device=self.device))

    def test_compiled_position_row_is_one_sequence(self):
        """Under ``torch.compile`` a row of restarting ``position_ids`` alone (the collator's default) is one sequence,
        as in eager mode: positions never mark documents, compiled or not."""
        if self.packing_refusal is not None:
            pytest.skip("packing refused")
        auto_name = "AutoModelForMaskedLM" if "AutoModelForMaskedLM" in self.heads else "AutoModel"
        model = self.make_model(auto_name, **self.packing_config)
        batch = self.pack(model, self.packing_documents(), "position_ids")
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(model, fullgraph=True, dynamic=False)(**batch)
            eager = model(**batch)
        field = "logits" if auto_name != "AutoModel" else "last_hidden_state"
        torch.testing.assert_close(getattr(out, field), getattr(eager, field), atol=self.atol, rtol=0)

    def test_compiled_packed_training_is_exact_and_does_not_recompile(self):
        """``torch.compile(fullgraph=True, dynamic=True)`` trains packed rows (``cu_seq_lens`` form): the loss and
        logits equal eager mode's, and a second batch with other document counts and lengths runs without a
        recompile.

        The ``aot_eager`` backend: dynamo and AOT autograd trace forward and backward as one graph with dynamic
        shapes (what can break in our code: a graph break, a data-dependent guard, a recompile, a wrong gradient),
        without inductor's code generation, which is torch's and costs this suite minutes per architecture (as
        ``test_compile_export.py`` traces every architecture with the ``eager`` backend); inductor compiles packed
        training once, on BigBird's block layout (``test_packing_bigbird.py``)."""
        if self.packing_refusal is not None:
            pytest.skip("packing refused")
        model = self._classifier().train()
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
        counts = torch._dynamo.utils.counters
        frames = []
        for lengths in ((10, 23, 7), (9, 4, 12, 6, 11)):
            labels = torch.arange(len(lengths)) % model.config.num_labels
            model.zero_grad()
            eager = self._packed_step(model, lengths, labels=labels)
            eager_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            model.zero_grad()
            traced = self._packed_step(compiled, lengths, labels=labels)
            torch.testing.assert_close(traced.logits, eager.logits, atol=self.atol, rtol=1e-4)
            torch.testing.assert_close(traced.loss, eager.loss, atol=self.atol, rtol=1e-4)
            traced_grads = [p.grad for p in model.parameters() if p.grad is not None]
            for a, b in zip(traced_grads, eager_grads):
                torch.testing.assert_close(a, b, atol=10 * self.atol, rtol=1e-3)
            frames.append(counts["stats"]["unique_graphs"])
        assert frames[1] == frames[0], f"the second packed batch recompiled: {frames}"
