"""Adaptive input embeddings and adaptive softmax (Baevski & Auli, 2019; Grave et al., 2017).

The vocabulary is split by ``cutoffs`` into clusters of decreasing frequency: ids ``[0, c_0)`` form the
shortlist (the "head"), ``[c_0, c_1)`` the first tail cluster, ..., ``[c_last, vocab_size)`` the last one.
Cluster ``i`` gets an embedding width of ``d_embed // div_val**i``, and a projection to the model width
``d_proj``, so rare tokens cost fewer parameters.

Both modules keep the tensor layout of the Transformer-XL checkpoints (``emb_layers``/``emb_projs`` and
``out_layers``/``out_projs``/``cluster_weight``/``cluster_bias``), so imports are renames. A projection
``P`` of shape ``(d_proj, d_emb_i)`` maps an embedding ``e`` to ``e @ P.T`` and a hidden state ``h`` to
``h @ P`` (the softmax uses it transposed, which is what lets the two sides share it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def cluster_bounds(cutoffs: list[int], vocab_size: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` id ranges of the clusters: the shortlist first, then each tail cluster."""
    ends = [0, *cutoffs, vocab_size]
    return [(ends[i], ends[i + 1]) for i in range(len(ends) - 1)]


def check_resizable(cutoffs: list[int], new_vocab_size: int) -> None:
    """Raise ``ValueError`` unless a vocabulary of ``new_vocab_size`` keeps every cluster non-empty."""
    last = cutoffs[-1] if cutoffs else 0
    if new_vocab_size <= last:
        raise ValueError(
            f"Resizing to {new_vocab_size} tokens would empty the last adaptive cluster, which starts at cutoff {last}: "
            f"resize to more than {last} tokens, or build a new config with cutoffs below the new size (and train "
            "the adaptive layers again)."
        )


def resized_rows(old: torch.Tensor, new_rows: int, std: float | None = None) -> torch.Tensor:
    """``old`` ``(n, ...)`` cut or grown to ``(new_rows, ...)``. New rows are the mean of the old ones when ``std``
    is None, so new tokens start as an average token (transformers' ``mean_resizing`` idea, without the sampling),
    else drawn from ``N(0, std)`` (0 for 1-d tensors such as biases)."""
    n = old.shape[0]
    if new_rows <= n:
        return old[:new_rows].clone()
    if std is None:
        fill = old.mean(0, keepdim=True).expand(new_rows - n, *old.shape[1:])
    else:
        fill = old.new_empty(new_rows - n, *old.shape[1:])
        fill.normal_(0.0, std) if old.dim() > 1 else fill.zero_()
    return torch.cat([old, fill], 0)


