"""Which cuMemAddressReserve address hints the driver honours beside a Foundry region (one-off probe).

Ran once on 2026-12-03 (nvidia-h200, tree at ad84aee with this file untracked, then named
probe_symm_hint.py) as ``PYTHONPATH=$PWD/src python benchmarks/symm_hint_probe.py``; the output is
in benchmarks/results/symm-hint-probe-h200.json. The parent reserves a region at 0x600000000000
(8 GiB) and asks for reservations at several hints; each child (``--shift N``) places torch symmetric
memory through ``symmetric.placed`` in a window N GiB past the region's end (the hint-based placing
of that commit).
"""

import json
import subprocess
import sys

import torch
from cuda.bindings import driver as cu

import foundry_core as fc
from foundry_core import symmetric

SHIFT = int(sys.argv[2]) if len(sys.argv) > 2 else None
torch.cuda.set_device(0)
torch.zeros(1, device="cuda")
region = fc.Region(0x600000000000, 8 << 30, 0)
end = region.base + region.size
G, M = 1 << 30, 1 << 20
if SHIFT is None:
    res = {}
    for label, hint, size, align in [
        ("end", end, 8 * M, 0),
        ("end_align2M", end, 8 * M, 2 * M),
        ("end+1G", end + G, 8 * M, 0),
        ("end+1G_align2M", end + G, 8 * M, 2 * M),
        ("end+16G", end + 16 * G, 8 * M, 0),
        ("0x700000000000", 0x700000000000, 8 * M, 0),
        ("0x400000000000", 0x400000000000, 8 * M, 0),
        ("end+4G_1G", end + 4 * G, G, 0),
        ("0x7f0000000000", 0x7F0000000000, 8 * M, 0),
    ]:
        out = cu.cuMemAddressReserve(size, align, hint, 0)
        err, ptr = out[0], out[1]
        res[label] = [int(err), hex(int(ptr)), int(ptr) == hint]
        if int(err) == 0:
            cu.cuMemAddressFree(ptr, size)
    print("HINTS", json.dumps(res), flush=True)
    for shift in (0, 1, 16):
        r = subprocess.run(
            [sys.executable, __file__, "--shift", str(shift)], capture_output=True, text=True, timeout=120
        )
        print("CHILD", shift, r.returncode, r.stdout.strip()[-600:], r.stderr.strip()[-800:], flush=True)
    sys.exit(0)

import torch.distributed as dist  # noqa: E402
import torch.distributed._symmetric_memory as symm_mem  # noqa: E402

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{29577 + SHIFT}", rank=0, world_size=1)
group = dist.group.WORLD.group_name
symmetric.window = lambda r: ((-(-(r.base + r.size) // G) * G) + SHIFT * G, 64 * G)
try:
    with symmetric.placed(region) as mapped:
        t = symm_mem.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
        h = symm_mem.rendezvous(t, group)
    print("SHIFT", SHIFT, "ok", hex(t.data_ptr()), [hex(a) for a, _ in symmetric.placements(0)], flush=True)
except Exception as e:
    print("SHIFT", SHIFT, "failed", type(e).__name__, e, flush=True)
