#!/usr/bin/env bash
# One reference run of the comparison (issue 63, item 6; spec/experiments-hetero.md §5):
#   run_reference.sh HTFLLIB_ROOT ALGO SEED LOG
# HTFLLIB_ROOT: a clone of HtFLlib at e959261 with apply_edits.py applied (with --fd-soft for the FD runs).
# PYTHON: an interpreter with torch (the CPU build), numpy, scikit-learn, h5py and calmsize (HtFLlib's imports).
set -euo pipefail
ROOT=$(cd "$1" && pwd); ALGO=$2; SEED=$3; LOG=$(realpath -m "$4"); PYTHON=${PYTHON:-python}
BASE="-data mnist -m HtFE-mnist-3 -ncl 10 -nc 20 -jr 1 -lr 0.01 -lbs 10 -ls 1 -gr 6 -fd 512 -eg 1 -dev cpu -seed $SEED"
case $ALGO in  # each method's flags of HtFLlib's pre-tuned system/total.sh (spec/experiments-hetero.md §4)
  FD) EXTRA="-lam 1";;
  FedProto) EXTRA="-lam 10";;
  FedGH) EXTRA="-slr 0.01 -se 1";;
  FedTGP) EXTRA="-lam 10 -mart 100 -se 100";;
  FML) EXTRA="-al 0.5 -bt 0.5";;
  LG-FedAvg) EXTRA="";;
  FedKD) EXTRA="-mlr 0.01 -Ts 0.95 -Te 0.98";;
  FedMRL) EXTRA="-sfd 128";;
  *) echo "run_reference.sh: ALGO must be one of FD, FedProto, FedGH, FedTGP, FML, LG-FedAvg, FedKD, FedMRL, not '$ALGO'" >&2; exit 2;;
esac
cd "$ROOT/system"
OMP_NUM_THREADS=1 "$PYTHON" -u main.py -algo "$ALGO" $BASE $EXTRA > "$LOG" 2>&1 || echo "EXIT $?" >> "$LOG"
