"""The benchmark harnesses' bookkeeping: slopes and the merging of rounds (the timed runs themselves are not tests)."""

from __future__ import annotations

import pytest

from benchmarks import benchmark_long_context as long_context
from benchmarks import benchmark_swin
from benchmarks import long_context_models as models


def cells(times: dict[int, float]) -> dict:
    return {long_context.key("hfx", length, "forward"): {"status": "ok", "time_s": t} for length, t in times.items()}


def test_loglog_slope_is_the_growth_exponent():
    linear = cells({2048: 0.1, 16384: 0.8})
    quadratic = cells({2048: 0.1, 16384: 6.4})
    assert long_context.loglog_slope(linear, "hfx", "forward", 2048, 16384) == pytest.approx(1.0)
    assert long_context.loglog_slope(quadratic, "hfx", "forward", 2048, 16384) == pytest.approx(2.0)
    assert long_context.loglog_slope(linear, "ref", "forward", 2048, 16384) is None  # no reference cells
    failed = {**linear, long_context.key("hfx", 16384, "forward"): {"status": "OOM"}}
    assert long_context.loglog_slope(failed, "hfx", "forward", 2048, 16384) is None
    line = long_context.slope_line(quadratic, [1024, 2048, 16384], "forward")
    assert "from 2048 to 16384" in line and "hfx 2.00" in line and "ref -" in line


def test_swin_rounds_are_merged_by_the_median_of_all_calls():
    rounds = [
        {"status": "ok", "time_s": 1.0, "times_s": [1.0, 1.1, 0.9], "background_cpu": [0.01], "peak_mib": 100.0},
        {"status": "error", "error": "killed"},
        {"status": "ok", "time_s": 2.0, "times_s": [2.0, 2.1, 1.9], "background_cpu": [0.02], "peak_mib": 140.0},
    ]
    merged = benchmark_swin.combine(rounds)
    assert merged["rounds"] == 2 and len(merged["times_s"]) == 6
    assert merged["time_s"] == pytest.approx(1.5)  # median of the six calls
    assert merged["peak_mib"] == pytest.approx(120.0)
    assert benchmark_swin.combine([{"status": "error", "error": "x"}])["status"] == "error"


def test_reformer_builders_give_the_same_model():
    """The `reformer` entry gives ours and transformers' ReformerModel one config: with a fixed hash seed (the
    benchmark draws fresh rotations) transformers' weights load into ours and the outputs agree."""
    import torch

    c = models.BenchConfig(hidden=128, layers=2, heads=2, intermediate=256, vocab=50, window=16, dropout=0.0)
    length = 128
    ref = models._ref_reformer(c, length, hash_seed=3).eval()
    ours = models._hfx_reformer(c, length, hash_seed=3).eval()
    assert ours.config.num_buckets == ref.config.num_buckets == 16
    assert ours.config.attn_layers == ref.config.attn_layers == ["local", "lsh"]
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(5, c.vocab, (1, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert models.build_model("reformer_stored", "hfx", c, length).config.reversible is False
    with pytest.raises(ValueError, match="multiple"):
        models._reformer_kwargs(c, 100)


def test_reformer_lucidrains_entry_matches_sizes():
    """The lucidrains comparison: all-LSH layers on both sides, chunk = bucket_size, 1 round, heads of 64."""
    pytest.importorskip("reformer_pytorch")
    import torch

    c = models.BenchConfig(hidden=128, layers=2, heads=2, intermediate=512, vocab=50, window=16, dropout=0.0)
    ours = models.build_model("reformer_lucidrains", "hfx", c, 128)
    theirs = models.build_model("reformer_lucidrains", "ref", c, 128)
    assert ours.config.attn_layers == ["lsh", "lsh"] and ours.config.num_buckets == 128 // 16
    lsh = theirs.reformer.layers.blocks[0].f.net.fn
    assert (lsh.heads, lsh.dim_head, lsh.bucket_size, lsh.lsh_attn.n_hashes) == (2, 64, 16, 1)
    assert not lsh.use_full_attn and lsh.full_attn_thres < 128  # LSH, not its full-attention fallback
    ids = torch.randint(5, c.vocab, (1, 128))
    out = theirs(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    assert out.shape == (1, 128, c.hidden)
