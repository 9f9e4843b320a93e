"""The benchmark harnesses' bookkeeping: slopes, the merging of rounds, the precision flags (--dtype, --autocast,
--device) and the registry entries (the timed runs themselves are not tests; cells run here in-process at tiny
sizes)."""

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


# --dtype / --autocast / --device (benchmarks/precision.py) in the long-context benchmark. Cells run in this process
# (the worker's own function instead of a subprocess) so that each takes well under a second.

TINY = ["--window", "16", "--hidden", "32", "--layers", "1", "--heads", "2", "--vocab", "50", "--repeats", "1",
        "--threads", "1", "--max-background", "1", "--quiet-wait", "0"]  # fmt: skip


def _in_process(spec: dict, timeout: float, mem_limit_gib: float) -> dict:
    from benchmarks.long_context_worker import run_worker

    return {**run_worker(spec), "wall_s": 0.0}


def _spec(arch: str, impl: str, mode: str, length: int = 64, **precision) -> dict:
    import dataclasses

    c = models.BenchConfig(hidden=32, layers=1, heads=2, intermediate=64, vocab=50, window=16)
    return {"arch": arch, "impl": impl, "length": length, "mode": mode, "config": dataclasses.asdict(c), "repeats": 1,
            "threads": 1, "seed": 0, "max_background": 1.0, "quiet_wait": 0, **precision}  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "autocast", "weights", "compute"),
    [
        ("forward", False, "bfloat16", "bfloat16"),  # inference: bf16 weights
        ("backward", True, "float32", "bfloat16"),  # Trainer(bf16=True): fp32 weights, bf16 compute
        ("backward", False, "bfloat16", "bfloat16"),  # pure bf16 training
    ],
)
def test_worker_casts_the_weights_or_autocasts_the_training_forward(monkeypatch, mode, autocast, weights, compute):
    import torch

    from benchmarks import long_context_worker as worker

    seen = {}

    def build_and_watch(*args):
        model = models.build_model(*args)
        # What a matrix product computes in (under autocast the LayerNorms return float32: look at a Linear).
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_hook(lambda m, i, out: seen.update(output=out.dtype))
        seen["model"] = model
        return model

    monkeypatch.setattr(worker, "build_model", build_and_watch)
    res = worker.run_worker(_spec("longformer", "hfx", mode, dtype="bfloat16", autocast=autocast, device="cpu"))
    assert res["status"] == "ok" and (res["dtype"], res["autocast"]) == ("bfloat16", autocast)
    assert {p.dtype for p in seen["model"].parameters()} == {getattr(torch, weights)}
    assert seen["output"] == getattr(torch, compute)
    if mode == "backward":
        # (Longformer's global projections get no gradient without global tokens.)
        grads = [p.grad for p in seen["model"].parameters() if p.grad is not None]
        assert grads and {g.dtype for g in grads} == {getattr(torch, weights)}
    fp32 = worker.run_worker(_spec("longformer", "hfx", mode))  # no precision fields: float32 as before
    assert fp32["dtype"] == "float32" and seen["output"] == torch.float32


@pytest.mark.parametrize("arch", ["universal", "transfo_xl"])
def test_universal_and_transfo_xl_entries_train_under_autocast_and_have_no_reference(arch):
    from benchmarks.long_context_worker import run_worker

    for mode in ("forward", "backward"):
        res = run_worker(_spec(arch, "hfx", mode, length=48, dtype="bfloat16", autocast=True))
        assert res["status"] == "ok" and res["time_s"] > 0 and res["params_m"] > 0
    c = models.BenchConfig(hidden=32, layers=1, heads=2, intermediate=64, vocab=50, window=16)
    with pytest.raises(ValueError, match="no reference"):
        models.build_model(arch, "ref", c, 48)


