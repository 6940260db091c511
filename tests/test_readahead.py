"""Read-ahead lists: recorded at SAVE, replayed at LOAD, bad entries skipped one by one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foundry_core.engine import readahead


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(readahead.STARTED_ENV, raising=False)
    monkeypatch.delenv(readahead.ENV, raising=False)
    readahead.reset()
    yield
    readahead.reset()


def _archive_with_model(tmp_path):
    archive = tmp_path / "archive"
    caches = archive / "rank0.caches"
    caches.mkdir(parents=True)
    (caches / "manifest.json").write_text("{}")
    (caches / "blob.bin").write_bytes(os.urandom(3000))
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(os.urandom(5000))
    (model / "notes.md").write_text("not read ahead")
    return archive, caches, model


def _record_in_fresh_process(archive, caches, model):
    """``record`` as a SAVE process makes it: in a fresh interpreter. This test process has imported
    modules from other tests' temporary folders, which a LOAD rightly counts as untrusted."""
    src = Path(readahead.__file__).resolve().parents[2]
    code = (
        "import sys; from pathlib import Path; from foundry_core.engine import readahead; "
        "readahead.record(Path(sys.argv[1]), 'rank0', caches_dir=Path(sys.argv[2]), "
        "model='tiny-model', model_dir=Path(sys.argv[3]))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code, str(archive), str(caches), str(model)], env=env, check=True)


def test_record_lists_modules_libraries_caches_and_model(tmp_path):
    archive, caches, model = _archive_with_model(tmp_path)
    path = readahead.record(archive, "rank0", caches_dir=caches, model="tiny-model", model_dir=model)
    data = json.loads(path.read_text())
    assert path.name == "readahead-rank0.json" and data["format"] == readahead.FORMAT
    by_path = {e["path"]: e for e in data["files"]}
    # The import read json's bytecode, not its source.
    json_pyc = [p for p in by_path if "/json/__pycache__/__init__" in p]
    assert json_pyc and by_path[json_pyc[0]]["kind"] == "module"
    assert by_path[str((caches / "blob.bin").resolve())]["kind"] == "caches"
    weights = by_path[str((model / "model.safetensors").resolve())]
    assert weights["kind"] == "model" and weights["size"] == 5000
    assert str((model / "notes.md").resolve()) not in by_path
    kinds = [e["kind"] for e in data["files"]]
    assert kinds.index("model") > kinds.index("caches") > kinds.index("module")
    assert data["model"] == {"name": "tiny-model", "dir": str(model.resolve())}


def test_plan_skips_changed_missing_and_untrusted_files(tmp_path):
    archive, caches, model = _archive_with_model(tmp_path)
    _record_in_fresh_process(archive, caches, model)
    list_path = archive / "readahead-rank0.json"
    data = json.loads(list_path.read_text())
    before = readahead.plan(archive, model_names=["tiny-model"])
    assert before.skipped == {"missing": 0, "changed": 0, "untrusted": 0}
    outside = tmp_path / "elsewhere" / "secret.bin"
    outside.parent.mkdir()
    outside.write_bytes(b"x" * 100)
    st = outside.stat()
    link = archive / "link.bin"  # inside the archive, pointing outside: refused by its real path
    link.symlink_to(outside)
    beside = Path(f"{archive.resolve()}-other") / "x.bin"  # its name begins with the archive's: not in it
    beside.parent.mkdir()
    beside.write_bytes(b"y" * 10)
    data["files"] += [
        {"path": str(beside), "kind": "module", "size": 10, "mtime_ns": beside.stat().st_mtime_ns},
        {"path": str(outside), "kind": "module", "size": 100, "mtime_ns": st.st_mtime_ns},
        {"path": str(link), "kind": "module", "size": 100, "mtime_ns": st.st_mtime_ns},
        {"path": "relative/file.py", "kind": "module", "size": 1, "mtime_ns": 1},
        {"path": 42},
    ]
    list_path.write_text(json.dumps(data))
    (caches / "blob.bin").write_bytes(os.urandom(3001))  # changed after the SAVE
    (caches / "manifest.json").unlink()  # gone

    p = readahead.plan(archive, model_names=["--model-path", "tiny-model"])
    planned = {f[0] for f in p.files}
    assert str((model / "model.safetensors").resolve()) in planned
    assert str((caches / "blob.bin").resolve()) not in planned
    assert str(outside) not in planned
    # The link and its target are one real file, refused once; the entry with no size counts as changed.
    assert p.skipped == {"missing": 1, "changed": 2, "untrusted": 3}
    assert [f[0] for f in p.files][-1] == str((model / "model.safetensors").resolve())  # weights last


def test_model_directory_is_trusted_only_when_this_start_names_that_model(tmp_path):
    archive, caches, model = _archive_with_model(tmp_path)
    _record_in_fresh_process(archive, caches, model)
    other = readahead.plan(archive, model_names=["other-model"])
    assert not any(f[0].startswith(str(model.resolve())) for f in other.files)
    assert other.skipped["untrusted"] == 2  # config.json and the weights
    by_dir = readahead.plan(archive, model_names=[str(model)])
    assert any(f[0].endswith("model.safetensors") for f in by_dir.files)


def test_a_damaged_list_is_skipped_and_the_others_used(tmp_path):
    archive, caches, model = _archive_with_model(tmp_path)
    readahead.record(archive, "rank0", caches_dir=caches)
    (archive / "readahead-launcher.json").write_text("{not json")
    (archive / "readahead-huge.json").write_text(json.dumps({"format": 99, "files": []}))
    p = readahead.plan(archive)
    assert p.lists == 1 and sorted(p.bad_lists) == ["readahead-huge.json", "readahead-launcher.json"]
    assert p.files


@pytest.mark.parametrize("how", ["advise", "read"])
def test_replay_reads_every_planned_file_and_skips_one_changed_meanwhile(tmp_path, how):
    archive, caches, model = _archive_with_model(tmp_path)
    readahead.record(archive, "rank0", caches_dir=caches, model="tiny-model", model_dir=model)
    p = readahead.plan(archive, model_names=["tiny-model"])
    (model / "config.json").write_text('{"hidden_size": 16}')  # changed between plan and read
    replay = readahead.Replay(p.files, threads=3, how=how).start()
    assert replay.join(timeout=60)
    s = replay.summary()
    assert s["files"] == len(p.files) and s["read_files"] == len(p.files) - 1
    assert s["done_s"] is not None and s["how"] == how


def test_run_for_launch_reads_ahead_once_per_launch(tmp_path, monkeypatch):
    archive, caches, model = _archive_with_model(tmp_path)
    readahead.record(archive, "rank0", caches_dir=caches, model="tiny-model", model_dir=model)
    config = tmp_path / "foundry.toml"
    config.write_text(f'mode = "load"\narchive_dir = "{archive}"\n')
    argv = [
        "sglang",
        "serve",
        "--model-path",
        "tiny-model",
        "--enable-foundry",
        "--foundry-config",
        str(config),
    ]
    assert readahead.run_for_launch(argv) is True
    replay = readahead._state["replay"]
    assert replay.join(timeout=60)
    s = readahead.summary()
    assert s["read_files"] == s["files"] > 0 and s["lists"] == 1
    assert os.environ[readahead.STARTED_ENV] == str(os.getpid())
    # A process this one starts inherits the mark and reads nothing again.
    readahead._state.clear()
    assert readahead.run_for_launch(argv) is False


@pytest.mark.parametrize("mode", ["save", None])
def test_no_read_ahead_for_a_save_or_without_a_configuration(tmp_path, mode):
    config = tmp_path / "foundry.toml"
    config.write_text(f'mode = "{mode or "load"}"\narchive_dir = "{tmp_path}"\n')
    argv = ["x", "--foundry-config", str(config)] if mode else ["x"]
    assert readahead.run_for_launch(argv, environ={}) is False
    assert "replay" not in readahead._state


def test_disabled_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(readahead.ENV, "0")
    assert readahead.record(tmp_path, "rank0") is None
    assert readahead.start(tmp_path) is None
    assert sys.modules["foundry_core.engine.readahead"] is readahead


def test_the_helper_stops_reading_once_the_launcher_is_gone(tmp_path, monkeypatch, capsys):
    """child_main (the helper process's body, run here in-process): it plans, says so, reads, and
    stops taking files once its parent is not the launcher that started it any more."""
    archive = tmp_path / "archive"
    archive.mkdir()
    entries = []
    for i in range(200):
        f = archive / f"f{i}.bin"
        f.write_bytes(b"x" * 100)
        st = f.stat()
        entries.append({"path": str(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "kind": "caches"})
    (archive / "readahead-rank0.json").write_text(json.dumps({"format": readahead.FORMAT, "files": entries}))
    parents = iter([4242])  # the launcher at the start, then gone (re-parented)
    monkeypatch.setattr(readahead.os, "getppid", lambda: next(parents, 1))

    def slow(path, size, mtime, buf=None):  # 200 files x 50 ms: 10 s if nothing stops it
        time.sleep(0.05)
        return size

    monkeypatch.setattr(readahead, "_advise_one", slow)
    readahead.child_main(
        {
            "archive_dir": str(archive),
            "names": [],
            "roots": [],
            "environment": [],
            "threads": 1,
            "how": "advise",
        }
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["plan"]["files"] == 200 and lines[0]["plan"]["lists"] == 1
    result = lines[1]["replay"]
    assert result["files"] == 200 and 0 < result["read_files"] < 200


def test_a_plans_real_paths_are_realpaths(tmp_path):
    """The plan works each folder's real path out once: the same answers as os.path.realpath for
    linked folders, a linked file, a link to a link, '..' and '.' in a path, a missing file and a
    relative path."""
    real_dir = tmp_path / "real"
    (real_dir / "sub").mkdir(parents=True)
    (real_dir / "sub" / "f.py").write_text("x")
    (real_dir / "g.py").write_text("y")
    (tmp_path / "via").symlink_to(real_dir)
    (real_dir / "link.py").symlink_to(real_dir / "sub" / "f.py")
    (real_dir / "link2.py").symlink_to(real_dir / "link.py")
    paths = [
        f"{tmp_path}/via/sub/f.py",
        f"{tmp_path}/via/g.py",
        f"{tmp_path}/via/link.py",
        f"{tmp_path}/via/link2.py",
        f"{tmp_path}/via/sub/../g.py",
        f"{tmp_path}/via/sub/./f.py",
        f"{tmp_path}/via/sub/..",
        f"{tmp_path}/via/missing.py",
        "relative/f.py",
    ]
    folders: dict[str, str] = {}
    for path in paths * 2:  # the second time from the folders already worked out
        assert readahead._real(path, folders) == os.path.realpath(path), path
