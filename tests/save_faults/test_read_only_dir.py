"""Issue 19, without a GPU: the archive directory is read-only, or missing and not creatable: a LOAD
still works, every write is refused in one line (model: save_model.py)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from save_model import (
    FLAVORS,
    LINUX_ONLY,
    cfg_for,
    engine_save,
    helper_json,
    one_line,
)

pytestmark = LINUX_ONLY


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
