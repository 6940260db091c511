"""Issue 19 fault cases that the engine layer can be checked for without a GPU.

A SAVE killed at each of its steps, a full disk, a read-only archive directory, two replicas saving
at once, an archive replaced under a process that holds it, damaged or foreign carried caches.

The plugins' SAVE is modelled by the calls they make, in their order (SGLang: drop the sidecar when
the scheduler starts, capture, ``fc.save``, write the sidecar; vLLM: capture, drop the manifest,
``fc.save``, write the manifest), with the plugins' own record functions, the real archive writer
and the engine layer's decision functions. Only what needs a GPU is stood in for: the capture, the
graphs' content (blobs) and the machine fingerprint. Subprocesses run this file as a script
(``python tests/test_engine_faults.py <command> ...``, see ``_helper``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

import foundry_core.api as api
from foundry_core.archive import (
    ANY_VERSION,
    ArchiveError,
    ArchiveNotFound,
    ArchiveSuperseded,
    ArchiveWriter,
    open_archive,
    require_version,
)
from foundry_core.config import config_from_dict
from foundry_core.engine import decide
from foundry_core.errors import FoundryError
from foundry_core.fingerprint import make_fingerprint
from foundry_sglang_plugin import _view as sglang_view
from foundry_sglang_plugin import archive as sglang_records
from foundry_vllm_plugin import archive as vllm_records

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="Foundry's archive layer and these fault stand-ins are Linux-only",
)

HERE = Path(__file__).resolve()
SRC = HERE.parents[1] / "src"

FLAVORS = ("vllm", "sglang")
#: The model facts the graphs are saved for (what a plugin passes as ``fingerprint_model``).
MODEL = {"name": "faults-test", "capture_sizes": [1, 2, 4]}
MACHINE = dict(
    gpu_name="NVIDIA H200",
    compute_capability="9.0",
    sm_count=132,
    driver_version=13000,
    cuda_version="13.0",
    torch_version="2.11.0+cu130",
)
#: vLLM's engine fingerprint, as its manifest records it (any JSON object will do here).
VLLM_FP = {"config_hash": "faults-test", "max_num_seqs": 4}
#: SGLang server arguments; the plugin's own ``fingerprint`` reads them (no SGLang needed).
SGLANG_ARGS = types.SimpleNamespace(model_path="faults-test-model", tp_size=1, dp_size=1)
MEMBERS = 6
SIZE = 4096


def machine_fingerprint(device=0, model=None, rank=0, world_size=1):
    """Stands for ``foundry_core.fingerprint.current_fingerprint`` (which reads the GPU)."""
    return make_fingerprint(**MACHINE, rank=rank, world_size=world_size, model=model if model else {})


def blob(tag: str, i: int, size: int = SIZE) -> bytes:
    seed = hashlib.sha256(f"{tag}:{i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def cfg_for(archive_dir, mode: str = "auto"):
    return config_from_dict({"mode": mode, "archive_dir": str(archive_dir)})


def write_graph_archive(
    path,
    tag: str,
    *,
    lock_timeout: float = 0.0,
    expected_version=ANY_VERSION,
    delay: float = 0.0,
    size: int = SIZE,
    compress=False,
) -> str:
    """What ``fc.save`` writes, as far as the archive layer sees it: members, then the commit."""
    with ArchiveWriter(path, lock_timeout=lock_timeout, expected_version=expected_version) as w:
        for i in range(MEMBERS):
            w.add_bytes(f"memory/{i:05d}.bin", blob(tag, i, size), compress=compress)
            time.sleep(delay)
        meta = {"kind": api.ARCHIVE_KIND, "device": 0, "tag": tag, "files": MEMBERS}
        return w.commit(fingerprint=machine_fingerprint(0, MODEL), meta=meta)


def record_suffix(flavor: str) -> str:
    return ".vllm.json" if flavor == "vllm" else sglang_records.SIDECAR_SUFFIX


def write_record(cfg, flavor: str, tag: str, **extra) -> None:
    """The record that marks a SAVE finished: vLLM's manifest or SGLang's sidecar."""
    if flavor == "vllm":
        vllm_records.write_manifest(vllm_records.manifest_path(cfg, 0), VLLM_FP, {"tag": tag, **extra}, [])
    else:
        fp = sglang_records.fingerprint(SGLANG_ARGS, cfg)
        sglang_records.write_sidecar(cfg, 0, {"fingerprint": fp, "slots": {}, "outputs": {}, "tag": tag})


def record_tag(cfg, flavor: str) -> str | None:
    if flavor == "vllm":
        manifest = vllm_records.read_manifest(vllm_records.manifest_path(cfg, 0))
        return None if manifest is None else manifest["sizing"]["tag"]
    side = sglang_records.read_sidecar(cfg, 0)
    return None if side is None else side["tag"]


def engine_save(cfg, flavor: str, tag: str, *, guard=None, delay=0.0, point=lambda name: None) -> str:
    """One rank's SAVE as the plugin orders it (see the module docstring); ``guard``: the
    ``decide.save_guard`` arguments the plugins pass to ``fc.save``."""
    guard = guard or {}
    if flavor == "sglang":
        sglang_records.drop_sidecar(cfg, 0)  # Session.__init__ of a SAVE, before the model is built
    point("capture")
    if flavor == "vllm":
        require_version(cfg.rank_archive_dir(0), guard.get("expected_version", ANY_VERSION))
        vllm_records.manifest_path(cfg, 0).unlink(missing_ok=True)  # FoundrySession.save, before fc.save
    digest = write_graph_archive(cfg.rank_archive_dir(0), tag, delay=delay, **guard)
    point("caches")  # carried caches (and vLLM's warmups) before the record
    write_record(cfg, flavor, tag)
    return digest


def next_auto_start(cfg, flavor: str) -> tuple[str, str | None]:
    """What the next ``auto`` start of that engine does with what is on disk: ``("save", None)``,
    ``("load", tag of the archive it verified)`` or ``("refused", reason)`` (a record whose archive
    ``fc.verify`` refuses: the start falls back to a SAVE, or stops in ``load`` mode)."""
    if flavor == "vllm":
        mode = vllm_records.resolve_mode(cfg, 0, VLLM_FP)[0]
    else:
        mode = sglang_records.decide_mode(SGLANG_ARGS, cfg)
    if mode == "save":
        return "save", None
    verified, reason = decide.verify_archive(cfg, 0, device=0, fingerprint=MODEL, world_size=1)
    if reason is not None:
        return "refused", reason
    tag = record_tag(cfg, flavor)
    assert verified.meta["tag"] == tag, (
        f"record of SAVE {tag!r} beside the archive of SAVE {verified.meta['tag']!r}"
    )
    return "load", tag


def archive_tag(path) -> str | None:
    try:
        return open_archive(path).meta["tag"]
    except ArchiveNotFound:
        return None


def archive_entries(path: Path) -> set[str]:
    """The archive's own names in its parent: the path, its lock, versions and scratch leftovers."""
    return {e for e in os.listdir(path.parent) if e == path.name or e.startswith(f".{path.name}.")}


