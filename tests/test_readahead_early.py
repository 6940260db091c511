"""A plugin's register() starts a LOAD's read-ahead through foundry_core.early, in a fresh process
(as an engine's launcher runs it): one thread, the engine layer imported on it, the lists read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from foundry_core.engine import readahead

SRC = str(Path(__file__).resolve().parents[1] / "src")

CHILD = textwrap.dedent(
    """
    import json, sys, time
    sys.argv = ["serve", "--model-path", "m", "--foundry-config", sys.argv[1]]
    t = time.perf_counter()
    from foundry_core.early import start_readahead
    thread = start_readahead("test")
    started_s = time.perf_counter() - t
    engine_imported = "foundry_core.engine.readahead" in sys.modules
    if thread is not None:
        thread.join(60)
    from foundry_core.engine import readahead
    replay = readahead._state.get("replay")
    if replay is not None:
        replay.join(60)
    print(json.dumps({"thread": thread is not None, "started_s": started_s,
                      "summary": readahead.summary()}))
    """
)


def _run(config: Path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FOUNDRY_")}
    environ.update(PYTHONPATH=SRC, **env)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(config)], capture_output=True, text=True, env=environ, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def load_config(tmp_path):
    archive = tmp_path / "archive"
    caches = archive / "rank0.caches"
    caches.mkdir(parents=True)
    (caches / "blob.bin").write_bytes(os.urandom(4096))
    assert readahead.record(archive, "rank0", caches_dir=caches) is not None
    config = tmp_path / "foundry.toml"
    config.write_text(f'mode = "load"\narchive_dir = "{archive}"\n')
    return config


def test_register_time_read_ahead_reads_the_recorded_lists(load_config):
    out = _run(load_config)
    assert out["thread"] is True
    s = out["summary"]
    assert s["lists"] == 1 and s["files"] > 100 and s["read_files"] == s["files"]
    assert s["how"] == "advise"
    # Planned and read by a helper process, not on the launcher's GIL
    assert s["helper_pid"] > 0 and s["plan_s"] is not None


def test_without_a_helper_process_the_launcher_reads_ahead_itself_and_trusts_the_same(load_config):
    helped = _run(load_config)["summary"]
    out = _run(load_config, FOUNDRY_READAHEAD_HELPER="0")
    s = out["summary"]
    assert "helper_pid" not in s and s["lists"] == 1 and s["read_files"] == s["files"] > 100
    # The helper was handed the launcher's environment roots (its own sys.path is bare): it keeps
    # and refuses the same files (the recording test process imported a few from elsewhere).
    assert (helped["files"], helped["skipped"]) == (s["files"], s["skipped"])


def test_switched_off_or_started_by_the_parent_it_does_nothing(load_config):
    assert _run(load_config, FOUNDRY_READAHEAD="0")["thread"] is False
    out = _run(load_config, FOUNDRY_READAHEAD_STARTED="1")
    assert out["thread"] is False and out["summary"] == {"started_by": "1"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a process's age is read from /proc")
def test_marks_hold_the_process_age_at_each_point():
    """A worker's start report says how long after its process started Foundry's plugin and
    session came (foundry_core.early.mark): measured from the process's start, not the import."""
    child = textwrap.dedent(
        """
        import json, os, time
        time.sleep(0.5)
        from foundry_core import early
        early.mark("plugin_registered")
        time.sleep(0.3)
        early.mark("plugin_registered")  # the first time only
        early.mark("session_begin")
        parent = dict(early.MARKS)
        pid = os.fork()
        if pid == 0:  # a forked worker: its own marks, its age from its own start
            early.mark("session_begin")
            os.write(1, json.dumps(early.MARKS).encode() + b"\\n")
            os._exit(0)
        os.waitpid(pid, 0)
        print(json.dumps(parent))
        """
    )
    environ = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, env=environ, timeout=60
    )
    assert out.returncode == 0, out.stderr
    child, marks = (json.loads(line) for line in out.stdout.splitlines())
    assert list(child) == ["session_begin"] and child["session_begin"] < 0.5
    assert 0.5 <= marks["plugin_registered"] < marks["session_begin"]
    assert marks["session_begin"] - marks["plugin_registered"] >= 0.25


SITE_HOOK = Path(__file__).resolve().parents[1] / "src" / "foundry_graphs_early.pth"

SITE_CHILD = textwrap.dedent(
    """
    import json, logging, site, sys
    sys.argv = ["serve", "--model-path", "m", *sys.argv[2:]]
    site.addsitedir(__import__("os").environ["HOOK_DIR"])
    early = sys.modules.get("foundry_core.early")
    out = {"started": bool(early and early._started), "engine_imported": "foundry_core.engine" in sys.modules}
    if early is not None and early._started:
        from foundry_core.engine import readahead
        import time
        deadline = time.monotonic() + 60
        while readahead._state.get("replay") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        readahead._state["replay"].join(60)
        got = []
        class Keep(logging.Handler):
            def emit(self, record):
                got.append(record.getMessage())
        engine_log = logging.getLogger("engine.foundry")
        engine_log.addHandler(Keep())
        engine_log.setLevel(logging.INFO)
        engine_log.propagate = False
        out["before_handover"] = list(got)
        early.start_readahead("engine.foundry")  # the engine's plugin registers: lines handed over
        out["lines"] = got
        out["again"] = early.start_readahead("engine.foundry") is None
    else:
        out["foundry_imported"] = any(m.startswith("foundry_core") for m in sys.modules)
    print(json.dumps(out))
    """
)


def _run_site(hook_dir: Path, *args: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FOUNDRY_")}
    environ.update(PYTHONPATH=SRC, HOOK_DIR=str(hook_dir), **env)
    out = subprocess.run(
        [sys.executable, "-c", SITE_CHILD, "x", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Error processing line" not in out.stderr, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_site_hook_reads_ahead_from_interpreter_start_and_hands_its_lines_to_the_engine(
    load_config, tmp_path
):
    """foundry_graphs_early.pth (installed into site-packages by the core's wheel) starts the
    read-ahead while Python starts, before any engine import, when the command line names
    --foundry-config; what it logged before the engine's plugin registered reaches the engine's
    logger then, and the plugin's own call starts nothing more."""
    hook_dir = tmp_path / "site"
    hook_dir.mkdir()
    (hook_dir / SITE_HOOK.name).write_bytes(SITE_HOOK.read_bytes())
    out = _run_site(hook_dir, "--foundry-config", str(load_config))
    assert out["started"] is True
    assert out["before_handover"] == []
    assert any(line.startswith("Foundry: reading ahead") for line in out["lines"]), out["lines"]
    assert any(line.startswith("Foundry: read ahead") for line in out["lines"]), out["lines"]
    assert out["again"] is True
    # Switched off: nothing starts
    assert _run_site(hook_dir, f"--foundry-config={load_config}", FOUNDRY_READAHEAD="0")["started"] is False


def test_the_site_hook_imports_nothing_without_a_foundry_configuration(tmp_path):
    hook_dir = tmp_path / "site"
    hook_dir.mkdir()
    (hook_dir / SITE_HOOK.name).write_bytes(SITE_HOOK.read_bytes())
    out = _run_site(hook_dir, "--model", "m")
    assert out == {"started": False, "engine_imported": False, "foundry_imported": False}
    # One line, as site.py runs it: an import statement that tests the arguments before anything else
    lines = SITE_HOOK.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import sys;")