def test_transfo_xl_entry_reads_the_row_in_segments_with_memories():
    """The wrapper covers the whole row, and its segments see the earlier ones through the memory."""
    import torch

    c = models.BenchConfig(hidden=32, layers=1, heads=2, intermediate=64, vocab=50, window=16, dropout=0.0)
    model = models.build_model("transfo_xl", "hfx", c, 48).eval()
    ids = torch.randint(5, 50, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = model(input_ids=ids).last_hidden_state
        alone = model.model(input_ids=ids[:, 16:32]).last_hidden_state
    assert states.shape == (1, 48, 32)
    assert not torch.allclose(states[:, 16:32], alone, atol=1e-4)  # the memory of segment 1 changed segment 2


def test_bf16_run_writes_a_suffixed_table_that_records_the_precision(tmp_path, monkeypatch):
    monkeypatch.setattr(long_context, "run_cell", _in_process)
    argv = [
        "--arch",
        "universal",
        "--lengths",
        "32",
        "--dtype",
        "bfloat16",
        "--autocast",
        "--out",
        str(tmp_path),
        *TINY,
    ]
    assert long_context.main(argv) == 0
    stem = tmp_path / "universal_w16_h32_l1_b1_bf16_autocast"
    text = stem.with_suffix(".md").read_text()
    assert "- dtype: bfloat16 weights (forward); autocast bfloat16, fp32 weights (training); device cpu." in text
    import json

    saved = json.loads(stem.with_suffix(".json").read_text())
    assert (saved["meta"]["dtype"], saved["meta"]["autocast"], saved["meta"]["device"]) == ("bfloat16", True, "cpu")
    assert set(saved["results"]) == {"hfx|32|forward", "sdpa|32|forward", "hfx|32|backward", "sdpa|32|backward"}
    assert "| 32 | " in text and " | - | " in text  # the missing reference shows as '-'
    # The float32 table of the same sizes keeps its own name.
    assert long_context.main(["--arch", "universal", "--lengths", "32", "--modes", "forward", "--impls", "hfx",
                              "--out", str(tmp_path), *TINY]) == 0  # fmt: skip
    assert (tmp_path / "universal_w16_h32_l1_b1.md").exists() and stem.with_suffix(".md").exists()
    assert (
        "dtype: float32 weights (forward); float32 weights (training)"
        in (tmp_path / "universal_w16_h32_l1_b1.md").read_text()
    )


def test_precision_flags_refuse_what_cannot_work(capsys):
    from benchmarks.precision import Precision

    with pytest.raises(SystemExit):
        long_context.main(["--autocast", "--render-only"])
    assert "--autocast needs a 16-bit --dtype" in capsys.readouterr().err
    assert (
        Precision("bfloat16").suffix() == "_bf16"
        and Precision("float16", True, "cuda").suffix() == "_fp16_autocast_cuda"
    )
    assert Precision().suffix() == "" and Precision("bfloat16").describe(training=True).endswith(
        "no autocast (training)"
    )


def test_old_float32_results_still_render(tmp_path):
    """A committed results file from before the precision fields renders as float32 on the CPU, as measured."""
    import shutil
    from pathlib import Path

    committed = Path(long_context.__file__).parent / "results" / "linformer_w256_h256_l4_b1.json"
    shutil.copy(committed, tmp_path / committed.name)
    argv = ["--arch", "linformer", "--window", "256", "--render-only", "--out", str(tmp_path)]
    assert long_context.main(argv) == 0
    text = (tmp_path / "linformer_w256_h256_l4_b1.md").read_text()
    assert "- dtype: float32 weights (forward); float32 weights (training); device cpu." in text
    assert "peak RSS" in text and "## forward+backward (train)" in text


def test_comparison_table_gives_speedups_and_ours_against_the_reference():
    def run(dtype: str, hfx: float, ref: float) -> tuple[dict, dict]:
        meta = {"arch": "longformer", "config": {"hidden": 32}, "date": "d", "dtype": dtype, "autocast": False}
        results = {long_context.key(i, 1024, "forward"): {"status": "ok", "time_s": t, "peak_mib": 10 * t}
                   for i, t in (("hfx", hfx), ("ref", ref))}  # fmt: skip
        return meta, results

    bf16, fp32 = run("bfloat16", 1.0, 3.0), run("float32", 4.0, 6.0)
    table = long_context.render_comparison(*bf16, *fp32)
    assert "## bf16 against fp32: forward" in table
    # hfx fp32/bf16 4.00x, ref 2.00x, sdpa absent, ref/hfx 3.00x in bf16 and 1.50x in fp32.
    assert "| 1024 | 1.000 | 4.000 | 4.00x | 2.00x | - | 3.00x | 1.50x | - | 4.00x | 2.00x |" in table
    other = ({**fp32[0], "config": {"hidden": 64}}, fp32[1])
    with pytest.raises(ValueError, match="same config"):
        long_context.render_comparison(*bf16, *other)


TINY_SWIN = dict(embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=2, patch_size=4)


def test_swin_benchmark_records_and_applies_the_precision(tmp_path, monkeypatch):
    """Swin's worker (in this process, at a tiny size): bf16 weights and pixels for the forward, float32 weights under
    autocast for the backward; the files get the suffix and the table the precision."""
    import torch

    monkeypatch.setattr(benchmark_swin, "SWIN_T", TINY_SWIN)
    monkeypatch.setattr(benchmark_swin, "SIZES", {"224": (32, 1), "448": (64, 1)})
    built = []
    real_build = benchmark_swin.build
    monkeypatch.setattr(benchmark_swin, "build", lambda impl, size: built.append(real_build(impl, size)) or built[-1])

    def in_process(spec: dict, timeout: float) -> dict:
        return {**benchmark_swin.run_worker(spec), "wall_s": 0.0}

    monkeypatch.setattr(benchmark_swin, "run_cell", in_process)
    argv = ["--sizes", "224", "--impls", "hfx", "hf", "--repeats", "1", "--threads", "1", "--max-background", "1",
            "--quiet-wait", "0", "--dtype", "bfloat16", "--autocast", "--out", str(tmp_path)]  # fmt: skip
    assert benchmark_swin.main(argv) == 0
    weights = [{p.dtype for p in model.parameters()} for model, _ in built]
    # forward (hfx, hf): bf16 weights; backward (hfx, hf): float32 weights, trained under autocast.
    assert weights == [{torch.bfloat16}] * 2 + [{torch.float32}] * 2
    text = (tmp_path / "swin_bf16_autocast.md").read_text()
    assert "- dtype: bfloat16 weights (forward); autocast bfloat16, fp32 weights (training); device cpu." in text
    import json

    saved = json.loads((tmp_path / "swin_bf16_autocast.json").read_text())
    assert {r["status"] for r in saved["results"].values()} == {"ok"} and len(saved["results"]) == 4
    assert saved["meta"]["dtype"] == "bfloat16" and not (tmp_path / "swin.json").exists()
    assert {r["autocast"] for r in saved["results"].values()} == {True}


def test_attention_switch_benchmark_autocast_training_and_file_name(tmp_path, monkeypatch):
    import torch

    from benchmarks import benchmark_attention_switch as switch

    for name, value in (("HIDDEN", 32), ("HEADS", 2), ("INTERMEDIATE", 64), ("VOCAB", 50)):
        monkeypatch.setattr(switch, name, value)
    dtypes = []
    real_build = switch.build

    def build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        model.register_forward_pre_hook(lambda m, a: dtypes.append((next(m.parameters()).dtype,
                                                                    torch.is_autocast_enabled("cpu"))))  # fmt: skip
        return model

    monkeypatch.setattr(switch, "build", build)
    argv = ["--archs", "longformer", "--lengths", "64", "--implementations", "sdpa", "--modes", "forward", "train",
            "--repeats", "1", "--warmup", "0", "--threads", "1", "--dtype", "bfloat16", "--autocast",
            "--out", str(tmp_path)]  # fmt: skip
    switch.main(argv)
    assert set(dtypes) == {(torch.bfloat16, False), (torch.float32, True)}  # forward bf16; training autocast
    text = (tmp_path / "attention_switch_cpu_bfloat16_autocast.md").read_text()
    assert "dtype: bfloat16 weights (forward); autocast bfloat16, fp32 weights (training); device cpu." in text
    with pytest.raises(SystemExit):
        switch.main(["--autocast"])


# ----- utilisation: model FLOPs, the product rate of the run, MFU -------------------------------------------------


def test_model_flops_formula_and_parameters():
    import torch

    from benchmarks import utilisation

    # 6 N T + 3 * L * 4 T K W for a training step, 2 N T + L * 4 T K W for a forward.
    assert utilisation.step_flops(1000, 10, 2, 5, 8) == 6 * 1000 * 10 + 3 * 2 * 4 * 10 * 5 * 8
    assert utilisation.step_flops(1000, 10, 2, 5, 8, training=False) == 2 * 1000 * 10 + 2 * 4 * 10 * 5 * 8
    model = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 4))
    assert utilisation.matmul_parameters(model) == 8 * 4 + 4  # the table is a lookup, not a product
    assert utilisation.keys_longformer(512, 4096) == 513 and utilisation.keys_longformer(512, 100) == 100
    # BigBird: 2 global query blocks see all; the rest 3 + 2 + r blocks; short inputs are full attention.
    assert utilisation.keys_bigbird(64, 3, 4096) == (2 * 64 * 4096 + (4096 - 128) * 8 * 64) / 4096
    assert utilisation.keys_bigbird(64, 3, 11 * 64) == 11 * 64
    assert utilisation.utilisation(2e12, 1.0, 4.0) == 0.5 and utilisation.utilisation(None, 1.0, 4.0) is None


