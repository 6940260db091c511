"""`foundry verify ARCHIVE` and `foundry inspect ARCHIVE`: one archive, or an engine's archive_dir of
rank archives, each checked as its rank would load it; `--integrity-only` without the machine. The
machine's fingerprint is stood in for (it reads the GPU); the archives are real (no graph in them
was captured: their one graph is a description, as SAVE writes it)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import foundry_core.api as api
from foundry_core import cli
from foundry_core.archive import ArchiveWriter
from foundry_core.fingerprint import make_fingerprint

# Any machine will do: the archives here are saved for it, and checked against it.
MACHINE = {"gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "sm_count": 132}
MACHINE.update(driver_version=12080, cuda_version="12.8", torch_version="2.9.0+cu128")
MODEL = {"layers": 2}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"


@pytest.fixture
def machine(monkeypatch):
    """This machine: two H200s; records which device each fingerprint was asked for."""
    asked: list[int] = []

    def current(device=0, model=None, rank=0, world_size=1):
        asked.append(device)
        return make_fingerprint(**MACHINE, rank=rank, world_size=world_size, model=model or {})

    monkeypatch.setattr(api, "current_fingerprint", current)
    return asked


CUBIN = b"\x7fELF" + bytes(range(60))
IMAGE = hashlib.sha256(CUBIN).hexdigest()
BASE = 0x600000000000
GRAPH = {
    "nodes": [
        {"type": "kernel", "image": IMAGE, "name": "decode", "grid": [1, 1, 1], "block": [32, 1, 1],
         "smem": 0, "params": "", "attrs": {}},
        {"type": "empty"},
    ],
    "edges": [[0, 1, 0, 0, 0]],
    "rng": None,
}  # fmt: skip


def meta(device=0, **changes) -> dict:
    """A graph archive's meta as SAVE writes it: one graph, one code image, one memory snapshot."""
    return {
        "kind": api.ARCHIVE_KIND,
        "device": device,
        "layout": {"base": BASE, "size": 1 << 30, "segments": [[BASE, 64, 1, "weights", "eager"]]},
        "graphs": [{"name": "decode/bs=1", "file": "graphs/0000.json", "nodes": 2, "rng": False}],
        "kernels": [[IMAGE, "decode", {}]],
        "images": [IMAGE],
        "tensors": {"out": {"addr": BASE, "shape": [8], "stride": [1], "dtype": "float32"}},
        "snapshots": [[0, [0]]],
        "slots": {},
        **changes,
    }


def save(path, *, rank=0, world_size=1, device=0, graph=None, meta_changes=None, **machine) -> None:
    fp = make_fingerprint(**{**MACHINE, **machine}, rank=rank, world_size=world_size, model=MODEL)
    with ArchiveWriter(path) as w:
        w.add_bytes("memory/00000.bin", b"x" * 64)
        w.add_bytes(f"modules/{IMAGE}.cubin", CUBIN)
        w.add_json("graphs/0000.json", GRAPH if graph is None else graph)
        w.commit(fingerprint=fp, meta=meta(device, **(meta_changes or {})))


@pytest.fixture
def no_machine(monkeypatch):
    """This machine cannot be asked (no GPU): a check that asks fails."""

    def current(*args, **kwargs):
        raise AssertionError("the machine was asked")

    monkeypatch.setattr(api, "current_fingerprint", current)


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


# --- an engine's archive_dir: every rank's archive ---------------------------------------------------


def test_an_archive_dir_is_verified_rank_by_rank(tmp_path, machine, capsys):
    save(tmp_path / "rank0", rank=0, world_size=2, device=0)
    save(tmp_path / "rank1", rank=1, world_size=2, device=1)
    (tmp_path / "rank0.caches").mkdir()  # carried caches beside them are no rank archive
    assert cli.main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("matches this machine") == 2 and machine == [0, 1]
    assert out.splitlines()[-1] == f"foundry verify: OK: 2 of 2 rank archives under {tmp_path} sound"
    # --rank picks that rank's archive of the directory.
    assert cli.main(["verify", str(tmp_path), "--rank", "1"]) == 0
    assert str(tmp_path / "rank1") in capsys.readouterr().out and machine == [0, 1, 1]
    assert cli.main(["verify", str(tmp_path), "--rank", "2"]) == 1
    assert f"no rank2 archive under {tmp_path}" in capsys.readouterr().err
    # A digest pins one archive: given a directory of several, it needs --rank.
    assert cli.main(["verify", str(tmp_path), "--digest", "ab" * 32]) == 2
    assert "--digest pins one archive" in capsys.readouterr().err


