"""RoBERTa-compatible token embeddings shared by the text architectures."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.fast_dropout import HfxDropout


def position_ids_from_input_ids(input_ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """Position ids that skip padding, RoBERTa style.

    Real tokens are numbered ``padding_idx + 1, padding_idx + 2, ...`` in order of appearance and padding
    tokens get ``padding_idx``, so left and right padding give a token the same position.

    Args:
        input_ids: ``(batch, seq_len)`` token ids.
        padding_idx: the pad token id (also the padding row of the position table).

    Returns:
        ``(batch, seq_len)`` long tensor.
    """
    mask = input_ids.ne(padding_idx).long()
    return torch.cumsum(mask, dim=1) * mask + padding_idx


class HfxTextEmbeddings(nn.Module):
    """Word + learned absolute position + token type embeddings, then LayerNorm and dropout.

    Parameter names follow RoBERTa/Longformer (``word_embeddings``, ``position_embeddings``,
    ``token_type_embeddings``, ``LayerNorm``) so their checkpoints map onto ours by a prefix rename.
    Position ids are offset by ``pad_token_id + 1`` as in RoBERTa: a table of
    ``max_position_embeddings`` rows serves ``max_position_embeddings - pad_token_id - 1`` tokens.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.padding_idx = config.pad_token_id
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=self.padding_idx)
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings, config.hidden_size, padding_idx=self.padding_idx
        )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = HfxDropout(config.hidden_dropout_prob)

    @property
    def position_offset(self) -> int:
        """The position id of a sequence's first token (RoBERTa: ``pad_token_id + 1``)."""
        return self.padding_idx + 1

    @property
    def max_tokens(self) -> int:
        """Longest sequence the position table can serve."""
        return self.position_embeddings.num_embeddings - self.padding_idx - 1

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns ``(batch, seq_len, hidden)``."""
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        batch, seq_len = inputs_embeds.shape[:2]
        if position_ids is None:
            if input_ids is not None:
                position_ids = position_ids_from_input_ids(input_ids, self.padding_idx)
            else:
                # Without ids we cannot tell padding apart: number every position.
                start = self.padding_idx + 1
                position_ids = torch.arange(start, start + seq_len, device=inputs_embeds.device).expand(batch, -1)
        if token_type_ids is None:
            token_type_ids = torch.zeros((batch, seq_len), dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.position_embeddings(position_ids) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(embeddings))
