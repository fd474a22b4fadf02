#!/bin/bash
# Plan a nightly and submit its phases to Slurm: the cell lists here, then an array of N shares computing the
# references once into the shared cache, an array of N shares running the cells, and the merge of their results.
#   HARNESS_NIGHTLY_DIR=/shared/nightly/$(date +%F) deploy/slurm/submit.sh 4
set -euo pipefail
shares=${1:?usage: deploy/slurm/submit.sh SHARES}
cd "$(dirname "$0")/../.."
deploy/nightly.sh plan
refs=$(sbatch --parsable --array=0-$((shares - 1)) deploy/slurm/nightly.sbatch references)
cells=$(sbatch --parsable --array=0-$((shares - 1)) --dependency=afterok:"$refs" deploy/slurm/nightly.sbatch cells)
merge=$(sbatch --parsable --dependency=afterany:"$cells" deploy/slurm/nightly.sbatch merge)
echo "submitted: references $refs, cells $cells, merge $merge; report: $HARNESS_NIGHTLY_DIR/report/index.html"
