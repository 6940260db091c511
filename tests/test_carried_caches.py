"""Carried compile/JIT caches (foundry_core.engine): SAVE packs private cache directories into an
archive of their own, LOAD verifies it and hands the files over; nothing reaches the user's caches.

The machine fingerprint needs a GPU, so these CPU tests replace it with a fixed one (the GPU,
driver and versions it would hold are exercised by the engine runs on the H200)."""

import json
import logging
import os
import stat

import pytest

from foundry_core.archive import ArchiveError, ArchiveNotFound, FingerprintMismatch
from foundry_core.config import ConfigError, config_from_dict
from foundry_core.engine import CacheHandover, caches
from foundry_core.engine.handover import CacheRefused

ENGINE = {"name": "testengine", "testengine": "1.0"}


@pytest.fixture(autouse=True)
def machine(caches_machine):
    """A fixed machine fingerprint and private folders (tests/conftest.py), for every test here."""
    return caches_machine


def _fill(dirs):
    (dirs.path("triton") / "ab12").mkdir()
    (dirs.path("triton") / "ab12" / "kernel.cubin").write_bytes(b"\x7fELF" + bytes(range(256)) * 40)
    (dirs.path("triton") / "ab12" / "kernel.json").write_text('{"name": "k"}')
    (dirs.path("triton") / "ab12" / "busy.lock").write_text("")  # bookkeeping: never carried
    if "tvm-ffi" not in dirs.kinds:
        return
    so = dirs.path("tvm-ffi") / "mod" / "mod.so"
    so.parent.mkdir()
    so.write_bytes(b"\x7fELF-so")
    so.chmod(0o755)
    os.utime(so, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))


def _cfg(tmp_path, **extra):
    return config_from_dict({"mode": "auto", "archive_dir": str(tmp_path / "archive"), **extra})