def one_line(text: str) -> bool:
    return "\n" not in text and text == text.strip()


@pytest.fixture(autouse=True)
def plain_server_args(monkeypatch):
    """SGLANG_ARGS is a plain namespace, read with getattr: SGLang's resolver (which imports SGLang
    where it is installed, seconds per subprocess) is not asked, here or in the helpers."""
    monkeypatch.setattr(sglang_view, "_resolution_result", lambda: None)


@pytest.fixture
def cpu_machine(monkeypatch):
    monkeypatch.setattr(api, "current_fingerprint", machine_fingerprint)


def helper(*args, preexec_fn=None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, str(HERE), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=preexec_fn,
    )


def helper_json(*args, preexec_fn=None) -> dict:
    proc = helper(*args, preexec_fn=preexec_fn)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


# --- SIGKILL during a SAVE ---------------------------------------------------------------------------

KILL_POINTS = ["capture", "member", "manifest", "rename", "swap", "swapped", "record-temp", "record-done"]
# After a kill at each point, when an older SAVE ("old") had finished: the next auto start of each
# engine, and the archive then at the archive path. Without an older SAVE "old" reads as nothing.
AFTER_KILL = {
    "capture": ({"vllm": ("load", "old"), "sglang": ("save", None)}, "old"),  # SGLang dropped its sidecar
    "member": ({"vllm": ("save", None), "sglang": ("save", None)}, "old"),  # persisting
    "manifest": ({"vllm": ("save", None), "sglang": ("save", None)}, "old"),
    "rename": ({"vllm": ("save", None), "sglang": ("save", None)}, "old"),  # publishing the core archive
    "swap": ({"vllm": ("save", None), "sglang": ("save", None)}, "old"),
    "swapped": ({"vllm": ("save", None), "sglang": ("save", None)}, "new"),  # published, no record yet
    "record-temp": ({"vllm": ("save", None), "sglang": ("save", None)}, "new"),  # publishing the record
    "record-done": ({"vllm": ("load", "new"), "sglang": ("load", "new")}, "new"),
}


