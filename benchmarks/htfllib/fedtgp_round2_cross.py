"""FedTGP's round 2 on one set of inputs through both server steps (issue 63, item 6; spec/fedtgp.md A3).

The comparison's round 2 parted (ours 12.3 / 17.6 / 9.2 % pooled, HtFLlib's 58.2 / 49.6 / 18.5) while round 1 and
the rounds from 3 on agreed. This takes one reference run's saved state (``apply_edits.py --keep-state DIR``; a
FedTGP run of ``run_reference.sh`` with ``-gr 2`` is enough) and runs round 2's server update from it, on the same
uploads and the same starting generator, through HtFLlib's own ``update_TGP`` and through ours
(``adaptive_margin``, ``sgd_on_rows`` on ``margin_contrastive_loss``), each under many shuffle orders, then scores
every resulting set of global prototypes as round 2's evaluation does: the nearest prototype to the features of
the reference's round-2 client models, pooled over all clients' test samples. It also prints, for the reference's
own run, what decides that score: the features' norm against the prototypes' norms.

Run it with the reference's interpreter (torch, numpy; HtFLlib's own code imported from its tree) and our sources:

    PYTHONPATH=path/to/fedistill/src python benchmarks/htfllib/fedtgp_round2_cross.py \
        --htfllib HTFLLIB_ROOT --state DIR --shuffles 20
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from torch import nn

CLIENTS, CLASSES = 20, 10


def client_split(root: Path, split: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's HtFLlib file (a pickled dict ``data`` = {x, y}), read as the comparison's data."""
    data = np.load(root / "dataset" / "mnist" / split / f"{k}.npz", allow_pickle=True)["data"].tolist()
    return torch.as_tensor(data["x"]).float(), torch.as_tensor(data["y"]).long()


def prototype_table(path: Path) -> torch.Tensor:
    saved = torch.load(path, weights_only=False)  # HtFLlib's own pickle, written by the run being read
    return torch.stack([saved[c] for c in range(CLASSES)]).float()


def reference_step(state: Path, seed: int, scratch: Path) -> torch.Tensor:
    """HtFLlib's ``receive_protos`` + ``update_TGP`` (its code, on a stand-in for its server object) from the
    generator after round 1 on round 2's uploads, its DataLoader shuffled from ``torch.manual_seed(seed)``."""
    from flcore.servers.servertgp import FedTGP  # HtFLlib's, from --htfllib

    folder = scratch / f"reference_{seed}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(state / "r1", folder)  # the generator as round 2 starts (Server_TGP.pt)
    clients = [types.SimpleNamespace(id=k, role=f"Client_{k}", save_folder_name=f"{state / 'r2'}/") for k in range(CLIENTS)]
    server = types.SimpleNamespace(
        role="Server", save_folder_name=f"{folder}/", num_classes=CLASSES, device="cpu", server_learning_rate=0.01,
        batch_size=10, server_epochs=100, margin_threthold=100, CEloss=nn.CrossEntropyLoss(), selected_clients=clients,
    )  # fmt: skip
    FedTGP.receive_protos(server)
    torch.manual_seed(seed)
    FedTGP.update_TGP(server)
    return prototype_table(folder / "Server_global_protos.pt")