def test_dirs_redirect_the_engine_variables(tmp_path):
    dirs = caches.CacheDirs.create(["triton", "cuda"], label="rank0")
    dirs.redirect()
    assert os.environ["TRITON_CACHE_DIR"] == str(dirs.path("triton"))
    assert os.environ["CUDA_CACHE_PATH"] == str(dirs.path("cuda"))
    assert dirs.root == tmp_path / "private" / f"foundry-caches-{os.getuid()}" / "rank0"
    assert stat.S_IMODE(dirs.root.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(dirs.path("triton").stat().st_mode) == 0o700
    with pytest.raises(ValueError, match="unknown cache kind 'nope'"):
        caches.CacheDirs.create(["nope"], label="x")


def test_save_and_load_use_the_same_path_and_start_empty(tmp_path):
    # Caches record absolute paths (FlashInfer's build files): a LOAD must see SAVE's folder names.
    cfg = _cfg(tmp_path)
    save = CacheHandover(cfg, 0, ["flashinfer"], ENGINE)
    save.begin()
    (save.dirs.path("flashinfer") / "stale.o").write_bytes(b"from an earlier start")
    save.dirs.close()  # the SAVE process ended
    del os.environ[caches.DIR_ENV]  # the LOAD is a new process: it inherits nothing
    load = CacheHandover(cfg, 0, ["flashinfer"], ENGINE)
    load.begin()
    assert load.dirs.root == save.dirs.root
    assert load.dirs.files() == {"flashinfer": {}}
    del os.environ[caches.DIR_ENV]
    other = CacheHandover(_cfg(tmp_path / "elsewhere"), 0, ["flashinfer"], ENGINE)
    other.begin()
    assert other.dirs.root != load.dirs.root


def test_a_second_server_on_the_same_archive_gets_its_own_folder(tmp_path, log_records):
    records = log_records("foundry.caches", logging.WARNING)
    first = caches.CacheDirs.create(["triton"], label="archive-x")
    (first.path("triton") / "k.cubin").write_bytes(b"in use")
    second = caches.CacheDirs.create(["triton"], label="archive-x")
    assert second.root != first.root and second.root.name.startswith("foundry-caches-archive-x-")
    assert (first.path("triton") / "k.cubin").read_bytes() == b"in use"  # not emptied under it
    assert any("held by another server" in r.getMessage() for r in records)
    first.close()
    third = caches.CacheDirs.create(["triton"], label="archive-x")
    assert third.root == first.root and third.files() == {"triton": {}}
    third.close()


def test_a_folder_others_can_enter_is_not_used(tmp_path, log_records):
    records = log_records("foundry.caches", logging.WARNING)
    shared = tmp_path / "private" / f"foundry-caches-{os.getuid()}"
    shared.mkdir(parents=True, mode=0o777)
    shared.chmod(0o777)
    dirs = caches.CacheDirs.create(["triton"], label="rank0")
    assert dirs.root.parent == tmp_path / "private" and dirs.root.name.startswith("foundry-caches-rank0-")
    assert any("using a random folder" in r.getMessage() for r in records)


def test_workers_adopt_the_launchers_directories(tmp_path):
    from foundry_core.engine import redirect_for_launch

    cfg = _cfg(tmp_path)
    launched = redirect_for_launch(cfg, ["triton", "deep-gemm"])
    assert os.environ[caches.DIR_ENV] == str(launched.root)
    # SGLang overwrites DG_JIT_CACHE_DIR from its own variable: both point at the private folder.
    assert (
        os.environ["DG_JIT_CACHE_DIR"] == os.environ["SGLANG_DG_CACHE_DIR"] == str(launched.path("deep-gemm"))
    )
    worker = CacheHandover(cfg, 0, ["triton", "deep-gemm", "cuda"], ENGINE)
    worker.begin()
    assert worker.dirs.root == launched.root and worker.dirs.path("cuda").is_dir()
    assert redirect_for_launch(_cfg(tmp_path, caches={"carry": False}), ["triton"]) is None


def test_the_launcher_gets_only_its_records_and_only_for_a_load(tmp_path, machine, log_records):
    from foundry_core.engine import redirect_for_launch, undo_launch_redirect

    records = log_records("foundry.caches", logging.DEBUG)
    cfg = _cfg(tmp_path)
    saved = caches.CacheDirs.create(["vllm", "triton"], label="save")
    _fill(saved)
    (saved.path("vllm") / "modelinfos").mkdir()
    (saved.path("vllm") / "modelinfos" / "m-Qwen3ForCausalLM.json").write_text('{"hash": "h"}')
    (saved.path("vllm") / "torch_compile_cache").mkdir()
    (saved.path("vllm") / "torch_compile_cache" / "code.py").write_text("compiled")
    caches.pack(cfg.rank_caches_dir(0), saved, device=0, engine=ENGINE)
    wanted = {"vllm": ("modelinfos/",)}

    launched = redirect_for_launch(cfg, ["vllm", "triton"], engine=ENGINE, launcher_records=wanted)
    # No compiled code and no native file before the worker has checked the GPU.
    assert {k: sorted(v) for k, v in launched.files().items()} == {
        "vllm": ["modelinfos/m-Qwen3ForCausalLM.json"],
        "triton": [],
    }
    assert (launched.path("vllm") / "modelinfos" / "m-Qwen3ForCausalLM.json").read_text() == '{"hash": "h"}'
    assert any("1 launcher records" in r.getMessage() for r in records)

    # Another engine version: nothing (the worker's restore reports why).
    undo_launch_redirect()
    other = redirect_for_launch(
        cfg, ["vllm"], engine={**ENGINE, "testengine": "2.0"}, launcher_records=wanted
    )
    assert other.files() == {"vllm": {}}
    assert any("no launcher records" in r.getMessage() and "testengine" in r.getMessage() for r in records)
    # A SAVE starts empty; so does a start whose graphs are pinned and caches are not.
    undo_launch_redirect()
    save = redirect_for_launch(_cfg(tmp_path, mode="save"), ["vllm"], engine=ENGINE, launcher_records=wanted)
    assert save.files() == {"vllm": {}}
    undo_launch_redirect()
    pinned = _cfg(tmp_path, trust={"archive_digest": "0" * 64})
    assert redirect_for_launch(pinned, ["vllm"], engine=ENGINE, launcher_records=wanted).files() == {
        "vllm": {}
    }


def test_pack_then_unpack_hands_every_file_over(tmp_path):
    saved = caches.CacheDirs.create(["triton", "tvm-ffi", "inductor"], label="save")
    _fill(saved)
    entry = saved.path("inductor") / "aotautograd" / "ab" / "entry"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"aot entry")
    (saved.path("triton") / "jit.log").write_text("built ab12")  # a log: never carried
    (saved.path("triton") / ".ninja_log").write_text("# ninja log v5")  # build state: carried
    summary = caches.pack(tmp_path / "archive" / "rank0.caches", saved, device=0, engine=ENGINE)
    assert summary["kinds"]["triton"]["files"] == 3  # the lock file and the log stayed behind
    assert summary["kinds"]["tvm-ffi"] == {"files": 1, "bytes": 7, "what": caches.KINDS["tvm-ffi"].what}

    loaded = caches.CacheDirs.create(["triton", "tvm-ffi", "inductor", "cuda"], label="load")
    got = caches.unpack(tmp_path / "archive" / "rank0.caches", loaded, device=0, engine=ENGINE)
    assert got["digest"] == summary["digest"]
    for rel in ("ab12/kernel.cubin", "ab12/kernel.json"):
        assert (loaded.path("triton") / rel).read_bytes() == (saved.path("triton") / rel).read_bytes()
    assert not (loaded.path("triton") / "ab12" / "busy.lock").exists()
    assert (
        not (loaded.path("triton") / "jit.log").exists() and (loaded.path("triton") / ".ninja_log").exists()
    )
    so = loaded.path("tvm-ffi") / "mod" / "mod.so"
    assert so.read_bytes() == b"\x7fELF-so" and so.stat().st_mode & 0o100
    # Times travel too: ninja would rebuild an output that looks older than its sources.
    assert so.stat().st_mtime_ns == (saved.path("tvm-ffi") / "mod" / "mod.so").stat().st_mtime_ns
    none = {"triton": 0, "tvm-ffi": 0, "inductor": 0, "cuda": 0, "total": 0, "rewritten": 0}
    assert loaded.new_files() == none
    # What the engine compiles afterwards is counted as this process's compilation.
    (loaded.path("cuda") / "ComputeCache").mkdir()
    (loaded.path("cuda") / "ComputeCache" / "index").write_bytes(b"x")
    assert loaded.new_files() == dict(none, cuda=1, total=1)
    # Inductor writes some entries it loads again: with the same bytes that compiled nothing, and
    # is counted apart, whatever the file's new time.
    again = loaded.path("inductor") / "aotautograd" / "ab" / "entry"
    again.write_bytes(b"aot entry")
    os.utime(again, ns=(again.stat().st_mtime_ns + 10**9,) * 2)
    assert loaded.new_files() == dict(none, cuda=1, total=1, rewritten=1)
    # A build tool's output written again is a rebuild even with the same bytes (ninja decided
    # to build, and paid for it) ...
    so.write_bytes(b"\x7fELF-so")
    os.utime(so, ns=(so.stat().st_mtime_ns + 10**9,) * 2)
    assert loaded.new_files() == dict(none, cuda=1, **{"tvm-ffi": 1}, total=2, rewritten=1)
    # ... and so is an Inductor entry written with other bytes.
    again.write_bytes(b"aot entry, rebuilt")
    assert loaded.new_files() == dict(none, cuda=1, inductor=1, **{"tvm-ffi": 1}, total=3)


