"""BigBird under ``"flex_attention"``: FlexAttention's ``BlockMask`` made straight from a table of BigBird's blocks.

A block table says which key blocks every query block attends to (global, window and random blocks); the kernel then
visits exactly those blocks and evaluates the mask only in the key blocks that hold padding. The padded path builds
the table per example (:meth:`~hf_xformers.attention.block_sparse.HfxBlockSparseSelfAttention.pattern_blocks`); a
packed batch builds the part every layer shares once per forward (:func:`document_block_table`) and each layer adds
its random blocks.
"""

from __future__ import annotations

import torch

from ..ops.attention_switch import block_mask_from_tables, flex_attention
from .block_sparse_layout import DocumentBlocks


def flex_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    key_mask: torch.Tensor,
    block_size: int,
    length: int,
) -> torch.Tensor:
    """FlexAttention of ``q, k, v`` ``(batch, heads, length, dim)`` under the block table ``blocks`` ``(batch,
    heads, nb, nb)`` (True where query block, row, attends to key block, column) and ``key_mask`` ``(batch, nb * b)``
    with ``b = block_size``; returns ``(batch, heads, length, dim)``."""
    b = block_size
    nb = blocks.shape[-1]
    real_keys = key_mask.view(key_mask.shape[0], nb, b)
    whole = real_keys.all(-1)[:, None, None, :]  # key blocks without padding: no per-score mask
    partial = blocks & ~whole & real_keys.any(-1)[:, None, None, :]
    full = blocks & whole

    # The whole pattern, not only the key mask: the compiled kernel evaluates it in the partial blocks alone, but
    # FlexAttention's eager form applies it to every score and ignores the block lists.
    def in_pattern(batch_idx, head, q_idx, kv_idx):
        return blocks[batch_idx, head, q_idx // b, kv_idx // b] & key_mask[batch_idx, kv_idx]

    block_mask = block_mask_from_tables(partial, full, b, in_pattern, length)
    return flex_attention(q, k, v, block_mask=block_mask)


def document_block_table(layout: DocumentBlocks) -> torch.Tensor:
    """The layer-independent part of the pattern of the aligned layout
    (:func:`~hf_xformers.attention.block_sparse_layout.plan_documents`): ``(nb, nb)`` bool, True where query block
    (row) attends to key block (column) in the same document as a global block, a window block, or as a row whose
    pattern is its whole document (global rows, and every row of a short document). Spare blocks see themselves. Each
    layer adds its random blocks
    (:meth:`~hf_xformers.attention.block_sparse_packed.PackedBlockSparse._layout_pattern_blocks`)."""
    i = torch.arange(layout.num_blocks, device=layout.block_doc.device)
    first, last = layout.block_first, layout.block_first + layout.block_count - 1
    full_row = ~layout.sparse_random
    j = i[None, :]
    same = layout.block_doc[:, None] == layout.block_doc[None, :]
    near = full_row[:, None] | (j == first[:, None]) | (j == last[:, None]) | ((i[:, None] - j).abs() <= 1)
    return same & near
