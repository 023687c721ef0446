"""Summarise a federated-distillation comparison made with `fedistill reproduce` (issue 12).

For every run under PRESET_DIR/<column>/<method>/seed0: seconds per round split into the clients' part and the
server's (aggregation: the FD server's training on the uploaded features), personalised accuracy per round
with its spread over clients in the last round, and bytes per round against exchanging the same clients'
weights and against FedAvg's bytes per round where the directory has a FedAvg run.

    python benchmarks/summarise_fd.py /tmp/bench_fd/fedict_fmnist_homo [/tmp/bench_fd/fedict_fmnist_hetero ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarise(preset_dir: Path) -> None:
    for column in sorted(p for p in preset_dir.iterdir() if p.is_dir()):
        runs = {m.name: m / "seed0" for m in sorted(column.iterdir()) if (m / "seed0" / "metrics.jsonl").is_file()}
        history = {name: rows_of(path) for name, path in runs.items()}
        fedavg_bytes = None
        if "FedAvg" in history:
            fedavg_bytes = statistics.fmean(r["bytes_up"] + r["bytes_down"] for r in history["FedAvg"])
        print(f"### {preset_dir.name} / {column.name}\n")
        print("| method | rounds | s/round | clients s | server s | final acc % | best acc % | min / median / max % (last) | MB/round | × weight exchange | × FedAvg bytes |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, rows in history.items():
            seconds = statistics.fmean(r["seconds"] for r in rows)
            clients = statistics.fmean(r["train_seconds"] for r in rows)
            server = statistics.fmean(r["seconds"] - r["train_seconds"] - r["eval_seconds"] for r in rows)
            accs = [r["personal_accuracy"] for r in rows if r.get("personal_accuracy") is not None]
            last = rows[-1]
            traffic = statistics.fmean(r["bytes_up"] + r["bytes_down"] for r in rows)
            weights = statistics.fmean(r["bytes_weight_exchange"] for r in rows)
            versus_fedavg = f"{traffic / fedavg_bytes:.1f}" if fedavg_bytes else "-"
            spread = f"{last['personal_min']:.1f} / {last['personal_median']:.1f} / {last['personal_max']:.1f}"
            print(
                f"| {name} | {len(rows)} | {seconds:.1f} | {clients:.1f} | {server:.1f} | {accs[-1]:.2f} | {max(accs):.2f} | "
                f"{spread} | {traffic / 1e6:.1f} | {traffic / weights:.1f} | {versus_fedavg} |"
            )
        width = max(len(rows) for rows in history.values())
        print("\npersonalised accuracy (%) by round:\n")
        print("| method | " + " | ".join(str(i) for i in range(1, width + 1)) + " |")
        print("|---|" + "---|" * width)
        for name, rows in history.items():
            cells = [f"{r['personal_accuracy']:.1f}" if r.get("personal_accuracy") is not None else "-" for r in rows]
            print(f"| {name} | " + " | ".join(cells + [""] * (width - len(cells))) + " |")
        print()


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        summarise(Path(arg))
