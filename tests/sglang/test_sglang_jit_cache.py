"""SGLang 0.5.23 builds its own JIT kernels with nvcc at first use, into ``SGLANG_JIT_CACHE_DIR``
(default ``~/.cache/sglang/jit``); stock builds them during its first capture. Not carried, a cold
LOAD builds them at its first prefill instead (the likely cause of 56 s there on an H100 at e473ac8):
the folder is a carried kind, and SGLang's own cache lookup resolves to Foundry's private folder."""

from __future__ import annotations

from foundry_core.engine import caches
from foundry_sglang_plugin import session


def test_sglangs_jit_kernel_cache_is_carried_where_sglang_looks(monkeypatch, tmp_path):
    assert "sglang-jit" in session.CACHE_KINDS
    monkeypatch.setenv(caches.ROOT_ENV, str(tmp_path))
    monkeypatch.delenv("SGLANG_JIT_CACHE_DIR", raising=False)
    dirs = caches.CacheDirs.create(session.CACHE_KINDS, label="test")
    try:
        for name, value in dirs.environment().items():
            monkeypatch.setenv(name, value)
        from sglang.kernels.jit.utils.compile import cache

        assert cache.cache_root() == dirs.path("sglang-jit")
        # A published build is carried; a build still in its staging folder is not.
        leaf = dirs.path("sglang-jit") / "cuda_sm90" / "norm" / "build-ab" / "deps-cd"
        leaf.mkdir(parents=True)
        (leaf / "norm.so").write_bytes(b"\x7fELF")
        staging = dirs.path("sglang-jit") / "cuda_sm90" / "norm" / "build-ab" / ".staging-1234"
        staging.mkdir()
        (staging / "norm.so").write_bytes(b"\x7fEL")
        assert list(dirs.files()["sglang-jit"]) == ["cuda_sm90/norm/build-ab/deps-cd/norm.so"]
    finally:
        dirs.close()
