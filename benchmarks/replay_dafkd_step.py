"""One DaFKD server step, replayed from a dump and tried with other settings (issue 61: the collapse at its step).

``diagnose_dafkd.py --dump-rounds R --dump-dir DIR`` saves what round R's server step starts from: the clients'
aggregate ŵ, the round-start generator and the uploads. This script rebuilds the run's server from the dumped
config, runs the server step once per variant on exactly those inputs and prints, per variant, the test accuracy
of ŵ and of the model after the step, the predicted-class histogram after it, and what the step was asked to
learn: the teachers' target on the generated batch (its top class share and its batch-mean class distribution at
T = 1, which a student that copies it also learns as a prior on real images). It also scores that target, and each
teacher alone, on the real test images, and how often the student after the step predicts what the target does
there (``target_accuracy_real``, ``teachers_accuracy_real``, ``student_agrees_with_target_real``), and the
per-class test accuracy of ŵ and of the model after the step.

    PYTHONPATH=src:benchmarks python benchmarks/replay_dafkd_step.py DUMP.pt \\
        --variant default: --variant probs:algorithm.ensemble_space=probs [--out rows.jsonl]

A variant is ``NAME:KEY=VALUE[,KEY=VALUE...]`` with the keys of ``fedistill run --set``; an empty list is the
dumped config itself. ``--precision fp32`` replays the step in fp32 instead of the run's bf16; ``--save-students DIR`` keeps each
variant's student for ``replay_dafkd_next_clients.py --start-file``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fedistill.config import build_config, parse_override
from fedistill.engine.evaluation import autocast_context
from fedistill.models.flat import set_flat
from fedistill.protocol import Message, RoundInfo
from fedistill.runner import load_dataset_for
from fedistill.simulation import Simulation


def predict(model: torch.nn.Module, x: torch.Tensor, precision: str) -> torch.Tensor:
    """The model's predicted classes on ``x`` in eval mode under the run's autocast, as the run evaluates (its mode
    is put back)."""
    was = model.training
    model.eval()
    with torch.inference_mode(), autocast_context(precision, x.device):
        out = torch.cat([model(xb).float().argmax(1) for xb in x.split(500)])
    model.train(was)
    return out


def class_accuracies(predicted: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """Per-class test accuracy (%), one decimal: which classes a server step keeps and which it loses."""
    return [round(100.0 * float((predicted[labels == c] == c).float().mean()), 1) for c in range(int(labels.max()) + 1)]


def teacher_accuracies(algorithm, server, replies: list[Message], x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Each uploaded model's test accuracy on the real images (eval mode): how good the teachers are alone."""
    teacher, _ = algorithm._server_teachers(server)
    accuracies = []
    for reply in replies:
        set_flat(teacher, reply["weights"])
        accuracies.append(100.0 * float((predict(teacher, x, server.precision) == y).float().mean()))
    return accuracies


def inputs_from_uploaded_generators(algorithm, server, rnd: int, replies: list[Message]) -> torch.Tensor:
    """N distillation inputs drawn from the clients' uploaded generators θ_k^g instead of the round-start average
    θ_g^t: sample i comes from upload i mod K (a mixture of the clients' generators, not a generator of their
    averaged parameters). A diagnostic of whether the average's class coverage is what the step lacks."""
    from fedistill.algorithms.dafkd import GENERATOR_KEY

    average = server.state[GENERATOR_KEY]
    parts = []
    try:
        for k, reply in enumerate(replies):
            server.state[GENERATOR_KEY] = reply["generator"]
            parts.append((k, algorithm.server_distill_inputs(server, rnd)))
    finally:
        server.state[GENERATOR_KEY] = average
    x = torch.empty_like(parts[0][1])
    for k, xk in parts:
        x[k :: len(replies)] = xk[k :: len(replies)]
    return x


