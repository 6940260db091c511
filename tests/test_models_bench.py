"""benchmarks/models.py: the model-family table built from cold-start run records, on the CPU. The
records are shaped as benchmarks/cold_start.py writes them (its assemble() makes the document)."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


models = _load("models")
cs = _load("cold_start")


def _outputs(seed):
    """Four prompts' outputs, different from each other; ``seed`` shifts every logprob."""
    return {
        "tokens": [[10 + i, 20 + i, 30 + i] for i in range(4)],
        "token_logprobs": [[-0.1 * (i + 1) - seed, -0.2] for i in range(4)],
        "top_logprobs": [[[["a", -0.1 - seed], ["b", -2.0]]] for _ in range(4)],
        "text": [None] * 4,
    }


def _run(ok=True, outputs=None, sampled=None, report=None, error=None, log_tail=None):
    rec = {"ok": ok, "ready_s": 40.0, "ttft_s": 41.0}
    if outputs is not None:
        rec["outputs"] = outputs
    if sampled is not None:
        rec["outputs_sampled"] = sampled
    if report is not None:
        rec["foundry_report"] = report
    if error:
        rec["error"] = error
    if log_tail:
        rec["log_tail"] = log_tail
    return rec


def _doc(engine="sglang", **runs):
    meta = {
        "engine": engine,
        "date": "2026-12-02",
        "commit": "abc1234",
        "weights": "seeded",
        "max_tokens": 256,
    }
    meta["model_config"] = {"architectures": ["Qwen3MoeForCausalLM"]}
    return cs.assemble(meta, runs)


def _validated_runs():
    report = {
        "graphs": 52,
        "restore_s": 0.2,
        "capture_s": 3.0,
        "decode_phase_stream_captures": {"driver": 0, "runtime": 0},
    }
    return {
        "save": _run(outputs=_outputs(0), sampled=_outputs(1), report=report),
        "load_cold": _run(outputs=_outputs(0), sampled=_outputs(1), report=report),
        "stock_cold": _run(outputs=_outputs(0), sampled=_outputs(1)),
    }


def test_a_family_whose_outputs_agree_everywhere_is_validated_in_both_modes():
    rows = models.rows_for("moe", _doc(**_validated_runs()))
    assert [(r["mode"], r["outcome"]) for r in rows] == [("greedy", "validated"), ("sampling", "validated")]
    for r in rows:
        assert r["distinct_outputs"] == 4 and r["prompts"] == 4 and r["graphs"] == 52
        assert r["logprobs_identical_to_save"] is r["logprobs_identical_to_stock"] is True


def test_one_logprob_off_in_one_mode_is_a_mismatch_in_that_mode_only():
    runs = _validated_runs()
    runs["stock_cold"]["outputs_sampled"] = _outputs(1.5)  # sampled logprobs differ, tokens the same
    greedy, sampling = models.rows_for("moe", _doc(**runs))
    assert greedy["outcome"] == "validated"
    assert sampling["outcome"] == "mismatch" and sampling["tokens_identical_to_stock"] is True
    assert sampling["logprobs_identical_to_stock"] is False and sampling["logprobs_identical_to_save"] is True


def test_degenerate_outputs_do_not_validate():
    runs = _validated_runs()
    same = _outputs(0)
    same["tokens"] = [[7, 7, 7]] * 4
    for rec in runs.values():
        rec["outputs"] = copy.deepcopy(same)
    greedy, _ = models.rows_for("dense", _doc(**runs))
    assert greedy["distinct_outputs"] == 1 and greedy["outcome"] == "mismatch"


def test_a_missing_stock_run_is_incomplete_not_a_mismatch():
    runs = _validated_runs()
    del runs["stock_cold"]
    doc = _doc(**runs)
    doc["errors"] = {"stock_cold": "TimeoutError: server not ready"}
    for r in models.rows_for("dense", doc):
        assert r["outcome"] == "incomplete" and r["tokens_identical_to_stock"] is None
        assert "no comparison with stock" in r["reason"] and "TimeoutError" in r["reason"]
    runs["load_cold"]["outputs"] = _outputs(2)  # and a real difference still wins
    assert models.rows_for("dense", _doc(**runs))[0]["outcome"] == "mismatch"


