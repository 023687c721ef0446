#!/bin/bash
# A fedistill bench suite as a SLURM array job: one cell per array task, all writing the same output directory
# (on a shared filesystem). Finished cells are skipped, so the array can be resubmitted after a pre-emption; the
# last task to finish writes the full leaderboard, and `fedistill bench SUITE --out DIR` (with nothing left to
# run) rewrites it at any time.
#
#   N=$(fedistill bench fd-mnist --cells --out /shared/bench | wc -l)
#   sbatch --array=0-$((N - 1))%16 benchmarks/slurm_bench.sh fd-mnist /shared/bench /shared/data
#
#SBATCH --job-name=fedistill-bench
#SBATCH --cpus-per-task=2
#SBATCH --mem=8G
#SBATCH --time=04:00:00
#SBATCH --output=fedistill-bench-%A_%a.log
set -euo pipefail
SUITE=${1:?suite name or path}
OUT=${2:?output directory}
DATA=${3:-data}
fedistill bench "$SUITE" --cell "$SLURM_ARRAY_TASK_ID" --out "$OUT" --data-dir "$DATA" --set "run.threads=${SLURM_CPUS_PER_TASK:-1}"
