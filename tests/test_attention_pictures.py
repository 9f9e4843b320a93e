"""The attention pictures of the architecture pages (scripts/draw_attention.py): each pattern read off a tiny model
is the pattern the model's own masks define, nonzero, and drawn into a PNG that its page shows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

from hf_xformers.attention.relative_memory import allowed_keys

REPO = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("draw_attention", REPO / "scripts" / "draw_attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


draw_attention = _load_script()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_longformer_band_and_global_rows():
    length, window, globals_ = 40, 8, (0, 25)
    picture = draw_attention.longformer(length, window, globals_)
    attended = picture.attended["attention"]
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    expected = (np.abs(i - j) <= window // 2) | np.isin(j, globals_) | np.isin(i, globals_)
    np.testing.assert_array_equal(attended, expected)
    # The band is window + 1 keys wide away from the edges and the global tokens.
    assert attended[12].sum() == window + 1 + len(globals_)


def test_bigbird_matches_the_layers_pattern_mask():
    length = 96
    picture = draw_attention.bigbird(length, block=8, random_blocks=2)
    layer = picture.model.encoder.layer[0].attention.self
    plan = layer.plan(torch.ones(1, length, dtype=torch.bool))
    expected = layer.pattern_mask(plan, length)[0, 0].numpy()
    np.testing.assert_array_equal(picture.attended["attention"], expected)
    # Random blocks are there: more than the window and the global blocks.
    blocks = np.arange(length) // 8
    window_or_global = (np.abs(blocks[:, None] - blocks[None, :]) <= 1) | np.isin(blocks, (0, 11))[None, :]
    assert (expected & ~window_or_global).any()


def test_reformer_local_chunks_and_lsh_sorted_chunks():
    length, chunk = 48, 8
    picture = draw_attention.reformer(length, chunk, buckets=4)
    chunks = np.arange(length) // chunk
    q, k = chunks[:, None], chunks[None, :]
    num_chunks = length // chunk
    # Local attention: own chunk and the one before (the first chunk's "before" is the last, as in transformers).
    np.testing.assert_array_equal(picture.attended["local"], (k == q) | (k == (q - 1) % num_chunks))
    # LSH: in bucket-sorted order, each query sees its own sorted chunk and the one before, never itself here.
    sorted_lsh = picture.attended["lsh_sorted"]
    assert not (sorted_lsh & ~((k == q) | (k == (q - 1) % num_chunks))).any()
    assert sorted_lsh.any(axis=1).all() and not np.diag(sorted_lsh).any()
    assert not np.array_equal(picture.attended["lsh"], sorted_lsh)  # the hashing reordered the positions


def test_transfo_xl_memory_and_causal_segment():
    picture = draw_attention.transfo_xl(segment=6, memory=6)
    expected = allowed_keys(6, 6, same_length=True, mem_len=6).numpy()
    np.testing.assert_array_equal(picture.attended["attention"], expected)


def test_swin_windows_and_shifted_regions():
    side, window, shift = 8, 4, 2
    plain, shifted = draw_attention.swin_tokens(side, window)
    y, x = np.divmod(np.arange(side * side), side)
    same_window = (y[:, None] // window == y[None, :] // window) & (x[:, None] // window == x[None, :] // window)
    np.testing.assert_array_equal(plain, same_window)
    # After the roll by -shift, windows group rolled positions; tokens rolled in from the other edge stay apart.
    ry, rx = (y - shift) % side, (x - shift) % side
    region_y = (ry >= side - window).astype(int) + (ry >= side - shift)
    region_x = (rx >= side - window).astype(int) + (rx >= side - shift)
    expected = (
        (ry[:, None] // window == ry[None, :] // window)
        & (rx[:, None] // window == rx[None, :] // window)
        & (region_y[:, None] == region_y[None, :])
        & (region_x[:, None] == region_x[None, :])
    )
    np.testing.assert_array_equal(shifted, expected)
    assert not np.array_equal(plain, shifted)


def test_linformer_projects_every_key():
    picture = draw_attention.linformer(length=32, k=8)
    assert picture.attended["attention"].shape == (32, 8) and picture.attended["attention"].all()
    assert picture.attended["projection"].shape == (8, 32)


def test_pictures_are_drawn_and_shown(tmp_path):
    (path,) = draw_attention.main(["--out", str(tmp_path), "--only", "transfo-xl"])
    pixels = matplotlib.image.imread(path)[..., :3]
    assert (pixels < 0.9).any(axis=-1).mean() > 0.05  # coloured cells, not a blank figure
    for name in draw_attention.PICTURES:
        image = REPO / "docs" / "images" / f"attention_{name}.png"
        assert image.is_file(), f"{image.relative_to(REPO)} is missing: run python scripts/draw_attention.py"
        page = (REPO / "docs" / "architectures" / f"{name}.md").read_text(encoding="utf-8")
        assert f"../images/attention_{name}.png" in page, f"docs/architectures/{name}.md does not show {image.name}"