def replay(dump: dict, overrides: list[str], save_student: str | None = None, inputs: str = "average") -> dict:
    cfg = build_config(dump["config"], dict(parse_override(o) for o in overrides))
    sim = Simulation(cfg, load_dataset_for(cfg))
    runtime, algorithm = sim.server_runtime, sim.algorithm
    server = runtime.server
    set_flat(server.model, dump["aggregate"])
    server.state.clear()
    server.state.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in dump["server_state"].items()})
    replies = [Message(r) for r in dump["replies"]]
    info = RoundInfo(dump["round"], dump["lr"])
    if inputs == "uploads":
        fixed = inputs_from_uploaded_generators(algorithm, server, info.round, replies)
        algorithm.server_distill_inputs = lambda server, rnd: fixed
    row: dict = {"round": dump["round"]}
    row["acc_aggregate"], row["loss_aggregate"] = runtime.evaluate_global()
    x = algorithm.server_distill_inputs(server, info.round)
    target = algorithm.teacher_target(server, x, replies, lambda: algorithm.aggregate_logits(server, x)).exp()  # q at T
    row["target_top_class_share"] = float(torch.bincount(target.argmax(1), minlength=target.shape[1]).max()) / x.shape[0]
    # What a student that matches q at T learns at T = 1: the batch-mean of softmax(T·log q) is its class prior.
    t = algorithm.params.temperature
    sharpened = torch.softmax(t * target.clamp_min(1e-30).log(), dim=1)
    row["target_prior_at_t1"] = [round(float(v), 3) for v in sharpened.mean(0)]
    # The same target on the real test images (labels used only to score it): is what the step is asked to copy
    # right on real data, and does the student carry it there (issue 61: the target was right, the student was not)?
    real_x, real_y = (torch.cat(parts) for parts in zip(*runtime.test_pipeline.test_batches(500)))
    real_target = algorithm.teacher_target(server, real_x, replies, lambda: algorithm.aggregate_logits(server, real_x))
    real_pred = real_target.argmax(1)
    row["target_accuracy_real"] = 100.0 * float((real_pred == real_y).float().mean())
    row["teachers_accuracy_real"] = [round(a, 1) for a in teacher_accuracies(algorithm, server, replies, real_x, real_y)]
    row["class_accuracy_aggregate"] = class_accuracies(predict(server.model, real_x, server.precision), real_y)
    metrics = algorithm.refine(server, info, replies, dump["cids"])
    predicted_after = predict(server.model, real_x, server.precision)
    row["class_accuracy_after"] = class_accuracies(predicted_after, real_y)
    row["student_agrees_with_target_real"] = 100.0 * float((predicted_after == real_pred).float().mean())
    acc, loss, predictions = runtime.evaluate_global_with_predictions()  # predictions: the class histogram
    histogram = torch.as_tensor(predictions).double()
    row.update(acc_after=acc, loss_after=loss, predicted_class_share_after=round(float(histogram.max()) / float(histogram.sum()), 3))
    row.update({k: v for k, v in metrics.items() if not k.endswith("seconds")})
    if save_student:  # the flat student, for replay_dafkd_next_clients.py --start-file
        from fedistill.models.flat import get_flat

        torch.save(get_flat(server.model).clone(), save_student)
        row["student_file"] = save_student
    sim.close()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dumps", nargs="+")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...")
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16"])
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--inputs", default="average", choices=["average", "uploads"],
        help="distil on the round-start averaged generator's samples (the method), or on a mixture of the clients' "
        "uploaded generators' samples (a diagnostic of the average's class coverage)",
    )  # fmt: skip
    parser.add_argument(
        "--save-students", default=None, metavar="DIR",
        help="save each variant's student (flat) as DIR/<dump name>_<variant>.pt, to start the next round's clients "
        "from it with replay_dafkd_next_clients.py --start-file",
    )  # fmt: skip
    args = parser.parse_args(argv)
    variants = [v.partition(":") for v in (args.variant or ["dumped:"])]
    rows = []
    for path in args.dumps:
        dump = torch.load(path, weights_only=False)
        for name, _, spec in variants:
            overrides = ["run.progress=false", "run.threads=1", *filter(None, spec.split(","))]
            if args.precision:
                overrides.append(f"run.precision={args.precision}")
            student = None
            if args.save_students:
                from pathlib import Path

                Path(args.save_students).mkdir(parents=True, exist_ok=True)
                student = str(Path(args.save_students) / f"{Path(path).stem}_{name}.pt")
            row = {"dump": path, "variant": name, "inputs": args.inputs, **replay(dump, overrides, student, args.inputs)}
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