def test_a_flipped_byte_is_refused_before_any_file_is_written(tmp_path):
    saved = caches.CacheDirs.create(["triton", "tvm-ffi"], label="save")
    _fill(saved)
    path = tmp_path / "archive" / "rank0.caches"
    caches.pack(path, saved, device=0, engine=ENGINE)
    member = path / "caches" / "tvm-ffi" / "mod" / "mod.so"
    data = bytearray(member.read_bytes())
    data[3] ^= 1
    member.chmod(0o644)
    member.write_bytes(bytes(data))
    loaded = caches.CacheDirs.create(["triton", "tvm-ffi"], label="load")
    with pytest.raises(ArchiveError, match="mod.so"):
        caches.unpack(path, loaded, device=0, engine=ENGINE)
    assert loaded.files() == {"triton": {}, "tvm-ffi": {}}


def test_foreign_caches_are_refused(tmp_path, machine):
    saved = caches.CacheDirs.create(["triton"], label="save")
    _fill(saved)
    path = tmp_path / "archive" / "rank0.caches"
    caches.pack(path, saved, device=0, engine=ENGINE)
    loaded = caches.CacheDirs.create(["triton"], label="load")
    with pytest.raises(FingerprintMismatch, match="model"):
        caches.unpack(path, loaded, device=0, engine={"name": "testengine", "testengine": "2.0"})
    machine["gpu"] = "NVIDIA H100"
    with pytest.raises(FingerprintMismatch, match="gpu_name"):
        caches.unpack(path, loaded, device=0, engine=ENGINE)
    assert loaded.files() == {"triton": {}}


