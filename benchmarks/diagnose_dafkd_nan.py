"""Where DaFKD's model goes non-finite on Fashion-MNIST with Dirichlet α = 0.05 (issue 42, item 1).

Runs round 1 of dafkd_reduced's Fashion-MNIST column with ``partition.alpha: 0.05`` (20 clients, 8 a round,
at least 100 samples each, the CNN, bf16, DaFKD's default profile, n_g = 32) client by client, and records, at
every joint step of each client (Eq. 9: CE + the discriminator's BCE terms, one optimiser over the classifier
and ψ_k), the loss terms, the discriminator's real and fake logits, the norm of the shared features φ(x) and of
the head ψ_k, and the largest weight. It stops at the first step whose loss or weights are not finite and prints
that client's trajectory, its label histogram and what went non-finite first.

    PYTHONPATH=src python benchmarks/diagnose_dafkd_nan.py --data-dir ../shared/data [--seed 1] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from fedistill.algorithms import dafkd as dafkd_module
from fedistill.studies.reproduce import load_preset, run_config
from fedistill.runner import load_dataset_for
from fedistill.simulation import Simulation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=os.environ.get("FEDISTILL_DATA"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--method", default="DaFKD")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--show", type=int, default=12, help="steps printed before the first non-finite one")
    parser.add_argument("--client", type=int, default=None, help="run only this client of round 1 and print its trajectory")
    parser.add_argument("--engine", action="store_true", help="run round 1 through the engine (sim.run_round) instead of client by client")
    parser.add_argument("--order", default=None, help="comma-separated client ids: run round 1's clients in this order")
    parser.add_argument("--every", type=int, default=20, help="with --client: print every N-th step")
    args = parser.parse_args(argv)
    preset = load_preset("benchmarks/presets/dafkd_reduced.yaml")
    overrides = [f"partition.alpha={args.alpha}", f"dataset.data_dir={args.data_dir}", "run.progress=false",
                 "run.checkpoint_every=0", "run.workers=1", *args.set]  # fmt: skip
    cfg = run_config(preset, "fmnist_0.1", args.method, args.seed, 1, overrides)
    sim = Simulation(cfg, load_dataset_for(cfg))
    algorithm = sim.client_runtime.algorithm

    steps: list[dict] = []
    seen: dict = {}
    original_loss = dafkd_module.discriminator_loss

    def watched_loss(real_logits, fake_logits):
        seen["real"] = real_logits.detach().float()
        seen["fake"] = fake_logits.detach().float()
        value = original_loss(real_logits, fake_logits)
        seen["adversarial"] = float(value.detach())
        return value

    dafkd_module.discriminator_loss = watched_loss
    original_penalty = dafkd_module.interpolation_gradient_penalty

    def watched_penalty(score, real, fake, mix, weight):
        value = original_penalty(score, real, fake, mix, weight)
        seen["penalty"] = float(value.detach())
        return value

    dafkd_module.interpolation_gradient_penalty = watched_penalty

    def record(model, discriminator, loss):
        head = discriminator.head.weight.detach().float()
        weights = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        grads = [p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None]
        row = {
            "loss": float(loss),
            "adversarial": seen.get("adversarial"),
            "penalty": seen.get("penalty"),
            "grad_norm": float(torch.cat(grads).norm()) if grads else None,
            "real_logit_max": float(seen["real"].abs().max()) if "real" in seen else None,
            "fake_logit_max": float(seen["fake"].abs().max()) if "fake" in seen else None,
            "feature_norm": seen.get("feature_norm"),
            "head_norm": float(head.norm()),
            "max_weight": float(weights.abs().max()),
            "finite": bool(torch.isfinite(weights).all() and math.isfinite(float(loss))),
        }
        seen.clear()
        steps.append(row)

    class Stop(Exception):
        pass

    # Wrap the client's optimiser step: DaFKD builds its joint optimiser per client from torch.optim.
    for cls in (torch.optim.SGD, torch.optim.Adam):
        step = cls.step

        def watched_step(self, closure=None, _step=step):
            out = _step(self, closure)
            model, discriminator = current["model"], current["discriminator"]
            if any(p is q for group in self.param_groups for p in group["params"] for q in model.parameters()):
                record(model, discriminator, current["loss"])
                if not steps[-1]["finite"]:
                    raise Stop
            return out

        cls.step = watched_step

    current: dict = {}
    original_backward = torch.Tensor.backward

    def watched_backward(self, *a, **k):
        current["loss"] = float(self.detach())
        return original_backward(self, *a, **k)

    torch.Tensor.backward = watched_backward
    original_local_update = algorithm.local_update

    def local_update(client, info, msg):
        current["model"] = client.model
        current["discriminator"] = algorithm._worker_discriminator(client)
        extract = client.model.extract

        def extract_watched(x):
            features = extract(x)
            seen["feature_norm"] = float(features.detach().float().norm(dim=1).max())
            return features

        client.model.extract = extract_watched
        steps.clear()
        try:
            reply = original_local_update(client, info, msg)
        finally:
            del client.model.extract
        if args.engine:
            last = steps[-1] if steps else {}
            worst = max((r["max_weight"] for r in steps), default=0.0)
            print(f"client {client.cid}: {len(steps)} steps, last loss {last.get('loss', float('nan')):.4g}, "
                  f"largest weight seen {worst:.4g}, finite {all(r['finite'] for r in steps)}", flush=True)
        return reply

    algorithm.local_update = local_update
    if args.engine:  # the round as the engine runs it (executor, client states, order)
        try:
            sim.run_round(1)
        except Stop:
            print(f"non-finite at step {len(steps)}")
            for i, row in enumerate(steps[-args.show :], len(steps) - min(args.show, len(steps)) + 1):
                print(f"  step {i}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
            return 1
        except Exception as exc:  # TrainingDiverged: the engine's own message
            print(f"{type(exc).__name__}: {exc}")
            return 1
        return 0
    info = sim.round_info(1)
    cids = sim.server_runtime.select_clients(1)
    if args.order:
        cids = [int(c) for c in args.order.split(",")]
    for cid in cids if args.client is None else [args.client]:
        steps.clear()
        counts = sim.federation.class_counts_of([cid])[0]
        try:
            sim.client_runtime.update(cid, info, sim.server_runtime.broadcast(info, cid), {})
        except Stop:
            print(f"client {cid}: {int(counts.sum())} samples, labels {counts.tolist()}: non-finite at step {len(steps)}")
            for i, row in enumerate(steps[-args.show :], len(steps) - min(args.show, len(steps)) + 1):
                print(f"  step {i}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
            return 1
        if args.client is not None:
            for i, row in enumerate(steps, 1):
                if i % args.every == 0 or i <= 5:
                    print(f"  step {i}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        last = steps[-1] if steps else {}
        print(
            f"client {cid}: {int(counts.sum())} samples, labels {counts.tolist()}: finite after {len(steps)} steps "
            f"(last loss {last.get('loss', float('nan')):.4g}, feature norm {last.get('feature_norm') or 0:.4g}, "
            f"head norm {last.get('head_norm', 0):.4g}, max weight {last.get('max_weight', 0):.4g})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
