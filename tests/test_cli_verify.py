"""`foundry verify ARCHIVE`: an archive checked against this machine, each rank's as that rank would
load it. The machine's fingerprint is stood in for (it reads the GPU); the archives are real."""

from __future__ import annotations

import pytest

import foundry_core.api as api
from foundry_core import cli
from foundry_core.archive import ArchiveWriter
from foundry_core.fingerprint import make_fingerprint

# Any machine will do: the archives here are saved for it, and checked against it.
MACHINE = {"gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "sm_count": 132}
MACHINE.update(driver_version=12080, cuda_version="12.8", torch_version="2.9.0+cu128")
MODEL = {"layers": 2}


@pytest.fixture
def machine(monkeypatch):
    """This machine: two H200s; records which device each fingerprint was asked for."""
    asked: list[int] = []

    def current(device=0, model=None, rank=0, world_size=1):
        asked.append(device)
        return make_fingerprint(**MACHINE, rank=rank, world_size=world_size, model=model or {})

    monkeypatch.setattr(api, "current_fingerprint", current)
    return asked


def save(path, *, rank=0, world_size=1, device=0, **machine) -> None:
    fp = make_fingerprint(**{**MACHINE, **machine}, rank=rank, world_size=world_size, model=MODEL)
    with ArchiveWriter(path) as w:
        w.add_bytes("memory/00000.bin", b"x" * 64)
        w.commit(fingerprint=fp, meta={"kind": api.ARCHIVE_KIND, "device": device, "graphs": []})


def test_a_rank_archive_is_checked_as_its_own_rank_on_its_own_device(tmp_path, machine, capsys):
    save(tmp_path / "rank1", rank=1, world_size=2, device=1)
    assert cli.main(["verify", str(tmp_path / "rank1")]) == 0
    assert "foundry verify: OK" in capsys.readouterr().out
    assert machine == [1]  # the device it was saved on, not device 0
    # Asked as another rank or device, it is refused with the reason, as that LOAD would be.
    assert cli.main(["verify", str(tmp_path / "rank1"), "--rank", "0"]) == 1
    assert "rank" in capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path / "rank1"), "--device", "0"]) == 1
    assert "was saved on cuda:1, this process restores on cuda:0" in capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path / "rank1"), "--world-size", "4"]) == 1
    assert "world_size" in capsys.readouterr().err


def test_the_machine_is_still_compared(tmp_path, machine, capsys):
    save(tmp_path / "rank0", driver_version=13000)
    assert cli.main(["verify", str(tmp_path / "rank0")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("foundry verify: REFUSED:") and "driver_version" in err


def test_a_damaged_archive_is_refused_before_the_machine_is_asked(tmp_path, machine, capsys):
    save(tmp_path / "rank0")
    member = tmp_path / "rank0" / "memory" / "00000.bin"
    member.write_bytes(b"y" * 64)
    assert cli.main(["verify", str(tmp_path / "rank0")]) == 1
    assert "REFUSED" in capsys.readouterr().err and machine == []