class HfxAdaptiveEmbedding(nn.Module):
    """Token ids ``(batch, seq_len)`` -> embeddings ``(batch, seq_len, d_proj)``, scaled by ``sqrt(d_proj)``.

    With ``div_val == 1`` there is one table of width ``d_embed`` (projected only when ``d_embed != d_proj``);
    otherwise one table and one projection per cluster.
    """

    def __init__(self, vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int], div_val: int = 1) -> None:
        super().__init__()
        self.vocab_size, self.d_embed, self.d_proj, self.div_val = vocab_size, d_embed, d_proj, div_val
        self.bounds = cluster_bounds(list(cutoffs), vocab_size)
        self.scale = d_proj**0.5
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        if div_val == 1:
            self.emb_layers.append(nn.Embedding(vocab_size, d_embed))
            if d_proj != d_embed:
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)))
        else:
            for i, (start, end) in enumerate(self.bounds):
                width = d_embed // div_val**i
                self.emb_layers.append(nn.Embedding(end - start, width))
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, width)))

    def resize_vocab(self, new_vocab_size: int, std: float | None = None) -> None:
        """Grow or shrink the vocabulary at its end: the last cluster (or the single table) gains or loses rows
        (new rows: see :func:`resized_rows`)."""
        check_resizable([end for _, end in self.bounds[:-1]], new_vocab_size)
        delta = new_vocab_size - self.vocab_size
        table = self.emb_layers[-1]
        new = nn.Embedding(
            table.num_embeddings + delta, table.embedding_dim, device=table.weight.device, dtype=table.weight.dtype
        )
        with torch.no_grad():
            new.weight.copy_(resized_rows(table.weight, new.num_embeddings, std))
        self.emb_layers[-1] = new
        self.vocab_size = new_vocab_size
        self.bounds[-1] = (self.bounds[-1][0], new_vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.div_val == 1:
            embed = self.emb_layers[0](input_ids)
            if len(self.emb_projs):
                embed = F.linear(embed, self.emb_projs[0])
            return embed * self.scale
        # Every cluster embeds every token (ids clamped into its range) and a mask keeps the right one: no
        # data-dependent shapes, so the same code runs eagerly, compiled and exported. The tail tables are narrow
        # (d_embed / div_val**i), so this costs little more than one projection of the shortlist width.
        out = None
        for i, (start, end) in enumerate(self.bounds):
            local = (input_ids - start).clamp(0, end - start - 1)
            embed = F.linear(self.emb_layers[i](local), self.emb_projs[i])
            inside = ((input_ids >= start) & (input_ids < end)).unsqueeze(-1)
            part = torch.where(inside, embed, torch.zeros((), dtype=embed.dtype, device=embed.device))
            out = part if out is None else out + part
        return out * self.scale


class HfxAdaptiveLogSoftmax(nn.Module):
    """Hidden states ``(n, d_proj)`` -> log-probabilities over the vocabulary, factorised over clusters.

    The head softmax covers the shortlist plus one logit per tail cluster (``cluster_weight``/``cluster_bias``,
    in cluster order); ``log p(token in tail cluster i) = log p_head(cluster i) + log p_i(token | cluster i)``.

    Layout as in Transformer-XL checkpoints: with ``div_val == 1`` a single ``out_layers[0]`` spans the whole
    vocabulary (sliced per cluster) and ``out_projs`` has one ``(d_proj, d_embed)`` projection per cluster, or
    none when ``d_proj == d_embed``; otherwise cluster ``i`` has ``out_layers[i]`` and ``out_projs[i]`` of width
    ``d_embed // div_val**i``.
    """

    def __init__(self, vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int], div_val: int = 1) -> None:
        super().__init__()
        self.vocab_size, self.d_embed, self.d_proj, self.div_val = vocab_size, d_embed, d_proj, div_val
        self.bounds = cluster_bounds(list(cutoffs), vocab_size)
        self.shortlist_size = self.bounds[0][1]
        self.n_tail = len(self.bounds) - 1
        if self.n_tail:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_tail, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_tail))
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ParameterList()
        if div_val == 1:
            self.out_layers.append(nn.Linear(d_embed, vocab_size))
            if d_proj != d_embed:
                for _ in self.bounds:
                    self.out_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)))
        else:
            for i, (start, end) in enumerate(self.bounds):
                width = d_embed // div_val**i
                self.out_layers.append(nn.Linear(width, end - start))
                self.out_projs.append(nn.Parameter(torch.empty(d_proj, width)))

    def resize_vocab(self, new_vocab_size: int, std: float | None = None) -> None:
        """Grow or shrink the vocabulary at its end, as :meth:`HfxAdaptiveEmbedding.resize_vocab` does (new biases:
        the mean of the old ones, or 0 with ``std``)."""
        check_resizable([end for _, end in self.bounds[:-1]], new_vocab_size)
        delta = new_vocab_size - self.vocab_size
        layer = self.out_layers[-1]
        new = nn.Linear(
            layer.in_features, layer.out_features + delta, device=layer.weight.device, dtype=layer.weight.dtype
        )
        with torch.no_grad():
            new.weight.copy_(resized_rows(layer.weight, new.out_features, std))
            new.bias.copy_(resized_rows(layer.bias, new.out_features, std))
        self.out_layers[-1] = new
        self.vocab_size = new_vocab_size
        self.bounds[-1] = (self.bounds[-1][0], new_vocab_size)
        self.shortlist_size = self.bounds[0][1]

    def _cluster_logits(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        """Logits ``(n, cluster size [+ n_tail for the head])`` of cluster ``i`` for hidden states ``(n, d_proj)``."""
        start, end = self.bounds[i]
        if self.div_val == 1:
            weight, bias = self.out_layers[0].weight[start:end], self.out_layers[0].bias[start:end]
        else:
            weight, bias = self.out_layers[i].weight, self.out_layers[i].bias
        if i == 0 and self.n_tail:
            weight = torch.cat([weight, self.cluster_weight], 0)
            bias = torch.cat([bias, self.cluster_bias], 0)
        if len(self.out_projs):
            hidden = hidden @ self.out_projs[i]
        return F.linear(hidden, weight, bias)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(n, d_proj)`` -> ``(n, vocab_size)`` log-probabilities (in float32 for low-precision inputs)."""
        head = F.log_softmax(self._cluster_logits(hidden, 0).float(), dim=-1)
        if not self.n_tail:
            return head
        parts = [head[:, : self.shortlist_size]]
        for i in range(1, len(self.bounds)):
            tail = F.log_softmax(self._cluster_logits(hidden, i).float(), dim=-1)
            parts.append(head[:, self.shortlist_size + i - 1, None] + tail)
        return torch.cat(parts, dim=-1)

    def nll(self, hidden: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Negative log-likelihood ``(n,)`` of ``target`` ``(n,)`` (0 where ``target == ignore_index``).

        Only the clusters that hold a target are evaluated, which is what makes training with a large
        vocabulary cheap.
        """
        if torch.compiler.is_compiling():
            # Tracing cannot follow the data-dependent cluster selection below: score the full distribution.
            picked = self.log_prob(hidden).gather(1, target.clamp(0, self.vocab_size - 1)[:, None]).squeeze(1)
            return torch.where(target == ignore_index, torch.zeros_like(picked), -picked)
        nll = torch.zeros(target.shape[0], dtype=torch.float32, device=hidden.device)
        head = F.log_softmax(self._cluster_logits(hidden, 0).float(), dim=-1)
        for i, (start, end) in enumerate(self.bounds):
            rows = ((target >= start) & (target < end) & (target != ignore_index)).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            local = (target[rows] - start)[:, None]
            if i == 0:
                logp = head[rows].gather(1, local).squeeze(1)
            else:
                tail = F.log_softmax(self._cluster_logits(hidden[rows], i).float(), dim=-1)
                logp = head[rows, self.shortlist_size + i - 1] + tail.gather(1, local).squeeze(1)
            nll = nll.index_copy(0, rows, -logp)
        return nll
