"""The tools beside the Foundry library: the demo, the benchmark, the soak and the embedded models.

``foundry_tools.demo`` (SAVE in one process, LOAD in a fresh one, compare), ``foundry_tools.bench``
(capture against restore, replay parity), ``foundry_tools.soak`` (long replay, load/unload cycles,
the CPU reliability suite), ``foundry_tools.workloads`` and ``foundry_tools.models`` (the Qwen3-shaped
random-weight model they build). They import ``foundry_core``; ``foundry_core`` never imports them:
the ``foundry`` command finds their subcommands (demo, bench, soak, tp) through the entry-point group
``foundry_graphs.commands``, which names the functions of ``foundry_tools.commands`` that add them.
``foundry_tools.options`` holds their command-line options; neither imports torch.
"""
