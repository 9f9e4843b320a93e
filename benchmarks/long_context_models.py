"""The architectures of the long-context benchmark: for each, how to build the hf_xformers model and its reference
at a given length, plus the full-attention SDPA RoBERTa every architecture is also measured against.

Adding an architecture is one registry entry::

    ARCHS["bigbird"] = Arch(build_hfx=lambda c, L: ..., build_reference=lambda c, L: ...)

where ``c`` is the :class:`BenchConfig` (hidden, layers, heads, intermediate, vocab, window) and ``L`` the length.
Builders import their libraries when called, so a missing reference package only fails its own cells.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from benchmarks.utilisation import (
    global_projection_parameters,
    keys_bigbird,
    keys_full,
    keys_longformer,
    matmul_parameters,
    step_flops,
)

if TYPE_CHECKING:
    from torch import nn

# Every cell is one of these: ours, the architecture's reference, or full-attention SDPA RoBERTa.
IMPLS = ("hfx", "ref", "sdpa")


@dataclass
class BenchConfig:
    """The model sizes of a run (the same for every implementation); ``window`` is the architecture's own knob
    (attention window, block size, projected length, random features or chunk length)."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    intermediate: int = 1024
    vocab: int = 1000
    window: int = 512
    batch: int = 1
    dropout: float = 0.1


@dataclass
class Arch:
    """``build_hfx(cfg, length)`` / ``build_reference(cfg, length)`` return an ``nn.Module`` whose forward takes
    ``input_ids`` and ``attention_mask`` and returns an output with ``last_hidden_state``; the builder sizes the
    position table for ``length`` itself. ``build_reference`` is None where no library has the architecture (its
    cells are not run; the table shows ``-``)."""

    build_hfx: Callable
    build_reference: Callable | None
    description: str = ""
    # The keys each query attends to under the architecture's pattern at a length, (cfg, length) -> K, and the
    # attention width (cfg) -> W, for the model FLOPs of benchmarks/utilisation.py (None: full attention over the
    # hidden size). The same for ours and the reference: model FLOPs count the pattern's work, not an implementation's.
    keys_per_query: Callable[[BenchConfig, int], float] | None = None
    attention_width: Callable[[BenchConfig], int] | None = None
    # Parameters of a built model (ours or the reference) that these inputs leave idle, not counted in N.
    idle_parameters: Callable[[nn.Module], int] | None = None


def _padded(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def _hfx_longformer(c: BenchConfig, length: int):
    import hf_xformers

    config = hf_xformers.HfxLongformerConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        attention_window=c.window,
        max_position_embeddings=length + 2,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return hf_xformers.HfxLongformerModel(config)


def _ref_longformer(c: BenchConfig, length: int):
    from transformers import LongformerConfig, LongformerModel

    config = LongformerConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        attention_window=c.window,
        # transformers pads the input to a multiple of the window before the embeddings.
        max_position_embeddings=_padded(length, c.window) + 2,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return LongformerModel(config, add_pooling_layer=False)


def build_sdpa_roberta(c: BenchConfig, length: int) -> nn.Module:
    """Full-attention ``RobertaModel`` through ``scaled_dot_product_attention``, no pooler: the baseline of every arch."""
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        max_position_embeddings=length + 2,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
        attn_implementation="sdpa",
    )
    model = RobertaModel(config, add_pooling_layer=False)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


ARCHS: dict[str, Arch] = {
    "longformer": Arch(
        build_hfx=_hfx_longformer,
        build_reference=_ref_longformer,
        description="sliding window (attention_window = --window), no global tokens; "
        "reference = transformers.LongformerModel",
        keys_per_query=lambda c, length: keys_longformer(c.window, length),
        idle_parameters=global_projection_parameters,  # no global tokens here
    ),
}


# BigBird: --window is the block size (run with --window 64); 3 random blocks. Both BigBirds use exact GELU, like
# the SDPA RoBERTa baseline, so the comparison is about attention, not activation functions.
BIGBIRD_RANDOM_BLOCKS = 3


