"""Example (e): clients with different architectures (docs/guides/model-groups.md).

Nine clients on the embedded 8x8 digits, label-skewed, each training one of three architectures of different
families (client k trains ``model.clients[k mod 3]``: a CNN, a ResNet-8 and a logistic regression, each ending in a
64-wide feature and a linear head). A method that averages whole models cannot train this federation, so the
methods here are those whose clients keep models of their own and exchange something every architecture has: class
statistics (FD's per-class logits, FedProto's and FedTGP's prototypes) or a shared part (LG-FedAvg's head). Local,
where nothing travels, is the floor. Each method's accuracy is the mean over clients of its own model on its own
test split; the bytes are what it sends a round.

    python examples/hetero_clients.py [--rounds 10] [--methods local_only,fd,fedproto,fedtgp,lg_fedavg] [--out hetero]

From the command line, one of them: ``fedistill run --algorithm fedproto --set
model.clients=[digits_cnn,resnet8,logistic] --set partition.per_client_test=true``; on MNIST-sized images use a
model group instead, ``--set model.group=mixed4``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import fedistill

ARCHITECTURES = ["digits_cnn", "resnet8", "logistic"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--methods", default="local_only,fd,fedproto,fedtgp,lg_fedavg")
    parser.add_argument("--out", type=Path, default=Path("hetero"))
    args = parser.parse_args()
    print(f"{'method':<12} {'accuracy %':>10} {'kB up a round':>14}")
    for method in args.methods.split(","):
        result = fedistill.run(
            {
                "algorithm": {"name": method},
                "dataset": {"name": "digits"},
                "model": {"clients": ARCHITECTURES},
                # per-class Dirichlet; every client has a test split of its own, on which its own model is scored
                "partition": {"scheme": "lda", "num_clients": 9, "alpha": 0.5, "per_client_test": True},
                "clients_per_round": 9,
                "rounds": args.rounds,
                # the digits' setting for all methods (their HtFLlib defaults, batch 10 and lr 0.01, are for MNIST)
                "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
                "run": {"out_dir": str(args.out), "name": method, "threads": 1, "figures": False},
            }
        )
        last = result.history[-1]
        print(f"{method:<12} {last['personal_accuracy']:>10.1f} {last['bytes_up'] / 1000:>14.1f}", flush=True)


if __name__ == "__main__":
    main()
