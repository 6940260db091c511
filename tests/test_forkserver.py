"""Workers forked from Foundry's fork server get what a spawned worker gets from its launcher.

Each scenario runs in a fresh interpreter (the fork server is one per process): that interpreter is
the launcher; it starts the server, changes its own state the way an engine's launcher does before
it starts its workers, and starts a worker through ``multiprocessing``'s ``forkserver`` method with
:class:`foundry_core.forkserver.WithLaunchState` around the target.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from foundry_core import forkserver, forkserver_preload
from foundry_core.engine import start_method

SRC = str(Path(__file__).resolve().parents[1] / "src")

LAUNCHER = textwrap.dedent(
    """
    import json, multiprocessing as mp, os, resource, signal, sys, threading
    from foundry_core import forkserver

    def worker(queue):
        from foundry_core import forkserver_preload
        queue.put({
            "parent": os.getppid(),
            "preloaded": "colorsys" in sys.modules,
            "imported": forkserver_preload.IMPORTED,
            "failed": forkserver_preload.FAILED,
            "set_after": os.environ.get("SET_AFTER_SERVER"),
            "removed_after": os.environ.get("REMOVED_AFTER_SERVER"),
            "native": [os.environ.get("NATIVE_BEFORE_SERVER"), os.environ.get("NATIVE_AFTER_SERVER")],
            "preload_env": os.environ.get(forkserver.PRELOAD_ENV),
            "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "umask": os.umask(0o022),
            "sigquit_default": signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL,
        })
        if os.environ.get("TELL_PARENT"):
            os.kill(os.getppid(), signal.SIGQUIT)  # as SGLang's scheduler reports a failure

    if __name__ == "__main__":
        os.environ["REMOVED_AFTER_SERVER"] = "launcher-had-it"
        # Set by native code (setenv(3)): os.environ never shows it, a spawned worker has it.
        os.putenv("NATIVE_BEFORE_SERVER", "n1")
        assert forkserver.start(["colorsys", "no_such_module_for_foundry", "foundry_raising_mod"])
        # What the launcher does between the plugin's registration and the workers' start.
        os.environ["SET_AFTER_SERVER"] = "1"
        del os.environ["REMOVED_AFTER_SERVER"]
        os.putenv("NATIVE_AFTER_SERVER", "n2")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))
        os.umask(0o027)
        told = threading.Event()
        signal.signal(signal.SIGQUIT, lambda *a: told.set())
        queue = mp.get_context("forkserver").Queue()
        p = mp.get_context("forkserver").Process(target=forkserver.WithLaunchState(worker), args=(queue,))
        p.start()
        out = queue.get(timeout=120)
        p.join(60)
        spawned = mp.get_context("spawn").Process(target=worker, args=(queue,))
        spawned.start()
        out["spawned"] = queue.get(timeout=120)
        spawned.join(60)
        out.update(launcher=os.getpid(), exitcode=p.exitcode, nofile_launcher=soft - 1,
                   running=forkserver.running(), unusable=forkserver.unusable(),
                   told=told.wait(10 if os.environ.get("TELL_PARENT") else 0))
        print(json.dumps(out))
    """
)


def _run_launcher(tmp_path: Path, script_text: str, args: list[str], environ: dict) -> tuple[dict, str]:
    """Run ``script_text`` as a launcher in a fresh interpreter: (its last line as JSON, its stderr)."""
    script = tmp_path / "launcher.py"
    script.write_text(script_text)
    done = subprocess.run(
        [sys.executable, str(script), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _launch(tmp_path: Path, **env: str) -> dict:
    # A module whose import raises: the server goes on without it.
    (tmp_path / "foundry_raising_mod.py").write_text("raise RuntimeError('import-time failure')\n")
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(tmp_path)]), **env}
    return _run_launcher(tmp_path, LAUNCHER, [], environ)[0]


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server start method is Linux's here")
def test_a_worker_from_the_fork_server_has_the_launchers_state_at_start(tmp_path):
    out = _launch(tmp_path)
    assert out["exitcode"] == 0
    assert out["parent"] != out["launcher"]  # forked from the server, not from the launcher
    assert out["preloaded"] is True and out["imported"] == ["colorsys"]
    assert out["failed"] == ["no_such_module_for_foundry", "foundry_raising_mod"]  # the server lived on
    assert out["set_after"] == "1" and out["removed_after"] is None and out["preload_env"] is None
    # The environment a spawned worker gets (the C library's, native settings included), not os.environ's.
    assert out["native"] == out["spawned"]["native"] == ["n1", "n2"]
    assert out["nofile"] == out["nofile_launcher"]
    assert out["umask"] == 0o027
    assert out["sigquit_default"] is True
    assert out["running"] == ["colorsys", "no_such_module_for_foundry", "foundry_raising_mod"]
    assert out["unusable"] is None


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server start method is Linux's here")
def test_a_workers_sigquit_to_its_parent_reaches_the_launcher(tmp_path):
    out = _launch(tmp_path, TELL_PARENT="1")
    assert out["told"] is True


UNUSABLE = textwrap.dedent(
    """
    import json, sys
    from foundry_core import forkserver

    if __name__ == "__main__":
        assert forkserver.start([sys.argv[1]])
        first = forkserver.unusable(timeout_s=float(sys.argv[2]))
        print(json.dumps([first, forkserver.unusable(timeout_s=float(sys.argv[2]))]))
    """
)


def _unusable(tmp_path: Path, module_text: str, timeout_s: float) -> list:
    (tmp_path / "foundry_preloaded_mod.py").write_text(module_text)
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(tmp_path)])}
    return _run_launcher(tmp_path, UNUSABLE, ["foundry_preloaded_mod", str(timeout_s)], environ)[0]


@pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("gcc") is None,
    reason="the fork server start method is Linux's here; a stand-in driver library needs gcc",
)
def test_a_server_whose_preload_initialised_the_driver_is_passed_over(tmp_path):
    # The preloaded module loads a driver that answers as after cuInit (a module that asked
    # torch.cuda.is_available() at import): the launcher learns it before any worker forks.
    lib = _stand_in_driver(tmp_path, result=0)
    module = f"import ctypes, os\nctypes.CDLL({str(lib)!r}, mode=os.RTLD_GLOBAL)\n"
    assert _unusable(tmp_path, module, 120) == [
        "it initialised CUDA while importing foundry_preloaded_mod",
        "it initialised CUDA while importing foundry_preloaded_mod",
    ]


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server start method is Linux's here")
def test_a_server_that_died_in_its_preload_is_passed_over(tmp_path):
    first, again = _unusable(tmp_path, "import os\nos._exit(3)\n", 120)
    assert first == again == "it exited before its preload was done"


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server start method is Linux's here")
def test_a_preload_not_done_in_time_is_passed_over(tmp_path):
    first, _ = _unusable(tmp_path, "import time\ntime.sleep(5)\n", 1)
    assert first == "its preload was not done within 1 s"


def test_no_server_is_unusable(monkeypatch):
    monkeypatch.setattr(forkserver, "_started", None)
    assert forkserver.unusable() == "no fork server was started"


def test_a_server_that_initialised_cuda_is_refused_in_the_worker(monkeypatch):
    monkeypatch.setattr(forkserver_preload, "CUDA_INITIALISED", True)
    monkeypatch.setattr(forkserver_preload, "IMPORTED", ["torch"])
    with pytest.raises(
        RuntimeError, match="initialised CUDA while importing torch.*FOUNDRY_WORKER_START=spawn"
    ):
        forkserver.apply_launch_state(forkserver.launch_state())


def test_the_fork_server_where_forking_the_launcher_is_unsafe():
    preload = ("torch", "numpy")
    c = start_method.decide(cuda=True, threads=[], forkserver=preload, environ={})
    assert c.method == "forkserver" and "CUDA is initialised" in c.reason and "torch, numpy" in c.reason
    c = start_method.decide(cuda=False, threads=["zmq-io"], forkserver=preload, environ={})
    assert c.method == "forkserver" and "zmq-io" in c.reason
    # A clean launcher forks: its own modules include the engine's, the server's do not.
    assert start_method.decide(cuda=False, threads=[], forkserver=preload, environ={}).method == "fork"
    asked = start_method.decide(
        cuda=False, threads=[], forkserver=preload, environ={start_method.ENV: "forkserver"}
    )
    assert asked.method == "forkserver" and "=forkserver" in asked.reason
    # The engine's reasons to exec each worker, and the user's spawn, still win.
    assert start_method.decide(
        blockers=["numactl"], cuda=True, threads=[], forkserver=preload, environ={}
    ) == (start_method.Choice("spawn", "numactl"))
    assert (
        start_method.decide(
            cuda=True, threads=[], forkserver=preload, environ={start_method.ENV: "spawn"}
        ).method
        == "spawn"
    )
    assert start_method.decide(cuda=True, threads=[], forkserver=None, environ={}).method == "spawn"


FAKE_DRIVER = "int cuDeviceGetCount(int *n) { *n = 1; return RESULT; }\n"


def _stand_in_driver(tmp_path: Path, result: int) -> Path:
    src = tmp_path / "cuda.c"
    src.write_text(FAKE_DRIVER.replace("RESULT", str(result)))
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)], check=True
    )
    return lib


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build a stand-in driver library")
@pytest.mark.parametrize("result, initialised", [(0, True), (3, False)])
def test_a_driver_initialised_by_a_preloaded_module_is_seen(tmp_path, result, initialised):
    # A stand-in libcuda.so.1 whose cuDeviceGetCount answers as the driver does after cuInit (0)
    # and before it (3, CUDA_ERROR_NOT_INITIALIZED), loaded as a module's import would load it.
    lib = _stand_in_driver(tmp_path, result)
    code = (
        "import ctypes, os, sys\n"
        "from foundry_core import forkserver_preload as p\n"
        "before = p.driver_initialised()\n"
        f"ctypes.CDLL({str(lib)!r}, mode=os.RTLD_GLOBAL)\n"
        "print(before, p.driver_initialised())\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", str(initialised)]


KEPT = textwrap.dedent(
    """
    import json, multiprocessing as mp, os, sys
    from foundry_core import forkserver

    def worker():
        pass

    if __name__ == "__main__":
        assert forkserver.start([sys.argv[1]], resynced=sys.argv[2:])
        for key, value in json.loads(os.environ["SET_AFTER_SERVER"]).items():  # the launcher's later settings
            if os.environ.get("SET_NATIVELY"):
                os.putenv(key, value)  # as native code's setenv(3): os.environ does not show it
            else:
                os.environ[key] = value
        for name in filter(None, os.environ.get("IMPORT_AFTER_SERVER", "").split(",")):
            __import__(name)  # as SGLang's launcher imports OpenCV after the server started
        why = forkserver.unusable(timeout_s=120)
        p = mp.get_context("forkserver").Process(target=forkserver.WithLaunchState(worker))
        p.start()  # forked anyway: the worker refuses to run
        p.join(60)
        print(json.dumps({"unusable": why, "exitcode": p.exitcode}))
    """
)


def _kept(
    tmp_path: Path,
    files: dict[str, str],
    module: str,
    set_after: dict,
    resynced=(),
    natively=False,
    base: dict | None = None,
    import_after: str = "",
) -> dict:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), SRC])}
    environ["SET_AFTER_SERVER"] = json.dumps(set_after)
    environ["IMPORT_AFTER_SERVER"] = import_after
    if natively:
        environ["SET_NATIVELY"] = "1"
    for name in ("FOUNDRY_TEST_KEPT", "FOUNDRY_TEST_OTHER", "TQDM_DISABLE"):
        environ.pop(name, None)
    environ.update(base or {})
    out, stderr = _run_launcher(tmp_path, KEPT, [module, *resynced], environ)
    return {**out, "stderr": stderr}


READS_AT_IMPORT = "import os\nKEPT = os.environ.get('FOUNDRY_TEST_KEPT')\n"


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server start method is Linux's here")
def test_a_variable_the_preload_read_and_the_launcher_changed_passes_the_server_over(tmp_path):
    out = _kept(tmp_path, {"kept_mod.py": READS_AT_IMPORT}, "kept_mod", {"FOUNDRY_TEST_KEPT": "1"})
    # How it changed and where the launcher changed it (the line of KEPT that sets it), never the value.
    line = KEPT.splitlines().index("            os.environ[key] = value") + 1
    assert out["unusable"] == (
        f"its preload read FOUNDRY_TEST_KEPT (set since, by launcher.py:{line}; read by kept_mod.py:2) "
        "before the launcher changed it, and a module may keep what it read"
    )
    # A worker forked from it anyway refuses to run rather than keep the server's value.
    assert out["exitcode"] != 0 and "FOUNDRY_TEST_KEPT" in out["stderr"]
    assert "FOUNDRY_WORKER_START=spawn" in out["stderr"]
    # Set by native code after the preload read it: seen all the same.
    out = _kept(
        tmp_path, {"kept_mod.py": READS_AT_IMPORT}, "kept_mod", {"FOUNDRY_TEST_KEPT": "1"}, natively=True
    )
    assert out["unusable"] is not None and out["unusable"].startswith(
        "its preload read FOUNDRY_TEST_KEPT (set"
    )


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server start method is Linux's here")
def test_a_variable_nobody_read_or_one_the_worker_applies_again_may_change(tmp_path):
    files = {"kept_mod.py": READS_AT_IMPORT}
    assert _kept(tmp_path, files, "kept_mod", {"FOUNDRY_TEST_OTHER": "1"})["unusable"] is None
    out = _kept(tmp_path, files, "kept_mod", {"FOUNDRY_TEST_KEPT": "1"}, resynced=["FOUNDRY_TEST_KEPT"])
    assert out["unusable"] is None and out["exitcode"] == 0


# A stand-in for Triton's NVIDIA driver module, which reads LD_LIBRARY_PATH (libcuda_dirs) and keeps
# only the folders on it that hold libcuda.so.1.
TRITON_DRIVER = "import os\nPATH = os.getenv('LD_LIBRARY_PATH')\n"


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server start method is Linux's here")
def test_a_change_no_reader_keeps_leaves_the_server_usable(tmp_path):
    """OpenCV in SGLang's launcher puts its library folder in front of LD_LIBRARY_PATH after the
    preload's Triton read it: harmless, since Triton keeps only the folders holding libcuda.so.1.
    A folder that does hold one, or a reader Foundry knows nothing of, still passes it over."""
    files = {
        "triton/__init__.py": "",
        "triton/backends/__init__.py": "",
        "triton/backends/nvidia/__init__.py": "",
        "triton/backends/nvidia/driver.py": TRITON_DRIVER,
        "other_reader.py": "import os\nPATH = os.environ.get('LD_LIBRARY_PATH')\n",
    }
    (tmp_path / "cv2libs").mkdir()
    (tmp_path / "driverlibs").mkdir()
    (tmp_path / "driverlibs" / "libcuda.so.1").touch()
    base = {"LD_LIBRARY_PATH": "/opt/none"}
    grown = {"LD_LIBRARY_PATH": f"{tmp_path / 'cv2libs'}:/opt/none"}
    out = _kept(tmp_path, files, "triton.backends.nvidia.driver", grown, base=base)
    assert out["unusable"] is None and out["exitcode"] == 0, out
    driver = {"LD_LIBRARY_PATH": f"{tmp_path / 'driverlibs'}:/opt/none"}
    out = _kept(tmp_path, files, "triton.backends.nvidia.driver", driver, base=base)
    # A folder with libraries changes what the server's own dynamic loader finds, first of all.
    assert out["unusable"].startswith("its dynamic loader took LD_LIBRARY_PATH when it started (grown")
    assert out["exitcode"] != 0
    out = _kept(tmp_path, files, "other_reader", grown, base=base)
    assert "read by other_reader.py:2)" in out["unusable"] and out["exitcode"] != 0


# A stand-in for OpenCV's cv2/__init__.py: it puts its own folder on sys.path, then grows
# LD_LIBRARY_PATH in front, reading and writing it in one statement (line 4).
CV2_INIT = (
    "import os, sys\n"
    "sys.path.insert(0, os.path.dirname(__file__))\n"
    "LIBS = os.path.join(os.path.dirname(__file__), 'libs')\n"
    "os.environ['LD_LIBRARY_PATH'] = LIBS + ':' + os.environ.get('LD_LIBRARY_PATH', '')\n"
)


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server start method is Linux's here")
def test_a_module_that_reads_a_variable_only_to_grow_it_keeps_nothing(tmp_path):
    """OpenCV, imported by the preload and again by SGLang's launcher, reads LD_LIBRARY_PATH only
    to put its folder in front: harmless while that folder holds no shared library (the worker is
    handed the launcher's value); once it holds one, the server's dynamic loader, which took the
    variable at its start, would find other libraries than a spawned worker: passed over."""
    files = {"cv2/__init__.py": CV2_INIT}
    (tmp_path / "cv2" / "libs").mkdir(parents=True)
    base = {"LD_LIBRARY_PATH": "/opt/none"}
    out = _kept(tmp_path, files, "cv2", {}, base=base, import_after="cv2")
    assert out["unusable"] is None and out["exitcode"] == 0, out
    (tmp_path / "cv2" / "libs" / "libopencv_core.so.4").touch()
    out = _kept(tmp_path, files, "cv2", {}, base=base, import_after="cv2")
    assert out["unusable"] == (
        "its dynamic loader took LD_LIBRARY_PATH when it started (grown at the front, by "
        "cv2/__init__.py:4 since), and a worker forked from it searches as the server does"
    )
    # Another module that keeps what it read is no read-modify-write: named, by its package.
    files["cv2/keeper.py"] = "import os\nKEPT = os.environ.get('LD_LIBRARY_PATH')\n"
    (tmp_path / "cv2" / "libs" / "libopencv_core.so.4").unlink()
    out = _kept(
        tmp_path,
        {**files, "cv2/__init__.py": CV2_INIT + "from . import keeper\n"},
        "cv2",
        {},
        base=base,
        import_after="cv2",
    )
    assert "read by cv2/__init__.py:4, cv2/keeper.py:2)" in out["unusable"], out


CV2_5_INIT = (
    "import os, sys\n"
    "def _prepend_env_paths(key, paths, sep):\n"
    "    old = os.environ.get(key)\n"
    "    os.environ[key] = sep.join(paths) + ((sep + old) if old else '')\n"
    "_prepend_env_paths('LD_LIBRARY_PATH', [os.path.join(os.path.dirname(__file__), 'libs')], ':')\n"
)


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server start method is Linux's here")
def test_a_helper_that_reads_a_variable_only_to_grow_it_keeps_nothing(tmp_path):
    """OpenCV 5 grows LD_LIBRARY_PATH in a helper function: the read and the write are on two lines
    of one call, which the preload sees (seen with the real SGLang 0.5.23 launcher and OpenCV 5.1.0
    on the CPU). A helper that reads it and sets something else keeps what it read: passed over."""
    (tmp_path / "cv2" / "libs").mkdir(parents=True)
    base = {"LD_LIBRARY_PATH": "/opt/none"}
    out = _kept(tmp_path, {"cv2/__init__.py": CV2_5_INIT}, "cv2", {}, base=base, import_after="cv2")
    assert out["unusable"] is None and out["exitcode"] == 0, out
    replaced = CV2_5_INIT.replace("sep.join(paths) + ((sep + old) if old else '')", "sep.join(paths)")
    out = _kept(tmp_path, {"cv2/__init__.py": replaced}, "cv2", {}, base=base, import_after="cv2")
    assert out["unusable"] is not None and "read by cv2/__init__.py:3" in out["unusable"], out
    # The same line, called once more to keep what it read: not every read there grew it.
    keeping = (
        CV2_5_INIT.replace("(key, paths, sep):", "(key, paths, sep, keep=False):").replace(
            "    old = os.environ.get(key)\n", "    old = os.environ.get(key)\n    if keep: return old\n"
        )
        + "KEPT = _prepend_env_paths('LD_LIBRARY_PATH', [], ':', keep=True)\n"
    )
    out = _kept(tmp_path, {"cv2/__init__.py": keeping}, "cv2", {}, base=base, import_after="cv2")
    assert out["unusable"] is not None and "read by cv2/__init__.py:3" in out["unusable"], out


def test_the_loader_view_counts_folders_that_hold_libraries(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / "libx.so.1").touch()
    view = forkserver.loader_view
    assert view("LD_LIBRARY_PATH", f"{tmp_path / 'empty'}:/opt/none") == view("LD_LIBRARY_PATH", None) == []
    assert view("LD_LIBRARY_PATH", f"{tmp_path / 'libs'}:{tmp_path / 'libs'}") == [str(tmp_path / "libs")]
    assert view("LD_PRELOAD", "a.so") == "a.so"


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server start method is Linux's here")
def test_going_through_the_environment_counts_by_prefix_for_known_modules_only(tmp_path):
    # A stand-in for tqdm's envwrap: a known module that reads the variables of one prefix.
    prefix_reader = "import os\nOVERRIDES = {k: v for k, v in os.environ.items() if k.startswith('TQDM_')}\n"
    files = {"tqdm/__init__.py": "", "tqdm/utils.py": prefix_reader}
    assert _kept(tmp_path, files, "tqdm.utils", {"FOUNDRY_TEST_OTHER": "1"})["unusable"] is None
    out = _kept(tmp_path, files, "tqdm.utils", {"TQDM_DISABLE": "1"})
    assert out["unusable"].startswith("its preload read TQDM_DISABLE (set since, by launcher.py:")
    # Any other module that goes through the whole environment: nobody can tell what it kept.
    out = _kept(tmp_path, {"lister.py": "import os\nALL = dict(os.environ)\n"}, "lister", {})
    assert out["unusable"].startswith("its preload went through the whole environment (")
    assert "lister.py:2" in out["unusable"] and out["exitcode"] != 0


def test_the_reason_says_how_a_variable_changed_never_its_value():
    read = {"A": None, "B": "/x", "C": "/x", "D": "/x:/y", "E": "secret-1", "F": "s"}
    environ = {"A": "1", "C": "/x:/z", "D": "/y", "E": "secret-2", "F": "s"}
    why = forkserver._kept_settings(read, [], [], environ, ())
    assert why.startswith("its preload read A (set since), B (unset since), C (grown at the end) and 2 more")
    assert forkserver._how_changed("/x", "/w:/x") == "grown at the front"
    assert forkserver._how_changed("/x:/y", "/y") == "shortened"
    assert forkserver._how_changed("secret-1", "secret-2") == "another value"
    assert "secret" not in forkserver._kept_settings({"E": "secret-1"}, [], [], {"E": "secret-2"}, ())


def test_what_a_recording_counts_as_read(monkeypatch):
    for name in ("ENV_READ", "ENV_PREFIXES", "ENV_LISTED"):
        monkeypatch.setattr(forkserver_preload, name, type(getattr(forkserver_preload, name))())
    monkeypatch.setenv("FOUNDRY_TEST_SET", "a")
    monkeypatch.delenv("FOUNDRY_TEST_UNSET", raising=False)
    with forkserver_preload.recording_environment_reads():
        os.environ.get("FOUNDRY_TEST_SET")
        assert "FOUNDRY_TEST_UNSET" not in os.environ
        os.getenv(forkserver.PRELOAD_ENV)  # the server's own: not a setting of the preloaded modules
    os.environ.get("FOUNDRY_TEST_AFTER")  # after the recording: not counted
    assert forkserver_preload.ENV_READ == {"FOUNDRY_TEST_SET": "a", "FOUNDRY_TEST_UNSET": None}
    assert forkserver_preload.ENV_LISTED == []
    changes = forkserver_preload.environment_changes
    read = {"A": "1", "B": None}
    assert changes(read, [], {"A": "1"}) == []
    assert changes(read, [], {"A": "2", "B": "x"}) == ["A", "B"]
    assert changes(read, [], {"A": "2"}, resynced=["A"]) == []
    assert changes({"P_X": "1"}, ["P_"], {"P_X": "1", "P_NEW": "2"}) == ["P_NEW"]
