"""foundry_core.engine.gcheap: the import heap set aside from the collector, in a fresh interpreter
(a freeze is for the process's life). What is made afterwards is still collected as before."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

CHILD = textwrap.dedent(
    """
    import gc, json, weakref
    import email.mime.multipart, xml.dom.minidom, json.decoder  # an import heap of some size
    from foundry_core.engine import gcheap

    tracked = len(gc.get_objects())
    frozen = gcheap.freeze_import_heap()

    class Node:
        pass

    # A cycle made after the freeze, as every tensor and graph of a start is: still collected.
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = []
    weakref.finalize(a, gone.append, "a")
    del a, b
    collected = gc.collect()
    print(json.dumps({"tracked": tracked, "frozen": frozen, "count": gc.get_freeze_count(),
                      "gone": gone, "collected": collected, "left": len(gc.get_objects())}))
    """
)


def _run(**env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": SRC, **env},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_import_heap_is_set_aside_and_what_comes_after_is_collected_as_before():
    out = _run()
    # everything tracked before the call is set aside (a frozen object may still die by its count)
    assert out["frozen"] is True and out["tracked"] > 1000
    assert out["count"] >= out["tracked"] * 0.99
    assert out["gone"] == ["a"] and out["collected"] >= 2
    # a later pass walks what was made after the freeze only: far fewer than the heap
    assert out["left"] < out["count"] // 10


def test_the_switch_leaves_the_collector_alone():
    out = _run(FOUNDRY_GC_FREEZE="0")
    assert out["frozen"] is None and out["count"] == 0
    # the heap stays in the collector's view (less what was garbage already)
    assert out["gone"] == ["a"] and out["left"] > out["tracked"] * 0.9
