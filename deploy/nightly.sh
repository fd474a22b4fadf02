#!/usr/bin/env bash
# One phase of a sharded nightly, run from the repository root on every machine (Slurm, Kubernetes, CI):
#
#   deploy/nightly.sh plan        the cell list of each suite (harness matrix) into $HARNESS_NIGHTLY_DIR/cells/
#   deploy/nightly.sh references  this share's reference and noise runs into the shared cache (--references-only)
#   deploy/nightly.sh cells       this share's cells of each suite (--cells-from ... --shard $HARNESS_SHARD)
#   deploy/nightly.sh merge       every share's results into one report ($HARNESS_NIGHTLY_DIR/report)
#   deploy/nightly.sh rerun       the failed, errored and not-run cells of that report, into report-rerun
#
# The share comes from the scheduler's environment (--shard env: SLURM_ARRAY_TASK_ID/_COUNT,
# JOB_COMPLETION_INDEX with HARNESS_SHARD_COUNT, BUILDKITE_PARALLEL_JOB/_COUNT) or HARNESS_SHARD=K/N.
# Settings (environment): HARNESS_NIGHTLY_DIR (required: a folder every machine shares), HARNESS_SUITES
# (default "dcp tp gqa-odd spec"), HARNESS_SEEDS (default "0 1"), HARNESS_TOPO (default all), HARNESS_GPUS (only
# cells of that many GPUs: one runner class), HARNESS_RUN_ARGS (more `harness run` arguments, e.g. an engine),
# HARNESS_HISTORY (history store: estimates for plan, recording for merge), HARNESS_CMD (default harness).
# Exit: the worst `harness run` exit of the phase (0 pass, 1 a check failed, 3 a cell could not run).
set -euo pipefail

phase=${1:?usage: deploy/nightly.sh plan|references|cells|merge|rerun}
root=${HARNESS_NIGHTLY_DIR:?set HARNESS_NIGHTLY_DIR to a folder every machine of the nightly shares}
read -r -a harness <<< "${HARNESS_CMD:-harness}"
read -r -a suites <<< "${HARNESS_SUITES:-dcp tp gqa-odd spec}"
read -r -a extra <<< "${HARNESS_RUN_ARGS:-}"
shard=${HARNESS_SHARD:-env}
task=${SLURM_ARRAY_TASK_ID:-${JOB_COMPLETION_INDEX:-${BUILDKITE_PARALLEL_JOB:-${shard%%/*}}}}
history=()
if [ -n "${HARNESS_HISTORY:-}" ]; then history=(--history "$HARNESS_HISTORY"); fi

matrix_args() {  # the arguments that say which matrix suite $1 is (the same for every phase)
    args=(--suite "$1" --topo "${HARNESS_TOPO:-all}")
    for seed in ${HARNESS_SEEDS:-0 1}; do args+=(--seed "$seed"); done
    if [ -n "${HARNESS_GPUS:-}" ]; then args+=(--gpus "$HARNESS_GPUS"); fi
    args+=("${extra[@]}")
}

worst=0
keep() {  # remember the worst exit status (a FAIL of one suite does not stop the others)
    local code=$1
    if [ "$code" -gt "$worst" ]; then worst=$code; fi
}

case "$phase" in
plan)
    mkdir -p "$root/cells"
    for suite in "${suites[@]}"; do
        matrix_args "$suite"
        "${harness[@]}" matrix "${args[@]}" "${history[@]}" --summary > "$root/cells/$suite.jsonl"
    done ;;
references)
    for suite in "${suites[@]}"; do
        matrix_args "$suite"
        code=0
        "${harness[@]}" run "${args[@]}" --cells-from "$root/cells/$suite.jsonl" --shard "$shard" \
            --cache-dir "$root/cache" --references-only || code=$?
        keep "$code"
    done ;;
cells)
    for suite in "${suites[@]}"; do
        matrix_args "$suite"
        code=0
        "${harness[@]}" run "${args[@]}" --cells-from "$root/cells/$suite.jsonl" --shard "$shard" \
            --cache-dir "$root/cache" --out "$root/shards/$suite/share-$task" || code=$?
        keep "$code"
    done ;;
merge)
    dirs=()
    for results in "$root"/shards/*/*/results.json; do
        if [ -f "$results" ]; then dirs+=("$(dirname "$results")"); fi
    done
    if [ "${#dirs[@]}" -eq 0 ]; then echo "deploy/nightly.sh merge: no share wrote results under $root/shards" >&2; exit 3; fi
    code=0
    "${harness[@]}" report "${dirs[@]}" --out "$root/report" "${history[@]}" || code=$?
    keep "$code"
    if [ -n "${HARNESS_HISTORY:-}" ] && [ -f "$root/report/results.json" ]; then
        "${harness[@]}" history add "$root/report" "${history[@]}"
    fi ;;
rerun)
    code=0
    "${harness[@]}" run --rerun-failed "$root/report" --out "$root/report-rerun" "${history[@]}" || code=$?
    keep "$code" ;;
*)
    echo "deploy/nightly.sh: unknown phase '$phase' (plan, references, cells, merge, rerun)" >&2
    exit 2 ;;
esac
exit "$worst"