def kill_at(archive_dir: Path, flavor: str, tag: str, point: str) -> None:
    """Run an engine SAVE in a subprocess, stop it at ``point`` and SIGKILL it there."""
    proc = helper("save", archive_dir, flavor, tag, point)
    try:
        line = proc.stdout.readline()
        assert line.split()[:1] == ["paused"], f"the SAVE never reached {point!r}: {line!r}"
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]


@pytest.mark.parametrize("previous", [True, False], ids=["replacing", "first"])
@pytest.mark.parametrize("point", KILL_POINTS)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_save_killed_at_any_step_leaves_no_loadable_partial_archive(
    tmp_path, cpu_machine, flavor, point, previous
):
    cfg = cfg_for(tmp_path / "archive")
    path = cfg.rank_archive_dir(0)
    if previous:
        engine_save(cfg, flavor, "old")
    kill_at(cfg.archive_dir, flavor, "new", point)

    starts, on_disk = AFTER_KILL[point]
    want_start = starts[flavor]
    if not previous:
        on_disk = None if on_disk == "old" else on_disk
        want_start = ("save", None) if want_start == ("load", "old") else want_start
    # Never a record beside an archive it does not belong to, nor one whose archive is refused.
    assert next_auto_start(cfg, flavor) == want_start
    assert archive_tag(path) == on_disk  # the previous archive or the new one, complete, or none
    if point == "record-temp":  # a half-written record is a temporary sibling, never the record
        assert [p.name for p in cfg.archive_dir.glob(f"rank0{record_suffix(flavor)}.*.tmp")]

    # The SAVE that follows (auto decided SAVE, or mode = save) goes through and cleans up after the
    # killed one.
    digest = engine_save(cfg, flavor, "final")
    assert next_auto_start(cfg, flavor) == ("load", "final")
    assert archive_entries(path) == {"rank0", ".rank0.lock", f".rank0.{digest[:16]}"}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_later_save_removes_the_temporary_of_a_killed_record_write(tmp_path, cpu_machine, flavor):
    cfg = cfg_for(tmp_path / "archive")
    engine_save(cfg, flavor, "old")
    kill_at(cfg.archive_dir, flavor, "new", "record-temp")
    assert list(cfg.archive_dir.glob("*.tmp"))  # what the killed SAVE left
    engine_save(cfg, flavor, "final")
    assert next_auto_start(cfg, flavor) == ("load", "final")
    assert sorted(p.name for p in cfg.archive_dir.glob("*.tmp")) == []


# What a killed or interrupted SAVE (or a copy of one) can leave at the archive path, beside a record
# that says the SAVE finished; and the reason fc.verify gives for it.
LEFTOVERS = {
    "nothing": "no Foundry archive at",
    "scratch only": "no Foundry archive at",
    "dangling link": "is a dangling symlink to '.rank0.0123456789abcdef'",
    "no manifest": "manifest.json is missing",
    "truncated member": "file 'memory/00001.bin' is 4089 bytes, the manifest lists 4096",
}


