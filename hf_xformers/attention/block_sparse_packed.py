"""Packed (padding-free) batches through BigBird's attention: every document gets exactly the pattern of its own
forward.

The documents lie on whole blocks of their own in one block-aligned sequence
(:mod:`~hf_xformers.attention.block_sparse_layout`). The fast path runs on that layout: every query block through one
gathered SDPA call over its ``5 + r`` key blocks (the blocks of a document of at most ``r + 4`` blocks take their
whole document: its own forward's dense fallback), and the global blocks of long documents over their whole document
in chunks of ``5 + r`` key blocks, the chunks merged by their softmax normalisers; cost linear in the number of
blocks, nothing proportional to (documents x length). ``"flex_attention"`` uses the same layout, one call per layer
over all of it, with the block table of its blocks (``nb x nb``, as a single sequence of that length): the part every
layer shares built once per forward (:meth:`PackedBlockSparse.document_layout`), each layer adding its random blocks.
``"eager"`` and ``output_attentions`` apply the pattern as a ``(seq, seq)`` mask over the packed row (quadratic, as
for a single sequence), which is also the path a traced graph takes for packed input that does not carry the number
of documents and the longest one (``seq_idx`` or ``position_ids`` only). ``original_full`` masks the keys of other
documents. Training draws fresh random blocks per document, so only with ``fixed_random_blocks`` (or documents of at
most ``r + 4`` blocks) does a training forward equal the document's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.attention_switch import EAGER, eager_attention, flex_applies
from ..ops.input_checks import is_tracing
from ..ops.kernels import attention
from ..ops.packing import same_document
from ..ops.shapes import merge_heads, split_heads
from .base import AttentionOutput
from .block_sparse_flex import document_block_table, flex_block_attention
from .block_sparse_layout import DocumentBlocks, check_batch_sizes, plan_documents


class PackedBlockSparse:
    """The packed-batch paths of :class:`~hf_xformers.attention.block_sparse.HfxBlockSparseSelfAttention`, which
    inherits them. They read the layer's ``block_size``, ``num_random_blocks``, ``num_heads``, ``head_dim``,
    ``max_blocks``, ``fixed_random_blocks``, ``attention_type`` and ``dropout_p``, and call its projections
    (``fused_qkv``, ``_project``), its random blocks (``_layout_random``, ``_token_random``) and its softmax under a
    pattern (``_pattern_attention``)."""

    def document_layout(
        self,
        document_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        with_block_table: bool,
        count: int | None = None,
        longest: int | None = None,
        layout: DocumentBlocks | None = None,
        spans: tuple[tuple[int, int], ...] | None = None,
    ) -> DocumentBlocks:
        """Where the documents of a packed batch meet this layer's blocks: :func:`plan_documents`, with the part of
        the block table every layer shares (:func:`document_block_table`) when ``with_block_table`` (FlexAttention).

        The one place both are made: the model calls it once per forward for every layer
        (:meth:`~hf_xformers.models.bigbird.modeling_bigbird.HfxBigBirdModel.prepare_attention_inputs`); a layer
        called without them calls it itself, and completes a ``layout`` that lacks the table it needs.

        Args:
            document_ids: ``(batch, seq_len)`` long, documents numbered from 0 in each row.
            attention_mask: ``(batch, seq_len)`` bool, True for real tokens, or None.
            with_block_table: also build the shared block table (where the layout has block sizes).
            count: the number of documents, or None (see :func:`plan_documents`).
            longest: the longest document's length, or None.
            layout: a layout already planned for these documents, or None.
            spans: the documents' token spans in host memory (:attr:`DocumentBlocks.spans`): nothing is planned.
        """
        if spans is not None and layout is None:
            check_batch_sizes(count, longest, len(spans), max(end - start for start, end in spans))
            return DocumentBlocks(document_ids, None, None, None, spans=spans)
        if layout is None:
            layout = plan_documents(
                document_ids, attention_mask, self.block_size, self.num_random_blocks, count=count, longest=longest
            )
        if with_block_table and layout.num_blocks is not None and layout.block_table is None:
            layout = layout._replace(block_table=document_block_table(layout))
        return layout

    def _packed(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        output_attentions: bool,
        document_ids: torch.Tensor,
        document_blocks: DocumentBlocks | None,
        implementation: str,
    ) -> AttentionOutput:
        """Every document of a packed batch as in its own forward (module docstring); shapes as the layer's
        ``forward``, ``implementation`` the kernel choice of this forward."""
        if self.attention_type == "original_full":
            return self._packed_full(hidden_states, attention_mask, output_attentions, document_ids, implementation)
        if document_blocks is not None and document_blocks.spans is not None:
            if not (output_attentions or implementation == EAGER):
                return self._each_document(hidden_states, document_blocks.spans)
            document_blocks = None  # the maps and the eager reference want the whole row's pattern: planned below
        flex = flex_applies(implementation, hidden_states, self.training)
        layout = self.document_layout(document_ids, attention_mask, flex, layout=document_blocks)
        if output_attentions or implementation == EAGER or layout.num_blocks is None:
            context, probs = self._packed_dense(hidden_states, attention_mask, layout)
            return AttentionOutput(context, probs if output_attentions else None)
        seeded = not self.training or self.fixed_random_blocks
        if self.num_random_blocks and seeded and not is_tracing() and layout.max_count > self.max_blocks:
            raise ValueError(
                f"A document of {layout.max_count} blocks of {self.block_size} tokens is longer than the seeded "
                f"random-block table covers ({self.max_blocks} blocks, config.max_position_embeddings); split it."
            )
        # Each document on whole blocks of its own: the packed tokens gathered into the aligned layout, one sequence.
        aligned = hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, layout.slot_token)[None]
        q, k, v = self._project(aligned, aligned.shape[1])  # each (1, heads, nb * b, dim)
        random, valid = self._layout_random(layout)
        if flex:
            blocks = self._layout_pattern_blocks(layout, random, valid)[None]
            key_mask = layout.slot_key[None]
            context = flex_block_attention(q, k, v, blocks, key_mask, self.block_size, aligned.shape[1])[0]
        else:
            context = self._layout_block_sparse(q[0], k[0], v[0], layout, random, valid)
        # Back to the packed row: places outside every extent read an extra zero row.
        context = merge_heads(context[None])[0]
        context = torch.cat([context, context.new_zeros(1, context.shape[-1])]).index_select(0, layout.token_slot)
        context = context.view(hidden_states.shape)
        return AttentionOutput(
            context if attention_mask is None else context.masked_fill(~attention_mask[..., None], 0.0)
        )

    def _each_document(self, hidden_states: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> AttentionOutput:
        """``hidden_states`` ``(1, seq_len, hidden)`` of one unpadded packed row -> context ``(1, seq_len, hidden)``,
        each document through this layer's unpacked forward, as in its own forward (:attr:`DocumentBlocks.spans`)."""
        return AttentionOutput(torch.cat([self(hidden_states[:, a:b]).context for a, b in spans], dim=1))

    def _layout_block_sparse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: DocumentBlocks,
        random: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """The fast path on the aligned layout: ``q, k, v`` ``(heads, nb * b, dim)`` -> ``(heads, nb * b, dim)``.

        Every query block: one SDPA call over its ``s = 5 + r`` gathered key blocks (first and last block of its
        document, window, random; or a short document's blocks), as :meth:`_block_sparse`. The global blocks of long
        documents, which attend to their whole document, take their rows from :meth:`_layout_global` instead. Fixed
        shapes (``nb`` and the chunk rows are bounds from host ints), so the number of operators does not depend on
        the documents."""
        heads, _, dim = q.shape
        b, nb = self.block_size, layout.num_blocks
        qb = q.view(heads, nb, b, dim)
        k_blocks, v_blocks = (t.contiguous().view(-1, b, dim) for t in (k, v))  # (heads * nb, b, dim), per head
        head_offset = torch.arange(heads, device=q.device)[:, None, None] * nb
        blocks, ok = layout.sparse_slots.expand(heads, nb, -1), layout.sparse_ok
        if self.num_random_blocks:
            use = layout.sparse_random[:, None]
            blocks = torch.cat([blocks[..., :5], torch.where(use, random, blocks[..., 5:])], dim=-1)
            ok = torch.cat([ok[:, :5], torch.where(use, valid, ok[:, 5:])], dim=-1)
        key_ok = layout.slot_key.view(nb, b)[blocks] & ok[..., None]  # (heads, nb, s, b)
        flat = (head_offset + blocks).reshape(-1)
        k_slots = k_blocks.index_select(0, flat).view(heads, nb, -1, dim)
        v_slots = v_blocks.index_select(0, flat).view(heads, nb, -1, dim)
        neg_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
        bias = torch.where(key_ok, 0.0, neg_inf).view(heads, nb, 1, -1)
        out = F.scaled_dot_product_attention(qb, k_slots, v_slots, attn_mask=bias)  # (heads, nb, b, dim)
        out = torch.where(layout.is_global[:, None, None], self._layout_global(qb, k_blocks, v_blocks, layout), out)
        return out.view(heads, nb * b, dim)

    def _layout_global(
        self, qb: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, layout: DocumentBlocks
    ) -> torch.Tensor:
        """The global query blocks of long documents, each over every key block of its document: ``qb`` ``(heads, nb,
        b, dim)``, ``k_blocks`` / ``v_blocks`` ``(heads * nb, b, dim)`` -> ``(heads, nb, b, dim)`` (meaningful at the
        global blocks only).

        A document's keys come in chunks of ``s`` blocks (:class:`DocumentBlocks`), so the work is linear in the
        blocks whatever the documents' lengths: each chunk row gives its softmax-weighted values and the log of its
        normaliser, and the chunks of one query block are merged by those normalisers (the split softmax of
        FlashAttention), by index over the chunk rows: a fixed number of operators for any number of documents."""
        heads, nb, b, dim = qb.shape
        rows, keys, target = layout.chunk_query, layout.chunk_keys, layout.chunk_target
        p = rows.shape[0]
        head_offset = torch.arange(heads, device=qb.device)[:, None, None] * nb
        flat = (head_offset + keys[None]).reshape(-1)
        k_chunks = k_blocks.index_select(0, flat).view(heads, p, -1, dim)
        v_chunks = v_blocks.index_select(0, flat).view(heads, p, -1, dim)
        scores = torch.matmul(qb.index_select(1, rows), k_chunks.transpose(-1, -2)).float() * self.head_dim**-0.5
        # The float32 minimum, not -inf: a row with no key left (possible only for hand-made document ids with
        # padding inside a document) then gives finite numbers and a zero weight, not NaN.
        scores = scores.masked_fill(~layout.chunk_key_ok[None, :, None, :], torch.finfo(torch.float32).min)
        lse = torch.logsumexp(scores, dim=-1)  # (heads, p, b)
        chunk_out = torch.matmul(torch.exp(scores - lse[..., None]).to(v_chunks.dtype), v_chunks)
        # Merge: weights exp(lse - lse_total), the total over each target's chunks (their maximum subtracted first).
        index = target[None, :, None].expand_as(lse)
        top = lse.new_full((heads, nb + 1, b), torch.finfo(torch.float32).min)
        top = top.scatter_reduce(1, index, lse.detach(), reduce="amax").gather(1, index)
        weight = torch.exp(lse - top)
        total = lse.new_zeros(heads, nb + 1, b).index_add(1, target, weight)
        merged = lse.new_zeros(heads, nb + 1, b, dim).index_add(1, target, weight[..., None] * chunk_out.float())
        # Blocks that are no chunk's target have a zero total: divided by one (they are not used), never by zero.
        total = torch.where(total > 0, total, torch.ones_like(total))
        return (merged / total[..., None])[:, :nb].to(qb.dtype)

    def _layout_pattern_blocks(self, layout: DocumentBlocks, random: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The pattern of the aligned layout per block: ``(heads, nb, nb)`` bool, every document's own pattern on
        its diagonal block (for FlexAttention): the layer's random blocks added to the per-forward
        :func:`document_block_table` (``layout.block_table``, see :meth:`document_layout`)."""
        blocks = layout.block_table.expand(self.num_heads, -1, -1)
        if self.num_random_blocks:
            # Only the middle blocks of long documents take random blocks (the others' rows are whole already).
            hits = torch.zeros(*random.shape[:2], layout.num_blocks, dtype=torch.long, device=blocks.device)
            hits.scatter_add_(-1, random, (valid & layout.sparse_random[:, None]).expand_as(random).long())
            blocks = blocks | (hits > 0)
        return blocks

    def _packed_dense(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, layout: DocumentBlocks
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pattern of every document as a ``(seq, seq)`` mask over the packed row (``"eager"``,
        ``output_attentions``, traced graphs): context ``(batch, seq_len, hidden)`` and probabilities ``(batch, heads,
        seq_len, seq_len)``, zero between documents."""
        length = hidden_states.shape[1]
        q, k, v = self._project(hidden_states, length)
        local = layout.position // self.block_size
        last = (layout.count - 1)[:, :, None]
        lq, lk = local[:, :, None], local[:, None, :]
        near = (lq == 0) | (lq == last) | (lk == 0) | (lk == last) | ((lq - lk).abs() <= 1)  # (batch, seq, seq)
        random, valid = self._token_random(layout)
        hit = ((random[..., None, :] == lk[:, None, :, :, None]) & valid[:, None, :, None, :]).any(-1)
        keys = same_document(layout.document, layout.document) & layout.inside[:, None, :]
        if attention_mask is not None:
            keys = keys & attention_mask[:, None, :]
        allowed = keys[:, None] & (near[:, None] | hit)
        # Tokens past their document's extent (padding) have no pattern: let them see everything, they give zeros.
        allowed = allowed | ~layout.inside[:, None, :, None]
        return self._pattern_attention(q, k, v, allowed, attention_mask)

    def _packed_full(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        output_attentions: bool,
        document_ids: torch.Tensor,
        implementation: str,
    ) -> AttentionOutput:
        """``original_full`` on a packed batch: full attention with the keys of other documents masked (quadratic in
        the row's length, as full attention is)."""
        q, k, v = (split_heads(t, self.num_heads) for t in self.fused_qkv(hidden_states))
        mask = same_document(document_ids, document_ids)
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, :]
        # A document of pure padding would have no key at all (NaN): let it see everything, as `attend` does.
        mask = (mask | ~mask.any(-1, keepdim=True))[:, None]
        dropout = self.dropout_p if self.training else 0.0
        if not (output_attentions or implementation == EAGER):
            return AttentionOutput(merge_heads(attention(q, k, v, mask, dropout)))
        context, probs = eager_attention(q, k, v, mask, dropout)
        return AttentionOutput(merge_heads(context), probs if output_attentions else None)