def _hfx_bigbird(c: BenchConfig, length: int):
    import hf_xformers

    config = hf_xformers.HfxBigBirdConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        hidden_act="gelu",
        attention_type="block_sparse",
        block_size=c.window,
        num_random_blocks=BIGBIRD_RANDOM_BLOCKS,
        max_position_embeddings=length,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return hf_xformers.HfxBigBirdModel(config, add_pooling_layer=False)


def _ref_bigbird(c: BenchConfig, length: int):
    from transformers import BigBirdConfig, BigBirdModel

    config = BigBirdConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        hidden_act="gelu",
        attention_type="block_sparse",
        block_size=c.window,
        num_random_blocks=BIGBIRD_RANDOM_BLOCKS,
        # transformers pads the input to a multiple of the block size before the embeddings.
        max_position_embeddings=_padded(length, c.window),
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return BigBirdModel(config, add_pooling_layer=False)


ARCHS["bigbird"] = Arch(
    build_hfx=_hfx_bigbird,
    build_reference=_ref_bigbird,
    description="block sparse (block_size = --window, 3 random blocks, ITC), hidden_act gelu; reference = "
    "transformers.BigBirdModel(attention_type='block_sparse'), which switches to full attention at or below "
    "(5 + 2 * 3) blocks",
    keys_per_query=lambda c, length: keys_bigbird(c.window, BIGBIRD_RANDOM_BLOCKS, length),
)




# Linformer: --window is the projected length k (run with --window 256), one E and one F per layer shared by the
# heads (headwise, lucidrains' default too). Performer: --window is the number of random features per head (run with
# --window 266, int(d ln d) for d = 64: lucidrains' default). The references are lucidrains' `linformer` and
# `performer-pytorch` stacks (pre-LN, GELU feed-forward of 4 x hidden) under a token + learned position embedding,
# as in the anchor benchmarks; they take no pooler, and neither do ours here.


def _hfx_linformer(c: BenchConfig, length: int):
    import hf_xformers

    config = hf_xformers.HfxLinformerConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        linformer_k=c.window,
        linformer_sharing="headwise",
        max_position_embeddings=length + 2,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return hf_xformers.HfxLinformerModel(config, add_pooling_layer=False)


def _hfx_performer(c: BenchConfig, length: int):
    import hf_xformers

    config = hf_xformers.HfxPerformerConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        num_random_features=c.window,
        max_position_embeddings=length + 2,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return hf_xformers.HfxPerformerModel(config, add_pooling_layer=False)


def _lucidrains_encoder(c: BenchConfig, length: int, stack, takes_mask: bool):
    """Token + learned position embeddings in front of a lucidrains stack, with our models' call signature."""
    from types import SimpleNamespace

    import torch

    class LucidrainsEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token_emb = torch.nn.Embedding(c.vocab, c.hidden)
            self.pos_emb = torch.nn.Embedding(length, c.hidden)
            self.stack = stack

        def forward(self, input_ids, attention_mask=None):
            x = self.token_emb(input_ids) + self.pos_emb(torch.arange(input_ids.shape[1], device=input_ids.device))
            kwargs = {"mask": attention_mask.bool()} if takes_mask and attention_mask is not None else {}
            return SimpleNamespace(last_hidden_state=self.stack(x, **kwargs))

    return LucidrainsEncoder()


def _ref_linformer(c: BenchConfig, length: int):
    from linformer import Linformer  # pip install linformer (the `benchmarks` extra)

    stack = Linformer(dim=c.hidden, seq_len=length, depth=c.layers, k=c.window, heads=c.heads, dropout=c.dropout)
    return _lucidrains_encoder(c, length, stack, takes_mask=False)


def _ref_performer(c: BenchConfig, length: int):
    from performer_pytorch import Performer  # pip install performer-pytorch (the `benchmarks` extra)

    stack = Performer(dim=c.hidden, depth=c.layers, heads=c.heads, dim_head=c.hidden // c.heads,
                      nb_features=c.window, ff_dropout=c.dropout, attn_dropout=c.dropout)  # fmt: skip
    return _lucidrains_encoder(c, length, stack, takes_mask=True)


