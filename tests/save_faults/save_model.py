"""Issue 19 fault cases that the engine layer can be checked for without a GPU.

A SAVE killed at each of its steps, a full disk, a read-only archive directory, two replicas saving
at once, an archive replaced under a process that holds it, damaged or foreign carried caches.

The plugins' SAVE is modelled by the calls they make, in their order (SGLang: drop the sidecar when
the scheduler starts, capture, ``fc.save``, write the sidecar; vLLM: capture, drop the manifest,
``fc.save``, write the manifest), with the plugins' own record functions, the real archive writer
and the engine layer's decision functions. Only what needs a GPU is stood in for: the capture, the
graphs' content (blobs) and the machine fingerprint. Subprocesses run this file as a script
(``python tests/save_faults/save_model.py <command> ...``, see ``_helper``). The tests are the
``test_*.py`` modules beside this one, one fault each; conftest.py holds their fixtures.
"""

from __future__ import annotations

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

LINUX_ONLY = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="Foundry's archive layer and these fault stand-ins are Linux-only",
)

HERE = Path(__file__).resolve()
SRC = HERE.parents[2] / "src"

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


ENGINE = {"name": "testengine", "testengine": "1.0"}


def fill_caches(dirs) -> None:
    kernel = dirs.path("triton") / "ab12" / "kernel.cubin"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"\x7fELF" + bytes(range(256)) * 40)
    (dirs.path("triton") / "ab12" / "kernel.json").write_text('{"name": "k"}')


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
    if sys.path and Path(sys.path[0]).resolve() == HERE.parent:  # nothing the helper imports
        sys.path.pop(0)
    sys.exit(_helper(sys.argv[1:]))