def test_pinned_digest_and_location(tmp_path):
    saved = caches.CacheDirs.create(["triton"], label="save")
    _fill(saved)
    path = tmp_path / "archive" / "rank0.caches"
    digest = caches.pack(path, saved, device=0, engine=ENGINE)["digest"]
    loaded = caches.CacheDirs.create(["triton"], label="load")
    with pytest.raises(ArchiveError, match="pinned"):
        caches.unpack(path, loaded, device=0, engine=ENGINE, expected_digest="0" * 64)
    with pytest.raises(ArchiveError):
        caches.unpack(path, loaded, device=0, engine=ENGINE, trusted_root=tmp_path / "elsewhere")
    got = caches.unpack(
        path, loaded, device=0, engine=ENGINE, expected_digest=digest, trusted_root=path.parent
    )
    assert got["digest"] == digest


def test_graph_archive_is_not_taken_for_caches(tmp_path):
    from foundry_core.archive import ArchiveWriter

    path = tmp_path / "archive" / "rank0.caches"
    with ArchiveWriter(path) as w:
        w.add_bytes("caches/triton/x", b"x")
        w.commit(fingerprint=caches.fingerprint(0, ENGINE), meta={"kind": "foundry-graphs"})
    loaded = caches.CacheDirs.create(["triton"], label="load")
    with pytest.raises(caches.CacheError, match="not carried caches"):
        caches.unpack(path, loaded, device=0, engine=ENGINE)


# --- the engine layer's policy ------------------------------------------------------------------


def _saved(tmp_path, cfg):
    h = CacheHandover(cfg, 0, ["triton", "tvm-ffi"], ENGINE)
    h.begin()
    _fill(h.dirs)
    assert h.save(device=0)["kinds"]["triton"]["files"] == 2
    return h


def test_handover_save_then_restore(tmp_path):
    cfg = _cfg(tmp_path)
    saved = _saved(tmp_path, cfg)
    assert saved.finish()["new_files"]["total"] == 3  # SAVE compiled everything it carries
    h = CacheHandover(cfg, 0, ["triton", "tvm-ffi"], ENGINE)
    h.begin()
    assert os.environ["TRITON_CACHE_DIR"] == str(h.dirs.path("triton"))
    assert h.restore(device=0) is True
    report = h.finish()
    assert report["carried"] is True and report["digest"] == saved.report["digest"]
    assert report["new_files"]["total"] == 0


def test_a_load_that_compiles_anyway_says_so_once(tmp_path, log_records):
    records = log_records("foundry.caches", logging.WARNING)
    cfg = _cfg(tmp_path)
    saved = _saved(tmp_path, cfg)
    assert saved.finish()["new_files"]["total"] == 3 and not records  # a SAVE compiles: no warning
    h = CacheHandover(cfg, 0, ["triton", "tvm-ffi"], ENGINE)
    h.begin()
    assert h.restore(device=0) is True
    h.finish()
    assert not records  # nothing built
    (h.dirs.path("triton") / "other-key").mkdir()
    (h.dirs.path("triton") / "other-key" / "kernel.cubin").write_bytes(b"built again")
    assert h.finish()["new_files"] == {"triton": 1, "tvm-ffi": 0, "total": 1, "rewritten": 0}
    h.finish()
    (warning,) = [r.getMessage() for r in records]
    assert "built 1 cache files although the carried caches were handed over (triton 1)" in warning