def our_step(state: Path, seed: int) -> torch.Tensor:
    """fedistill's server update (fedtgp.py ``aggregate``'s calls) from the same generator weights and uploads."""
    from fedistill.algorithms.fedtgp import PrototypeGenerator
    from fedistill.algorithms.hetero import sgd_on_rows
    from fedistill.class_losses import adaptive_margin, margin_contrastive_loss, mean_over_holders

    theirs = torch.load(state / "r1" / "Server_TGP.pt", weights_only=False)
    generator = PrototypeGenerator(CLASSES, theirs.embedings.weight.shape[1], theirs.fc.weight.shape[1])
    with torch.no_grad():  # the same weights under our names
        generator.embedding.weight.copy_(theirs.embedings.weight)
        generator.net[0].load_state_dict(theirs.middle[0][0].state_dict())
        generator.net[2].load_state_dict(theirs.fc.state_dict())
    uploads = [torch.load(state / "r2" / f"Client_{k}_protos.pt", weights_only=False) for k in range(CLIENTS)]
    classes = [torch.tensor(sorted(u)) for u in uploads]
    rows = [torch.stack([u[c] for c in sorted(u)]).float() for u in uploads]
    means, present = mean_over_holders([(c, r, None) for c, r in zip(classes, rows)], CLASSES)
    margin = adaptive_margin(means, present, 100.0)
    sgd_on_rows(
        generator, lambda x, y: margin_contrastive_loss(x, y, generator(), margin), torch.cat(rows), torch.cat(classes),
        epochs=100, batch_size=10, lr=0.01, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    with torch.no_grad():
        return generator().float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--htfllib", type=Path, required=True, help="the reference's tree (apply_edits.py applied)")
    parser.add_argument("--state", type=Path, required=True, help="the --keep-state DIR of a FedTGP reference run")
    parser.add_argument("--shuffles", type=int, default=20)
    args = parser.parse_args()
    for needed in ("r1/Server_TGP.pt", "r2/Server_global_protos.pt", "r2/Client_0_protos.pt", "r2/Client_0_model.pt"):
        if not (args.state / needed).is_file():
            sys.exit(f"fedtgp_round2_cross.py: {args.state / needed} is missing: run the reference's FedTGP with "
                     "apply_edits.py --keep-state DIR for at least 2 rounds")  # fmt: skip
    sys.path.insert(0, str(args.htfllib / "system"))
    torch.set_num_threads(1)

    tests = [client_split(args.htfllib, "test", k) for k in range(CLIENTS)]
    with torch.no_grad():  # round 2's evaluation: the reference's client models after round 2, eval mode
        features = [torch.load(args.state / "r2" / f"Client_{k}_model.pt", weights_only=False).eval().base(x)
                    for k, (x, _) in enumerate(tests)]  # fmt: skip

    def pooled_nearest(prototypes: torch.Tensor) -> float:
        correct = sum((torch.cdist(f, prototypes).argmin(1) == y).sum().item() for f, (_, y) in zip(features, tests))
        return 100 * correct / sum(len(y) for _, y in tests)

    own, before = prototype_table(args.state / "r2" / "Server_global_protos.pt"), prototype_table(args.state / "r1" / "Server_global_protos.pt")
    print(f"the reference's own round 2: {pooled_nearest(own):.1f} % by the new prototypes, {pooled_nearest(before):.1f} % "
          f"by round 1's (which the clients were pulled to); client features' mean norm "
          f"{torch.cat(features).norm(dim=1).mean():.1f}, round 1's prototypes' norms {before.norm(dim=1).min():.1f}-"
          f"{before.norm(dim=1).max():.1f}, round 2's {own.norm(dim=1).min():.1f}-{own.norm(dim=1).max():.1f}")  # fmt: skip
    scores: dict[str, list[float]] = {"HtFLlib's update_TGP": [], "fedistill's server step": []}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in range(args.shuffles):
            scores["HtFLlib's update_TGP"].append(pooled_nearest(reference_step(args.state, seed, Path(scratch))))
            scores["fedistill's server step"].append(pooled_nearest(our_step(args.state, seed)))
    for side, values in scores.items():
        print(f"{side}, {len(values)} shuffles: {statistics.mean(values):.1f} ± {statistics.stdev(values):.1f} % "
              f"(min {min(values):.1f}, max {max(values):.1f}): {' '.join(f'{v:.1f}' for v in values)}")  # fmt: skip
    a, b = scores.values()
    diff = statistics.mean(b) - statistics.mean(a)
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    print(f"fedistill − HtFLlib: {diff:+.1f} points (standard error {se:.1f})")


if __name__ == "__main__":
    main()
