"""benchmarks/paired_pool.py: the paired rounds of several engine-benchmark calls pooled into one
comparison, refused where the calls compare different things."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def pp():
    spec = importlib.util.spec_from_file_location(
        "paired_pool_under_test", ROOT / "benchmarks" / "paired_pool.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(e2e, device, host, commit="abc1234"):
    return {
        "commit": commit,
        "machine": "1x NVIDIA H200",
        "model": "qwen3 28 layers",
        "vllm_version": "0.26.0",
        "decode_prompts": 64,
        "decode_tokens": 128,
        "paired": {
            "rounds": len(e2e),
            "e2e_tok_s_ratio": {"values": e2e},
            "tok_s_ratio": {"values": e2e},
            "replay_device_ratio": {"values": device},
            "replay_host_diff_us": {"values": host},
        },
    }


def test_rounds_of_two_calls_pool_into_one_interval(pp):
    a = _result([0.95, 1.0, 1.02, 0.99, 1.01, 1.0], [1.0] * 6, [0.1] * 6)
    b = _result([1.05, 0.98, 1.0, 1.0, 0.97, 1.03, 1.01], [1.002] * 7, [0.3] * 7)
    out = pp.pool([("a.json", a), ("b.json", b)])
    pooled = a["paired"]["e2e_tok_s_ratio"]["values"] + b["paired"]["e2e_tok_s_ratio"]["values"]
    e2e = out["paired"]["e2e_tok_s_ratio"]
    assert out["paired"]["rounds"] == e2e["n"] == 13
    assert e2e["ci95"] == pp.steps.median_ci95(pooled) and e2e["median"] == 1.0
    assert [s["e2e_tok_s_ratio"]["n"] for s in out["sources"]] == [6, 7], "each call's own figures kept"
    assert out["engine"] == "vllm" and out["commit"] == "abc1234"
    # The targets are read on the whole interval.
    assert out["targets"]["e2e_tok_s_ratio"]["met"] is (e2e["ci95"][0] >= 0.97 and e2e["ci95"][1] <= 1.03)
    assert out["targets"]["replay_host_diff_us"]["met"] is True
    assert pp.within({"ci95": [0.96, 1.0]}, (0.97, 1.03)) is False
    assert pp.within({"ci95": [0.0, 2.5]}, (None, 2.0)) is False and pp.within({}, (0.97, 1.03)) is None


def test_calls_that_compare_different_things_are_refused(pp):
    a = _result([1.0] * 6, [1.0] * 6, [0.0] * 6)
    with pytest.raises(pp.PoolError, match="b.json: commit 'def5678' differs"):
        pp.pool([("a.json", a), ("b.json", _result([1.0] * 6, [1.0] * 6, [0.0] * 6, commit="def5678"))])
    other = _result([1.0] * 6, [1.0] * 6, [0.0] * 6)
    other["decode_tokens"] = 512
    with pytest.raises(pp.PoolError, match="decode_tokens"):
        pp.pool([("a.json", a), ("c.json", other)])
    unpaired = dict(a, paired=None)
    with pytest.raises(pp.PoolError, match="d.json: no paired rounds"):
        pp.pool([("d.json", unpaired)])


def test_one_committed_call_pools_to_its_own_figures(pp, tmp_path, capsys):
    """The 6640e28 vLLM call (257 rounds): pooled alone, the benchmark's own medians and intervals;
    with the 6885ef1 call, refused (another commit)."""
    path = RESULTS / "vllm-h200-6640e28.json"
    own = json.loads(path.read_text())["paired"]
    out = tmp_path / "pool.json"
    assert pp.main([str(path), "--out", str(out)]) == 0
    pooled = json.loads(out.read_text())["paired"]
    for key in ("e2e_tok_s_ratio", "replay_device_ratio", "replay_host_diff_us"):
        assert pooled[key]["median"] == own[key]["median"] and pooled[key]["ci95"] == own[key]["ci95"], key
    assert "target NOT met" in capsys.readouterr().out  # 0.9804..1.035: wider than ±3 % on one side
    assert pp.main([str(RESULTS / "vllm-h200-6885ef1.json"), str(path), "--out", str(out)]) == 2
    assert "commit '6640e28' differs" in capsys.readouterr().err


def test_the_committed_pool_is_what_its_two_calls_give(pp, tmp_path, capsys):
    """The 9ae1f57 vLLM calls (207 rounds with SAVE, 440 rounds stock,load): pooled again, the
    committed vllm-h200-paired.json's figures, every target met on the whole interval."""
    calls = [RESULTS / "vllm-h200.json", RESULTS / "vllm-h200-9ae1f57-stock-load.json"]
    out = tmp_path / "pool.json"
    assert pp.main([*map(str, calls), "--out", str(out)]) == 0
    pooled = json.loads(out.read_text())["paired"]
    committed = json.loads((RESULTS / "vllm-h200-paired.json").read_text())["paired"]
    assert pooled["rounds"] == committed["rounds"] == 647
    for key in ("e2e_tok_s_ratio", "replay_device_ratio", "replay_host_diff_us"):
        assert pooled[key]["median"] == committed[key]["median"], key
        assert pooled[key]["ci95"] == committed[key]["ci95"], key
    assert "NOT met" not in capsys.readouterr().out
