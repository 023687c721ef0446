"""Why some members of a FedProto group fail under nearest-prototype inference (the ht_resnet4 clients of mixed4).

For each FedProto run directory given (its last checkpoint): the run's federation is rebuilt from the
checkpoint's config (same partition, same per-client test splits, same normalisation), each client's own model is
loaded from the state file the checkpoint refers to, and on the client's own test split, in eval mode, fp32,
under inference mode, the script measures

* ``proto``: accuracy by the nearest global prototype (the run's ``inference: prototype``, fedproto.md P5), with
  the prototypes the checkpoint's server state holds, i.e. the ones round R's evaluation scored with;
* ``head``: accuracy by the client's own linear head (what ``inference: head`` would report);
* ``|f|``: the mean L2 norm of the client's 512-wide features;
* for every class c in the client's test split, the distance from the client's class mean of test features m_c
  to the global prototype P^c (``d_own``) and to the nearest global prototype of another class (``d_other``);
  ``ratio`` is the mean over those classes of d_own / d_other (above 1: the class mean sits closer to another
  class's prototype than to its own);
* ``top``: the share of the client's test samples given the single most predicted class under the prototypes,
  beside ``majority``, the share of its most frequent true class (``top`` far above ``majority``: the features
  fall into one prototype's cell);
* the feature subspace of the member: a member whose own feature is n < 512 wide (``PooledToDim.native_dim``:
  ResNet-4's 64, ResNet-8's 256) has every feature f in the n-dimensional image S of ``pool_to_dim``, so
  ``‖f − P^c‖² = ‖f − Π_S P^c‖² + ‖Π_⊥ P^c‖²``: the second term is a per-class constant the client cannot move.
  ``floor`` is the mean over the client's classes of ‖Π_⊥ P^c‖ (the least d_own can be), and ``proj`` the
  accuracy by the nearest *projected* prototype Π_S P^c (the same prediction without those constants; equal to
  ``proto`` for a 512-wide member). The per-class constants are printed per member.

It prints the norms of the global prototypes, a per-member summary (mean over the member's clients) and a
per-client table, and checks the mean of ``proto`` over the clients against the run's last ``personal_accuracy``
in metrics.jsonl (and each client's against ``personal_accuracies``).

Usage: python benchmarks/diagnose_fedproto_members.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from fedistill.algorithms.hetero import load_own_model
from fedistill.class_losses import nearest_prototype_scores
from fedistill.config import build_config
from fedistill.engine.state_store import client_states_of
from fedistill.models.group import pool_to_dim
from fedistill.protocol import ClassRows
from fedistill.runner import load_dataset_for
from fedistill.simulation import Simulation

SHORT = {"ht_fedavgcnn": "FedAvgCNN", "ht_mlp": "MLP", "ht_resnet4": "ResNet-4", "ht_resnet8": "ResNet-8"}


def last_metrics(run_dir: Path) -> dict:
    """The last row of metrics.jsonl that has a personal accuracy."""
    last: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("personal_accuracy") is not None:
            last = row
    return last


def feature_projection(model: torch.nn.Module, dim: int) -> torch.Tensor | None:
    """The orthogonal projection ``(dim, dim)`` onto the subspace the model's features can take (the image of
    ``pool_to_dim`` from its own width), or None when that is all of R^dim."""
    native = getattr(model, "native_dim", dim)
    basis = pool_to_dim(torch.eye(native, dtype=torch.float64), dim).T  # (dim, native): the image of each unit vector
    u, sv, _ = torch.linalg.svd(basis, full_matrices=False)
    u = u[:, sv > sv.max() * 1e-9]
    return None if u.shape[1] >= dim else (u @ u.T).float()


@torch.inference_mode()
def client_stats(ctx, batches, prototypes: torch.Tensor, present: torch.Tensor) -> dict:
    """The client's model (already loaded into ``ctx.model``) on its test batches: both accuracies, the feature
    norm, the class-mean distances to the global prototypes and their split along the member's feature subspace."""
    model = ctx.model
    model.eval()
    features, labels = [], []
    for x, y in batches:
        features.append(model.extract(x).float())
        labels.append(y)
    f, y = torch.cat(features), torch.cat(labels)
    by_proto = nearest_prototype_scores(f, prototypes, present).argmax(1)
    by_head = model.classify(f).float().argmax(1)
    projection = feature_projection(model, f.shape[1])
    if projection is None:
        by_projected, residual = by_proto, torch.zeros(prototypes.shape[0])
    else:
        by_projected = nearest_prototype_scores(f, prototypes @ projection, present).argmax(1)
        residual = (prototypes - prototypes @ projection).norm(dim=1)
        off_subspace = float((f - f @ projection).norm(dim=1).max())
        assert off_subspace < 1e-3 * float(f.norm(dim=1).max()) + 1e-6, f"features leave the subspace: {off_subspace}"
    held = [int(c) for c in torch.unique(y)]
    d_own, d_other, ratios = [], [], []
    for c in held:
        mean = f[y == c].mean(0)
        dist = (prototypes - mean).norm(dim=1)
        dist = torch.where(present, dist, torch.full_like(dist, float("inf")))
        own = float(dist[c])
        other = float(torch.cat([dist[:c], dist[c + 1 :]]).min())
        d_own.append(own)
        d_other.append(other)
        ratios.append(own / other)
    predicted = torch.bincount(by_proto, minlength=prototypes.shape[0])
    n = y.numel()
    return {
        "n": n,
        "classes": held,
        "proto": 100.0 * float((by_proto == y).double().mean()),
        "head": 100.0 * float((by_head == y).double().mean()),
        "feature_norm": float(f.norm(dim=1).mean()),
        "d_own": sum(d_own) / len(d_own),
        "d_other": sum(d_other) / len(d_other),
        "ratio": sum(ratios) / len(ratios),
        "top": 100.0 * float(predicted.max()) / n,
        "majority": 100.0 * float(torch.bincount(y).max()) / n,
        "floor": sum(float(residual[c]) for c in held) / len(held),
        "proj": 100.0 * float((by_projected == y).double().mean()),
        "residual": residual,
    }


