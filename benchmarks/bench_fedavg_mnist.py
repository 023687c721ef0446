"""FedAvg on the FedLMD MNIST protocol: fedistill's engine against a plain research-code loop.

Protocol (experiments-fedlmd.md §2-4): 100 clients, LDA alpha = 0.1, 10 clients per round, E = 5, B = 50,
SGD lr 0.01 (x0.99 per round), momentum 0.9, weight decay 1e-5, the FedNTD/FedLMD CNN, training
augmentation RandomCrop(28, pad 4) + HorizontalFlip + Cutout(16), evaluation on the 10k test images.

The "plain" implementation is written here the way most research FL code does it: a torch Dataset with
per-sample transforms, one DataLoader per client per round, ``copy.deepcopy`` of the global model per
client, state_dict averaging, evaluation through a DataLoader with batch 50. Both implementations use the
same partition, the same clients each round and the same initial weights, so their accuracies must agree
(same algorithm, same work; only the batch order differs).

Run:  python benchmarks/bench_fedavg_mnist.py --data-dir ../shared/data --rounds 20 [--only plain --only bf16 ...]
Writes a JSON with every round to benchmarks/out/ and prints a markdown table for RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from fedistill.config import build_config
from fedistill.data.sources import load_dataset
from fedistill.engine.seeding import CLIENT, INIT, make_generator, sample_clients
from fedistill.simulation import Simulation, build_federation, build_model_for

PROTOCOL = {
    "rounds": 20,
    "clients_per_round": 10,
    "algorithm": {"name": "fedavg"},
    "dataset": {"name": "mnist"},
    "partition": {"scheme": "lda", "num_clients": 100, "alpha": 0.1, "seed": 19940817},
    "model": {"name": "cnn"},
    "local": {"epochs": 5, "batch_size": 50, "lr": 0.01, "lr_decay": 0.99, "momentum": 0.9, "weight_decay": 1e-5},
    "eval": {"every": 1, "batch_size": 100},
    "run": {"progress": False, "checkpoint_every": 0},
}


# fedistill variants: precision and executor (2 one-thread worker processes vs one process with --threads
# threads, as the default was before issue 41; "bf16-default" leaves the executor to run.workers=auto).
VARIANTS = {
    "plain": {},
    "fp32": {"run.precision": "fp32", "run.workers": 1, "run.threads": "THREADS"},
    "bf16": {"run.precision": "bf16", "run.workers": 1, "run.threads": "THREADS"},
    "fp32-2workers": {"run.precision": "fp32", "run.workers": 2, "run.threads": 1},
    "bf16-2workers": {"run.precision": "bf16", "run.workers": 2, "run.threads": 1},
    "bf16-default": {"run.precision": "bf16"},
}


# ---------------------------------------------------------------------------------------------
# The plain loop (what we compare against). Deliberately conventional, not deliberately slow: a torch
# Dataset with per-sample transforms, a DataLoader per client and epoch, deepcopy per client, state_dict
# averaging. To compare the *same work*, it consumes the client's random stream exactly as fedistill's
# pipeline does (epoch permutation, then per batch: crop offsets, flip coins, cutout centres), so both
# implementations see identical batches and augmentations and their accuracies can be compared closely.
class AugmentedSamples(TorchDataset):
    """Per-sample pipeline over pre-drawn records: crop (zero pad 4), flip, to float, normalise, cutout."""

    def __init__(self, images, labels, records, mean, std):
        self.images, self.labels, self.records = images, labels, records
        self.mean, self.std = mean, std

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        j, oy, ox, flip, cy, cx = self.records[i]
        img = self.images[j]
        _, h, w = img.shape
        img = F.pad(img, (4, 4, 4, 4))[:, oy : oy + h, ox : ox + w]
        if flip:
            img = img.flip(2)
        x = (img.float() / 255 - self.mean) / self.std
        x[:, max(cy - 8, 0) : cy + 8, max(cx - 8, 0) : cx + 8] = 0
        return x, self.labels[j]


class TestImages(TorchDataset):
    def __init__(self, images, labels, mean, std):
        self.images, self.labels, self.mean, self.std = images, labels, mean, std

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return (self.images[i].float() / 255 - self.mean) / self.std, self.labels[i]


def epoch_records(idx, batch_size, gen, h, w):
    """The records of one epoch, drawn in fedistill's order (TensorPipeline.epoch_batches/train_batch)."""
    order = idx[torch.randperm(idx.numel(), generator=gen)]
    records = []
    for start in range(0, order.numel(), batch_size):
        chunk = order[start : start + batch_size]
        b = chunk.numel()
        oy = torch.randint(0, 9, (b,), generator=gen)
        ox = torch.randint(0, 9, (b,), generator=gen)
        flip = torch.rand(b, generator=gen) < 0.5
        cy = torch.randint(0, h, (b,), generator=gen)
        cx = torch.randint(0, w, (b,), generator=gen)
        records += zip(chunk.tolist(), oy.tolist(), ox.tolist(), flip.tolist(), cy.tolist(), cx.tolist())
    return records


