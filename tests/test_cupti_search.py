"""Where Foundry looks for CUPTI (foundry_core.modules): the NVIDIA wheels' lib folders first, found
without walking every NVIDIA wheel, and only as far as the caller asks (CPU only)."""

from __future__ import annotations

import glob
import sys

from foundry_core import modules


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def test_the_wheels_lib_folders_come_first_and_nothing_else_is_walked(tmp_path, monkeypatch):
    site = tmp_path / "site"
    _touch(site / "nvidia" / "cu13" / "lib" / "libcupti.so.13")
    for i in range(50):  # other NVIDIA wheels' files, which the old search walked
        _touch(site / "nvidia" / "cublas" / "include" / f"h{i}.h")
    odd = tmp_path / "odd"
    _touch(odd / "nvidia" / "deep" / "er" / "libcupti.so.12")  # not where a wheel keeps it
    monkeypatch.delenv("FOUNDRY_CUPTI", raising=False)
    monkeypatch.setattr(sys, "path", [str(site), str(odd)])
    walked = []
    real_glob = glob.glob

    def spy(pattern, *a, **k):
        walked.append(pattern)
        return real_glob(pattern, *a, **k)

    monkeypatch.setattr(modules.glob, "glob", spy)
    found = modules._cupti_candidates()
    assert next(found) == str(site / "nvidia" / "cu13" / "lib" / "libcupti.so.13")
    assert not any("**" in p for p in walked)  # the first answer needed no walk
    rest = list(found)
    assert str(odd / "nvidia" / "deep" / "er" / "libcupti.so.12") in rest  # a walk where nothing is in place
    assert rest[-1] == "libcupti.so"
