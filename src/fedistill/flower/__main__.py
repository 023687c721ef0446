"""``python -m fedistill.flower app``: write the Flower App directory for a fedistill configuration.

    python -m fedistill.flower app --config configs/digits_fedavg.yaml --out flower-app \
        --set partition.num_clients=3 --round-timeout 300 --run-dir runs/digits-flower

Then ``flwr run flower-app <connection> --stream`` (docs/flower.md). An unset
``run.threads`` is written as the count ``fedistill run`` uses on this machine (see :mod:`.project`).

Two more commands make deployment rounds fast (docs/flower.md):

    python -m fedistill.flower supernode [--poll-interval 0.1] <flower-supernode options>   (:mod:`.supernode`)
    python -m fedistill.flower clientapp --insecure --runtime-api-address 127.0.0.1:9094      (:mod:`.worker`)
"""

from __future__ import annotations

import argparse
import sys

from ..config import build_config, read_yaml
from ..errors import FedistillError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["clientapp"]:
        from .worker import main as clientapp_main

        return clientapp_main(argv[1:])
    if argv[:1] == ["supernode"]:
        from .supernode import main as supernode_main

        return supernode_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m fedistill.flower", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("supernode", help="flower-supernode that polls the SuperLink faster while a run is active (options: supernode --help)")
    sub.add_parser("clientapp", help="a long-running ClientApp next to a SuperNode started with --isolation process (clientapp --help)")
    app = sub.add_parser("app", help="write a Flower App directory (pyproject.toml) for a fedistill configuration")
    app.add_argument("--config", help="fedistill YAML file (default: the defaults)")
    app.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a key (repeatable)")
    app.add_argument("--out", required=True, help="app directory to write (created if missing)")
    app.add_argument("--run-dir", default="", help="run directory on the SuperLink machine (default: run.out_dir/run.name)")
    app.add_argument("--round-timeout", type=float, default=600.0, help="seconds to wait for one round's replies (600)")
    app.add_argument("--min-fraction", type=float, default=1.0, help="fraction of sampled clients a round needs (1.0)")
    app.add_argument("--min-replies", type=int, default=1, help="replies a round needs at least (1)")
    app.add_argument("--discovery-timeout", type=float, default=120.0, help="seconds to wait for the SuperNodes at the start (120)")
    args = parser.parse_args(argv)
    try:
        from .project import write_app
        from .settings import with_client_threads

        given = build_config(read_yaml(args.config) if args.config else {}, args.overrides)
        cfg = with_client_threads(given)  # what the ClientApps train with (project.py)
        out = write_app(
            args.out,
            cfg,
            run_dir=args.run_dir,
            round_timeout=args.round_timeout,
            min_fraction=args.min_fraction,
            min_replies=args.min_replies,
            discovery_timeout=args.discovery_timeout,
        )
    except FedistillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {out / 'pyproject.toml'}: {cfg.algorithm.display_name()} on {cfg.dataset.name}, {cfg.partition.num_clients} clients; "
        f"start {cfg.partition.num_clients} SuperNodes with --node-config 'partition-id=<0..{cfg.partition.num_clients - 1}> "
        f"num-partitions={cfg.partition.num_clients}'"
    )
    if given.run.threads is None:
        print(
            f"run.threads={cfg.run.threads} (unset in the configuration: the count `fedistill run` uses on this machine, so "
            "that the Flower run gives its numbers; with several SuperNodes on one machine, --set run.threads=1)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
