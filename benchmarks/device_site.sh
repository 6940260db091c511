# Sourced by the benchmarks' device scripts (run_sxs_h200.sh, run_faults_h200.sh): an engine's own
# Python site on the GPU machine, from the wheel set that was sent beforehand as tar pieces into
# /tmp/dw (made here, with the lists, by benchmarks/device_wheels.sh);
# the repository's .devwheels/lists/<engine>.list names the engine's wheels (carry .devwheels/lists).
#   engine_site ENGINE LOG   installs into /tmp/site-ENGINE once per machine; returns 1 on failure
#                            (ENGINE peer: upstream Foundry alone, for the side-by-side peer mode)
#   site_path SITE           the PYTHONPATH entries that make SITE importable as a site: SITE and
#                            what its .pth files add
#   engine_ready ENGINE LOGS T0   the site and the native library for a one-engine run, or exit:
#                                 2 when the install failed (its log's tail shown), 3 when the build did
# Each engine gets its own --target site, so the two engines' pins never meet.

site_path() {  # site
  # A --target folder on PYTHONPATH is no site dir: Python does not read its .pth files at start
  # (SGLang 0.5.23's Qwen3 MLP imports the CUTLASS DSL, whose .pth adds its packages folder).
  local added
  added=$(python3 -c 'import site, sys; b = set(sys.path); site.addsitedir(sys.argv[1]); print(":".join(p for p in sys.path if p not in b and p != sys.argv[1]))' "$1" 2>/dev/null)
  echo "$1${added:+:$added}"
}

unpack_wheels() {
  [ -f /tmp/wh/.unpacked ] && return 0
  mkdir -p /tmp/wh
  cat /tmp/dw/part-* | tar -xf - -C /tmp/wh && touch /tmp/wh/.unpacked
}

engine_site() {  # engine log
  local site=/tmp/site-$1
  [ -f "$site/.done" ] && return 0
  unpack_wheels || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    $(sed 's|^|/tmp/wh/|' ".devwheels/lists/$1.list") >"$2" 2>&1 || return 1
  # Bytecode, as pip compiles it at install in a user's image (--no-compile above only saves the
  # wheel step's time). Without it Python did not cache bytecode there: the profile of 2026-12-01
  # showed SGLang's scheduler compiling 670 modules from source at every start, stock and LOAD.
  python3 -m compileall -q -j 0 "$site" >>"$2" 2>&1
  touch "$site/.done"
}

engine_ready() {  # engine logdir start-time
  engine_site "$1" "$2/install.log" || { tail -n 20 "$2/install.log"; exit 2; }
  echo "wheels ready in $(($(date +%s) - $3)) s"
  bash benchmarks/build_native.sh || exit 3
}
