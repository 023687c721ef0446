"""DaFKD's server step, looked at from inside (issue 24): per round, the accuracy of the weighted average ŵ
before the distillation and of w after it, the spread of the generated distillation inputs (per-pixel std
across the N samples, against the real images'), and how the importance-weighted teacher spreads them over
the classes (share of the most frequent argmax class).

    PYTHONPATH=src:benchmarks python benchmarks/diagnose_dafkd.py --rounds 8 [--set algorithm.profile=paper ...]

Uses the digits config of the README (configs/digits_fedavg.yaml) with algorithm.name = dafkd unless --config
names another; --set takes the same KEY=VALUE overrides as `fedistill run`. Prints one line per round and
writes them as JSON lines to --out when given.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from fedistill.config import build_config, parse_override, read_yaml
from fedistill.models.flat import get_flat, set_flat
from fedistill.losses import domain_aware_teacher, domain_log_importance
from fedistill.simulation import Simulation
from fedistill.runner import load_dataset_for

from diagnose_refiner import watch_refiner  # the refine wrapper, the summary and the JSON lines


def dump_server_step(args, cfg, server, info, replies, cids) -> None:
    """The state a DaFKD server step starts from, as one file: the aggregate ŵ (flat), the round-start generator
    θ_g^t, the replies (weights, discriminator heads, generators, sample counts), the round and the config."""
    from pathlib import Path

    path = Path(args.dump_dir) / f"dafkd_step_seed{cfg.seed}_round{info.round}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "config": cfg.model_dump(mode="json"),
            "round": info.round,
            "lr": info.lr,
            "cids": list(cids),
            "aggregate": get_flat(server.model).clone(),
            "server_state": {k: (v.clone() if torch.is_tensor(v) else v) for k, v in server.state.items()},
            "replies": [{k: v for k, v in dict(r).items()} for r in replies],
        },
        path,
    )
    print(f"dumped round {info.round}'s server step to {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/digits_fedavg.yaml")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--dump-rounds", type=int, nargs="*", default=[], metavar="R",
        help="save the server step's inputs of these rounds (the aggregate, the uploads, the generator) under "
        "--dump-dir, for replay_dafkd_step.py to try other server steps on them without replaying the clients",
    )  # fmt: skip
    parser.add_argument("--dump-dir", default=".")
    parser.add_argument(
        "--real-inputs", type=int, default=0, metavar="N",
        help="distil on the first N real training images (labels unused) instead of the generator's samples; "
        "reports how often the teachers' mixed target is right on them and whether Eq. 7's importance sends "
        "each image to the clients holding its class (against uniform and oracle weights)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    overrides = ["algorithm.name=dafkd", f"rounds={args.rounds}", f"seed={args.seed}", "run.progress=false", *args.set]
    cfg = build_config(read_yaml(args.config), dict(parse_override(o) for o in overrides))
    dataset = load_dataset_for(cfg)
    sim = Simulation(cfg, dataset)
    algorithm = sim.algorithm
    real = sim.server_runtime.test_pipeline
    real_x = torch.cat([xb for xb, _ in real.test_batches(500)])
    real_std = float(real_x.std(dim=0).mean())
    real_labels = None
    if args.real_inputs:
        real_inputs, real_labels = sim.server_runtime.test_pipeline.clean_batch(torch.arange(args.real_inputs))
        algorithm.server_distill_inputs = lambda server, rnd: real_inputs

    def before(server, info, replies, row, cids):
        if info.round in args.dump_rounds:
            dump_server_step(args, cfg, server, info, replies, cids)
        row["refined"] = algorithm.distils(info.round)  # the summary counts the rounds with a distillation
        if row["refined"]:
            x = algorithm.server_distill_inputs(server, info.round)
            # the target as the step forms it (teacher_scale: the teachers brought to the aggregate's logit scale)
            target = algorithm.teacher_target(server, x, replies, lambda: algorithm.aggregate_logits(server, x)).exp()
            top = torch.bincount(target.argmax(dim=1), minlength=target.shape[1])
            row.update(
                sample_pixel_std=float(x.std(dim=0).mean()),
                real_pixel_std=real_std,
                sample_range=(float(x.min()), float(x.max())),
                teacher_top_class_share=float(top.max()) / x.shape[0],
                teacher_max_prob=float(target.max(dim=1).values.mean()),
            )
            row.update(logit_scales(server, x, replies))
            if real_labels is not None:
                row["teacher_target_accuracy"] = 100.0 * float((target.argmax(dim=1) == real_labels).float().mean())
                row.update(routing(server, x, replies, cids))

    def logit_scales(server, x, replies):
        """How large the logits are that the student is asked to match (issue 42: a collapse with test loss 70):
        per teacher the mean over the inputs of max − min logit, the largest teacher's, and the student's (ŵ) on the
        same inputs and on the real test images."""
        teacher, discriminator = algorithm._server_teachers(server)
        spreads = []
        with torch.no_grad():
            for reply in replies:
                set_flat(teacher, reply["weights"])
                z = teacher(x).float()
                spreads.append(float((z.max(1).values - z.min(1).values).mean()))
            student = server.model
            was = student.training
            student.eval()
            z_gen, z_real = student(x).float(), student(real_x[:2000]).float()
            student.train(was)
        spread = lambda z: float((z.max(1).values - z.min(1).values).mean())  # noqa: E731
        return dict(
            teacher_logit_spread_mean=sum(spreads) / len(spreads),
            teacher_logit_spread_max=max(spreads),
            student_logit_spread_generated=spread(z_gen),
            student_logit_spread_real=spread(z_real),
        )

    def routing(server, x, replies, cids):
        """Do the discriminators send each real image to the clients that hold its class (Eq. 7's purpose)?
        Importance mass on those "holders" against what a uniform α̂ gives, and the target's accuracy with
        uniform, discriminator and oracle (holders only) weights, in the run's ensemble space and in the other."""
        holds = torch.as_tensor(sim.federation.class_counts_of(cids) > 0)[:, real_labels]  # (K, N)
        teacher, discriminator = algorithm._server_teachers(server)
        logits, disc = [], []
        with torch.no_grad():
            for reply in replies:
                set_flat(teacher, reply["weights"])
                discriminator.load_vector(reply["discriminator"])
                z, ell = algorithm.score_inputs(teacher, discriminator, x)
                logits.append(z)
                disc.append(ell)
        logits, log_alpha = torch.stack(logits), domain_log_importance(torch.stack(disc))
        own = [100.0 * float((z.argmax(1) == real_labels)[h].float().mean()) for z, h in zip(logits, holds) if h.any()]
        p = algorithm.params

        def target_accuracy(log_weights, space=p.ensemble_space):
            q = domain_aware_teacher(logits, log_weights, p.temperature, space)
            return 100.0 * float((q.argmax(1) == real_labels).float().mean())

        uniform = torch.full_like(log_alpha, -math.log(len(replies)))
        oracle = torch.where(holds, 0.0, -1e9)
        oracle = oracle - torch.logsumexp(oracle, dim=0, keepdim=True)
        covered = holds.any(dim=0)
        return dict(
            importance_on_holders=float((log_alpha.exp() * holds).sum(0)[covered].mean()),
            uniform_on_holders=float((holds.sum(0) / len(replies))[covered].mean()),
            samples_with_a_holder=float(covered.float().mean()),
            teachers_own_class_accuracy=sum(own) / len(own),
            target_accuracy_uniform=target_accuracy(uniform),
            target_accuracy_oracle=target_accuracy(torch.where(covered, oracle, uniform)),
            target_accuracy_probs=target_accuracy(log_alpha, "probs"),  # Eq. 8's space, the paper's
            target_accuracy_uniform_probs=target_accuracy(uniform, "probs"),
        )

    def after(server, info, replies, row, metrics):
        if info.round in args.dump_rounds:  # the model the next round's clients start from, beside the step's inputs
            from pathlib import Path

            path = Path(args.dump_dir) / f"dafkd_step_seed{cfg.seed}_round{info.round}.pt"
            dump = torch.load(path, weights_only=False)
            dump["distilled"] = get_flat(server.model).clone()
            torch.save(dump, path)
        if row.get("refined"):  # the student's logit spread after the distillation, on real test images
            with torch.no_grad():
                student = server.model
                was = student.training
                student.eval()
                z = student(real_x[:2000]).float()
                student.train(was)
            row["student_logit_spread_real_after"] = float((z.max(1).values - z.min(1).values).mean())

    watch_refiner(sim, args.rounds, before, after, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
