"""What a server refiner does to the global model, round by round (issue 25: FedFTG's claims, looked at inside).

For one run of a reproduce preset (column, method, seed), each round prints:

- ``acc_average``: the global model's test accuracy right after aggregation, before the refiner;
- ``acc_after_refine``: after it (FedFTG's fine-tune, FedDF's or DaFKD's distillation): their difference is what
  the server step bought or cost in that round; ``refine_relative_change`` = ||w_after - w_before|| / ||w_before||;
- ``teacher_mean_acc``: the round's client models as an ensemble (mean of their softmax) on the test set, and
  ``teacher_best_acc``, the best single client model: how good the teachers being distilled are;
- for FedFTG (alone or as an ingredient), ``generator_label_agreement``: on 500 fresh generator samples G(z, y)
  with y drawn from the round's pooled label counts, how often the teachers' ensemble predicts y (does the
  generator make what it is asked for?), and ``generator_top_class_share``: the most frequent predicted class's
  share (mode collapse shows as a share near 1).

    PYTHONPATH=src:benchmarks python benchmarks/diagnose_refiner.py benchmarks/presets/dafkd_reduced.yaml \\
        --column fmnist_0.1 --method FedFTG --seed 0 --rounds 10 --data-dir ../shared/data [--out rows.jsonl]

The run is the preset's, bit for bit, apart from the extra evaluations (they read the models, they change nothing).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fedistill.algorithms.fedftg import FedFTG, TeacherEnsemble, stratified_labels
from fedistill.models.flat import get_flat
from fedistill.studies.reproduce import load_preset, run_config
from fedistill.runner import load_dataset_for
from fedistill.simulation import Simulation


def ensemble_accuracies(server_model, weight_vectors, batches, device) -> tuple[float, float]:
    """(accuracy of the mean-softmax ensemble, best single member's accuracy) in % on ``batches``."""
    teachers = TeacherEnsemble().load(server_model, weight_vectors, device)
    right_mean, right_each, n = 0, torch.zeros(len(weight_vectors)), 0
    with torch.inference_mode():
        for xb, yb in batches:
            logits = teachers.all_logits(xb).float()  # (K, B, C)
            right_mean += int((logits.softmax(-1).mean(0).argmax(-1) == yb).sum())
            right_each += (logits.argmax(-1) == yb).sum(-1).cpu()
            n += yb.shape[0]
    return 100.0 * right_mean / n, 100.0 * float(right_each.max()) / n


def fedftg_part(algorithm):
    """The FedFTG refiner inside ``algorithm`` (itself, or an ingredient of a composition), else None."""
    if isinstance(algorithm, FedFTG):
        return algorithm
    for part in getattr(algorithm, "parts", []):
        if isinstance(part, FedFTG):
            return part
    return None


def generator_check(ftg: FedFTG, server, weight_vectors, label_counts, samples: int = 500) -> dict[str, float]:
    generator = ftg._generator.load(server).eval()  # the generator as the refine just stored it
    teachers = TeacherEnsemble().load(server.model, weight_vectors, server.device)
    rng = torch.Generator().manual_seed(12345)
    y = stratified_labels(samples, label_counts.sum(0), rng).to(server.device)
    z = torch.randn(samples, ftg.params.noise_dim, generator=rng).to(server.device)
    with torch.inference_mode():
        guesses = teachers.all_logits(generator(z, y)).float().softmax(-1).mean(0).argmax(-1)
    top = torch.bincount(guesses, minlength=int(label_counts.shape[1])).max()
    return {
        "generator_label_agreement": 100.0 * float((guesses == y).float().mean()),
        "generator_top_class_share": float(top) / samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset")
    parser.add_argument("--column", required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    overrides = ["run.progress=false", *args.set] + ([f"dataset.data_dir={args.data_dir}"] if args.data_dir else [])
    cfg = run_config(load_preset(args.preset), args.column, args.method, args.seed, args.rounds, overrides)
    sim = Simulation(cfg, load_dataset_for(cfg))
    runtime = sim.server_runtime
    ftg = fedftg_part(sim.algorithm)
    before_weights: dict[str, torch.Tensor] = {}

    def before(server, info, replies, row, cids):
        before_weights["w"] = get_flat(server.model)
        row["teacher_mean_acc"], row["teacher_best_acc"] = ensemble_accuracies(
            server.model, [r["weights"] for r in replies], runtime.test_pipeline.test_batches(500), server.device
        )

    def after(server, info, replies, row, metrics):
        w = before_weights["w"]  # how far the refiner moved the weights, relative to their norm
        row["refine_relative_change"] = float((get_flat(server.model) - w).norm() / w.norm())
        if ftg is not None and "label_counts" in replies[0]:
            counts = torch.stack([r["label_counts"].to(torch.int64) for r in replies])
            row.update(generator_check(ftg, server, [r["weights"] for r in replies], counts))
        row.update({k: v for k, v in metrics.items() if isinstance(v, float) and not k.endswith("seconds")})

    watch_refiner(sim, args.rounds, before, after, args.out)
    sim.close()
    return 0


def watch_refiner(sim, rounds: int, before, after, out: str | None) -> list[dict]:
    """Run ``rounds`` rounds of ``sim`` with its algorithm's ``refine`` wrapped: the global model's accuracy
    before and after it, plus what ``before(server, info, replies, row, cids)`` and ``after(server, info, replies, row,
    metrics)`` add to the round's row; one JSON line a round, a summary, and the rows as JSON lines in ``out``."""
    algorithm, runtime = sim.algorithm, sim.server_runtime
    original_refine = algorithm.refine
    rows: list[dict] = []

    def refine(server, info, replies, cids):
        row = dict(zip(("round", "acc_average", "loss_average"), (info.round, *runtime.evaluate_global())))
        before(server, info, replies, row, cids)
        metrics = original_refine(server, info, replies, cids)
        row["acc_after_refine"], row["loss_after_refine"] = runtime.evaluate_global()
        after(server, info, replies, row, metrics)
        rows.append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        return metrics

    algorithm.refine = refine
    for rnd in range(1, rounds + 1):
        sim.run_round(rnd)
    gains = [r["acc_after_refine"] - r["acc_average"] for r in rows if r.get("refined", True)]
    if gains:
        print(f"server step: mean {sum(gains) / len(gains):+.2f} points, raised accuracy in {sum(g > 0 for g in gains)} of {len(gains)} rounds")
    if out:
        with open(out, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    sys.exit(main())
