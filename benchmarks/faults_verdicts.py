"""A case's verdict from its checks, and the checks several cases (and the table) share."""

from __future__ import annotations

from typing import Any


def verdict(checks: dict[str, bool | None]) -> str:
    """pass: every check true; fail: any false; inconclusive: none false but some unknown."""
    if not checks:
        return "inconclusive"
    values = list(checks.values())
    if any(v is False for v in values):
        return "fail"
    return "pass" if all(v is True for v in values) else "inconclusive"


def restart_ok(kill: dict[str, Any], restart_mode: str | None) -> bool | None:
    """After a kill, auto mode must SAVE; it may LOAD only an archive that was complete (record
    written, graph and caches verified) when the kill came."""
    if restart_mode is None:
        return None
    state = kill.get("state_after") or {}
    if restart_mode == "save":
        return True
    return restart_mode == "load" and bool(state.get("complete"))


def requests_equal(rec: dict[str, Any]) -> bool | None:
    """Every request a server answered equals the reference (None: it answered none)."""
    requests = rec.get("requests") or []
    if not requests:
        return None
    return all(r.get("equal") is True for r in requests)


def refused_cleanly(rec: dict[str, Any], key: str) -> dict[str, bool | None]:
    """A start that must fail: it never became ready, ended by itself with a nonzero status, and
    its log has the expected line (``key`` in LOG_PATTERNS)."""
    facts = rec.get("facts") or {}
    return {
        "never_ready": rec.get("ready_s") is None,
        "exited_nonzero": bool(rec.get("exited_by_itself")) and rec.get("exit_code") not in (0, None),
        "line": key in (facts.get("lines") or {}),
    }
