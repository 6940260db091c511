"""Issue 19, without a GPU: damaged or foreign carried caches are refused before use, naming why
(model: save_model.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from save_model import (
    ENGINE,
    LINUX_ONLY,
    cfg_for,
    fill_caches,
    one_line,
)

pytestmark = LINUX_ONLY


@pytest.fixture
def carried(caches_machine):
    """caches_machine, and the cache variables a handover points elsewhere put back afterwards."""
    saved = dict(os.environ)
    yield caches_machine
    os.environ.clear()
    os.environ.update(saved)


def _pack_caches(cfg, engine=ENGINE) -> Path:
    from foundry_core.engine import caches

    saved = caches.CacheDirs.create(["triton"], label="save")
    fill_caches(saved)
    caches.pack(cfg.rank_caches_dir(0), saved, device=0, engine=engine)
    saved.close()
    return cfg.rank_caches_dir(0)


def _damage(path: Path, how: str) -> str:
    """Damage the caches archive at ``path``; returns the file the refusal must name."""
    real = Path(os.path.realpath(path))
    member = real / "caches" / "triton" / "ab12" / "kernel.cubin"
    member.chmod(0o644)
    if how == "flipped byte":
        data = bytearray(member.read_bytes())
        data[len(data) // 2] ^= 0x01
        member.write_bytes(bytes(data))
    elif how == "truncated":
        member.write_bytes(member.read_bytes()[:-3])
    elif how == "missing":
        member.unlink()
    elif how == "manifest":  # one hex digit of a checksum in the manifest
        manifest = real / "manifest.json"
        text = manifest.read_text()
        at = text.index('"sha256": "') + len('"sha256": "')
        manifest.chmod(0o644)
        manifest.write_text(text[:at] + ("0" if text[at] != "0" else "1") + text[at + 1 :])
        return "manifest.json"
    return "caches/triton/ab12/kernel.cubin"


@pytest.mark.parametrize("mode", ["auto", "load"])
@pytest.mark.parametrize("how", ["flipped byte", "truncated", "missing", "manifest"])
def test_damaged_carried_caches_are_refused_before_use_naming_why(tmp_path, carried, log_records, how, mode):
    from foundry_core.engine import CacheHandover, caches
    from foundry_core.engine.handover import CacheRefused

    cfg = cfg_for(tmp_path / "archive", mode)
    named = _damage(_pack_caches(cfg), how)
    records = log_records("faults.test", logging.WARNING)
    h = CacheHandover(cfg, 0, ["triton"], ENGINE, log=logging.getLogger("faults.test"))
    h.begin()
    if mode == "auto":
        assert h.restore(device=0) is False  # the engine compiles as usual
        (warning,) = [r.getMessage() for r in records]
        assert one_line(warning) and named in warning and warning.endswith("the engine compiles as usual")
        assert named in h.report["refused"]
    else:
        with pytest.raises(CacheRefused) as err:
            h.restore(device=0)
        assert one_line(str(err.value)) and named in str(err.value)
        assert str(err.value).endswith("mode=load cannot go on")
    # Refused before use: nothing handed over to the engine.
    assert h.dirs.files() == {"triton": {}} and not (h.dirs.root / caches.CARRIED_LIST).exists()


@pytest.mark.parametrize("mode", ["auto", "load"])
def test_carried_caches_for_another_engine_version_are_refused_naming_it(
    tmp_path, carried, log_records, mode
):
    from foundry_core.engine import CacheHandover
    from foundry_core.engine.handover import CacheRefused

    cfg = cfg_for(tmp_path / "archive", mode)
    _pack_caches(cfg)
    why = "archive was saved for model.engine.testengine='1.0', this machine has '2.0'"
    records = log_records("faults.test", logging.WARNING)
    h = CacheHandover(
        cfg, 0, ["triton"], {**ENGINE, "testengine": "2.0"}, log=logging.getLogger("faults.test")
    )
    h.begin()
    if mode == "auto":
        assert h.restore(device=0) is False
        (warning,) = [r.getMessage() for r in records]
        assert why in warning and warning.endswith("the engine compiles as usual")
    else:
        with pytest.raises(CacheRefused, match="mode=load cannot go on") as err:
            h.restore(device=0)
        assert why in str(err.value) and one_line(str(err.value))
    assert h.dirs.files() == {"triton": {}}


def test_the_launcher_takes_no_record_from_a_damaged_caches_archive(tmp_path, carried, log_records):
    from foundry_core.engine import caches, redirect_for_launch

    records = log_records("foundry.caches", logging.DEBUG)
    cfg = cfg_for(tmp_path / "archive")
    saved = caches.CacheDirs.create(["vllm"], label="save")
    info = saved.path("vllm") / "modelinfos" / "m-Qwen3ForCausalLM.json"
    info.parent.mkdir()
    info.write_text('{"hash": "h"}')
    caches.pack(cfg.rank_caches_dir(0), saved, device=0, engine=ENGINE)
    member = Path(os.path.realpath(cfg.rank_caches_dir(0))) / "caches" / "vllm" / "modelinfos" / info.name
    member.chmod(0o644)
    member.write_text('{"hash": "x"}')
    launched = redirect_for_launch(cfg, ["vllm"], engine=ENGINE, launcher_records={"vllm": ("modelinfos/",)})
    assert launched.files() == {"vllm": {}}
    assert any("no launcher records" in r.getMessage() and info.name in r.getMessage() for r in records)