ARCHS["linformer"] = Arch(
    build_hfx=_hfx_linformer,
    build_reference=_ref_linformer,
    description="projected length k = --window, headwise sharing; reference = lucidrains linformer.Linformer "
    "(same k, headwise) under token + position embeddings",
    keys_per_query=lambda c, length: min(length, c.window),  # the k projected keys
)
ARCHS["performer"] = Arch(
    build_hfx=_hfx_performer,
    build_reference=_ref_performer,
    description="FAVOR+ with --window orthogonal random features per head; reference = lucidrains "
    "performer_pytorch.Performer (same number of features) under token + position embeddings",
    # Linear attention: phi(K)^T V and phi(Q) (phi(K)^T V) are two products of m features per token, the work of
    # attending to m keys.
    keys_per_query=lambda c, length: float(c.window),
)


# Reformer: --window is the chunk length of local and LSH attention (run with --window 64); layers alternate local and
# LSH attention, 1 hashing round, the feed-forward is --intermediate wide (relu, transformers' default), heads of 64.
# Axial positions (64, L / 64) with widths (64, hidden - 64): transformers' training needs the grid to equal the
# length. Both models get the same explicit num_buckets (ours derives it from the length, transformers would pick it
# from the first input). `reformer_stored` is ours with reversible=False (stored activations, the same numbers), for
# the depth/memory study (benchmark_reformer_depth.py).
REFORMER_HEAD_SIZE = 64


