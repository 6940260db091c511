"""The CPU suite of ``foundry soak``: the reliability tests, run in this process and counted.

:func:`run_cpu_suite` runs the tamper matrix, the damage fuzzing and the SIGKILL crash test of a
repository's ``tests/`` folder with :class:`SuiteCounter`, a pytest plugin that counts what ran.
soak.py explains how those counts enter the record; ``python -m foundry_tools.soak cpu-suite`` runs
this.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
import time
from pathlib import Path

# The CPU suite's test files, by name, in the folder given with ``--tests`` (the repository's tests/).
TAMPER_FILE = "test_tamper_matrix.py"
FUZZ_FILE = "test_archive_fuzz.py"
CRASH_FILE = "test_archive_crash.py"
CPU_SUITE_FILES = (TAMPER_FILE, FUZZ_FILE, CRASH_FILE)
KILL_TEST = "test_sigkill_during_save_never_leaves_a_partial_archive"
SWEEP_TEST = "test_every_flipped_manifest_byte"
MATRIX_TEST = "test_tamper_matrix"


def parse_hypothesis_statistics(text: str) -> dict[str, int]:
    """Test cases Hypothesis executed, from the statistics it attaches to a pytest item.

    Counts the explicit, reuse and generate phases (shrinking only happens after a failure and
    re-runs variations of it). Accepts both the current wording (``N passing, M failing, and K
    invalid test cases``) and the older one (``N passing examples, M failing examples, ...``).
    """
    counts = {"passing": 0, "failing": 0, "invalid": 0}
    pattern = re.compile(
        r"during (\w+) phase.*?(\d+) passing(?: examples?)?, (\d+) failing(?: examples?)?,"
        r" (?:and )?(\d+) invalid",
        re.S,
    )
    for phase, passing, failing, invalid in pattern.findall(text or ""):
        if phase == "shrink":
            continue
        counts["passing"] += int(passing)
        counts["failing"] += int(failing)
        counts["invalid"] += int(invalid)
    return counts


class SuiteCounter:
    """A pytest plugin that counts what the reliability tests did while they ran.

    * tamper matrix: each ``test_tamper_matrix[<row>]`` case (every row expects a refusal; the test
      passes only if the refusal came, with the right type and message, before any GPU step);
    * manifest sweep: refusals seen by ``open_archive`` inside ``test_every_flipped_manifest_byte``
      (one pinned and one unpinned per flipped byte);
    * fuzzing: test cases Hypothesis executed (its own statistics on each item);
    * crash test: every ``kill_at`` call (one SIGKILLed SAVE each) and what the ``check_complete``
      that follows it found: a complete archive, no archive, an archive refused as damaged, or an
      archive that opened but was not exactly one SAVE's content (a loadable partial archive).
    """

    def __init__(self):
        self.outcomes: dict[str, str] = {}
        self.fuzz: dict[str, dict] = {}
        self.kills: list[str] = []
        self.after_kill: dict[str, int] = {"complete": 0, "absent": 0, "refused": 0, "loadable_partial": 0}
        self.sweep = {"refused_pinned": 0, "refused_unpinned": 0}
        self._pending_kill = False

    def pytest_runtest_logreport(self, report):
        """One outcome per test: failed if any phase failed, else skipped if skipped, else passed."""
        previous = self.outcomes.get(report.nodeid)
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.skipped and previous != "failed":
            self.outcomes[report.nodeid] = "skipped"
        elif report.when == "call" and previous is None:
            self.outcomes[report.nodeid] = "passed"

    def note_statistics(self, item, when: str) -> None:
        text = getattr(item, "hypothesis_statistics", None)
        if when == "call" and text:
            self.fuzz[item.nodeid] = parse_hypothesis_statistics(text)

    def _wrap_crash(self, module):
        import foundry_core.archive as archive

        kill_at, check_complete = module.kill_at, module.check_complete

        def counted_kill_at(*a, **k):
            phase, ev = kill_at(*a, **k)
            self.kills.append(phase)
            self._pending_kill = True
            return phase, ev

        def counted_check_complete(*a, **k):
            pending, self._pending_kill = self._pending_kill, False
            try:
                got = check_complete(*a, **k)
            except archive.ArchiveNotFound:
                self.after_kill["absent"] += pending
                raise
            except archive.ArchiveError:
                self.after_kill["refused"] += pending
                raise
            except AssertionError:
                self.after_kill["loadable_partial"] += pending
                raise
            self.after_kill["complete"] += pending
            return got

        module.kill_at, module.check_complete = counted_kill_at, counted_check_complete
        return lambda: (
            setattr(module, "kill_at", kill_at),
            setattr(module, "check_complete", check_complete),
        )

    def _wrap_sweep(self, module):
        import foundry_core.archive as archive

        open_archive = module.open_archive

        def counted(*a, **k):
            try:
                return open_archive(*a, **k)
            except archive.ArchiveError:
                self.sweep["refused_pinned" if k.get("expected_digest") else "refused_unpinned"] += 1
                raise

        module.open_archive = counted
        return lambda: setattr(module, "open_archive", open_archive)

    def counts(self) -> dict:
        def of(file: str, name: str | None = None) -> list[str]:
            # Node ids are relative to pytest's rootdir ("tests/test_x.py::test_y[row]"): match the file by name.
            return [
                o
                for nid, o in self.outcomes.items()
                if nid.split("::", 1)[0].rsplit("/", 1)[-1] == file
                and (name is None or nid.split("::")[-1].split("[")[0] == name)
            ]

        rows = of(TAMPER_FILE, MATRIX_TEST)
        fuzz_total = sum(c["passing"] for c in self.fuzz.values()) if self.fuzz else None
        kill_test = of(CRASH_FILE, KILL_TEST)
        return {
            "tamper_cases": len(rows),
            "tamper_refused": rows.count("passed"),
            "tamper_file_tests": len(of(TAMPER_FILE)),
            "tamper_file_passed": of(TAMPER_FILE).count("passed"),
            "manifest_flips_refused_pinned": self.sweep["refused_pinned"],
            "manifest_flips_refused_unpinned": self.sweep["refused_unpinned"],
            "fuzz_cases": fuzz_total,
            "fuzz_invalid_cases": sum(c["invalid"] for c in self.fuzz.values()) if self.fuzz else None,
            "fuzz_failing_cases": sum(c["failing"] for c in self.fuzz.values()) if self.fuzz else None,
            "fuzz_tests": {nid.split("::")[-1]: c["passing"] for nid, c in sorted(self.fuzz.items())},
            "fuzz_file_tests": len(of(FUZZ_FILE)),
            "fuzz_file_passed": of(FUZZ_FILE).count("passed"),
            "kill_points": len(self.kills),
            "kill_phases": {p: self.kills.count(p) for p in sorted(set(self.kills))},
            "kill_outcomes": dict(self.after_kill),
            "kill_loadable_partial": self.after_kill["loadable_partial"],
            "kill_test": kill_test[0] if kill_test else "not run",
            "crash_file_tests": len(of(CRASH_FILE)),
            "crash_file_passed": of(CRASH_FILE).count("passed"),
        }


def _make_plugin():
    import pytest

    class Plugin(SuiteCounter):
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item):
            undo = None
            if item.name == KILL_TEST:
                undo = self._wrap_crash(item.module)
            elif item.name == SWEEP_TEST:
                undo = self._wrap_sweep(item.module)
            try:
                yield
            finally:
                if undo:
                    undo()

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_makereport(self, item, call):
            # A firstresult hook: run before pytest's own implementation and return None.
            self.note_statistics(item, call.when)

    return Plugin()


def run_cpu_suite(out_json: str, tests: str | Path) -> int:
    """Run the reliability tests in the folder ``tests`` here (in this process); write what they did to ``out_json``.

    ``tests`` is the repository's ``tests/`` folder, named by the caller: the installed package has
    no tests of its own. pytest runs from the folder above it (the checkout, whose pyproject.toml
    configures pytest), on the files of ``CPU_SUITE_FILES`` that are there.
    """
    import importlib.util

    import pytest

    started = datetime.datetime.now(datetime.timezone.utc)
    tests = Path(tests).resolve()
    root = tests.parent
    present = [f for f in CPU_SUITE_FILES if (tests / f).is_file()]
    notes = []
    if importlib.util.find_spec("hypothesis") is None:
        present = [f for f in present if f != FUZZ_FILE]
        notes.append("hypothesis is not installed here: the fuzz tests did not run, fuzz_cases is null")
    missing = [f for f in CPU_SUITE_FILES if not (tests / f).is_file()]
    if missing:
        notes.append(f"not found in {tests}: {', '.join(missing)}")
    files = [str((tests / f).relative_to(root)) for f in present]
    plugin = _make_plugin()
    t0 = time.perf_counter()
    status = 5  # pytest's "no tests were collected"
    if files:  # never a bare pytest.main([]): that would run whatever the folder's configuration names
        cwd = os.getcwd()
        os.chdir(root)
        try:
            status = int(pytest.main([*files, "-q", "-p", "no:cacheprovider"], plugins=[plugin]))
        finally:
            os.chdir(cwd)
    versions = {}
    for name in ("pytest", "hypothesis", "torch"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    result = {
        "where": f"{socket.gethostname()} ({platform.platform()}, Python {platform.python_version()}), "
        "no GPU visible (CUDA_VISIBLE_DEVICES='')",
        "started_utc": started.isoformat(timespec="seconds"),
        "duration_s": round(time.perf_counter() - t0, 1),
        "command": f"cd {root} && python -m pytest "
        + " ".join(files)
        + " -q  (with foundry_tools.soak's counting plugin)",
        "versions": versions,
        "exit_status": 0 if status == 0 and not missing else (status or 1),
        "outcomes": {
            o: list(plugin.outcomes.values()).count(o) for o in sorted(set(plugin.outcomes.values()))
        },
        "failed": sorted(n for n, o in plugin.outcomes.items() if o == "failed"),
        "counts": plugin.counts(),
        "notes": notes,
    }
    Path(out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result["exit_status"]
