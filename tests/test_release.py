"""The release gate, the configuration keys it and ``strict`` add, and ``auto``'s fallbacks under ``strict``.

The engines' own launch paths are exercised with the real packages in tests/sglang/test_sglang_release_gate.py
and tests/vllm/test_vllm_release_gate.py; here the rules themselves, on the real configuration parser.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from foundry_core.config import ConfigError, config_from_dict, config_from_env
from foundry_core.engine import decide, release


def cfg(**top):
    return config_from_dict({"archive_dir": "/tmp/foundry-release-test", **top})


@pytest.mark.parametrize(
    "engine, version, inside",
    [
        ("sglang", "0.5.23", True),
        ("sglang", "0.5.23.post1", True),
        ("sglang", "0.5.24", False),
        ("sglang", "0.5.17", False),  # the release validated before; dropped from the range
        ("sglang", "0.5.24rc0", False),
        ("vllm", "0.33.0", True),
        ("vllm", "0.33.2+cu129", True),
        ("vllm", "0.34.0", False),
        ("vllm", "0.34.0rc1", False),
        ("vllm", "0.26.0", False),
        ("vllm", "not-a-version", False),
    ],
)
def test_tested_ranges(engine, version, inside):
    assert release.in_range(version, release.TESTED[engine]) is inside


def test_a_release_outside_the_range_is_refused_in_one_line_naming_it():
    with pytest.raises(release.UntestedReleaseError) as err:
        release.gate("vllm", cfg(), version="0.26.0")
    line = str(err.value)
    assert "\n" not in line
    assert "vllm >=0.33.0,<0.34" in line and "this is vllm 0.26.0" in line
    assert "allow_untested_release = true" in line
    assert isinstance(err.value, ConfigError)  # the plugins' launch paths turn it into one exit line


def test_an_engine_that_is_not_installed_is_refused(monkeypatch):
    monkeypatch.setattr(release, "installed_version", lambda engine: None)
    with pytest.raises(release.UntestedReleaseError, match=r"this is sglang \(not installed\)"):
        release.gate("sglang", cfg())


def test_in_range_the_configuration_is_unchanged():
    c = cfg()
    assert release.gate("sglang", c, version="0.5.23") is c


def test_allowed_untested_release_warns_once_and_forces_the_structure_check(caplog):
    c = cfg(allow_untested_release=True)
    assert c.check_structure is False
    with caplog.at_level(logging.WARNING, logger="foundry.test"):
        gated = release.gate("sglang", c, logging.getLogger("foundry.test"), version="0.5.17")
    assert gated.check_structure is True and gated.allow_untested_release is True
    assert gated.archive_dir == c.archive_dir and gated.mode == c.mode
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "sglang 0.5.17 is outside the tested range >=0.5.23,<0.5.24" in record.getMessage()


def test_the_installed_version_is_read_from_the_distribution_metadata():
    import importlib.metadata as md

    assert release.installed_version("packaging") == md.version("packaging")
    assert release.installed_version("no-such-distribution-foundry") is None


@pytest.mark.parametrize("key", ["strict", "allow_untested_release"])
def test_new_keys_default_off_and_must_be_booleans(key):
    assert getattr(cfg(), key) is False
    assert getattr(cfg(**{key: True}), key) is True
    with pytest.raises(ConfigError, match=f"^{key}: expected true or false"):
        cfg(**{key: "yes"})


def test_new_keys_travel_through_the_environment():
    c = cfg(strict=True, allow_untested_release=True)
    env = c.to_env()
    back = config_from_env(env)
    assert back.strict is True and back.allow_untested_release is True
    assert "FOUNDRY_STRICT" not in cfg().to_env()


# -- auto's fallbacks: one WARNING line each, or a one-line refusal under strict ------------------


def test_auto_refusal_falls_back_with_exactly_one_warning(caplog):
    c = cfg(mode="auto")
    with caplog.at_level(logging.DEBUG, logger="foundry.engine"):
        line = decide.after_refusal(c, 0, 1, "checksum mismatch")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [line]
    assert "checksum mismatch" in line and line.endswith("capturing and saving a fresh one")


def test_strict_auto_refuses_instead_of_saving_again(caplog):
    c = cfg(mode="auto", strict=True)
    with caplog.at_level(logging.DEBUG, logger="foundry.engine"):
        with pytest.raises(decide.ArchiveRefused) as err:
            decide.after_refusal(c, 0, 1, "checksum mismatch")
    line = str(err.value)
    assert "\n" not in line and "checksum mismatch" in line
    assert "strict = true: auto mode stops instead of capturing and saving a fresh one" in line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the error is the one line


def test_strict_auto_refuses_instead_of_capturing_after_a_failed_restore():
    with pytest.raises(decide.ArchiveRefused, match="strict = true: auto mode stops instead of capturing"):
        decide.after_load_failure(cfg(mode="auto", strict=True), 0, 1, RuntimeError("graph 3 not built"))


def test_strict_auto_refuses_an_archive_dir_it_cannot_write(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    c = config_from_dict({"archive_dir": str(blocker / "archive"), "mode": "auto", "strict": True})
    with pytest.raises(decide.ArchiveRefused, match="is not writable.*strict = true"):
        decide.save_blocked(c, 0)
    lax = config_from_dict({"archive_dir": str(blocker / "archive"), "mode": "auto"})
    assert "is not writable" in decide.save_blocked(lax, 0)


def test_strict_auto_keeps_a_failed_save_an_error(caplog):
    error = OSError(28, "No space left on device")
    with pytest.raises(OSError):
        decide.save_failed(cfg(mode="auto", strict=True), 0, error)
    with caplog.at_level(logging.DEBUG, logger="foundry.engine"):
        decide.save_failed(cfg(mode="auto"), 0, error)  # not strict: serves on, one warning
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_strict_is_documented_with_the_other_keys():
    docs = Path(__file__).resolve().parents[1] / "docs"
    text = "\n".join(p.read_text() for p in docs.glob("*.md"))
    assert "strict = " in text and "allow_untested_release = " in text