def test_a_load_says_what_its_first_served_batch_built(tmp_path, log_records):
    # The start's report is written before the server's warmup request: what that first prefill
    # builds although the caches were handed over shows only after it (SGLang's JIT kernels did).
    records = log_records("foundry.caches", logging.WARNING)
    cfg = _cfg(tmp_path)
    _saved(tmp_path, cfg).finish()
    h = CacheHandover(cfg, 0, ["triton", "tvm-ffi"], ENGINE)
    h.begin()
    assert h.restore(device=0) is True
    assert h.finish()["new_files"]["total"] == 0 and not records
    (h.dirs.path("tvm-ffi") / "prefill.so").write_bytes(b"built at the first prefill")
    h.served(device=0).join()
    (warning,) = [r.getMessage() for r in records]
    assert "built 1 cache files although the carried caches were handed over (tvm-ffi 1)" in warning
    assert h.report["new_files"]["total"] == 1
    assert h.served(device=0) is None  # only the first batch is looked at


def test_missing_caches_build_as_usual(tmp_path, log_records):
    records = log_records("foundry.caches", logging.INFO)
    h = CacheHandover(_cfg(tmp_path), 0, ["triton"], ENGINE)
    h.begin()
    assert h.restore(device=0) is False
    assert h.report["missing"] is True
    assert any("carries no compile caches" in r.getMessage() for r in records)


def test_refused_caches_warn_in_auto_and_stop_a_load(tmp_path, machine, log_records):
    cfg = _cfg(tmp_path)
    _saved(tmp_path, cfg)
    machine["gpu"] = "NVIDIA H100"
    records = log_records("foundry.caches", logging.WARNING)
    h = CacheHandover(cfg, 0, ["triton"], ENGINE)
    h.begin()
    assert h.restore(device=0) is False
    assert "gpu_name" in h.report["refused"]
    assert any("compiles as usual" in r.getMessage() for r in records)
    strict = CacheHandover(
        config_from_dict({"mode": "load", "archive_dir": str(tmp_path / "archive")}), 0, ["triton"], ENGINE
    )
    strict.begin()
    with pytest.raises(CacheRefused, match="mode=load cannot go on"):
        strict.restore(device=0)


def test_pinned_graphs_need_pinned_caches(tmp_path):
    cfg = _cfg(tmp_path)
    digest = _saved(tmp_path, cfg).report["digest"]
    pinned = _cfg(tmp_path, trust={"archive_digest": "a" * 64})
    h = CacheHandover(pinned, 0, ["triton"], ENGINE)
    h.begin()
    assert h.restore(device=0) is False
    assert "caches_digest does not pin" in h.report["refused"]
    both = _cfg(tmp_path, trust={"archive_digest": "a" * 64, "caches_digest": digest})
    h = CacheHandover(both, 0, ["triton"], ENGINE)
    h.begin()
    assert h.restore(device=0) is True


def test_carry_off_touches_nothing(tmp_path):
    cfg = _cfg(tmp_path, caches={"carry": False})
    h = CacheHandover(cfg, 0, ["triton"], ENGINE)
    h.begin()
    assert "TRITON_CACHE_DIR" not in os.environ
    assert h.restore(device=0) is False and h.save(device=0) is None
    assert h.finish()["carried"] is None


def test_a_failed_pack_keeps_the_save_going(tmp_path, monkeypatch, log_records):
    records = log_records("foundry.caches", logging.WARNING)
    h = CacheHandover(_cfg(tmp_path), 0, ["triton"], ENGINE)
    h.begin()

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(caches, "pack", full)
    assert h.save(device=0) is None
    assert "No space left" in h.report["error"]
    assert any("not saved" in r.getMessage() for r in records)


