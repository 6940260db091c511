"""benchmarks/engine_faults.py without an engine or a GPU: answers compared (faults_answers) and
sustained_load's schedule (faults_sustained)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine_run as cs  # noqa: E402
import faults_answers  # noqa: E402
import faults_sustained  # noqa: E402


def test_compare_outputs():
    ref = {
        "tokens": [[1, 2, 3], [4, 5, 6]],
        "token_logprobs": [[-1.0, -2.0, -3.0]] * 2,
        "top_logprobs": [[]] * 2,
    }
    assert faults_answers.compare_outputs(ref, json.loads(json.dumps(ref)))["equal"] is True
    other = json.loads(json.dumps(ref))
    other["tokens"][1][2] = 9
    other["token_logprobs"][0][1] = -2.5
    cmp = faults_answers.compare_outputs(other, ref)
    assert cmp["equal"] is False and cmp["tokens"] is False and cmp["logprobs"] is False
    assert cmp["first_difference"] == {"prompt": 1, "position": 2, "got": [9], "want": [6]}
    assert cmp["max_logprob_difference"] == 0.5
    assert faults_answers.compare_outputs(None, ref)["equal"] is None


def test_sustained_requests_mix_batch_sizes():
    requests = faults_sustained.sustained_requests(16)
    assert [len(r) for r in requests] == [1, 3, 8, 16]
    flat = [tuple(p) for r in requests for p in r]
    assert len(set(flat)) == len(flat)  # every prompt differs
    assert all(
        len(cs.TOKENIZER_SPECIALS) <= t < len(cs.TOKENIZER_SPECIALS) + cs.TOKENIZER_WORDS
        for p in flat
        for t in p
    )
    assert [len(r) for r in faults_sustained.sustained_requests(0)] == list(faults_sustained.SUSTAIN_SIZES)


def _answer(seed: int, prompts: int = 2) -> dict:
    """An answer as extract_outputs makes it: ids, chosen logprobs, top logprobs as [key, value] pairs."""
    ids = [[(seed * 7 + p * 3 + k) % 50 for k in range(4)] for p in range(prompts)]
    lps = [[-0.25 - ((t + seed) % 5) / 8 for t in row] for row in ids]
    tops = [[[[str(t), lp], ["x", lp - 1.0]] for t, lp in zip(row, lrow)] for row, lrow in zip(ids, lps)]
    return {"tokens": ids, "token_logprobs": lps, "top_logprobs": tops, "text": ["a"] * prompts}


def _variant(answer: dict, change) -> dict:
    out = json.loads(json.dumps(answer))
    change(out)
    return out


@pytest.mark.parametrize(
    ("change", "equal"),
    [
        (lambda a: None, True),
        (lambda a: a.update(text=["other"] * 2), True),  # text is not compared
        (lambda a: a["top_logprobs"][1][2][0].__setitem__(1, -9.0), False),
        (lambda a: a["token_logprobs"][0].__setitem__(3, -0.3), False),
        (lambda a: a["tokens"][1].__setitem__(0, 49), False),
        (lambda a: a["tokens"].append([1]), False),
        (lambda a: a.pop("top_logprobs"), False),
        (lambda a: a["token_logprobs"].__setitem__(1, None), False),
    ],
)
def test_answer_digest_equal_exactly_where_compare_outputs_is(change, equal):
    ref = _answer(3)
    got = _variant(ref, change)
    assert faults_answers.compare_outputs(got, ref)["equal"] is equal
    assert (faults_answers.answer_digest(got) == faults_answers.answer_digest(ref)) is equal


def test_answer_digest_of_odd_floats_and_errors():
    ref = _answer(1)
    ref["token_logprobs"][0][0] = 0.0
    negative_zero = _variant(ref, lambda a: a["token_logprobs"][0].__setitem__(0, -0.0))
    assert faults_answers.compare_outputs(negative_zero, ref)["equal"] is True  # -0.0 == 0.0
    assert faults_answers.answer_digest(negative_zero) == faults_answers.answer_digest(ref)
    infinite = _variant(ref, lambda a: a["top_logprobs"][0][0][1].__setitem__(1, float("-inf")))
    assert faults_answers.compare_outputs(infinite, json.loads(json.dumps(infinite)))["equal"] is True
    assert faults_answers.answer_digest(infinite) == faults_answers.answer_digest(
        json.loads(json.dumps(infinite))
    )
    assert faults_answers.answer_digest(infinite) != faults_answers.answer_digest(ref)
    nan = _variant(ref, lambda a: a["token_logprobs"][1].__setitem__(2, float("nan")))
    nan_again = json.loads(json.dumps(nan))
    assert faults_answers.compare_outputs(nan, nan_again)["equal"] is False  # NaN equals nothing
    assert faults_answers.answer_digest(nan) != faults_answers.answer_digest(nan_again)
    assert faults_answers.answer_digest({"error": "RuntimeError: boom"}) is None
    assert faults_answers.answer_digest({}) is None


def _passes(n: int, requests: int = 3) -> list[list[dict]]:
    return [[_answer(10 * i + 1) for i in range(requests)] for _ in range(n)]


def _stock_case(load: list[list[dict]], stock: list[list[dict]] | None) -> dict:
    digests = [[faults_answers.answer_digest(g) for g in p] for p in load]
    return faults_answers.compare_with_stock(load[:2], digests, stock)


def test_compare_with_stock_counts_and_names_a_late_mismatch():
    stock = _passes(2)
    stock[1][1] = _answer(99)  # stock's second pass differs from its first: pass p >= 1 is against it
    load = _passes(8)
    for p in range(1, 8):
        load[p][1] = _answer(99)
    assert _stock_case(load, stock) == {"compared": 24, "mismatches": 0, "first_mismatch": None}
    load[5][2] = _variant(load[5][2], lambda a: a["top_logprobs"][0][3][1].__setitem__(1, -7.5))
    assert _stock_case(load, stock) == {
        "compared": 24,
        "mismatches": 1,
        "first_mismatch": {
            "pass": 5,
            "request": 2,
            "equal": False,
            "digests_differ": True,
            "load_error": False,
            "stock_error": False,
        },
    }
    # The same difference in a pass still kept whole: compare_outputs's detail.
    load[1][0] = _variant(load[1][0], lambda a: a["token_logprobs"][1].__setitem__(2, -4.0))
    out = _stock_case(load, stock)
    assert out["mismatches"] == 2 and out["first_mismatch"]["pass"] == 1
    assert out["first_mismatch"]["request"] == 0 and out["first_mismatch"]["tokens"] is True
    assert out["first_mismatch"]["logprobs"] is False and out["first_mismatch"]["max_logprob_difference"] > 3


def test_compare_with_stock_counts_errors_on_either_side():
    stock, load = _passes(2), _passes(6)
    load[3][0] = {"error": "RuntimeError: /v1/completions answered 500"}
    out = _stock_case(load, stock)
    assert out["mismatches"] == 1
    assert out["first_mismatch"] == {
        "pass": 3,
        "request": 0,
        "equal": False,
        "digests_differ": True,
        "load_error": True,
        "stock_error": False,
    }
    stock[1][2] = {"error": "OSError: reset"}  # against every LOAD pass from the second on
    out = _stock_case(load, stock)
    assert out["compared"] == 18 and out["mismatches"] == 1 + 5
    assert out["first_mismatch"] == {"pass": 1, "request": 2, "equal": False, "error": "OSError: reset"}


def test_without_stock_passes_nothing_is_compared():
    nothing = {"compared": 0, "mismatches": None, "first_mismatch": None}
    assert _stock_case(_passes(4), None) == nothing
    assert _stock_case(_passes(4), []) == nothing
    assert _stock_case([], _passes(2)) == nothing


_UNUSED = {"compared": 0, "mismatches": None, "first_mismatch": None}
_SAME = {"compared": 12, "mismatches": 0, "first_mismatch": None}
_DIFFERS = {"compared": 12, "mismatches": 2, "first_mismatch": {"pass": 0, "request": 1}}


@pytest.mark.parametrize(
    "base_reference, mismatches, stock_answered, vs_load, vs_reference, want",
    [
        # No base reference: stock is the reference, or nothing is.
        (False, None, False, _UNUSED, _UNUSED, (None, None)),
        (False, 0, True, _UNUSED, _UNUSED, (True, True)),
        (False, 3, True, _UNUSED, _UNUSED, (False, False)),
        # A base reference: stock equals every LOAD pass only through the base's two passes.
        (True, 0, True, _SAME, _SAME, (True, True)),
        (True, 0, True, _DIFFERS, _SAME, (True, False)),
        (True, 1, True, _SAME, _SAME, (False, False)),
        (True, 0, False, _UNUSED, _UNUSED, (True, None)),
    ],
)
def test_sustained_output_checks(base_reference, mismatches, stock_answered, vs_load, vs_reference, want):
    got = faults_answers.sustained_output_checks(
        base_reference, mismatches, stock_answered, vs_load, vs_reference
    )
    assert (got["outputs_equal_reference"], got["outputs_equal_stock"]) == want
