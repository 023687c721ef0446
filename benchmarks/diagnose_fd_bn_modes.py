"""Why the FedGKT family's eval-mode knowledge fails with heterogeneous clients (issue 25, RESULTS "FedICT's ranking claim").

On the tests' synthetic digits with FedICT's five client architectures (tests/test_fd.py's fd_config), runs FedICT
with each ``zs_mode`` and, after the last round, scores the final server on every client's uploaded features
three ways against the client's labels: in eval mode (BatchNorm running statistics, updated by all clients'
features in turn), with each batch's own statistics (train mode, on a copy), and the knowledge stored for the
client. Usage: python benchmarks/diagnose_fd_bn_modes.py [--rounds 6]
"""

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import _digits  # noqa: E402
from test_fd import HETERO, fd_config  # noqa: E402

from fedistill.simulation import Simulation  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    dataset = _digits()
    print("| zs_mode | personalised % | client (architecture) | eval-mode right % | batch statistics right % | stored knowledge right % |")
    print("|---|---|---|---|---|---|")
    for mode in ("eval", "train_pass"):
        sim = Simulation(fd_config("fedict", rounds=args.rounds, params={"zs_mode": mode}), dataset)
        uploads = {}
        aggregate = sim.algorithm.aggregate

        def capture(server, info, replies, aggregate=aggregate):
            uploads.update(replies)
            return aggregate(server, info, replies)

        sim.algorithm.aggregate = capture
        history = sim.run()
        for cid, reply in sorted(uploads.items()):
            labels = sim.server.state["labels"][cid]
            right = lambda logits: float((logits.argmax(1) == labels).float().mean()) * 100  # noqa: E731
            with torch.no_grad():
                eval_mode = right(copy.deepcopy(sim.server.model).eval()(reply["features"]))
                batch_stats = right(copy.deepcopy(sim.server.model).train()(reply["features"]))
            stored = right(sim.server.state["knowledge"][cid])
            print(f"| {mode} | {history[-1]['personal_accuracy']:.1f} | {cid} ({HETERO[cid % len(HETERO)]}) | {eval_mode:.1f} | {batch_stats:.1f} | {stored:.1f} |")


if __name__ == "__main__":
    main()
