#!/bin/bash
# Issue 28's from-scratch check: re-run some cells of a bench suite on a fresh clone of this repository and compare
# them, round by round and bit for bit, with the cells of an existing bench output (the committed leaderboard's).
# Each cell runs with the thread count its reference cell recorded (the numbers depend on it).
#
#   benchmarks/bench_from_scratch.sh fd-mnist /work/bench/fd-mnist ../shared/data "0 37 101" [CLONE_DIR]
#
# CLONE_DIR: an existing clone with its .venv (made with `make install`); left out, a fresh one is cloned from this
# repository's HEAD into a temporary directory and installed there.
set -euo pipefail
SUITE=${1:?suite name}
REFERENCE=$(realpath "${2:?the reference suite directory, <out>/<suite>}")
DATA=$(realpath "${3:?the dataset directory}")
CELLS=${4:?cell numbers, e.g. "0 37 101" (fedistill bench SUITE --cells lists them)}
HERE=$(cd "$(dirname "$0")/.." && pwd)
CLONE=${5:-}
if [ -z "$CLONE" ]; then
    CLONE=$(mktemp -d)/fedistill
    git clone -q "$HERE" "$CLONE"
    make -C "$CLONE" install >/dev/null
fi
OUT=$(mktemp -d)
# A bench gives every cell the same thread count (cores / --jobs unless --set): the reference's, from any cell.
threads=$(sed -n 's/^ *threads: *\([0-9][0-9]*\).*/\1/p' "$(find "$REFERENCE" -name config.yaml | head -1)" | head -1)
for cell in $CELLS; do
    (cd "$CLONE" && .venv/bin/fedistill bench "$SUITE" --cell "$cell" --out "$OUT" --data-dir "$DATA" --set "run.threads=${threads:-1}" >/dev/null)
done
"$HERE/.venv/bin/python" "$HERE/benchmarks/compare_bench_cells.py" "$REFERENCE" "$OUT/$(basename "$REFERENCE")"