def test_a_decode_capture_at_load_does_not_validate():
    runs = _validated_runs()
    runs["load_cold"]["foundry_report"]["decode_phase_stream_captures"] = {"driver": 0, "runtime": 3}
    assert {r["outcome"] for r in models.rows_for("moe", _doc(**runs))} == {"mismatch"}


def test_a_refusal_at_startup_is_a_row_with_its_reason():
    line = "error: Foundry cannot run this vllm configuration: hybrid (Mamba/linear-attention) models"
    runs = {
        "save": _run(
            ok=False, error="RuntimeError: server exited with status 1 (stage ready)", log_tail=f"x\n{line}"
        ),
        "load_cold": _run(
            ok=False, error="RuntimeError: server exited with status 1 (stage ready)", log_tail=line
        ),
        "stock_cold": _run(outputs=_outputs(0), sampled=_outputs(1)),
    }
    rows = models.rows_for("hybrid", _doc("vllm", **runs))
    assert {r["outcome"] for r in rows} == {"refused"}
    assert (
        rows[0]["reason"]
        == "Foundry cannot run this vllm configuration: hybrid (Mamba/linear-attention) models"
    )


def test_the_table_file_names_its_sources_and_refuses_another_engines_run(tmp_path):
    sg = tmp_path / "models-sglang-moe-h200.json"
    sg.write_text(json.dumps(_doc(**_validated_runs())))
    out = tmp_path / "models-sglang-h200.json"
    assert models.main(["--engine", "sglang", "--out", str(out), f"moe={sg}"]) == 0
    table = json.loads(out.read_text())
    assert table["engine"] == "sglang" and table["commit"] == "abc1234" and len(table["rows"]) == 2
    assert table["sources"] == {"moe": str(sg)}
    with pytest.raises(SystemExit, match="is a sglang run, not vllm"):
        models.main(["--engine", "vllm", "--out", str(out), f"moe={sg}"])
    with pytest.raises(SystemExit):
        models.main(["--engine", "sglang", "--out", str(out), f"mixture={sg}"])


def test_a_mismatch_where_the_save_server_was_not_self_consistent_says_so():
    runs = _validated_runs()
    runs["load_cold"]["outputs_sampled"] = _outputs(2.5)
    runs["save"]["self_consistent_sampled"] = False
    runs["save"]["self_consistent"] = {"tokens": True, "logprobs": True}
    greedy, sampling = models.rows_for("hybrid", _doc(**runs))
    assert (greedy["outcome"], greedy["reason"], greedy["save_self_consistent"]) == ("validated", None, True)
    assert sampling["outcome"] == "mismatch" and sampling["save_self_consistent"] is False
    assert "not run-to-run deterministic" in sampling["reason"]


def test_a_mismatch_with_stock_alone_says_whether_stock_reproduces_itself():
    runs = _validated_runs()
    runs["stock_cold"]["outputs"] = _outputs(0.5)
    greedy = models.rows_for("moe", _doc(**runs))[0]
    assert greedy["outcome"] == "mismatch" and "not measured: --repeat 2" in greedy["reason"]
    runs["load_cold_2"] = _run(outputs=_outputs(0), sampled=_outputs(1))
    runs["stock_cold_2"] = _run(outputs=_outputs(0.7), sampled=_outputs(1))
    greedy = models.rows_for("moe", _doc(**runs))[0]
    assert greedy["outcome"] == "mismatch"
    assert "a second stock start differed from the first too" in greedy["reason"]
    runs["load_cold"]["outputs"] = _outputs(0.9)  # LOAD differs from SAVE: no such excuse
    assert models.rows_for("moe", _doc(**runs))[0]["reason"] is None


def test_rows_name_the_server_arguments_every_run_had():
    setting = '--compilation-config={"inductor_compile_config":{"dynamic_scale_rblock":false}}'
    doc = _doc(**_validated_runs())
    doc["engine_args"] = [setting]
    assert {tuple(r["engine_args"]) for r in models.rows_for("dense", doc)} == {(setting,)}
    del doc["engine_args"]  # a record written before they were kept: read from its command line
    doc["command"] = f"benchmarks/cold_start.py --engine vllm --engine-arg={setting} --engine-arg --no-x"
    assert models.rows_for("dense", doc)[0]["engine_args"] == [setting, "--no-x"]
    doc["command"] += " --engine-env TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK=0"
    assert models.rows_for("dense", doc)[0]["engine_env"] == ["TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK=0"]