def test_matmul_rate_is_measured_on_the_device():
    import torch

    from benchmarks import utilisation

    rate = utilisation.matmul_tflops("cpu", torch.float32, size=128, repeats=3, warmup=1)
    assert 0 < rate < 1000


def test_attention_switch_benchmark_reports_mfu_and_skips_past_its_budget(tmp_path, monkeypatch):
    import json

    from benchmarks import benchmark_attention_switch as switch

    for name, value in (("HIDDEN", 32), ("HEADS", 2), ("INTERMEDIATE", 64), ("VOCAB", 50)):
        monkeypatch.setattr(switch, name, value)
    monkeypatch.setattr(switch, "MATMUL_SIZE", {"cpu": 128, "cuda": 8192})
    argv = ["--archs", "longformer", "bigbird", "--lengths", "64", "--implementations", "sdpa", "--modes", "train",
            "--repeats", "1", "--warmup", "0", "--threads", "1", "--out", str(tmp_path)]  # fmt: skip
    switch.main(argv)
    saved = json.loads((tmp_path / "attention_switch_cpu_float32.json").read_text())
    assert saved["machine"]["matmul_tflops"] > 0
    for row in saved["results"]:
        assert row["flops"] > 0 and row["tflops"] > 0 and 0 < row["mfu"], row
    text = (tmp_path / "attention_switch_cpu_float32.md").read_text()
    assert "MFU sdpa" in text and " %" in text and "TFLOP/s in this run" in text
    switch.main([*argv, "--budget-s", "0"])
    saved = json.loads((tmp_path / "attention_switch_cpu_float32.json").read_text())
    assert {row["seconds"] for row in saved["results"]} == {switch.SKIPPED}