def plain_fedavg(cfg, dataset, federation, rounds, log):
    global_model = build_model_for(cfg.model_copy(update={"run": cfg.run.model_copy(update={"channels_last": False})}), dataset, (INIT,))
    mean, std = dataset.mean[0], dataset.std[0]
    _, h, w = dataset.input_shape
    test_loader = DataLoader(TestImages(dataset.test_x, dataset.test_y, mean, std), batch_size=50)
    rows = []
    for rnd in range(1, rounds + 1):
        start = time.perf_counter()
        lr = cfg.local.lr * cfg.local.lr_decay ** (rnd - 1)
        selected = sample_clients(federation.num_clients, cfg.clients_per_round, cfg.seed, rnd)
        states, sizes, samples = [], [], 0
        for cid in selected:
            idx = federation.train_indices[cid]
            gen = make_generator(cfg.seed, CLIENT, rnd, cid)
            local = copy.deepcopy(global_model)
            local.train()
            opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=cfg.local.momentum, weight_decay=cfg.local.weight_decay)
            for _ in range(cfg.local.epochs):
                loader = DataLoader(
                    AugmentedSamples(dataset.train_x, dataset.train_y, epoch_records(idx, cfg.local.batch_size, gen, h, w), mean, std),
                    batch_size=cfg.local.batch_size, shuffle=False,
                )
                for x, y in loader:
                    loss = F.cross_entropy(local(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    samples += len(y)
            states.append(local.state_dict())
            sizes.append(len(idx))
        train_seconds = time.perf_counter() - start
        total = sum(sizes)
        new_state = {k: sum(s[k] * (n / total) for s, n in zip(states, sizes)) for k in states[0]}
        global_model.load_state_dict(new_state)
        eval_start = time.perf_counter()
        global_model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in test_loader:
                correct += (global_model(x).argmax(1) == y).sum().item()
        acc = 100.0 * correct / len(dataset.test_y)
        row = {"round": rnd, "test_accuracy": acc, "samples": samples, "train_seconds": train_seconds,
               "eval_seconds": time.perf_counter() - eval_start, "seconds": time.perf_counter() - start}
        rows.append(row)
        log(f"plain round {rnd}: acc {acc:.2f} {row['seconds']:.2f}s")
    return rows


def fedistill_fedavg(cfg, dataset, federation, log, label):
    sim = Simulation(cfg, dataset, federation=federation)
    samples_per_round = []

    def on_round(row):
        log(f"{label} round {row['round']}: acc {row['test_accuracy']:.2f} {row['seconds']:.2f}s")

    sim.on_round = on_round
    history = sim.run()
    for rnd in range(1, cfg.rounds + 1):
        selected = sample_clients(federation.num_clients, cfg.clients_per_round, cfg.seed, rnd)
        samples_per_round.append(cfg.local.epochs * sum(int(federation.train_indices[c].numel()) for c in selected))
    for row, samples in zip(history, samples_per_round):
        row["samples"] = samples
    return history


def summarise(rows, skip=1):
    rows_t = rows[skip:] if len(rows) > skip else rows
    train_s = sum(r["train_seconds"] for r in rows_t)
    return {
        "s_per_round": float(np.mean([r["seconds"] for r in rows_t])),
        "train_samples_per_s": sum(r["samples"] for r in rows_t) / train_s,
        "eval_s_per_round": float(np.mean([r["eval_seconds"] for r in rows_t])),
        "final_accuracy": rows[-1]["test_accuracy"],
        "best_accuracy": max(r["test_accuracy"] for r in rows),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default=os.environ.get("FEDISTILL_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data")))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", choices=list(VARIANTS), action="append")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    log_path = Path(args.out) / "bench_fedavg_mnist.log"
    logf = open(log_path, "a")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    cfg = build_config(PROTOCOL, {"rounds": args.rounds, "dataset.data_dir": args.data_dir})
    dataset = load_dataset("mnist", args.data_dir)
    federation = build_federation(cfg, dataset)
    results = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__,
                    "python": platform.python_version(), "nproc": os.cpu_count()},
        "rounds": args.rounds,
        "runs": {},
    }
    # plain first: fedistill's runs change process-wide settings (the allocator) that plain must not get.
    todo = [v for v in VARIANTS if v in (args.only or VARIANTS)]
    for name in todo:
        torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        if name == "plain":
            rows = plain_fedavg(cfg, dataset, federation, args.rounds, log)
        else:
            variant = {k: args.threads if v == "THREADS" else v for k, v in VARIANTS[name].items()}
            run_cfg = build_config(PROTOCOL, {"rounds": args.rounds, "dataset.data_dir": args.data_dir, **variant})
            rows = fedistill_fedavg(run_cfg, dataset, federation, log, name)
        results["runs"][name] = {"summary": summarise(rows), "rows": rows, "wall_s": time.perf_counter() - t0}
        log(f"{name}: {json.dumps(results['runs'][name]['summary'])}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / f"bench_fedavg_mnist-{stamp}.json"
    out.write_text(json.dumps(results, indent=1))
    base = results["runs"].get("plain", {}).get("summary")
    print("\n| implementation | s/round | local-training samples/s | eval s/round | best acc % | final acc % | speed-up vs plain |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results["runs"].items():
        s = r["summary"]
        ratio = f"{base['s_per_round'] / s['s_per_round']:.2f}x" if base else "-"
        print(f"| {name} | {s['s_per_round']:.2f} | {s['train_samples_per_s']:.0f} | {s['eval_s_per_round']:.2f} | "
              f"{s['best_accuracy']:.2f} | {s['final_accuracy']:.2f} | {ratio} |")
    print(f"\nraw: {out}")


if __name__ == "__main__":
    main()
