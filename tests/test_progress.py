"""The SAVE/LOAD progress bars: tqdm's, on stderr, off in logs (stderr not a terminal)."""

from __future__ import annotations

import io
import sys

from foundry_core.progress import progress_bar


def _run(steps: int, enabled: bool | None, monkeypatch, *, tty: bool, env: str | None = None) -> str:
    err = io.StringIO()
    err.isatty = lambda: tty  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stderr", err)
    if env is None:
        monkeypatch.delenv("FOUNDRY_NO_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("FOUNDRY_NO_PROGRESS", env)
    with progress_bar("foundry: rebuilding graphs", steps, enabled) as bar:
        for _ in range(steps):
            bar.update()
    return err.getvalue()


def test_a_terminal_gets_the_bar_with_its_label_and_count(monkeypatch):
    out = _run(3, None, monkeypatch, tty=True)
    assert "foundry: rebuilding graphs" in out and "3/3" in out


def test_a_log_file_or_the_opt_out_gets_nothing(monkeypatch):
    assert _run(3, None, monkeypatch, tty=False) == ""
    assert _run(3, None, monkeypatch, tty=True, env="1") == ""
    assert _run(3, False, monkeypatch, tty=True) == ""


def test_enabled_true_draws_even_without_a_terminal_and_zero_steps_is_allowed(monkeypatch):
    assert "2/2" in _run(2, True, monkeypatch, tty=False)
    assert "foundry: rebuilding graphs" in _run(0, True, monkeypatch, tty=False)


def test_a_disabled_bar_does_not_import_tqdm(monkeypatch):
    monkeypatch.delitem(sys.modules, "tqdm", raising=False)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # an import of tqdm would raise now
    with progress_bar("foundry: walking graphs", 2, False) as bar:
        bar.update()
