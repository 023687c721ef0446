"""How long a pool of worker processes takes to start and train its first step: spawned (each process imports
torch, fedistill and, on torch.optim's first parameter group, torch._dynamo) against forked from fedistill's fork
server (engine/executors.py ``process_context``: those imports made once, in the server).

    python benchmarks/bench_worker_start.py [--workers 2] [--pools 3]

Prints one line per pool: the seconds from creating the pool to the end of ``--workers`` tasks, each a first SGD
step in a process that has not trained (a pool that starts fast may run them all in one worker: the line says in
how many). The first fork-server pool includes starting the server. Run it on an idle machine; results in
benchmarks/RESULTS.md, "Worker start"."""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import time


def first_step(_: int) -> int:
    import os

    import torch

    import fedistill.algorithms  # noqa: F401  (what a client worker imports)

    torch.set_num_threads(1)
    weight = torch.nn.Parameter(torch.zeros(4))
    optimiser = torch.optim.SGD([weight], lr=0.1)
    weight.sum().backward()
    optimiser.step()
    return os.getpid()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pools", type=int, default=3)
    args = parser.parse_args()
    from fedistill.engine.executors import process_context

    for name, context in (("spawn", multiprocessing.get_context("spawn")), ("fork server", process_context())):
        for pool_number in range(1, args.pools + 1):
            start = time.perf_counter()
            with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context) as pool:
                pids = set(pool.map(first_step, range(args.workers)))
            print(f"{name:11s} pool {pool_number}: {time.perf_counter() - start:6.2f} s for {args.workers} tasks in {len(pids)} worker(s)", flush=True)


if __name__ == "__main__":
    main()