def _leave(path: Path, state: str) -> None:
    if state == "scratch only":  # killed while writing: only the scratch directory exists
        (path.parent / ".rank0.tmp-4242-0123abcd" / "memory").mkdir(parents=True)
        (path.parent / ".rank0.tmp-4242-0123abcd" / "memory" / "00000.bin").write_bytes(blob("x", 0))
    elif state == "dangling link":  # the version it pointed to was removed
        path.symlink_to(".rank0.0123456789abcdef")
    elif state == "no manifest":  # members copied, manifest not (or a plain directory filled by hand)
        (path / "memory").mkdir(parents=True)
        (path / "memory" / "00000.bin").write_bytes(blob("x", 0))
    elif state == "truncated member":
        write_graph_archive(path, "old")
        member = Path(os.path.realpath(path)) / "memory" / "00001.bin"
        member.write_bytes(member.read_bytes()[:-7])


@pytest.mark.parametrize("state", list(LEFTOVERS))
@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_record_beside_a_missing_or_partial_archive_never_loads(tmp_path, monkeypatch, flavor, state):
    def no_gpu(*args, **kwargs):
        raise AssertionError("the archive was refused only after the machine was queried")

    monkeypatch.setattr(api, "current_fingerprint", no_gpu)
    cfg = cfg_for(tmp_path / "archive")
    write_record(cfg, flavor, "old")
    path = cfg.rank_archive_dir(0)
    _leave(path, state)

    # The plugin's own check first: vLLM looks for the core archive's directory, SGLang trusts the
    # sidecar and leaves the archive to fc.verify.
    if flavor == "vllm":
        mode, _, why = vllm_records.resolve_mode(cfg, 0, VLLM_FP)
        no_directory = state in ("nothing", "scratch only", "dangling link")
        assert mode == ("save" if no_directory else "load")
        if no_directory:
            assert why.endswith(f"has no core archive at {path}")
            with pytest.raises(vllm_records.ArchiveStateError, match="has no core archive") as err:
                vllm_records.resolve_mode(cfg_for(cfg.archive_dir, "load"), 0, VLLM_FP)
            assert one_line(str(err.value))
    else:
        assert sglang_records.decide_mode(SGLANG_ARGS, cfg) == "load"

    # fc.verify, before any memory exists: refused, naming why, without asking the GPU.
    verified, reason = decide.verify_archive(cfg, 0, device=0, fingerprint=MODEL, world_size=1)
    assert verified is None and LEFTOVERS[state] in reason and one_line(reason)
    # auto (one rank): a warning and a fresh SAVE; load: one line, the start stops.
    line = decide.after_refusal(cfg, 0, 1, reason, log=logging.getLogger("faults.test"))
    assert line.endswith(f"({reason}); capturing and saving a fresh one")
    with pytest.raises(decide.ArchiveRefused, match="mode = load cannot go on") as err:
        decide.after_refusal(cfg_for(cfg.archive_dir, "load"), 0, 1, reason)
    assert one_line(str(err.value)) and reason in str(err.value)


def test_an_archive_saved_on_another_device_ordinal_is_refused_before_any_memory(tmp_path, cpu_machine):
    """A second replica on the same machine but another GPU (SGLang's --base-gpu-id 1, a vLLM worker
    on cuda:1) passes the fingerprint (same GPU model); the device check refuses it in fc.verify, so
    an auto start SAVEs as a fresh start does instead of sizing its memory for a LOAD that would fail."""
    cfg = cfg_for(tmp_path / "archive")
    write_graph_archive(cfg.rank_archive_dir(0), "on-cuda0")
    verified, reason = decide.verify_archive(cfg, 0, device=0, fingerprint=MODEL, world_size=1)
    assert reason is None and verified.meta["device"] == 0
    verified, reason = decide.verify_archive(cfg, 0, device=1, fingerprint=MODEL, world_size=1)
    assert verified is None and one_line(reason)
    assert "was saved on cuda:0, this process restores on cuda:1" in reason
    assert "CUDA_VISIBLE_DEVICES" in reason  # says what to do
    line = decide.after_refusal(cfg, 0, 1, reason, log=logging.getLogger("faults.test"))
    assert line.endswith("; capturing and saving a fresh one")
    with pytest.raises(decide.ArchiveRefused, match="mode = load cannot go on"):
        decide.after_refusal(cfg_for(cfg.archive_dir, "load"), 0, 1, reason)


