"""benchmarks/engine_chart.py: the PNG beside an engine benchmark's JSON."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("engine_chart", ROOT / "benchmarks" / "engine_chart.py")
chart = importlib.util.module_from_spec(_spec)
sys.modules["engine_chart"] = chart
_spec.loader.exec_module(chart)

pytest.importorskip("matplotlib", reason="the chart needs matplotlib (the bench extra)")

PNG = b"\x89PNG\r\n\x1a\n"
#: Paired results of both engines, committed from the H200 (docs/performance.md).
PAIRED = [ROOT / "benchmarks" / "results" / f"{e}-h200.json" for e in ("sglang", "vllm")]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.parametrize("source", PAIRED, ids=lambda p: p.stem)
def test_a_paired_result_gets_two_panels(source, tmp_path):
    result = json.loads(source.read_text())
    assert result["paired"]["rounds"] > 0
    out = chart.write_chart(result, tmp_path / "paired.png")
    assert out == str(tmp_path / "paired.png")
    single = copy.deepcopy(result)
    del single["paired"]
    chart.write_chart(single, tmp_path / "single.png")
    (w2, h2), (w1, h1) = _png_size(tmp_path / "paired.png"), _png_size(tmp_path / "single.png")
    assert h2 == h1 and w2 > 1.8 * w1  # the paired panel beside the repetitions


def test_the_title_names_engine_commit_ready_and_restore():
    result = json.loads(PAIRED[0].read_text())
    title = chart._title(result)
    assert title.startswith(f"SGLang {result['sglang_version']}, {result['graphs']} graphs")
    assert f"commit {result['commit']}" in title
    assert f"load {result['ready_s_load']:.1f} s" in title
    assert f"{result['restore_critical_s']:.3f} s" in title
    partial = {"vllm_version": "0.26.0", "ready_s_save": 90.0, "ready_s_load": None, "graphs": 51}
    assert chart._title(partial).splitlines()[1] == "ready: save 90.0 s"


def test_a_result_without_repetitions_draws_nothing(tmp_path):
    assert chart.write_chart({"runs": {"save": {"error": "timed out"}}}, tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_a_run_missing_still_draws_the_others(tmp_path):
    result = json.loads(PAIRED[1].read_text())
    del result["runs"]["stock"]
    result["paired"] = {"rounds": 0}  # stock never reached its repetitions
    assert chart.write_chart(result, tmp_path / "c.png")
    assert _png_size(tmp_path / "c.png")[0] > 0


def test_the_command_writes_each_chart_beside_its_json(tmp_path, capsys):
    src = tmp_path / "vllm-h200.json"
    src.write_text(PAIRED[1].read_text())
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert chart.main([str(src), str(empty)]) == 0
    assert _png_size(tmp_path / "vllm-h200.png")[0] > 0
    assert not (tmp_path / "empty.png").exists()
    assert "no chart" in capsys.readouterr().out


def test_end_to_end_figures_come_from_the_generate_times():
    """Results written before ``e2e_tok_s_ratio`` existed: the chart derives it from the runs, as
    engine_steps.paired_stats computes it (stock's time over LOAD's, round by round)."""
    # SGLang at 87eda11, written before the field: no e2e figures in its paired block
    result = json.loads((ROOT / "benchmarks" / "results" / "sglang-h200-87eda11.json").read_text())
    assert "e2e_tok_s_ratio" not in result["paired"]
    stock, load = result["runs"]["stock"]["timed_long_s"], result["runs"]["load"]["timed_long_s"]
    values = chart.paired_values(result, "e2e_tok_s_ratio")
    assert values == [round(a / b, 4) for a, b in zip(stock, load)]
    assert sorted(values)[3] < 1.0 < sorted(values)[4]  # the median round is at stock's level
    assert (
        chart.paired_values(result, "replay_device_ratio")
        == result["paired"]["replay_device_ratio"]["values"]
    )
    run = result["runs"]["load"]
    per_rep = chart.end_to_end_tok_s(run)
    assert per_rep[1] == round((run["decode_tokens"] + run["decode_prompts"]) / load[1], 1)
    assert chart.end_to_end_tok_s({"timed_long_s": [1.0]}) == []  # no token counts: nothing drawn
