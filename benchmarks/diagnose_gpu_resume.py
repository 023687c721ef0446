"""Why a method's resumed run differs from an uninterrupted one on a GPU (issue 29: DaFKD on an H100/H200).

Runs, on the tests' synthetic digits and the method's quick test settings:
  1. two uninterrupted runs side by side, comparing the global model after every round (is the run deterministic?);
  2. whether a round consumes CUDA's global generator (a resumed run starts it afresh), and three whole runs one
     after another (a first run in the process unlike the next two is a first-use effect, not resume's);
  3. an uninterrupted run against 2 rounds + resume, round by round (which round first differs);
  4. the same rounds under strict deterministic algorithms, naming the first op that has no deterministic kernel.
Usage: PYTHONPATH=src:tests python benchmarks/diagnose_gpu_resume.py [dafkd] [--rounds 4]
"""

import argparse
import hashlib
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import _digits, small_config  # noqa: E402

from fedistill.config import parse_override  # noqa: E402
from fedistill.models.flat import get_flat  # noqa: E402
from fedistill.simulation import Simulation  # noqa: E402


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("algorithm", nargs="?", default="dafkd")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sections", default="1234", help="which of the checks to run, e.g. 1")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run")
    ap.add_argument("--warmup", metavar="ALGORITHM", help="run one round of ALGORITHM first (is it the process's first CUDA work?)")
    ap.add_argument("--no-cudnn", action="store_true", help="torch.backends.cudnn.enabled = False")
    args = ap.parse_args()
    if args.no_cudnn:
        torch.backends.cudnn.enabled = False
    quick = {}
    if args.algorithm == "dafkd":
        from test_dafkd import QUICK as quick
    ds = _digits()
    tmp = Path(tempfile.mkdtemp())
    extra = dict(parse_override(item) for item in args.set)
    cfg = lambda rounds, algorithm=args.algorithm: small_config(  # noqa: E731
        rounds=rounds, algorithm=algorithm, **(quick if algorithm == args.algorithm else {}), **extra, **{"run.device": args.device}
    )
    if args.warmup:
        Simulation(cfg(1, args.warmup), ds, run_dir=tmp / "warmup").run()
        print(f"warm-up: one round of {args.warmup} first", flush=True)

    if "1" in args.sections:
        two_runs(cfg, ds, tmp, args.rounds)
    if "2" in args.sections:
        sequential_runs(cfg, ds, tmp, args.rounds)
    if "3" in args.sections:
        resume(cfg, ds, tmp, args.rounds)
    if "4" in args.sections:
        strict(cfg, ds, tmp, args.rounds)


def sequential_runs(cfg, ds, tmp, rounds) -> None:
    """Three whole runs one after another: the first different from the next two = a first-use effect."""
    print("== 2. three runs one after another", flush=True)
    finals = []
    for name in "xyz":
        sim = Simulation(cfg(rounds), ds, run_dir=tmp / name)
        sim.run()
        finals.append(get_flat(sim.server.model))
        sim.close()
    for i, j in ((0, 1), (1, 2), (0, 2)):
        same = torch.equal(finals[i], finals[j])
        print(f"run {'xyz'[i]} vs {'xyz'[j]}: {'same' if same else 'DIFFERENT max %.3g' % (finals[i] - finals[j]).abs().max()}")


def two_runs(cfg, ds, tmp, rounds) -> None:
    print("== 1. two uninterrupted runs, round by round; 2. CUDA's generator", flush=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, b = Simulation(cfg(rounds), ds, run_dir=tmp / "a"), Simulation(cfg(rounds), ds, run_dir=tmp / "b")
        for rnd in range(1, rounds + 1):
            cuda_before = digest(torch.cuda.get_rng_state()) if torch.cuda.is_available() else "-"
            ra = a.run_round(rnd)
            cuda_after = digest(torch.cuda.get_rng_state()) if torch.cuda.is_available() else "-"
            rb = b.run_round(rnd)
            wa, wb = get_flat(a.server.model), get_flat(b.server.model)
            print(f"round {rnd}: a {digest(wa)} b {digest(wb)} {'same' if torch.equal(wa, wb) else 'DIFFERENT max |a-b| %.3g' % (wa - wb).abs().max()}"
                  f"; acc {ra.get('test_accuracy')} {rb.get('test_accuracy')}; CUDA generator {'untouched' if cuda_before == cuda_after else 'CONSUMED'} by run a's round", flush=True)
    messages = sorted({str(w.message)[:160] for w in caught})
    print(f"warnings during the two runs: {len(caught)}, distinct: {len(messages)}")
    for m in messages:
        print("  ", m)



def resume(cfg, ds, tmp, rounds) -> None:
    print("== 3. uninterrupted against 2 rounds + resume", flush=True)
    full = Simulation(cfg(rounds), ds, run_dir=tmp / "full")
    history_full = full.run()
    Simulation(cfg(2), ds, run_dir=tmp / "part").run()
    resumed = Simulation(cfg(rounds), ds, run_dir=tmp / "part")
    history_resumed = resumed.run(resume=True)
    for rf, rr in zip(history_full, history_resumed):
        keys = sorted(k for k in rf if not k.endswith("seconds") and rf.get(k) != rr.get(k))
        print(f"round {rf['round']}: {'same' if not keys else 'differs in ' + ', '.join(keys[:8])}"
              f" (acc {rf.get('test_accuracy')} / {rr.get('test_accuracy')})")
    wf, wr = get_flat(full.server.model), get_flat(resumed.server.model)
    print("final global model", "IDENTICAL" if torch.equal(wf, wr) else f"DIFFERENT max {float((wf - wr).abs().max()):.3g}")
    for key in sorted(set(full.server.state) | set(resumed.server.state)):
        x, y = full.server.state.get(key), resumed.server.state.get(key)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            print(f"  server state {key}: {'same' if torch.equal(x.cpu(), y.cpu()) else 'DIFFERENT'}")



def strict(cfg, ds, tmp, rounds) -> None:
    print("== 4. strict deterministic algorithms", flush=True)
    plain = torch.use_deterministic_algorithms
    torch.use_deterministic_algorithms = lambda mode, warn_only=False: plain(mode, warn_only=False)
    try:
        Simulation(cfg(rounds), ds, run_dir=tmp / "strict").run()
        print("strict: ran to the end, every op has a deterministic kernel")
    except Exception as exc:  # the op without one
        print("strict: stopped:", str(exc).splitlines()[0][:300])
        print("".join(traceback.format_exc().splitlines(keepends=True)[-14:]))
    finally:
        torch.use_deterministic_algorithms = plain


if __name__ == "__main__":
    main()
