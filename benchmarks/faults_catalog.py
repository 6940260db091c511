"""What benchmarks/engine_faults.py runs and how it judges: the cases, kill points, models and verdicts."""

from __future__ import annotations

import engine_run as cs

REPO = cs.REPO
SRC = cs.SRC
ENGINES = cs.ENGINES
CASES = (
    "kill_during_save",
    "disk_full",
    "read_only_dir",
    "two_replicas",
    "archive_replaced",
    "damaged_cache",
    "sustained_load",
)
DEFAULT_CASES = CASES[:-1]  # sustained_load only when asked for
#: Cases that start from a copy of the base archive (and so share the base's TOML path).
STAGED = ("archive_replaced", "damaged_cache", "sustained_load")
KILL_POINTS = ("capture", "persisting", "published", "complete")
MODELS = {"tiny": REPO / "examples" / "qwen3-tiny" / "config.json", "1.7b": None}
VERDICTS = ("pass", "fail", "inconclusive", "skipped", "error")


MAX_TOKENS = 32