def _reformer_kwargs(c: BenchConfig, length: int) -> dict:
    from hf_xformers.models.reformer.configuration_reformer import default_num_buckets

    if length % c.window or length // c.window < 2:
        raise ValueError(f"reformer: the length ({length}) must be a multiple (>= 2) of the chunk length --window")
    return dict(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        attn_layers=(["local", "lsh"] * c.layers)[: c.layers],
        num_attention_heads=c.heads,
        attention_head_size=REFORMER_HEAD_SIZE,
        feed_forward_size=c.intermediate,
        local_attn_chunk_length=c.window,
        lsh_attn_chunk_length=c.window,
        num_hashes=1,
        num_buckets=default_num_buckets(length, c.window),
        axial_pos_shape=(64, length // 64),
        axial_pos_embds_dim=(64, c.hidden - 64),
        max_position_embeddings=length,
        hidden_dropout_prob=c.dropout,
        local_attention_probs_dropout_prob=c.dropout,
        lsh_attention_probs_dropout_prob=c.dropout,
        hash_seed=None,
        is_decoder=False,
    )


def _keys_reformer(c: BenchConfig, length: int) -> float:
    # Local and LSH attention both see their chunk and the one before (chunks of --window, one hashing round).
    return float(min(length, 2 * c.window))


def _width_reformer(c: BenchConfig) -> int:
    return c.heads * REFORMER_HEAD_SIZE


def _hfx_reformer(c: BenchConfig, length: int, reversible: bool = True, **overrides):
    import hf_xformers

    kwargs = {**_reformer_kwargs(c, length), **overrides}
    return hf_xformers.HfxReformerModel(hf_xformers.HfxReformerConfig(**kwargs, reversible=reversible))


def _ref_reformer(c: BenchConfig, length: int, **overrides):
    from transformers import ReformerConfig, ReformerModel

    return ReformerModel(ReformerConfig(**{**_reformer_kwargs(c, length), **overrides}))


ARCHS["reformer"] = Arch(
    build_hfx=_hfx_reformer,
    build_reference=_ref_reformer,
    description="layers alternating chunked local and LSH attention, chunk length = --window, 1 hashing round, "
    "the same explicit num_buckets, axial positions (64, L/64); reference = transformers.ReformerModel (same config)",
    keys_per_query=_keys_reformer,
    attention_width=_width_reformer,
)
ARCHS["reformer_stored"] = Arch(
    build_hfx=lambda c, length: _hfx_reformer(c, length, reversible=False),
    build_reference=_ref_reformer,
    description="as `reformer`, ours with reversible=False (activations stored for backward, the same numbers); "
    "reference = transformers.ReformerModel (always reversible in training)",
    keys_per_query=_keys_reformer,
    attention_width=_width_reformer,
)


# Reformer against lucidrains' reformer-pytorch, whose layers all use LSH attention: ours gets attn_layers all "lsh"
# and the settings lucidrains fixes (num_buckets = L / bucket_size, chunk = bucket_size = --window, GELU feed-forward
# of 4 x hidden); lucidrains gets heads of 64, one hashing round, ff_chunks=1 (the feed-forward on all positions at
# once, as ours), dropout on attention probabilities, attention output and feed-forward activations, reversible
# layers, and the same axial positions (64, L / 64) of widths (64, hidden - 64) and a final LayerNorm in front of and
# behind its `Reformer` stack. What cannot match: lucidrains' output projection has a bias, it normalises the mean of
# the two streams (hidden wide) where ours normalises their concatenation, it has no dropout after the feed-forward
# output nor on the embeddings, and its self-attention mask value is -5e4 (ours -1e5).
def _hfx_reformer_all_lsh(c: BenchConfig, length: int):
    return _hfx_reformer(c, length, attn_layers=["lsh"] * c.layers, num_buckets=length // c.window,
                         hidden_act="gelu")  # fmt: skip


def _ref_reformer_lucidrains(c: BenchConfig, length: int):
    from types import SimpleNamespace

    import torch
    from axial_positional_embedding import AxialPositionalEmbedding
    from reformer_pytorch import Reformer  # pip install reformer-pytorch (the `benchmarks` extra)

    if c.intermediate % c.hidden:
        raise ValueError("reformer-pytorch's feed-forward width is a multiple of hidden: adjust --intermediate")

    class LucidrainsReformerEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token_emb = torch.nn.Embedding(c.vocab, c.hidden)
            self.pos_emb = AxialPositionalEmbedding(c.hidden, (64, length // 64), (64, c.hidden - 64))
            self.reformer = Reformer(dim=c.hidden, depth=c.layers, heads=c.heads, dim_head=REFORMER_HEAD_SIZE,
                                     bucket_size=c.window, n_hashes=1, ff_chunks=1, ff_mult=c.intermediate // c.hidden, causal=False,
                                     lsh_dropout=c.dropout, ff_dropout=c.dropout, post_attn_dropout=c.dropout)  # fmt: skip
            self.norm = torch.nn.LayerNorm(c.hidden)

        def forward(self, input_ids, attention_mask=None):
            x = self.token_emb(input_ids)
            x = x + self.pos_emb(x)
            kwargs = {"input_mask": attention_mask.bool()} if attention_mask is not None else {}
            return SimpleNamespace(last_hidden_state=self.norm(self.reformer(x, **kwargs)))

    return LucidrainsReformerEncoder()


ARCHS["reformer_lucidrains"] = Arch(
    build_hfx=_hfx_reformer_all_lsh,
    build_reference=_ref_reformer_lucidrains,
    description="every layer LSH attention (ours: attn_layers all 'lsh', num_buckets = L / --window, gelu), "
    "chunk = bucket_size = --window, 1 hashing round; reference = lucidrains reformer_pytorch.Reformer (ff_chunks=1, "
    "same dropouts but none after the feed-forward output) under token + axial position embeddings and a LayerNorm",
    keys_per_query=_keys_reformer,
    attention_width=_width_reformer,
)


# The Universal Transformer: one shared block applied --layers times (fixed steps, no ACT, so every implementation
# does the same work per layer), full softmax attention through SDPA; --window is not used. Its reference is the
# full-attention baseline itself (`sdpa`, a RoBERTa of the same width and depth): no library has the architecture
# with a long-context encoder (transformers has none).
def _hfx_universal(c: BenchConfig, length: int):
    import hf_xformers

    config = hf_xformers.HfxUniversalConfig(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        intermediate_size=c.intermediate,
        use_act=False,
        max_position_embeddings=length,
        hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout,
        type_vocab_size=1,
    )
    return hf_xformers.HfxUniversalModel(config, add_pooling_layer=False)


ARCHS["universal"] = Arch(
    build_hfx=_hfx_universal,
    build_reference=None,
    description="none (transformers has no Universal Transformer; compare with `sdpa`, full attention of the same "
    "size); ours: one shared block applied --layers times, no ACT, sinusoidal positions and timestep signal",
)


# Transformer-XL reads a long text in segments of --window tokens, each attending to itself and the memory of the
# previous --window tokens (mem_len = --window, same_length): the way it covers a long context in linear time. The
# memories are detached, as in its training, so a backward flows through each segment only. transformers 5 has no
# Transformer-XL any more (deprecated in 4.35, removed in 5.0): no reference.
def _hfx_transfo_xl(c: BenchConfig, length: int):
    from types import SimpleNamespace

    import torch

    import hf_xformers

    if c.hidden % c.heads:
        raise ValueError(f"transfo_xl: --hidden ({c.hidden}) must be a multiple of --heads ({c.heads})")
    config = hf_xformers.HfxTransfoXLConfig(
        vocab_size=c.vocab,
        cutoffs=[],
        div_val=1,
        d_model=c.hidden,
        n_head=c.heads,
        d_head=c.hidden // c.heads,
        d_inner=c.intermediate,
        n_layer=c.layers,
        mem_len=c.window,
        same_length=True,
        clamp_len=0,
        dropout=c.dropout,
        dropatt=c.dropout,
    )
    segment = c.window

    class TransfoXLSegmentReader(torch.nn.Module):
        """Reads a row in segments, carrying the memories; ``last_hidden_state`` (batch, length, hidden)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = hf_xformers.HfxTransfoXLModel(config)
            self.config = config  # what the worker's source hash reads

        def forward(self, input_ids, attention_mask=None):
            mems, states = None, []
            for start in range(0, input_ids.shape[1], segment):
                mask = None if attention_mask is None else attention_mask[:, start : start + segment]
                out = self.model(input_ids=input_ids[:, start : start + segment], attention_mask=mask, mems=mems)
                mems = out.mems
                states.append(out.last_hidden_state)
            return SimpleNamespace(last_hidden_state=torch.cat(states, dim=1))

    return TransfoXLSegmentReader()


ARCHS["transfo_xl"] = Arch(
    build_hfx=_hfx_transfo_xl,
    build_reference=None,
    description="none (transformers 5 has no Transformer-XL); ours reads the row in segments of --window tokens "
    "with memories of --window tokens (mem_len = --window, same_length, detached as in training), plain embeddings "
    "and no adaptive softmax",
    # A segment's query sees the memory (--window) and the earlier half of its segment on average (causal); the
    # relative-position scores are not counted.
    keys_per_query=lambda c, length: float(min(length, 1.5 * c.window)),
)


def cell_flops(arch: str, impl: str, c: BenchConfig, length: int, model: nn.Module, training: bool) -> float:
    """Model FLOPs of one call of a cell (:func:`benchmarks.utilisation.step_flops`): ``model``'s matrix-product
    parameters, ``c.batch * length`` tokens, the pattern's keys per query (full attention for the ``sdpa`` baseline;
    the Universal Transformer's steps are its layers)."""
    entry = ARCHS[arch]
    keys = keys_full(length) if impl == "sdpa" or entry.keys_per_query is None else entry.keys_per_query(c, length)
    width = c.hidden if impl == "sdpa" or entry.attention_width is None else entry.attention_width(c)
    idle = 0 if impl == "sdpa" or entry.idle_parameters is None else entry.idle_parameters(model)
    return step_flops(matmul_parameters(model) - idle, c.batch * length, c.layers, keys, width, training)


def build_model(arch: str, impl: str, c: BenchConfig, length: int) -> nn.Module:
    """The model of one cell: ``impl`` (one of :data:`IMPLS`) of ``arch`` (a key of :data:`ARCHS`) at ``length``."""
    if impl == "sdpa":
        return build_sdpa_roberta(c, length)
    entry = ARCHS[arch]
    if impl == "hfx":
        return entry.build_hfx(c, length)
    if entry.build_reference is None:
        raise ValueError(f"{arch} has no reference implementation; run it with --impls hfx sdpa")
    return entry.build_reference(c, length)