# --- the disk fills up during a SAVE -------------------------------------------------------------


def _enospc_on(monkeypatch, wanted) -> list[str]:
    """``os.write`` fails with ENOSPC for the files whose path ``wanted(path)`` accepts."""
    real_write = os.write
    hits: list[str] = []

    def write(fd, data):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if wanted(path):
            hits.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    return hits


FULL_AT = {
    "member": (lambda p: p.endswith("memory/00003.bin"), False),
    "compressed member": (lambda p: p.endswith("memory/00003.bin"), True),
    "manifest": (lambda p: p.endswith("/manifest.json"), False),
}


@pytest.mark.parametrize("previous", [True, False], ids=["replacing", "first"])
@pytest.mark.parametrize("where", list(FULL_AT))
def test_a_full_disk_fails_the_save_in_one_line_and_leaves_nothing_partial(
    tmp_path, monkeypatch, log_records, where, previous
):
    cfg = cfg_for(tmp_path / "archive")
    path = cfg.rank_archive_dir(0)
    if previous:
        old = write_graph_archive(path, "old")
    before = archive_entries(path) if previous else {".rank0.lock"}
    wanted, compress = FULL_AT[where]
    hits = _enospc_on(monkeypatch, wanted)
    with pytest.raises(ArchiveError) as err:
        write_graph_archive(path, "new", compress=compress)
    monkeypatch.undo()
    assert hits, "the full disk was never hit"
    message = str(err.value)
    assert one_line(message) and message.endswith(": No space left on device")
    assert str(path.parent) in message
    # Nothing partial: the previous archive as it was (or still none), no scratch directory.
    assert archive_entries(path) == before
    if previous:
        assert open_archive(path).digest == old
    else:
        with pytest.raises(ArchiveNotFound):
            open_archive(path)

    # The plugins' policy for that error: auto serves on with one warning line; save stops.
    records = log_records("faults.test", logging.WARNING)
    decide.save_failed(cfg, 0, err.value, logging.getLogger("faults.test"))
    (warning,) = [r.getMessage() for r in records]
    assert one_line(warning) and f"SAVE failed ({message})" in warning
    with pytest.raises(ArchiveError) as again:
        decide.save_failed(cfg_for(cfg.archive_dir, "save"), 0, err.value)
    assert again.value is err.value


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_full_disk_while_writing_the_record_keeps_the_previous_record(
    tmp_path, monkeypatch, full_disk_at_flush, flavor
):
    cfg = cfg_for(tmp_path / "archive")
    write_record(cfg, flavor, "old")
    full_disk_at_flush()
    with pytest.raises(OSError) as err:
        write_record(cfg, flavor, "new")
    monkeypatch.undo()
    assert err.value.errno == errno.ENOSPC
    assert record_tag(cfg, flavor) == "old"
    assert sorted(p.name for p in cfg.archive_dir.iterdir()) == [f"rank0{record_suffix(flavor)}"]


ENGINE = {"name": "testengine", "testengine": "1.0"}


def _fill_caches(dirs) -> None:
    kernel = dirs.path("triton") / "ab12" / "kernel.cubin"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"\x7fELF" + bytes(range(256)) * 40)
    (dirs.path("triton") / "ab12" / "kernel.json").write_text('{"name": "k"}')


def test_a_full_disk_while_packing_the_carried_caches_leaves_no_caches_archive(
    tmp_path, caches_machine, monkeypatch, log_records
):
    from foundry_core.engine import CacheHandover

    records = log_records("faults.test", logging.WARNING)
    cfg = cfg_for(tmp_path / "archive")
    saver = CacheHandover(cfg, 0, ["triton"], ENGINE, log=logging.getLogger("faults.test"))
    saver.begin()
    _fill_caches(saver.dirs)
    hits = _enospc_on(monkeypatch, lambda p: "/caches/triton/" in p)
    assert saver.save(device=0) is None  # the graphs are saved; the caches are not
    monkeypatch.undo()
    assert hits
    assert saver.report["error"].endswith("No space left on device") and one_line(saver.report["error"])
    (warning,) = [r.getMessage() for r in records]
    assert "compile caches not saved" in warning and "No space left on device" in warning
    caches_path = cfg.rank_caches_dir(0)
    assert archive_entries(caches_path) == {f".{caches_path.name}.lock"}
    with pytest.raises(ArchiveNotFound):
        open_archive(caches_path)


