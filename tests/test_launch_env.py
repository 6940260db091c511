"""Engine settings for a shorter start (foundry_core.engine.launch_env): set where the user chose
nothing, kept where the user set them when the process started, undone for a later engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foundry_core.engine import launch_env, redirect_for_launch, undo_launch_redirect

SETTINGS = {
    "FOUNDRY_TEST_METHOD": ("fork", "a reason"),
    "FOUNDRY_TEST_ARTIFACT": ("1", "another reason"),
    "FOUNDRY_TEST_MINE": ("1", "a third reason"),
}


@pytest.fixture
def env(monkeypatch):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    undo_launch_redirect()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux's /proc/self/environ")
def test_the_start_environment_is_read_apart_from_later_assignments():
    code = (
        "import json, os\n"
        "from foundry_core.engine import launch_env\n"
        "os.environ['FOUNDRY_TEST_LATER'] = 'x'\n"
        "os.environ['FOUNDRY_TEST_AT_START'] = 'changed'\n"
        "e = launch_env.initial_environment()\n"
        "print(json.dumps([e.get('FOUNDRY_TEST_AT_START'), e.get('FOUNDRY_TEST_LATER')]))\n"
    )
    run_env = dict(os.environ, FOUNDRY_TEST_AT_START="user")
    run_env.pop("FOUNDRY_TEST_LATER", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == ["user", None]


def test_settings_are_set_where_the_user_chose_nothing_and_undone(env, caplog):
    # The engine's launcher assigned its own default before plugins load (vLLM's CLI: spawn); the
    # user set FOUNDRY_TEST_MINE when starting the process.
    env.setenv("FOUNDRY_TEST_METHOD", "spawn")
    env.setenv("FOUNDRY_TEST_MINE", "0")
    env.setattr(launch_env, "initial_environment", lambda: {"FOUNDRY_TEST_MINE": "0"})
    with caplog.at_level("INFO"):
        done = launch_env.apply(SETTINGS)
    assert done == {"FOUNDRY_TEST_METHOD": "fork", "FOUNDRY_TEST_ARTIFACT": "1"}
    assert os.environ["FOUNDRY_TEST_METHOD"] == "fork" and os.environ["FOUNDRY_TEST_ARTIFACT"] == "1"
    assert os.environ["FOUNDRY_TEST_MINE"] == "0"  # the user's own
    assert "FOUNDRY_TEST_MINE=0 kept as set" in caplog.text and "FOUNDRY_TEST_METHOD=fork" in caplog.text
    launch_env.undo()
    assert os.environ["FOUNDRY_TEST_METHOD"] == "spawn" and "FOUNDRY_TEST_ARTIFACT" not in os.environ


def test_without_the_start_environment_a_present_variable_counts_as_the_users(env):
    env.setenv("FOUNDRY_TEST_METHOD", "spawn")
    env.setattr(launch_env, "initial_environment", lambda: None)
    assert launch_env.apply(SETTINGS) == {"FOUNDRY_TEST_ARTIFACT": "1", "FOUNDRY_TEST_MINE": "1"}
    assert os.environ["FOUNDRY_TEST_METHOD"] == "spawn"


def test_a_launch_redirect_applies_settings_and_its_undo_takes_them_back(env, tmp_path):
    env.setattr(launch_env, "initial_environment", lambda: {})
    cfg = type("Cfg", (), {"carry_caches": False, "mode": "auto", "archive_dir": tmp_path})()
    assert redirect_for_launch(cfg, [], settings=SETTINGS) is None  # no caches carried; settings still
    assert all(os.environ[n] == v for n, (v, _) in SETTINGS.items())
    # A second launch in the same process starts from the user's environment again.
    redirect_for_launch(cfg, [], settings={"FOUNDRY_TEST_METHOD": ("fork", "r")})
    assert "FOUNDRY_TEST_ARTIFACT" not in os.environ and os.environ["FOUNDRY_TEST_METHOD"] == "fork"
    undo_launch_redirect()
    assert not any(n in os.environ for n in SETTINGS)
