#!/usr/bin/env bash
# Issue 29's checks of the CUDA path in one script, for a lent GPU machine with little time (RESULTS.md "The GPU path").
# From the repository root, on a machine with CUDA and PyTorch:
#   DATA=DIR_WITH_mnist/ OUT=results_dir bash benchmarks/gpu_check.sh
# Stages, each with its own time limit so that one that hangs or fails does not cost the others:
#   1. speed: benchmarks/bench_gpu.py (FedAvg on the FedLMD MNIST protocol and ResNet-18 on a CIFAR-10-sized stand-in,
#      fp32 and bf16; FedFTG, DaFKD and FedICT rounds with their server seconds);
#   2. benchmarks/profile_gpu_round.py: GPU busy share and the host's waits in one FedAvg round;
#   3. kill and resume through the CLI on the GPU, compared with an uninterrupted run;
#   4. the test suite with CUDA visible (tests/test_cuda.py runs only here);
#   graphs (not in the default stages): run.cuda_graphs against the eager step, speed (FedAvg on the MNIST protocol
#   in fp32 and bf16, ResNet-18 in fp32) and the profile's GPU busy share, eager and with graphs.
#   loss-term graphs (issue 41, not in the default stages): "termprofile" profiles one round of FedAvg with graphs
#   (partial batches captured and not) and of FedProx and FedNTD with graphs (their steps captured since issue 41);
#   "methods" runs benchmarks/bench_gpu_methods.py (every method's round on the MNIST protocol, eager and graphs)
#   within METHODS_BUDGET seconds (METHODS=a,b: those registered names only).
#   resident (issue 66 item 3, first in the default stages): tests/test_cuda.py's run.resident_weights tests (the same
#   bits as today's GPU path, eager, graphed and under a cohort; no host copy at the boundary; resume), in under a minute.
#   cohort (issue 66): benchmarks/bench_gpu_cohort.py (FedAvg, FedProx, FedNTD, FedLMD, SCAFFOLD: the graphed
#   sequential step against run.cohort = 10, each also with run.resident_weights: seconds a round, samples a second,
#   accuracy) and profile_gpu_round.py's GPU busy share for the four paths. Back home,
#   `python -m fedistill.engine.cohort_choice OUT/cohort.json` records the rows that run.cohort=auto reads.
# RUN_SET adds settings to the kill-and-resume runs, e.g. RUN_SET="--set run.cuda_graphs=true".
set -u
DATA=${DATA:-../shared/data}
OUT=${OUT:-gpu_out}
DEVICE=${DEVICE:-cuda}  # cpu: try the script's plumbing on a machine without a GPU
PY=${PY:-python3}
STAGES=${STAGES:-"resident cohort speed profile resume tests"}  # a subset reruns what a fix touched
TESTS=${TESTS:-tests/}
SPEED_ARGS=${SPEED_ARGS:-"--rounds 4 --server-methods 2"}  # e.g. "--only none --server-methods 3": the server-side methods alone
SPEED_LIMIT=${SPEED_LIMIT:-150}
RUN_SET=${RUN_SET:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
stage() { echo "== $1 $(date +%T)"; }

stage environment
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/env.txt"

want() { [[ " $STAGES " == *" $1 "* ]]; }

want resident && { stage "resident weights (issue 66 item 3)"
timeout ${RESIDENT_LIMIT:-90} $PY -m pytest -p no:cacheprovider -q -rfE tests/test_cuda.py -k "resident" > "$OUT/resident.txt" 2>&1
echo "pytest exit $?"; tail -n 3 "$OUT/resident.txt"; grep -E "^(FAILED|ERROR)" "$OUT/resident.txt" | head -n 20; }

want cohort && { stage "cohort training (issue 66)"
timeout ${COHORT_LIMIT:-300} $PY benchmarks/bench_gpu_cohort.py --data-dir "$DATA" --device "$DEVICE" --json "$OUT/cohort.json" > "$OUT/cohort.txt" 2>&1
echo "exit $?"; grep -E "^\||Error|error" "$OUT/cohort.txt" | head -n 16
{ for args in "--cuda-graphs" "--cohort 10" "--cuda-graphs --resident" "--cohort 10 --resident"; do echo "### profile fp32 $args"; timeout 45 $PY benchmarks/profile_gpu_round.py --data-dir "$DATA" --precision fp32 $args; done; } > "$OUT/cohort_profile.txt" 2>&1
grep -E "^###|round_wall_s|gpu_busy_share|kernel_launches|Error" "$OUT/cohort_profile.txt"; }

want speed && { stage speed
timeout "$SPEED_LIMIT" $PY benchmarks/bench_gpu.py --data-dir "$DATA" $SPEED_ARGS --json "$OUT/bench_gpu.json" > "$OUT/bench_gpu.txt" 2>&1
echo "bench_gpu exit $?"; tail -n 14 "$OUT/bench_gpu.txt"; }

want profile && { stage profile
timeout 70 $PY benchmarks/profile_gpu_round.py --data-dir "$DATA" --json "$OUT/profile.json" > "$OUT/profile.txt" 2>&1
echo "profile exit $?"; head -n 14 "$OUT/profile.txt"; grep -A8 "^synchronising" "$OUT/profile.txt"; }

want graphs && { stage "graphs: speed"
{ timeout 90 $PY benchmarks/bench_gpu.py --data-dir "$DATA" --only mnist --graphs --rounds 4
  [ "${GRAPHS_RESNET:-1}" != 1 ] || timeout 90 $PY benchmarks/bench_gpu.py --data-dir "$DATA" --only resnet18 --precisions fp32 --graphs --rounds 3; } > "$OUT/graphs_speed.txt" 2>&1
echo "exit $?"; grep -E "^\| (mnist|resnet18)|Error|error" "$OUT/graphs_speed.txt" | head -n 20
stage "graphs: profile"
{ for flag in "" --cuda-graphs; do echo "### profile fp32 $flag"; timeout 60 $PY benchmarks/profile_gpu_round.py --data-dir "$DATA" --precision fp32 $flag; done; } > "$OUT/graphs_profile.txt" 2>&1
grep -E "^###|round_wall_s|gpu_busy|kernel_launches|sync_total|Error" "$OUT/graphs_profile.txt"; }

want termprofile && { stage "loss-term graphs: profile"
{ for args in "--algorithm fedavg" "--algorithm fedavg --no-partial-graphs" "--algorithm fedprox" "--algorithm fedntd"; do
    echo "### profile fp32 --cuda-graphs $args"; timeout 40 $PY benchmarks/profile_gpu_round.py --data-dir "$DATA" --precision fp32 --cuda-graphs $args
  done; } > "$OUT/term_profile.txt" 2>&1
grep -E "^###|round_wall_s|gpu_busy_share|kernel_launches|Error" "$OUT/term_profile.txt"; }

want methods && { stage "every method on the MNIST protocol"
timeout $(( ${METHODS_BUDGET:-200} + 90 )) $PY benchmarks/bench_gpu_methods.py --data-dir "$DATA" --budget-s "${METHODS_BUDGET:-200}" ${METHODS:+--methods "$METHODS"} --json "$OUT/methods.json" > "$OUT/methods.txt" 2>&1
echo "exit $?"; cat "$OUT/methods.txt" | grep -v Warning | tail -n 32; }

want resume && { stage "kill and resume"
RUNS=$(mktemp -d)
COMMON=(--dataset mnist --data-dir "$DATA" --clients 20 --clients-per-round 5 --epochs 1 --set run.device=$DEVICE --set run.checkpoint_every=1 $RUN_SET --no-progress -q)
timeout 60 $PY -m fedistill.cli run "${COMMON[@]}" --rounds 10 --out "$RUNS" --name straight > /dev/null 2>&1
$PY -m fedistill.cli run "${COMMON[@]}" --rounds 10 --out "$RUNS" --name killed > /dev/null 2>&1 &
pid=$!
rounds_of() { cat "$RUNS/$1/metrics.jsonl" 2>/dev/null | wc -l; }
for _ in $(seq 600); do [ "$(rounds_of killed)" -ge 3 ] && break; sleep 0.1; done
kill -9 "$pid"; wait "$pid" 2>/dev/null
echo "killed after $(rounds_of killed) rounds"
timeout 60 $PY -m fedistill.cli run --resume "$RUNS/killed" --no-progress -q > /dev/null 2>&1
$PY - "$RUNS" <<'EOF' | tee "$OUT/resume.txt"
import json, sys, hashlib
rows = lambda name: [json.loads(line) for line in open(f"{sys.argv[1]}/{name}/metrics.jsonl")]
strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rs]
a, b = strip(rows("straight")), strip(rows("killed"))
digest = lambda rs: hashlib.sha256(json.dumps(rs, sort_keys=True).encode()).hexdigest()[:16]
print("rounds", [r["round"] for r in a], [r["round"] for r in b])
print("accuracy", [r["test_accuracy"] for r in a], [r["test_accuracy"] for r in b])
print("straight", digest(a), "killed+resumed", digest(b), "IDENTICAL" if a == b else "DIFFERENT")
EOF
}

want tests && { stage tests
timeout ${TESTS_LIMIT:-180} $PY -m pytest -n 14 -p no:cacheprovider -rfEs $TESTS \
  --ignore=tests/test_flower.py --ignore=tests/test_flower_safety.py --ignore=tests/test_flower_longrunning.py \
  > "$OUT/tests.txt" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|error" "$OUT/tests.txt" | tail -n 3; grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | head -n 30; }
stage done
