"""DeepGEMM's JIT cache is a carried kind for SGLang, trusted only for the DeepGEMM that built it:
SGLang 0.5.23 installs SGLang's fork as ``sgl-deep-gemm``, whose version must be in the caches'
fingerprint (only the upstream ``deep-gemm`` was, so a cache built by another fork release loaded)."""

from __future__ import annotations

from importlib.metadata import version

from foundry_core.engine import caches
from foundry_sglang_plugin import session


def test_sglang_carries_deep_gemm_into_its_own_private_folder(monkeypatch, tmp_path):
    assert "deep-gemm" in session.CACHE_KINDS
    monkeypatch.setenv(caches.ROOT_ENV, str(tmp_path))
    dirs = caches.CacheDirs.create(["deep-gemm"], label="test")
    try:
        env = dirs.environment()
        # SGLang copies SGLANG_DG_CACHE_DIR over DG_JIT_CACHE_DIR at import: both name the carried folder.
        assert env["SGLANG_DG_CACHE_DIR"] == env["DG_JIT_CACHE_DIR"] == str(dirs.path("deep-gemm"))
        # DeepGEMM's per-kernel compile locks (SGLang's compile_utils) are never carried.
        (dirs.path("deep-gemm") / "locks").mkdir(parents=True)
        (dirs.path("deep-gemm") / "locks" / "GEMM_NT_F8F8BF16_n256_k256_g1.lock").write_text("")
        (dirs.path("deep-gemm") / "cache" / "kernel.x").mkdir(parents=True)
        (dirs.path("deep-gemm") / "cache" / "kernel.x" / "kernel.cubin").write_bytes(b"\x7fELF")
        assert list(dirs.files()["deep-gemm"]) == ["cache/kernel.x/kernel.cubin"]
    finally:
        dirs.close()


def test_the_installed_deep_gemm_fork_is_in_the_caches_fingerprint(monkeypatch):
    import foundry_core.fingerprint as fingerprint

    engine = session._engine_facts()
    tools = caches.model_facts(engine)["tools"]
    assert tools["sgl-deep-gemm"] == version("sgl-deep-gemm")
    real = fingerprint.package_version
    monkeypatch.setattr(
        fingerprint, "package_version", lambda d: "0.0.1" if d == "sgl-deep-gemm" else real(d)
    )
    assert caches.model_facts(engine) != {"engine": engine, "tools": tools}  # another build: refused