def test_an_archive_dir_missing_a_rank_or_holding_another_rank_is_refused(tmp_path, machine, capsys):
    save(tmp_path / "rank0", rank=0, world_size=2)
    assert cli.main(["verify", str(tmp_path)]) == 1
    assert "rank1 of 2 is missing" in capsys.readouterr().err
    save(tmp_path / "rank1", rank=0, world_size=2)  # rank 0's archive under rank1
    assert cli.main(["verify", str(tmp_path), "--integrity-only"]) == 1
    assert "was saved by rank 0, not rank 1" in capsys.readouterr().err


def test_inspect_takes_an_archive_dir(tmp_path, capsys):
    save(tmp_path / "rank0", rank=0, world_size=2)
    save(tmp_path / "rank1", rank=1, world_size=2, device=1)
    assert cli.main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "== rank0 ==" in out and "== rank1 ==" in out and out.count("decode/bs=1") == 2
    assert "kernel\n" not in out  # the kernel list only with --kernels
    assert cli.main(["inspect", "--kernels", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("kernel\n") == 2
    assert cli.main(["inspect", str(tmp_path / "rank1")]) == 0  # one rank, as before
    assert "== rank" not in capsys.readouterr().out
    (tmp_path / "rank1" / "manifest.json").unlink()  # through the symlink: that rank's archive damaged
    assert cli.main(["inspect", str(tmp_path)]) == 1
    assert "manifest.json is missing" in capsys.readouterr().err


# --- --integrity-only: checksums and structure, no GPU --------------------------------------------------


def test_integrity_only_needs_no_machine(tmp_path, no_machine, capsys):
    save(tmp_path / "rank0", driver_version=99999)  # saved on another machine: not compared
    assert cli.main(["verify", "--integrity-only", str(tmp_path / "rank0")]) == 0
    assert "checksums and structure sound" in capsys.readouterr().out


def test_integrity_only_refuses_damage(tmp_path, no_machine, capsys):
    save(tmp_path / "rank0")
    member = tmp_path / "rank0" / "memory" / "00000.bin"
    member.write_bytes(b"y" * 64)
    assert cli.main(["verify", "--integrity-only", str(tmp_path / "rank0")]) == 1
    assert "REFUSED" in capsys.readouterr().err


@pytest.mark.parametrize(
    "graph, changes, why",
    [
        (None, {"images": [IMAGE, "cd" * 32]}, "not in the archive"),
        (None, {"snapshots": [[3, [0]]]}, "names no segment of the layout"),
        (None, {"layout": None}, "no valid 'layout'"),
        (None, {"graphs": [{"name": "g", "file": "graphs/0000.json", "nodes": 5}]}, "holds 2 nodes"),
        (None, {"graphs": [{"name": "g", "file": "graphs/0000.json", "nodes": 2, "encoding": "FGB9"}]},
         "does not decode"),
        ({"edges": []}, {}, "does not decode"),
        ({"nodes": [{"type": "kernel", "image": "cd" * 32}, {"type": "empty"}], "edges": []}, {},
         "launches a kernel of code image cdcd"),
        (None, {"kernels": [["ab" * 32, "decode", {}]]}, "does not name one of its code images"),
        (None, {"tensors": {"out": {"addr": BASE}}}, "tensor 'out' lacks"),
        (None, {"kind": "foundry-caches"}, "not Foundry graphs"),
    ],
)  # fmt: skip
def test_integrity_only_refuses_what_a_load_could_not_use(tmp_path, no_machine, capsys, graph, changes, why):
    """Checksums all match (SAVE wrote them over these contents): only the structure is wrong."""
    save(tmp_path / "rank0", graph=graph, meta_changes=changes)
    assert cli.main(["verify", "--integrity-only", str(tmp_path / "rank0")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("foundry verify: REFUSED:") and why in err and len(err.splitlines()) == 1


def test_the_exit_codes_are_documented(capsys):
    for argv in (["--help"], ["verify", "--help"], ["inspect", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        out = capsys.readouterr().out
        assert "exit codes:" in out and "1  an archive was refused" in out
    assert "`foundry verify` exit codes" in DOCS.read_text()


def test_a_machine_that_cannot_be_asked_is_not_checked(tmp_path, monkeypatch, capsys):
    def no_driver(*args, **kwargs):
        raise RuntimeError("CUDA driver not found")

    monkeypatch.setattr(api, "current_fingerprint", no_driver)
    save(tmp_path / "rank0")
    assert cli.main(["verify", str(tmp_path / "rank0")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "foundry verify: NOT CHECKED: CUDA driver not found (--integrity-only checks the archive alone)"
    )
