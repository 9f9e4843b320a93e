"""The packing benchmark (benchmarks/benchmark_packing.py): its batches and a --quick run end to end."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import benchmark_packing as bp


def test_every_scheme_gets_the_same_documents():
    """The three schemes batch the same documents; group_by_length's batches come from a full mega-batch, so they
    pad less than random batches, as in a long run."""
    pool, schemes = bp.select_batches(batch_size=4, num_batches=5, mega_batch_mult=50, min_length=16, max_length=256,
                                      seed=0)  # fmt: skip
    assert len(pool) == 50 * 4
    chosen = {name: sorted(i for batch in batches for i in batch) for name, batches in schemes.items()}
    assert chosen["padded"] == chosen["group_by_length"] == chosen["packed"]
    assert len(chosen["padded"]) == len(set(chosen["padded"])) == 5 * 4
    assert schemes["packed"] == schemes["padded"]
    assert all(len(batch) == 4 for name in bp.SCHEMES for batch in schemes[name])
    padded = bp.overhead(schemes["padded"], pool, 16)
    grouped = bp.overhead(schemes["group_by_length"], pool, 16)
    assert 1.0 <= grouped < padded


def test_collated_batches_hold_the_documents():
    """Padded rows are the documents then padding (to the multiple); the packed row is their concatenation with
    positions restarting at the model's first position id, and no scored position is lost to the collator."""
    documents = [bp.make_document(i, length, vocab=50, seed=0) for i, length in enumerate([7, 20, 3])]
    padded = bp.collate("padded", documents, pad_id=1, multiple=8, position_start=2, packed_form="position_ids")
    assert padded["input_ids"].shape == (3, 24)
    assert padded["attention_mask"].sum(-1).tolist() == [7, 20, 3]
    assert torch.equal(padded["input_ids"][1, :20], documents[1][0])
    assert (padded["labels"][0, 7:] == -100).all()
    packed = bp.collate("packed", documents, pad_id=1, multiple=8, position_start=2, packed_form="seq_idx")
    assert packed["input_ids"].shape == (1, 30)
    assert torch.equal(packed["input_ids"][0], torch.cat([ids for ids, _ in documents]))
    assert torch.equal(packed["labels"][0], torch.cat([labels for _, labels in documents]))
    assert packed["position_ids"][0].tolist() == [*range(2, 9), *range(2, 22), *range(2, 5)]
    assert packed["seq_idx"][0].tolist() == [0] * 7 + [1] * 20 + [2] * 3
    assert int((packed["labels"] != -100).sum()) == sum(int((labels != -100).sum()) for _, labels in documents)


def test_quick_run_writes_tables_for_the_three_schemes(tmp_path):
    """`--quick` (Longformer, tiny sizes, in this process) trains every scheme and writes the table, JSON and plot;
    the losses of the schemes agree document by document."""
    assert bp.main(["--quick", "--arch", "longformer", "--out", str(tmp_path), "--name", "quick"]) == 0
    results = json.loads((tmp_path / "quick.json").read_text())["results"]
    assert sorted(r["scheme"] for r in results) == sorted(bp.SCHEMES)
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in results), results
    packed = next(r for r in results if r["scheme"] == "packed")
    assert packed["computed_tokens"] == packed["real_tokens"] and packed["position_ids_start"] == 2
    report = (tmp_path / "quick.md").read_text()
    assert "| longformer | 4 |" in report and "agree" in report and "DIFFER" not in report
    assert all(name in report for name in ("padded tok/s", "group_by_length tok/s", "packed tok/s"))
    assert (tmp_path / "quick.png").stat().st_size > 0


def test_rows_past_the_time_budget_are_left_out(tmp_path):
    """`--budget-s` leaves out whole rows (shown as skipped) instead of overrunning."""
    assert bp.main(["--quick", "--budget-s", "0", "--out", str(tmp_path), "--name", "none"]) == 0
    results = json.loads((tmp_path / "none.json").read_text())["results"]
    assert {r["status"] for r in results} == {"skipped"} and len(results) == 3
    assert "skipped: time budget" in (tmp_path / "none.md").read_text()


@pytest.mark.parametrize("arch", ["bigbird", "reformer", "universal"])
def test_position_ids_start_at_zero_without_a_roberta_offset(arch):
    config = dict(hidden=32, layers=1, heads=2, intermediate=64, vocab=50, window=8, dropout=0.0)
    assert bp.first_position_id(bp.build_model(arch, config, table=64)) == 0


def test_interleaved_row_times_the_three_schemes_round_by_round(tmp_path):
    """`--interleave` measures a row's three schemes in one process, pass by pass: every scheme trains, the packed
    row carries its per-round ratios (one round in --quick: the table's ratio of the medians), memory is measured
    per scheme, and the table says how it was timed."""
    argv = ["--quick", "--interleave", "--arch", "performer", "--out", str(tmp_path), "--name", "inter"]
    assert bp.main(argv) == 0
    saved = json.loads((tmp_path / "inter.json").read_text())
    assert saved["meta"]["interleave"] is True
    rows = {r["scheme"]: r for r in saved["results"]}
    assert sorted(rows) == sorted(bp.SCHEMES)
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["peak_mib"] >= 0 for r in rows.values()), rows
    assert all(len(r["times_s"]) == 1 for r in rows.values())
    rounds = rows["packed"]["round_ratios"]
    for other in ("padded", "group_by_length"):
        assert rounds[other] == pytest.approx([rows["packed"]["tokens_per_s"] / rows[other]["tokens_per_s"]])
    assert "passes interleaved round by round" in (tmp_path / "inter.md").read_text()


def test_interleave_is_refused_on_cuda():
    with pytest.raises(SystemExit):
        bp.parse_args(["--device", "cuda", "--interleave"])