def test_long_context_benchmark_reports_mfu_and_skips_past_its_budget(tmp_path, monkeypatch):
    import json

    from benchmarks import utilisation

    monkeypatch.setattr(long_context, "run_cell", _in_process)
    monkeypatch.setattr(utilisation, "MATMUL_SIZE", {"cpu": 128, "cuda": 8192})
    argv = ["--arch", "longformer", "--lengths", "64", "--modes", "backward", "--impls", "hfx", "sdpa",
            "--out", str(tmp_path), *TINY]  # fmt: skip
    assert long_context.main(argv) == 0
    saved = json.loads((tmp_path / "longformer_w16_h32_l1_b1.json").read_text())
    assert saved["meta"]["matmul_tflops"] > 0
    cells = saved["results"]
    assert cells["hfx|64|backward"]["model_flops"] > 0
    # Full attention does more model FLOPs than the band at the same size (window 16 < 64 tokens).
    assert cells["sdpa|64|backward"]["model_flops"] > cells["hfx|64|backward"]["model_flops"]
    text = (tmp_path / "longformer_w16_h32_l1_b1.md").read_text()
    assert "hfx MFU" in text and " %" in text.split("hfx MFU")[1]
    assert long_context.main([*argv, "--budget-s", "0"]) == 0
    saved = json.loads((tmp_path / "longformer_w16_h32_l1_b1.json").read_text())
    assert {r["status"] for r in saved["results"].values()} == {"skipped"}
    assert "Skipped (past `--budget-s`)" in (tmp_path / "longformer_w16_h32_l1_b1.md").read_text()