def diagnose(run_dir: Path) -> None:
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False, map_location="cpu")
    cfg = build_config(checkpoint["config"], source=str(run_dir / "config.yaml"))
    if cfg.algorithm.name != "fedproto":
        raise SystemExit(f"{run_dir}: algorithm {cfg.algorithm.name}, not fedproto")
    sim = Simulation(cfg, load_dataset_for(cfg))
    try:
        digest = sim.federation.partition_digest()
        clients = sim.client_runtime
        glob = ClassRows(checkpoint["server_state"]["prototype_classes"], checkpoint["server_state"]["prototype_rows"])
        prototypes, present = glob.dense(sim.dataset.num_classes, clients.device)
        states = client_states_of(checkpoint["client_store"], run_dir)  # read only: the files the checkpoint names
        rows = []
        for cid in sorted(states):
            ctx = clients.context(cid, checkpoint["round"], states[cid])
            load_own_model(ctx)  # the worker of its architecture now holds this client's own weights
            batches = clients.pipeline.test_batches_of(ctx.test_indices, cfg.eval.batch_size)
            rows.append({"cid": cid, "arch": clients.architecture(cid), **client_stats(ctx, batches, prototypes, present)})
    finally:
        sim.close()

    metrics = last_metrics(run_dir)
    mean_proto = sum(r["proto"] for r in rows) / len(rows)
    mean_head = sum(r["head"] for r in rows) / len(rows)
    print(f"\n## {run_dir} (round {checkpoint['round']}, {len(rows)} clients)\n")
    print(f"partition digest: rebuilt {digest}, checkpoint {checkpoint['partition_digest']}"
          f" ({'same' if digest == checkpoint['partition_digest'] else 'DIFFERENT'})")  # fmt: skip
    logged = metrics.get("personal_accuracy")
    print(f"proto accuracy, mean over clients: {mean_proto:.4f}; metrics.jsonl round {metrics.get('round')}: "
          f"{logged if logged is None else f'{logged:.4f}'}; head accuracy, mean over clients: {mean_head:.4f}")  # fmt: skip
    logged_each = dict(zip(metrics.get("personal_clients", []), metrics.get("personal_accuracies", [])))
    worst = max((abs(r["proto"] - logged_each[r["cid"]]) for r in rows if r["cid"] in logged_each), default=float("nan"))
    print(f"largest per-client difference to metrics.jsonl's personal_accuracies: {worst:.6f} points")
    norms = prototypes.norm(dim=1)
    print("global prototype norms (class: norm): " + ", ".join(
        f"{c}: {float(norms[c]):.2f}" if bool(present[c]) else f"{c}: absent" for c in range(len(norms))))  # fmt: skip
    off = [float((prototypes[a] - prototypes[b]).norm()) for a in range(len(norms)) for b in range(len(norms))
           if a < b and bool(present[a]) and bool(present[b])]  # fmt: skip
    print(f"distance between two prototypes: min {min(off):.2f}, mean {sum(off) / len(off):.2f}, max {max(off):.2f}")

    archs = list(dict.fromkeys(r["arch"] for r in rows))
    for arch in archs:
        residual = next(r["residual"] for r in rows if r["arch"] == arch)
        if float(residual.max()) > 0:
            print(f"{SHORT.get(arch, arch)}: ‖Π_⊥ P^c‖ per class (the distance its features can never close): "
                  + ", ".join(f"{c}: {float(residual[c]):.2f}" for c in range(len(residual))))  # fmt: skip

    keys = ("proto", "head", "proj", "feature_norm", "d_own", "d_other", "ratio", "floor", "top", "majority")
    print("\n| member | clients | proto % | head % | proj % | feature norm | d_own | d_other | ratio own/other | floor | top % | majority % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for arch in archs:
        group = [r for r in rows if r["arch"] == arch]
        m = {k: sum(r[k] for r in group) / len(group) for k in keys}
        print(f"| {SHORT.get(arch, arch)} | {len(group)} | {m['proto']:.2f} | {m['head']:.2f} | {m['proj']:.2f} | "
              f"{m['feature_norm']:.2f} | {m['d_own']:.2f} | {m['d_other']:.2f} | {m['ratio']:.3f} | {m['floor']:.2f} | "
              f"{m['top']:.1f} | {m['majority']:.1f} |")  # fmt: skip

    print("\n| client | member | test n | classes | proto % | logged % | head % | proj % | feature norm | d_own | d_other | ratio | floor | top % | majority % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        logged_r = logged_each.get(r["cid"])
        print(f"| {r['cid']} | {SHORT.get(r['arch'], r['arch'])} | {r['n']} | {''.join(map(str, r['classes']))} | "
              f"{r['proto']:.2f} | {'-' if logged_r is None else f'{logged_r:.2f}'} | {r['head']:.2f} | {r['proj']:.2f} | "
              f"{r['feature_norm']:.2f} | {r['d_own']:.2f} | {r['d_other']:.2f} | {r['ratio']:.3f} | {r['floor']:.2f} | "
              f"{r['top']:.1f} | {r['majority']:.1f} |")  # fmt: skip


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    torch.set_num_threads(1)
    for run_dir in sys.argv[1:]:
        diagnose(Path(run_dir))


if __name__ == "__main__":
    main()
