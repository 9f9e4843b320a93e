"""What the generation tests share: greedy decoding by hand, the reference every cached ``generate()`` must equal."""

from __future__ import annotations

import torch


def greedy_by_hand(
    model,
    ids: torch.Tensor,
    steps: int,
    attention_mask: torch.Tensor | None = None,
    token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ids`` ``(batch, seq_len)`` extended by ``steps`` tokens, each the argmax of the last position's logits from a
    full forward over the whole sequence so far (no cache). A new token is real in ``attention_mask`` and repeats the
    last token type, as ``generate()`` extends them. Returns ``(batch, seq_len + steps)``."""
    with torch.no_grad():
        for _ in range(steps):
            kwargs = {}
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
            new = model(input_ids=ids, **kwargs).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, new], dim=1)
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, torch.ones_like(new)], dim=1)
            if token_type_ids is not None:
                token_type_ids = torch.cat([token_type_ids, token_type_ids[:, -1:]], dim=1)
    return ids
