"""Pictures of each architecture's attention pattern for the documentation (``make docs`` runs this script).

Every picture is read off a tiny model: it is built with random weights, run once with ``output_attentions=True``,
and a query-key cell is drawn where the returned attention probability is nonzero (above ``ATTENDED``). So the pictures show what the
code does, not what a paper says it should do. Colours name the reason a key is visible (band, global token, random
block, memory ...), worked out from the positions alone; the nonzero pattern itself comes from the model.

    python scripts/draw_attention.py                 # writes docs/images/attention_<arch>.png
    python scripts/draw_attention.py --out /tmp/pics

``tests/test_attention_pictures.py`` checks each pattern against the model's own masks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

import hf_xformers as hfx  # noqa: E402
from hf_xformers.attention.lsh import HfxLSHSelfAttention  # noqa: E402
from hf_xformers.attention.shifted_window import window_token_indices  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "docs" / "images"
# Cell values of a picture: 0 = not attended, then one colour per reason a key is visible.
COLOURS = ["#ffffff", "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
# A probability above this counts as attended. Masked keys get 0, or about exp(-100) where a mask adds -100 to the
# scores (Swin's shift mask, as in transformers' Swin); visible keys of these tiny random models get more than 1e-3.
ATTENDED = 1e-12
TINY_TEXT = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


@dataclass
class Panel:
    """One heatmap: ``cells`` ``(rows, cols)`` ints indexing ``legend`` (0 = not attended, drawn white)."""

    title: str
    cells: np.ndarray
    legend: tuple[str, ...]
    xlabel: str = "key position"
    ylabel: str = "query position"
    grid: int = 0  # draw block lines every `grid` cells (0: none)
    cmap: str | None = None  # a matplotlib colour map for continuous values (then `legend` is unused)


@dataclass
class Picture:
    """What one architecture's figure shows, and the raw pattern the tests compare with the model's masks."""

    name: str
    caption: str
    panels: list[Panel]
    attended: dict[str, np.ndarray]  # (queries, keys) bool per panel key: probability > ATTENDED
    model: torch.nn.Module | None  # the model the pattern was read from (the tests ask it for its own masks)


def _ids(length: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(5, vocab, (1, length), generator=torch.Generator().manual_seed(0))


def _nonzero(probs: torch.Tensor) -> np.ndarray:
    """``(batch, heads, q, k)`` probabilities -> ``(q, k)`` bool: attended by head 0 of example 0 (the pattern is the
    same for every head except BigBird's random blocks and Reformer's buckets, which differ per head)."""
    return (probs[0, 0] > ATTENDED).numpy()


def longformer(length: int = 48, window: int = 12, global_positions: tuple[int, ...] = (0, 30)) -> Picture:
    """Sliding window of ``window`` keys (``window / 2`` each side) plus global tokens that see, and are seen by,
    every position."""
    config = hfx.HfxLongformerConfig(
        **TINY_TEXT, num_hidden_layers=1, attention_window=window, max_position_embeddings=length + 2
    )
    model = hfx.HfxLongformerModel(config).eval()
    is_global = torch.zeros(1, length, dtype=torch.long)
    is_global[0, list(global_positions)] = 1
    with torch.no_grad():
        out = model(input_ids=_ids(length), global_attention_mask=is_global, output_attentions=True)
    # attentions: (batch, heads, seq, G + window + 1), the G global keys first, then the band from -window/2 to
    # +window/2 (transformers' Longformer layout); global_attentions: (batch, heads, G, seq), the global rows.
    num_global, half = len(global_positions), window // 2
    band = out.attentions[0][0, 0]
    attended = np.zeros((length, length), dtype=bool)
    for query in range(length):
        for g, key in enumerate(global_positions):
            attended[query, key] |= bool(band[query, g] > ATTENDED)
        for offset in range(-half, half + 1):
            key = query + offset
            if 0 <= key < length and band[query, num_global + half + offset] > ATTENDED:
                attended[query, key] = True
    for g, query in enumerate(global_positions):
        attended[query] = (out.global_attentions[0][0, 0, g] > ATTENDED).numpy()
    cells = attended.astype(int)
    glob = np.zeros_like(attended)
    glob[list(global_positions)] = True
    glob[:, list(global_positions)] = True
    cells[attended & glob] = 2
    return Picture(
        "longformer",
        f"{length} tokens, attention_window={window}, global tokens at {', '.join(map(str, global_positions))}",
        [Panel("Longformer", cells, ("not attended", "sliding window", "global token (row and column)"))],
        {"attention": attended},
        model,
    )


def bigbird(length: int = 128, block: int = 8, random_blocks: int = 2) -> Picture:
    """Blocks of ``block`` tokens: each query block sees its neighbours (window), the first and last blocks (global),
    and ``random_blocks`` seeded random blocks."""
    config = hfx.HfxBigBirdConfig(
        **TINY_TEXT,
        num_hidden_layers=1,
        block_size=block,
        num_random_blocks=random_blocks,
        max_position_embeddings=length,
    )
    model = hfx.HfxBigBirdModel(config).eval()
    with torch.no_grad():
        out = model(input_ids=_ids(length), output_attentions=True)
    attended = _nonzero(out.attentions[0])
    qb = np.arange(length)[:, None] // block
    kb = np.arange(length)[None, :] // block
    last = (length - 1) // block
    window = np.abs(qb - kb) <= 1
    glob = (qb == 0) | (qb == last) | (kb == 0) | (kb == last)
    cells = np.where(attended, 3, 0)
    cells[attended & window] = 1
    cells[attended & glob] = 2
    legend = ("not attended", "window (neighbouring blocks)", "global (first and last block)", "random blocks")
    return Picture(
        "bigbird",
        f"{length} tokens, block_size={block}, num_random_blocks={random_blocks} (head 0)",
        [Panel("BigBird", cells, legend, grid=block)],
        {"attention": attended},
        model,
    )


def linformer(length: int = 48, k: int = 12) -> Picture:
    """Keys and values projected along the sequence to ``k`` slots: every query attends to the ``k`` slots, each a
    learned mixture of all ``length`` keys."""
    config = hfx.HfxLinformerConfig(**TINY_TEXT, num_hidden_layers=1, max_position_embeddings=length + 2, linformer_k=k)
    model = hfx.HfxLinformerModel(config).eval()
    with torch.no_grad():
        out = model(input_ids=_ids(length), output_attentions=True)
        key_projection = model.encoder.layer[0].attention.self.projections()[0][0, :length]  # (length, k)
    probs = out.attentions[0][0, 0].numpy()  # (length, k)
    weights = key_projection.T.abs().detach().numpy()  # (k, length)
    return Picture(
        "linformer",
        f"{length} tokens, linformer_k={k}: every query attends to {k} slots, each slot mixes all {length} keys",
        [
            Panel("attention probabilities", probs, (), xlabel="projected slot", cmap="Blues"),
            Panel(
                "|E|: weight of each key in a slot",
                weights,
                (),
                xlabel="key position",
                ylabel="projected slot",
                cmap="Oranges",
            ),
        ],
        {"attention": probs > ATTENDED, "projection": weights > 0},
        model,
    )


def reformer(length: int = 64, chunk: int = 8, buckets: int = 4) -> Picture:
    """Layer 1: chunked local attention (own chunk and the one before); layer 2: LSH attention (keys hashed into
    ``buckets``, sorted, attended within chunks of the sorted order)."""
    config = hfx.HfxReformerConfig(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=2,
        attention_head_size=16,
        feed_forward_size=64,
        attn_layers=["local", "lsh"],
        local_attn_chunk_length=chunk,
        lsh_attn_chunk_length=chunk,
        num_buckets=buckets,
        axial_pos_embds=False,
        max_position_embeddings=length,
        is_decoder=False,
    )
    model = hfx.HfxReformerModel(config).eval()
    lsh_layer = next(m for m in model.modules() if isinstance(m, HfxLSHSelfAttention))
    seen = {}

    def keep_buckets(module, args, out) -> None:
        # The LSH layer returns its buckets (batch, heads, rounds, seq) beside the context, in AttentionOutput's
        # third field.
        seen["buckets"] = out[2]

    hook = lsh_layer.register_forward_hook(keep_buckets)
    with torch.no_grad():
        out = model(input_ids=_ids(length), output_attentions=True)
    hook.remove()
    local, lsh = (_nonzero(a) for a in out.attentions)
    bucket = seen["buckets"][0, 0, 0].numpy()
    # LSH attention sorts positions by bucket (then position) and attends within chunks of that order.
    order = np.lexsort((np.arange(length), bucket))
    sorted_lsh = lsh[np.ix_(order, order)]
    same_bucket = bucket[:, None] == bucket[None, :]
    lsh_cells = np.where(lsh, 3, 0)
    lsh_cells[lsh & ~same_bucket] = 4
    legend = ("", "own and previous chunk", "", "same bucket", "another bucket, in a neighbouring sorted chunk")
    return Picture(
        "reformer",
        f"{length} tokens, chunk length {chunk}, {buckets} buckets, one hashing round (head 0)",
        [
            Panel("local attention (layer 1)", local.astype(int), legend, grid=chunk),
            Panel("LSH attention (layer 2)", lsh_cells, legend),
            Panel(
                "LSH, positions sorted by bucket",
                lsh_cells[np.ix_(order, order)],
                legend,
                xlabel="key (sorted by bucket)",
                ylabel="query (sorted by bucket)",
                grid=chunk,
            ),
        ],
        {"local": local, "lsh": lsh, "lsh_sorted": sorted_lsh},
        model,
    )


def transfo_xl(segment: int = 8, memory: int = 8) -> Picture:
    """A segment of ``segment`` queries over the cached ``memory`` of the previous segment and itself (causal)."""
    config = hfx.HfxTransfoXLConfig(
        vocab_size=64, d_model=32, d_embed=32, n_head=2, d_head=16, d_inner=64, n_layer=1, mem_len=memory, cutoffs=[]
    )
    model = hfx.HfxTransfoXLModel(config).eval()
    ids = _ids(2 * segment, vocab=64)
    with torch.no_grad():
        first = model(input_ids=ids[:, :segment])
        out = model(input_ids=ids[:, segment:], mems=first.mems, output_attentions=True)
    attended = _nonzero(out.attentions[0])  # (segment, memory + segment)
    cells = attended.astype(int)
    cells[:, :memory][attended[:, :memory]] = 5
    return Picture(
        "transfo-xl",
        f"segment 2 of {segment} tokens, mem_len={memory}, same_length=True",
        [
            Panel(
                "Transformer-XL",
                cells,
                ("", "current segment (causal)", "", "", "", "memory of the previous segment"),
                xlabel="key (memory, then segment)",
                grid=memory,
            )
        ],
        {"attention": attended},
        model,
    )


def swin_tokens(side: int = 8, window: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Token x token attention of Swin's first stage on a ``side x side`` map: ``(plain, shifted)`` bool
    ``(side**2, side**2)``, from the window attention probabilities of the first (plain) and second (shifted) block."""
    patterns = []
    for depth in (1, 2):  # a stage returns its last block's attentions: block 1 plain, block 2 shifted
        config = hfx.HfxSwinConfig(
            image_size=side * 4, patch_size=4, embed_dim=16, depths=[depth], num_heads=[2], window_size=window
        )
        model = hfx.HfxSwinModel(config).eval()
        pixels = torch.randn(1, 3, side * 4, side * 4, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            probs = model(pixel_values=pixels, output_attentions=True).attentions[0]  # (windows, heads, w*w, w*w)
        shift = window // 2 if depth == 2 else 0
        # The same slot -> token map the attention uses for its windows (pad, roll by the shift, partition).
        gather, _ = window_token_indices(side, side, window, shift, torch.device("cpu"))
        slots = gather.view(-1, window * window).numpy()
        dense = np.zeros((side * side, side * side), dtype=bool)
        for w, tokens in enumerate(slots):
            dense[np.ix_(tokens, tokens)] = (probs[w, 0] > ATTENDED).numpy()
        patterns.append(dense)
    return patterns[0], patterns[1]


def swin(side: int = 8, window: int = 4) -> Picture:
    """Windows of ``window x window`` patches, then the same windows shifted by ``window / 2``: each patch's
    colour is the group of patches it attends to (its window; after the shift, its window's region)."""
    plain, shifted = swin_tokens(side, window)

    def groups(dense: np.ndarray) -> np.ndarray:
        # Patches that attend to exactly the same keys form one group; number the groups in reading order.
        ids: dict[bytes, int] = {}
        return np.array([ids.setdefault(row.tobytes(), len(ids)) for row in dense]).reshape(side, side)

    return Picture(
        "swin",
        f"a {side} x {side} patch map, window_size={window}: block 1 (windows), block 2 (shifted by {window // 2})",
        [
            Panel("block 1: windows", groups(plain), (), "patch column", "patch row", cmap="tab10"),
            Panel("block 2: shifted windows", groups(shifted), (), "patch column", "patch row", cmap="tab10"),
        ],
        {"plain": plain, "shifted": shifted},
        None,
    )


PICTURES: dict[str, Callable[[], Picture]] = {
    "longformer": longformer,
    "bigbird": bigbird,
    "linformer": linformer,
    "reformer": reformer,
    "transfo-xl": transfo_xl,
    "swin": swin,
}


def draw(picture: Picture, path: Path) -> Path:
    """Save ``picture`` as a PNG at ``path``."""
    count = len(picture.panels)
    fig, axes = plt.subplots(1, count, figsize=(max(6.4, 4.6 * count), 5.0), squeeze=False)
    categories = ListedColormap(COLOURS)
    used: dict[str, str] = {}
    for ax, panel in zip(axes[0], picture.panels):
        if panel.cmap:
            ax.imshow(panel.cells, cmap=panel.cmap, interpolation="nearest", aspect="auto")
        else:
            ax.imshow(
                panel.cells, cmap=categories, vmin=0, vmax=len(COLOURS) - 1, interpolation="nearest", aspect="auto"
            )
        ax.set_title(panel.title, fontsize=12)
        ax.set_xlabel(panel.xlabel, fontsize=10)
        ax.set_ylabel(panel.ylabel, fontsize=10)
        if panel.grid:
            for edge in np.arange(panel.grid, max(panel.cells.shape), panel.grid) - 0.5:
                ax.axhline(edge, color="#d0d0d0", lw=0.5)
                ax.axvline(edge, color="#d0d0d0", lw=0.5)
        for value, label in enumerate(panel.legend):
            if value and label and value in panel.cells:
                used.setdefault(label, COLOURS[value])
    handles = [Patch(facecolor=colour, edgecolor="#888888", label=label) for label, colour in used.items()]
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=2 if count == 1 else 3, fontsize=10, frameon=False)
    fig.suptitle(picture.caption, fontsize=10)
    fig.tight_layout(rect=(0, 0.12 if handles and count == 1 else 0.08 if handles else 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=IMAGES, help="folder for attention_<arch>.png")
    parser.add_argument("--only", nargs="*", choices=sorted(PICTURES), help="draw these architectures only")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    written = []
    for name in args.only or PICTURES:
        written.append(draw(PICTURES[name](), args.out / f"attention_{name}.png"))
        print(written[-1])
    return written


if __name__ == "__main__":
    main()
