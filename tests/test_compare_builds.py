"""The pure logic of ``benches/compare_builds.py`` on synthetic inputs: run order, parsing of a
benchmark's JSON lines, medians and paired ratios, the table, the benchmark command. Builds
nothing and runs no benchmark (stdlib only; well under a second)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benches" / "compare_builds.py"
_spec = importlib.util.spec_from_file_location("compare_builds", _PATH)
cb = importlib.util.module_from_spec(_spec)
sys.modules["compare_builds"] = cb  # dataclasses resolve their module through sys.modules
_spec.loader.exec_module(cb)


def test_alternation_interleaves_base_first():
    assert cb.alternation(3) == [(0, "base"), (0, "new"), (1, "base"), (1, "new"), (2, "base"), (2, "new")]
    with pytest.raises(ValueError):
        cb.alternation(0)


def test_dig_follows_dotted_paths():
    obj = {"decode": {"p50_us": 3.5}, "size": 64}
    assert cb.dig(obj, "decode.p50_us") == 3.5
    assert cb.dig(obj, "size") == 64
    assert cb.dig(obj, "decode.mean_us") is None
    assert cb.dig(obj, "size.x") is None


def _line(size: int, p50: float, **extra) -> str:
    return json.dumps({"kind": "fixed_decode", "size": size, "decode": {"p50_us": p50}, **extra})


def test_parse_results_keeps_requested_sizes_and_skips_other_lines():
    out = "\n".join([
        "progress text, not JSON",
        json.dumps({"kind": "workload", "size": 64, "all": {"p50_us": 9.0}}),  # no decode.p50_us
        _line(64, 1.5),
        _line(128, 7.0),  # not requested
        _line(256, 4.25),
    ])
    assert cb.parse_results(out, "decode.p50_us", [64, 256]) == {64: 1.5, 256: 4.25}


def test_parse_results_rejects_missing_and_duplicate_sizes():
    with pytest.raises(ValueError, match="sizes \\[256\\]"):
        cb.parse_results(_line(64, 1.0), "decode.p50_us", [64, 256])
    with pytest.raises(ValueError, match="twice"):
        cb.parse_results(_line(64, 1.0) + "\n" + _line(64, 2.0), "decode.p50_us", [64])


def test_summarize_pairs_ratios_by_round():
    # Round 2 ran in a slow phase of the machine (both builds 2x): the paired ratios stay 1.1,
    # while the medians of each build move.
    runs = {
        "base": [{64: 10.0}, {64: 20.0}, {64: 10.0}],
        "new": [{64: 11.0}, {64: 22.0}, {64: 11.0}],
    }
    (row,) = cb.summarize(runs, [64], tolerance=0.05)
    assert row["base_median"] == 10.0 and row["new_median"] == 11.0
    assert row["ratios"] == pytest.approx([1.1, 1.1, 1.1])
    assert row["ratio_median"] == pytest.approx(1.1)
    assert row["ratio_of_medians"] == pytest.approx(1.1)
    assert row["within_tolerance"] is False
    (row,) = cb.summarize(runs, [64], tolerance=0.15)
    assert row["within_tolerance"] is True


def test_summarize_median_ignores_one_outlier_round():
    runs = {
        "base": [{8: 10.0, 16: 5.0}, {8: 10.0, 16: 5.0}, {8: 10.0, 16: 5.0}, {8: 10.0, 16: 5.0}, {8: 10.0, 16: 5.0}],
        "new": [{8: 9.0, 16: 5.0}, {8: 30.0, 16: 5.0}, {8: 9.5, 16: 5.0}, {8: 9.0, 16: 5.0}, {8: 9.5, 16: 5.0}],
    }
    rows = cb.summarize(runs, [8, 16], tolerance=0.05)
    assert [r["size"] for r in rows] == [8, 16]
    assert rows[0]["ratio_median"] == pytest.approx(0.95)
    assert rows[0]["ratio_max"] == pytest.approx(3.0) and rows[0]["ratio_min"] == pytest.approx(0.9)
    assert rows[1]["ratio_median"] == 1.0 and rows[1]["within_tolerance"]


def test_summarize_needs_equal_rounds():
    with pytest.raises(ValueError):
        cb.summarize({"base": [{64: 1.0}], "new": []}, [64], 0.05)


def test_format_table_has_a_row_per_size():
    runs = {"base": [{64: 2.0}, {64: 2.0}], "new": [{64: 1.0}, {64: 1.0}]}
    text = cb.format_table(cb.summarize(runs, [64], 0.05), "decode.p50_us", 0.05)
    row = [line for line in text.splitlines() if line.strip().startswith("64 |")]
    assert len(row) == 1 and "0.500" in row[0] and "yes" in row[0]


def test_default_command_runs_the_trees_scheduler_bench():
    args = cb.parse_args([])
    assert args.rounds == 5 and args.sizes == [64, 256, 1024, 4096] and args.base == "HEAD"
    cmd = cb.bench_command(args)
    assert cmd[0] == sys.executable and cmd[1].endswith("benches/scheduler_bench.py")
    assert cmd[2:] == ["--only-fixed", "--json", "--sizes", "64,256,1024,4096"]
    quick = cb.parse_args(["--quick"])
    assert quick.rounds == 2 and quick.sizes == [64, 256] and cb.bench_command(quick)[-1] == "--quick"
