"""Example (a): a sweep from Python, plotted.

FedProx's proximal coefficient mu on the embedded digits dataset (configs/digits_fedavg.yaml, Dirichlet
alpha 0.1 label skew), one run per value, then the accuracy curves in one figure:

    python examples/sweep.py                      # mu in 0, 0.01, 0.1, 1; 20 rounds; writes sweep/sweep.png
    python examples/sweep.py --mu 0 0.5 --rounds 5 --out /tmp/sweep

Every run is an ordinary run directory under --out (``fedistill compare`` reads them too).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt

import fedistill


def main(argv: list[str] | None = None) -> dict[float, fedistill.RunResult]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mu", type=float, nargs="+", default=[0.0, 0.01, 0.1, 1.0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("sweep"))
    args = parser.parse_args(argv)

    results = {}
    for mu in args.mu:
        # a shipped config by name, then keyword overrides (nested as dicts, or section__key=value)
        results[mu] = fedistill.run(
            "digits_fedavg", algorithm={"name": "fedprox", "mu": mu}, rounds=args.rounds,
            out_dir=str(args.out), name=f"fedprox-mu{mu:g}", threads=1,
        )  # fmt: skip

    fig, ax = plt.subplots(figsize=(6, 4))
    for mu, result in results.items():
        rounds = [row["round"] for row in result.history]
        ax.plot(rounds, [row["test_accuracy"] for row in result.history], label=f"μ = {mu:g}")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("FedProx on digits, Dirichlet α = 0.1")
    ax.legend()
    fig.tight_layout()
    figure = args.out / "sweep.png"
    fig.savefig(figure, dpi=120)
    for mu, result in results.items():
        print(f"mu={mu:g}: final {result.final_accuracy:.2f} %, best {result.summary['best_accuracy']:.2f} %  ({result.run_dir})")
    print(f"figure: {figure}")
    return results


if __name__ == "__main__":
    main()
