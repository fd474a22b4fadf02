#!/usr/bin/env bash
# Regenerate the committed results.json fixtures from real `harness run`s (the report tests render
# them; tests/test_report_fixtures.py checks they still have the checks and details keys a run
# writes today). Run from anywhere with the project's venv active.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
suite="$here/small.yaml"
run() {  # run NAME ARGS...: a real run; keep only its results.json (paths made relative to the run)
    local name="$1"; shift
    harness run --suite "$suite" --out "$work/$name" --cache-dir "$work/cache" "$@" >/dev/null
    echo "$name: exit $?"
    mkdir -p "$here/$name"
    python - "$work" "$work/$name/results.json" "$here/$name/results.json" <<'PY'
import sys
from pathlib import Path
work, src, dst = sys.argv[1:]
Path(dst).write_text(Path(src).read_text().replace(work + "/", "").replace(work, "."))
PY
}
run clean --topo tp2dcp2
run corruption --topo tp2dcp2 --fault dcp-tp-kv-layout
run gcd --model tiny-kv6 --topo tp4 --fault gcd-naive-gqa
HARNESS_INJECT_RANK_FAILURE=crash:1 run error --topo tp1,tp2 --timeout 120
run skip --topo tp2,tp3
