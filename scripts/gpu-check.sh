#!/usr/bin/env bash
# The GPU path end to end on a CUDA machine (nccl between ranks, one GPU per rank):
#   1. the main command (dcp suite) with --device cuda: must pass (exit 0)
#   2. the dcp suite with the dcp-lse-merge fault: must be flagged (exit 1)
#   3. the spec suite clean, and with the draft-stale-kv fault: must pass / be flagged
#   4. benchmarks/bench_engine.py at bfloat16 on cuda (engine vs transformers tokens/s)
# and a summary. Topologies are chosen to fit the visible GPUs (a rank per GPU). Usage, from the
# repository root with the environment active:  scripts/gpu-check.sh [OUT_DIR]
set -u
OUT=${1:-reports/gpu-check}
mkdir -p "$OUT"
rm -rf "$OUT/main" "$OUT/dcp-fault" "$OUT/spec" "$OUT/spec-fault"  # an earlier check's runs: --out never writes over results
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HARNESS_CACHE_DIR="$OUT/cache"

if ! python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu-check: torch sees no CUDA device (torch.cuda.is_available() is False); nothing run" >&2
    exit 2
fi
GPUS=$(python -c 'import torch; print(torch.cuda.device_count())')
python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])' | tee "$OUT/env.txt"
if [ "$GPUS" -ge 4 ]; then DCP=tp4dcp4; SPEC=tp4dcp4-mtp,tp4-draft; SPEC_FAULT=tp4-draft
elif [ "$GPUS" -ge 2 ]; then DCP=tp2dcp2; SPEC=tp2-mtp,tp2-draft; SPEC_FAULT=tp2-draft
else DCP=""; SPEC=tp1-mtp,tp1-draft; SPEC_FAULT=tp1-draft
fi

declare -a NAMES RCS WANTS SECS
step() {  # step NAME WANTED_EXIT CMD...
    local name=$1 want=$2; shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    NAMES+=("$name"); RCS+=("$rc"); WANTS+=("$want"); SECS+=("$((SECONDS - t0))")
    tail -n 5 "$OUT/$name.log"
}

if [ -n "$DCP" ]; then
    step main 0 harness run --suite dcp --topo "$DCP" --device cuda --out "$OUT/main"
    step dcp-fault 1 harness run --suite dcp --topo "$DCP" --device cuda --fault dcp-lse-merge --out "$OUT/dcp-fault"
else
    echo "== main / dcp-fault: skipped (DCP needs at least 2 GPUs, found $GPUS)"
fi
step spec 0 harness run --suite spec --topo "$SPEC" --device cuda --out "$OUT/spec"
step spec-fault 1 harness run --suite spec --topo "$SPEC_FAULT" --device cuda --fault draft-stale-kv --out "$OUT/spec-fault"
step bench-bf16 0 python benchmarks/bench_engine.py --device cuda --dtype bfloat16 --json "$OUT/bench-bf16.json"

echo
echo "gpu-check summary ($GPUS GPU(s); logs and reports in $OUT)"
ok=0
for i in "${!NAMES[@]}"; do
    verdict=OK; [ "${RCS[$i]}" = "${WANTS[$i]}" ] || { verdict=UNEXPECTED; ok=1; }
    printf '  %-11s exit %s (want %s) %5ss  %s\n' "${NAMES[$i]}" "${RCS[$i]}" "${WANTS[$i]}" "${SECS[$i]}" "$verdict"
done
[ -f "$OUT/bench-bf16.json" ] && python - "$OUT/bench-bf16.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"  bench {r['model']:<14} batch {r['batch']:>3}: prefill {r['engine_prefill'] / r['hf_prefill']:.2f}x, "
          f"decode {r['engine_decode'] / r['hf_decode']:.2f}x of transformers")
PY
exit $ok
