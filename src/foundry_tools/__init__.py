"""The tools beside the Foundry library: the demo, the benchmark, the soak and the embedded models.

``foundry_tools.demo`` (SAVE in one process, LOAD in a fresh one, compare), ``foundry_tools.bench``
(capture against restore, replay parity), ``foundry_tools.soak`` (long replay, load/unload cycles,
the CPU reliability suite), ``foundry_tools.workloads`` and ``foundry_tools.models`` (the Qwen3-shaped
random-weight model they build). They import ``foundry_core``; ``foundry_core`` never imports them
(only the ``foundry`` command line reaches them, lazily, inside its demo, bench and soak
subcommands). ``foundry_tools.options`` holds their command-line options and imports no torch.
"""