def test_a_file_size_limit_fails_the_save_and_the_record_cleanly(tmp_path):
    """The kernel refuses the writes (RLIMIT_FSIZE, as a full disk would): not a stand-in os.write."""
    pytest.importorskip("resource")
    cfg = cfg_for(tmp_path / "archive")
    path = cfg.rank_archive_dir(0)
    old = engine_save(cfg, "vllm", "old")
    before = sorted(os.listdir(cfg.archive_dir))
    got = helper_json("fsize", cfg.archive_dir, 64 << 10)
    assert one_line(got["archive_error"]) and got["archive_error"].endswith(": File too large")
    assert got["record_errno"] == errno.EFBIG
    assert sorted(os.listdir(cfg.archive_dir)) == before  # no scratch directory, no temporary record
    assert open_archive(path).digest == old and record_tag(cfg, "vllm") == "old"


# --- the archive directory is read-only, or missing and not creatable -------------------------------


def _honour_permissions() -> None:
    """``preexec_fn`` for a root child: drop CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER from
    the bounding set, so that after exec the child is refused what the file modes refuse."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` with its mode, size and time (a lock file's time aside: a SAVE
    may take the lock before it finds it cannot write)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            when = None if name.endswith(".lock") else st.st_mtime_ns
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, when)
    return out


def test_a_read_only_archive_dir_still_loads_and_refuses_every_write_in_one_line(tmp_path):
    ro = tmp_path / "ro"
    cfg = cfg_for(ro / "archive")
    for flavor in FLAVORS:
        engine_save(cfg, flavor, "old")  # both records beside one archive
    before = _tree(ro)
    ro.chmod(0o555)
    cfg.archive_dir.chmod(0o555)
    try:
        try:
            got = helper_json(
                "readonly",
                cfg.archive_dir,
                ro / "missing",
                preexec_fn=_honour_permissions if os.geteuid() == 0 else None,
            )
        except subprocess.SubprocessError as e:
            pytest.skip(f"cannot start a process that honours file permissions here: {e}")
    finally:
        cfg.archive_dir.chmod(0o755)
        ro.chmod(0o755)
    if not got["read_only"]:
        pytest.skip("this file system lets the test process write into a 0555 directory")

    for key, where in (("problem", cfg.archive_dir), ("problem_missing", ro / "missing")):
        assert got[key].startswith(f"archive_dir {where} is not writable (") and one_line(got[key])
    # A finished archive in a read-only directory is still loaded ...
    assert got["next"] == {"vllm": ["load", "old"], "sglang": ["load", "old"]}
    # ... and every write a SAVE would make is refused in one line.
    assert one_line(got["archive_error"]) and got["archive_error"].endswith("Permission denied")
    assert got["record_errno"] == errno.EACCES
    assert "SAVE failed" in got["auto_warning"] and one_line(got["auto_warning"])
    assert got["save_mode"] == "raised"
    assert _tree(ro) == before  # nothing written, nothing removed


# --- two replicas start at the same moment on one empty archive directory ---------------------------


@pytest.mark.parametrize("flavor", FLAVORS)
def test_two_replicas_saving_at_the_same_moment_publish_exactly_one_archive(tmp_path, cpu_machine, flavor):
    cfg = cfg_for(tmp_path / "archive")
    go = tmp_path / "go"
    procs = {tag: helper("replica", cfg.archive_dir, flavor, tag, go) for tag in ("a", "b")}
    try:
        for proc in procs.values():  # both decided SAVE on the empty directory before either saved
            assert proc.stdout.readline().split() == ["decided", "save"]
        go.touch()
        outs = {tag: proc.communicate(timeout=60) for tag, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for tag, proc in procs.items():
        assert proc.returncode == 0, outs[tag][1][-3000:]  # both serve
    events = {tag: outs[tag][0].split(maxsplit=1) for tag in procs}
    published = [tag for tag, (event, _) in events.items() if event == "published"]
    kept = [tag for tag, (event, _) in events.items() if event == "kept"]
    # The second waited for the first one's lock, found its archive and kept it, with no warning.
    assert len(published) == 1 and len(kept) == 1, events
    (winner,), (loser,) = published, kept
    assert json.loads(events[loser][1]) == []
    digest = events[winner][1].strip()
    # One archive, the winner's, whole; its record beside it; nothing left of the refused SAVE.
    assert open_archive(cfg.rank_archive_dir(0)).digest == digest
    assert next_auto_start(cfg, flavor) == ("load", winner)
    assert archive_entries(cfg.rank_archive_dir(0)) == {"rank0", ".rank0.lock", f".rank0.{digest[:16]}"}


# --- the archive is replaced while a process holds the old one --------------------------------------


def test_a_held_archive_is_unaffected_by_a_newer_save_and_the_next_start_loads_the_new_one(
    tmp_path, cpu_machine
):
    cfg = cfg_for(tmp_path / "archive")
    path = cfg.rank_archive_dir(0)
    first = engine_save(cfg, "vllm", "v1")
    held, reason = decide.verify_archive(cfg, 0, device=0, fingerprint=MODEL, world_size=1)
    assert reason is None and held.digest == first
    held_version = path.parent / os.readlink(path)

    second = engine_save(cfg, "vllm", "v2")  # another replica, or a later mode = save start
    assert second != first and not held_version.exists()  # the files the holder read are gone
    # The holder goes on with what it verified: the same bytes, and fc.load(archive=held) accepts it.
    assert held.digest == first and held.meta["tag"] == "v1"
    assert all(held.read_bytes(f"memory/{i:05d}.bin") == blob("v1", i) for i in range(MEMBERS))
    api._check_verified(held, path, machine_fingerprint(0, MODEL), None)
    api._check_verified(held, path, machine_fingerprint(0, MODEL), first)  # pinned to what it holds
    # The next start loads the new one.
    assert next_auto_start(cfg, "vllm") == ("load", "v2")
    fresh, _ = decide.verify_archive(cfg, 0, device=0, fingerprint=MODEL, world_size=1)
    assert fresh.digest == second and fresh.read_bytes("memory/00000.bin") == blob("v2", 0)


# --- damaged or foreign carried caches --------------------------------------------------------------


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
    _fill_caches(saved)
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


# --- subprocess side ----------------------------------------------------------------------------------


def _hold() -> None:
    print("paused", flush=True)
    time.sleep(60)
    os._exit(9)  # not reached: the test kills this process while it waits


def _pause_at(point: str, archive_path: str, suffix: str) -> None:
    """Stop (and wait to be killed) at ``point`` of an engine SAVE: before a member's file is
    created, before the manifest is, before the scratch directory is renamed to its version name,
    before or after the symlink swap, before or after the record's rename."""
    real_open, real_rename, real_replace = os.open, os.rename, os.replace

    def open_(path, flags, *args, **kwargs):
        p = os.fsdecode(os.fspath(path))
        if (point == "member" and p.endswith("memory/00002.bin")) or (
            point == "manifest" and p.endswith("/manifest.json") and flags & os.O_CREAT
        ):
            _hold()
        return real_open(path, flags, *args, **kwargs)

    def rename(src, dst, *args, **kwargs):
        if point == "rename" and ".tmp-" in os.fsdecode(os.fspath(src)):
            _hold()
        return real_rename(src, dst, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        d = os.fsdecode(os.fspath(dst))
        if (point == "swap" and d == archive_path) or (point == "record-temp" and d.endswith(suffix)):
            _hold()
        result = real_replace(src, dst, *args, **kwargs)
        if (point == "swapped" and d == archive_path) or (point == "record-done" and d.endswith(suffix)):
            _hold()
        return result

    os.open, os.rename, os.replace = open_, rename, replace


def _warnings_of(name: str) -> list[str]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger(name).addHandler(handler)
    return records


def _helper(argv: list[str]) -> int:
    command, archive_dir, *rest = argv
    cfg = cfg_for(archive_dir)
    api.current_fingerprint = machine_fingerprint
    sglang_view._resolution_result = lambda: None  # as plain_server_args does in the test process
    if command == "save":  # save DIR FLAVOR TAG POINT
        flavor, tag, point = rest
        _pause_at(point, str(cfg.rank_archive_dir(0)), record_suffix(flavor))
        digest = engine_save(cfg, flavor, tag, point=lambda name: _hold() if name == point else None)
        print("done", digest, flush=True)
    elif command == "replica":  # replica DIR FLAVOR TAG GO_FILE
        flavor, tag, go = rest
        if flavor == "vllm":
            decision = vllm_records.resolve_mode(cfg, 0, VLLM_FP)[0]
        else:
            decision = sglang_records.decide_mode(SGLANG_ARGS, cfg)
        # What the plugins pass to fc.save: the graph archive seen at the decision, and the wait
        guard = decide.save_guard(cfg, decide.archive_stamp(cfg.rank_archive_dir(0)))
        print("decided", decision, flush=True)
        while not os.path.exists(go):
            time.sleep(0.002)
        warnings = _warnings_of("faults.replica")
        try:
            digest = engine_save(cfg, flavor, tag, guard=guard, delay=0.1)
        except ArchiveSuperseded:  # the plugins keep the other replica's archive, with no warning
            print("kept", json.dumps([w.getMessage() for w in warnings]), flush=True)
            return 0
        except (FoundryError, OSError) as e:  # the plugins' except clause around fc.save
            decide.save_failed(cfg, 0, e, logging.getLogger("faults.replica"))
            print("served", json.dumps(warnings[0].getMessage()), flush=True)
            return 0
        print("published", digest, flush=True)
    elif command == "fsize":  # fsize DIR LIMIT
        import resource

        limit = int(rest[0])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        out = {}
        try:
            write_graph_archive(cfg.rank_archive_dir(0), "new", size=2 * limit)
        except ArchiveError as e:
            out["archive_error"] = str(e)
        try:
            write_record(cfg, "vllm", "new", pad="x" * 2 * limit)
        except OSError as e:
            out["record_errno"] = e.errno
        print(json.dumps(out), flush=True)
    elif command == "readonly":  # readonly DIR MISSING_DIR
        try:
            fd, probe = tempfile.mkstemp(dir=archive_dir)
        except OSError:
            pass
        else:
            os.close(fd)
            os.unlink(probe)
            print(json.dumps({"read_only": False}))
            return 0
        out: dict = {"read_only": True}
        out["problem"] = decide.archive_dir_problem(cfg)
        out["problem_missing"] = decide.archive_dir_problem(cfg_for(rest[0]))
        out["next"] = {flavor: list(next_auto_start(cfg, flavor)) for flavor in FLAVORS}
        error = None
        try:
            write_graph_archive(cfg.rank_archive_dir(0), "new")
        except ArchiveError as e:
            out["archive_error"], error = str(e), e
        try:
            write_record(cfg, "vllm", "new")
        except OSError as e:
            out["record_errno"] = e.errno
        if error is None:
            print(json.dumps(out), flush=True)
            return 0
        warnings = _warnings_of("faults.readonly")
        decide.save_failed(cfg, 0, error, logging.getLogger("faults.readonly"))
        out["auto_warning"] = warnings[0].getMessage() if warnings else None
        try:
            decide.save_failed(cfg_for(archive_dir, "save"), 0, error)
        except ArchiveError:
            out["save_mode"] = "raised"
        print(json.dumps(out), flush=True)
    else:
        raise SystemExit(f"unknown command {command!r}")
    return 0


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == HERE.parent:  # tests/ would shadow engine packages
        sys.path.pop(0)
    sys.exit(_helper(sys.argv[1:]))