# ----- sequence parallelism: per-rank memory and step time against length -------------------------------------------


def test_sequence_parallel_benchmark_has_a_row_per_ranks_and_length(tmp_path):
    """The real launches (a plain process for 1 rank, torch.distributed.run for 2) at a tiny size, under bfloat16
    autocast (float32 differs by the context only): a row per (ranks, length), positive memory and time, the budget
    table, the precision in the file name and the header."""
    pytest.importorskip("deepspeed", reason="sequence parallelism runs on DeepSpeed")
    import json

    from benchmarks import benchmark_sequence_parallel as sp

    # The vocabulary makes each rank's logits (128 x 600 x 4 B = 300 KiB whole, 150 KiB per rank of 2) larger than the
    # benchmark's mmap threshold (128 KiB): a step's tensors below it are reused from the heap and the peak need not grow.
    argv = ["--hidden", "32", "--layers", "1", "--heads", "2", "--vocab", "600", "--window", "16", "--lengths", "128",
            "--ranks", "1", "2", "--repeats", "1", "--timeout", "120", "--idle_check_s", "0", "--out", str(tmp_path),
            "--dtype", "bfloat16", "--autocast"]  # fmt: skip
    assert sp.main(argv) == 0
    saved = json.loads((tmp_path / "sequence_parallel_longformer_h32_l1_v600_bf16_autocast.json").read_text())
    rows = {(r["ranks"], r["length"]): r for r in saved["results"]}
    assert set(rows) == {(1, 128), (2, 128)}
    for row in rows.values():
        assert row["status"] == "ok" and row["peak_mib"] > 0 and row["time_s"] > 0, row
    assert len(rows[2, 128]["peak_mib_per_rank"]) == 2 and rows[2, 128]["tokens_per_rank"] == 64
    assert set(saved["budget"]) == {"1", "2"}
    text = (tmp_path / "sequence_parallel_longformer_h32_l1_v600_bf16_autocast.md").read_text()
    assert "| 128 | " in text and "peak RSS" in text and "1 thread(s) per rank" in text
    assert "autocast bfloat16, fp32 weights (training)" in text and saved["meta"]["spec"]["autocast"] is True


def test_sequence_parallel_budget_takes_the_longest_fitting_length_and_extrapolates():
    from benchmarks.benchmark_sequence_parallel import budget_lengths

    rows = [{"status": "ok", "length": n, "peak_mib": 10 + n / 100} for n in (1000, 2000, 4000)]
    assert budget_lengths(rows, 35.0) == {"longest_measured": 2000, "linear_extrapolation": 2500}
    assert budget_lengths(rows, 5.0)["longest_measured"] is None
    assert budget_lengths(rows[:1], 35.0)["linear_extrapolation"] is None
