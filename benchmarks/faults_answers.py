"""Answers compared: a server's outputs against a reference, passes of the sustained schedule against
each other, and the digests that let late passes be compared without keeping them whole."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from typing import Any


def compare_outputs(got: dict[str, Any] | None, want: dict[str, Any] | None) -> dict[str, Any]:
    """Tokens and logprobs (chosen and top-5) of ``got`` against ``want``; where they differ, the
    first differing token and the largest logprob difference."""
    if not got or not want:
        return {"tokens": None, "logprobs": None, "equal": None}
    tokens = got.get("tokens") == want.get("tokens")
    lp = ("token_logprobs", "top_logprobs")
    logprobs = [got.get(k) for k in lp] == [want.get(k) for k in lp]
    out: dict[str, Any] = {"tokens": tokens, "logprobs": logprobs, "equal": tokens and logprobs}
    if not tokens:
        for i, (a, b) in enumerate(zip(got.get("tokens") or [], want.get("tokens") or [])):
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if j is not None or len(a) != len(b):
                out["first_difference"] = {
                    "prompt": i,
                    "position": j,
                    "got": a[j : j + 4] if j is not None else len(a),
                    "want": b[j : j + 4] if j is not None else len(b),
                }
                break
    if not logprobs:
        worst = 0.0
        for a, b in zip(got.get("token_logprobs") or [], want.get("token_logprobs") or []):
            for x, y in zip(a or [], b or []):
                if isinstance(x, int | float) and isinstance(y, int | float):
                    worst = max(worst, abs(x - y))
        out["max_logprob_difference"] = worst
    return out


def compare_passes(
    got: list[list[dict[str, Any]]], want: list[list[dict[str, Any]]] | None
) -> dict[str, Any]:
    """Pass by pass, request by request: how many answers differ (an error counts as differing),
    and the first difference."""
    if not want or not got:
        return {"compared": 0, "mismatches": None, "first_mismatch": None}
    compared = mismatches = 0
    first = None
    for p, (g_pass, w_pass) in enumerate(zip(got, want)):
        for i, (g, w) in enumerate(zip(g_pass, w_pass)):
            compared += 1
            cmp = compare_outputs(g, w) if "error" not in g and "error" not in w else {"equal": False}
            if cmp["equal"] is not True:
                mismatches += 1
                first = first or {"pass": p, "request": i, **cmp}
    return {"compared": compared, "mismatches": mismatches, "first_mismatch": first}


ANSWER_FIELDS = ("tokens", "token_logprobs", "top_logprobs")  # what compare_outputs compares
_NEGATIVE_ZERO = re.compile(r"-0\.0(?=[,\]}])")
_NAN_MARKS = itertools.count()


def _canonical(x: Any) -> Any:
    if isinstance(x, float):
        if x != x:
            return ["NaN", next(_NAN_MARKS)]  # unequal to everything under ==, so to every digest
        return x + 0.0  # -0.0 becomes 0.0: they are equal under ==
    if isinstance(x, list | tuple):
        return [_canonical(v) for v in x]
    if isinstance(x, dict):
        return {k: _canonical(v) for k, v in x.items()}
    return x


def answer_digest(answer: dict[str, Any]) -> str | None:
    """sha256 of the fields compare_outputs compares: two answers read from JSON have the same
    digest exactly when compare_outputs finds them equal (unless one server writes a number as 1
    and the other as 1.0). None for an error (or empty) answer, which equals nothing."""
    if not answer or "error" in answer:
        return None
    fields = [answer.get(k) for k in ANSWER_FIELDS]
    try:
        text = json.dumps(fields, separators=(",", ":"), sort_keys=True, allow_nan=False)
    except ValueError:  # NaN or an infinity
        text = None
    if text is None or _NEGATIVE_ZERO.search(text):  # rare: the slower walk makes == and digests agree
        text = json.dumps(_canonical(fields), separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def compare_with_stock(
    kept: list[list[dict[str, Any]]],
    digests: list[list[str | None]],
    stock_passes: list[list[dict[str, Any]]] | None,
) -> dict[str, Any]:
    """Every LOAD pass p (``digests[p]``, one per request) against the stock server's pass
    min(p, 1), request by request, as the base reference is used. The passes in ``kept`` (the
    first ones, whole) are compared with compare_outputs, later ones by digest. An error on
    either side counts as a mismatch; without stock passes or LOAD passes nothing is compared."""
    if not stock_passes or not digests:
        return {"compared": 0, "mismatches": None, "first_mismatch": None}
    stock_digests = [[answer_digest(w) for w in w_pass] for w_pass in stock_passes]
    compared = mismatches = 0
    first = None
    for p, d_pass in enumerate(digests):
        s = min(p, len(stock_passes) - 1)
        for i, (d, w) in enumerate(zip(d_pass, stock_digests[s])):
            compared += 1
            if p < len(kept):  # both answers at hand: the full comparison
                g, want = kept[p][i], stock_passes[s][i]
                if "error" in g or "error" in want:
                    cmp = {"equal": False, "error": g.get("error") or want.get("error")}
                else:
                    cmp = compare_outputs(g, want)
            elif d is not None and d == w:
                continue
            else:
                cmp = {
                    "equal": False,
                    "digests_differ": True,
                    "load_error": d is None,
                    "stock_error": w is None,
                }
            if cmp["equal"] is not True:
                mismatches += 1
                first = first or {"pass": p, "request": i, **cmp}
    return {"compared": compared, "mismatches": mismatches, "first_mismatch": first}


def sustained_output_checks(
    base_reference: bool,
    mismatches: int | None,
    stock_answered: bool,
    vs_load: dict[str, Any],
    vs_reference: dict[str, Any],
) -> dict[str, bool | None]:
    """sustained_load's two output checks. ``mismatches``: the LOAD's passes against the base
    reference where there is one, else against stock's passes (None: nothing compared)."""
    if not base_reference:  # stock is the reference: its verdict on every LOAD pass is both checks
        equal = None if mismatches is None else mismatches == 0
        return {"outputs_equal_reference": equal, "outputs_equal_stock": equal}
    # Every LOAD pass equals the base SAVE's answers, and stock's two passes equal both the base's
    # and the LOAD's first two: so every LOAD answer equals stock's answer to the same request.
    stock_equal = None
    if stock_answered and vs_load["compared"] and vs_reference["compared"]:
        stock_equal = vs_load["mismatches"] == 0 and vs_reference["mismatches"] == 0 and mismatches == 0
    return {"outputs_equal_reference": mismatches == 0, "outputs_equal_stock": stock_equal}