def test_config_caches_table(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.carry_caches is True and cfg.caches_digest_for_rank(0) is None
    assert cfg.rank_caches_dir(1) == tmp_path / "archive" / "rank1.caches"
    cfg = _cfg(tmp_path, trust={"caches_digest": {"1": "b" * 64}})
    assert cfg.caches_digest_for_rank(1) == "b" * 64
    with pytest.raises(ConfigError, match="caches.carry"):
        _cfg(tmp_path, caches={"carry": "yes"})
    with pytest.raises(ConfigError, match=r"\[caches\]: unknown key 'size'"):
        _cfg(tmp_path, caches={"size": 1})
    with pytest.raises(ConfigError, match="trust.caches_digest"):
        _cfg(tmp_path, trust={"caches_digest": "xyz"})


def test_missing_archive_is_not_found(tmp_path):
    loaded = caches.CacheDirs.create(["triton"], label="load")
    with pytest.raises(ArchiveNotFound):
        caches.unpack(tmp_path / "none", loaded, device=0, engine=ENGINE)
    assert json.loads(json.dumps(loaded.files())) == {"triton": {}}


def test_kernels_built_while_serving_join_the_saved_caches(tmp_path):
    cfg = _cfg(tmp_path)
    h = CacheHandover(cfg, 0, ["triton", "tvm-ffi"], ENGINE)
    h.begin()
    assert h.served(device=0) is None  # nothing saved yet (a LOAD never saves)
    _fill(h.dirs)
    first = h.save(device=0)["digest"]
    h.served(device=0).join()  # batch 1: nothing new, nothing written
    assert h.report["digest"] == first and "late_saves" not in h.report
    (h.dirs.path("triton") / "prefill.cubin").write_bytes(b"built at the first prefill")
    h.served(device=0).join()  # batch 2: the new kernel is saved
    assert h.served(device=0) is None  # batch 3 is not a checkpoint
    assert h.report["late_saves"] == 1 and h.report["digest"] != first
    loaded = CacheHandover(cfg, 0, ["triton", "tvm-ffi"], ENGINE)
    loaded.begin()
    assert loaded.restore(device=0) is True
    assert (loaded.dirs.path("triton") / "prefill.cubin").read_bytes() == b"built at the first prefill"


def test_a_later_launch_gets_the_users_environment_back(tmp_path, monkeypatch):
    from foundry_core.engine import redirect_for_launch, undo_launch_redirect

    monkeypatch.setenv("TRITON_CACHE_DIR", "/home/user/.triton-mine")
    redirect_for_launch(_cfg(tmp_path), ["triton", "cuda"])
    assert os.environ["TRITON_CACHE_DIR"] != "/home/user/.triton-mine"
    undo_launch_redirect()
    assert os.environ["TRITON_CACHE_DIR"] == "/home/user/.triton-mine"
    assert "CUDA_CACHE_PATH" not in os.environ and caches.DIR_ENV not in os.environ
    undo_launch_redirect()  # nothing left to undo
    assert os.environ["TRITON_CACHE_DIR"] == "/home/user/.triton-mine"


def test_inductor_caches_come_with_a_torch_compile_job_id(tmp_path, monkeypatch):
    dirs = caches.CacheDirs.create(["inductor", "triton"], label="rank0")
    assert dirs.environment()["TORCH_COMPILE_JOB_ID"] == caches.PGO_JOB_ID
    assert "TORCH_COMPILE_JOB_ID" not in caches.CacheDirs.create(["triton"], label="r1").environment()
    monkeypatch.setenv("TORCH_COMPILE_STICKY_PGO_KEY", "the-users-own")  # theirs is kept
    assert "TORCH_COMPILE_JOB_ID" not in dirs.environment()
    monkeypatch.delenv("TORCH_COMPILE_STICKY_PGO_KEY")
    torch = pytest.importorskip("torch")
    assert torch.compiler.config.job_id is None
    dirs.redirect()  # torch was imported before: its config gets the id too (a forked worker keeps it)
    assert os.environ["TORCH_COMPILE_JOB_ID"] == caches.PGO_JOB_ID
    assert torch.compiler.config.job_id == caches.PGO_JOB_ID


def test_the_launch_redirect_gives_the_job_id_back(tmp_path):
    from foundry_core.engine import redirect_for_launch, undo_launch_redirect

    torch = pytest.importorskip("torch")
    redirect_for_launch(_cfg(tmp_path), ["inductor"])
    assert torch.compiler.config.job_id == caches.PGO_JOB_ID
    undo_launch_redirect()
    assert "TORCH_COMPILE_JOB_ID" not in os.environ and torch.compiler.config.job_id is None


def test_the_launch_redirect_seeds_the_private_triton_folder_with_this_machines_helpers(
    tmp_path, monkeypatch
):
    """SGLang's schedulers create Triton's CUDA driver at import, before their carried caches are
    handed over: without the launcher's helper in their private folder they ran the C compiler."""
    import sysconfig

    from foundry_core.engine import redirect_for_launch, undo_launch_redirect

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("TRITON_HOME", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    shared = home / ".triton" / "cache"
    helper = shared / "XU5DT2AO5BD5AEHEYGLP" / f"cuda_utils{suffix}"
    helper.parent.mkdir(parents=True)
    helper.write_bytes(b"\x7fELF the launcher's build")
    (shared / "KERNELKEY" / "kernel.cubin").parent.mkdir()
    (shared / "KERNELKEY" / "kernel.cubin").write_bytes(b"a kernel")  # kernels are not the launcher's to give
    (shared / "OTHERKEY").mkdir()
    (shared / "OTHERKEY" / "cuda_utils.so.tmp").write_bytes(b"half written")
    try:
        dirs = redirect_for_launch(_cfg(tmp_path), ["triton", "inductor"])
        private = dirs.path("triton")
        assert os.environ["TRITON_CACHE_DIR"] == str(private)
        got = sorted(p.relative_to(private).as_posix() for p in private.rglob("*") if p.is_file())
        assert got == [f"XU5DT2AO5BD5AEHEYGLP/cuda_utils{suffix}"]
        assert (private / got[0]).read_bytes() == helper.read_bytes()
        assert helper.exists()  # the user's folder is only read
    finally:
        undo_launch_redirect()

    # The user's own TRITON_CACHE_DIR is where the launcher's Triton looked: that one is read.
    theirs = tmp_path / "theirs"
    (theirs / "KEY2").mkdir(parents=True)
    (theirs / "KEY2" / f"cuda_utils{suffix}").write_bytes(b"theirs")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(theirs))
    try:
        dirs = redirect_for_launch(_cfg(tmp_path), ["triton"])
        assert [p.name for p in dirs.path("triton").iterdir()] == ["KEY2"]
    finally:
        undo_launch_redirect()
    assert os.environ["TRITON_CACHE_DIR"] == str(theirs)

    # No Triton kind carried, or nothing built yet: nothing to seed.
    try:
        dirs = redirect_for_launch(_cfg(tmp_path), ["inductor"])
        assert "TRITON_CACHE_DIR" in os.environ and os.environ["TRITON_CACHE_DIR"] == str(theirs)
    finally:
        undo_launch_redirect()


# One process of a carried-caches round trip: torch.compile'd like SGLang's MoE sum-reduce (plain
# @torch.compile: static for the first shape, dynamic after a second), the caches redirected as the
# engine layer does before the engine imports torch. Prints the FX-graph cache hits and misses.
_COMPILE_ONE = """
import json, sys
from pathlib import Path
from foundry_core.engine import caches
caches.CacheDirs(Path(sys.argv[1]), ("inductor",)).redirect()
import torch
from torch._dynamo.utils import counters

@torch.compile
def sum_reduce(x, out, scale):
    torch.sum(x, dim=1, out=out)
    out.mul_(scale)

for n in map(int, sys.argv[2:]):
    sum_reduce(torch.ones(n, 8, 16), torch.empty(n, 16), 0.5)
print(json.dumps({k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}))
"""


def _compile_in_a_process(root, *sizes):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in caches.PGO_JOB_ENVS}
    # Inductor's CPU code keeps precompiled headers in the system's temporary directory, whatever its
    # cache variable says (149 MB): kept out of /tmp, where the fault benchmark's tests look.
    env["TMPDIR"] = str(root.parent)
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_ONE, str(root), *map(str, sizes)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_nothing_for_a_shape_the_first_never_saw(tmp_path):
    """The state torch.compile keeps under the job id travels in the Inductor folder: a process that
    starts from SAVE's folder compiles its first call, at a size SAVE never ran, with the dynamic
    sizes SAVE ended with, and finds that graph in the cache instead of compiling a static one."""
    pytest.importorskip("torch")
    root = tmp_path / "caches"
    (root / "inductor").mkdir(parents=True)
    save = _compile_in_a_process(root, 4, 6)  # static for 4, then dynamic
    assert save["fxgraph_cache_miss"] == 2
    assert list((root / "inductor" / "dynamo").glob("code_state_*foundry*.pkl"))
    load = _compile_in_a_process(root, 9)
    assert load == {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0}
