"""The release gate and ``strict`` on SGLang's real launch path (its parser, resolution and
``check_server_args``), with the real installed SGLang: a release outside the tested range is
refused in one line before any scheduler starts; ``allow_untested_release`` goes on with every LOAD
structure-checked; ``strict`` turns ``auto``'s fallbacks into one-line refusals."""

from __future__ import annotations

import logging
import os
import types
from importlib.metadata import version

import pytest

import foundry_core
from foundry_core.engine import release
from foundry_sglang_plugin import archive, settings
from foundry_sglang_plugin.session import FoundrySessionError, Session, settle

pytestmark = pytest.mark.sglang

BASE_ARGV = ["--device", "cuda", "--cuda-graph-backend-prefill", "disabled", "--tp-size", "1"]
HINT = {"gpu_id": 0, "tp_rank": 0, "dp_rank": None}


def launch(parse, tmp_path, extra: str = "", mode: str = "auto", archive_dir=None):
    toml = tmp_path / "foundry.toml"
    toml.write_text(f'mode = "{mode}"\narchive_dir = "{archive_dir or tmp_path / "archive"}"\n{extra}')
    sa = parse(*BASE_ARGV, "--enable-foundry", "--foundry-config", str(toml), foundry=False)
    sa.resolve_once()
    return sa


def refused_line(sa) -> str:
    with pytest.raises(SystemExit) as err:
        sa.check_server_args()
    line = str(err.value.code)
    assert "\n" not in line and line.startswith("error: ")
    assert "FOUNDRY_SGLANG" not in os.environ  # refused before any scheduler got settings
    return line


def test_the_installed_sglang_is_in_the_tested_range(parse, tmp_path):
    assert release.in_range(version("sglang"), release.TESTED["sglang"])
    launch(parse, tmp_path).check_server_args()  # and a launch goes on


def test_the_installed_sglang_is_refused_when_the_range_excludes_it(parse, tmp_path, monkeypatch):
    monkeypatch.setitem(release.TESTED, "sglang", ">=0.5.24,<0.5.25")
    line = refused_line(launch(parse, tmp_path))
    assert f"Foundry is tested with sglang >=0.5.24,<0.5.25 but this is sglang {version('sglang')}" in line


def test_an_older_sglang_release_is_refused(parse, tmp_path, monkeypatch):
    """0.5.17, the release validated before this range: its version string, judged on the real path."""
    monkeypatch.setattr(release, "installed_version", lambda engine: "0.5.17")
    line = refused_line(launch(parse, tmp_path))
    assert "sglang >=0.5.23,<0.5.24 but this is sglang 0.5.17" in line
    assert "allow_untested_release = true" in line


def test_allow_untested_release_goes_on_and_structure_checks_every_load(parse, tmp_path, monkeypatch, logged):
    monkeypatch.setattr(release, "installed_version", lambda engine: "0.5.17")
    sa = launch(parse, tmp_path, "allow_untested_release = true\n")
    sa.check_server_args()
    warnings = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
    assert len([m for m in warnings if "outside the tested range" in m]) == 1, warnings
    cfg, _mode = settle(sa)  # what a scheduler's session runs with
    assert cfg.check_structure is True

    # A scheduler's LOAD with that configuration reads its graphs back (Restored.check) before serving.
    slots = {"memory_pool_config": {"max_total_num_tokens": 64}, "max_mamba_cache_size": None}
    plain = settings.load(sa)
    archive.write_sidecar(
        plain, 0, {"fingerprint": archive.fingerprint(sa, plain), "slots": slots, "outputs": {}}
    )
    monkeypatch.setattr(foundry_core, "verify", lambda path, **kw: None)
    monkeypatch.setattr(foundry_core, "start_recording", lambda keep_images=True: None)
    settings.set_mode(sa, "load")
    session = Session.begin(sa, HINT)
    assert session.mode == "load" and session.cfg.check_structure is True
    checked = []

    def load(path, **kwargs):
        meta = {"collectives": {}, "graphs": {}}
        return types.SimpleNamespace(
            slots=slots,
            timings={},
            digest="d" * 64,
            archive=types.SimpleNamespace(meta=meta),
            check=lambda: checked.append(path) or {},
        )

    monkeypatch.setattr(foundry_core, "load", load)
    session.region = object()
    session.restore()
    assert checked == [str(session.path)] and "structure_check_s" in session.report


def test_strict_refuses_where_auto_would_serve_without_foundry(parse, tmp_path, logged):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    sa = launch(parse, tmp_path, "strict = true\n", archive_dir=blocker / "archive")
    line = refused_line(sa)
    assert "is not writable" in line and "strict = true: auto mode stops instead of" in line
    assert not [r for r in logged if r.levelno == logging.WARNING]


def test_auto_without_strict_warns_exactly_once(parse, tmp_path, logged):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    launch(parse, tmp_path, archive_dir=blocker / "archive").check_server_args()
    warnings = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "serves without Foundry" in warnings[0]


def test_strict_refuses_a_refused_archive_instead_of_saving_again(parse, tmp_path, monkeypatch, logged):
    """A scheduler whose archive fc.verify refuses: ``auto`` would SAVE again; strict stops in one line."""
    sa = launch(parse, tmp_path, "strict = true\n")
    cfg = settings.load(sa)
    slots = {"memory_pool_config": {"max_total_num_tokens": 64}, "max_mamba_cache_size": None}
    archive.write_sidecar(
        cfg, 0, {"fingerprint": archive.fingerprint(sa, cfg), "slots": slots, "outputs": {}}
    )

    def verify(path, **kwargs):
        raise foundry_core.ArchiveError(f"archive {path}: graphs/decode.bin: checksum mismatch")

    monkeypatch.setattr(foundry_core, "verify", verify)
    monkeypatch.setattr(foundry_core, "start_recording", lambda keep_images=True: None)
    settings.set_mode(sa, "load")
    with pytest.raises(FoundrySessionError) as err:
        Session.begin(sa, HINT)
    assert "checksum mismatch" in str(err.value) and "strict = true" in str(err.value)
    assert "\n" not in str(err.value)
    assert not [r for r in logged if r.levelno == logging.WARNING]
