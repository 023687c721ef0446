"""The in-process round loop of DESIGN.md (:class:`RoundLoop`).

``broadcast -> local_update -> aggregate -> evaluate`` for the clients sampled each round, in client-id
order, with bytes counted from the Messages, a checkpoint every N rounds and exact resume. It is handed
the algorithm as a factory (``fedistill.simulation.Simulation`` passes the registry's builder): the
engine imports nothing from ``algorithms/``."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, Callable

from ..config import Config
from ..data.dataset import Dataset
from ..data.pipeline import TensorPipeline
from ..errors import ConfigError
from ..models.flat import weights_resident
from ..protocol import Algorithm, Message, RoundInfo, ServerContext, declares_resident_weights
from .client import AlgorithmFactory, ClientRuntime
from .cores import POOL_MIN_ROUND_FLOPS, CorePlanner, client_threads, count, usable_cores
from .cohort_choice import resolve_cohort
from .executors import AdaptiveExecutor, CohortExecutor, ProcessPoolExecutor, SequentialExecutor, make_executor, unguarded_main_script
from .federation import Federation, build_federation
from .run_setup import apply_process_settings, round_info, round_training_flops
from .server import RunState, ServerRuntime


class RoundLoop:
    """Runs ``cfg.rounds`` rounds in one process: a ServerRuntime whose messages go straight to a ClientRuntime.

    ``algorithm_factory(cfg)`` builds the method (once for the server, once for the clients' runtime, and once
    in each worker process): the caller plugs it in (``fedistill.simulation.Simulation``)."""

    def __init__(
        self,
        cfg: Config,
        dataset: Dataset,
        run_dir: Path | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        federation: Federation | None = None,
        *,
        algorithm_factory: AlgorithmFactory,
    ) -> None:
        algorithm = algorithm_factory(cfg)
        # run.cohort=auto becomes a size or the sequential path here, once (engine/cohort_choice.py): the server,
        # the clients and the checkpoint's numerics all see the choice, the run header says why.
        cfg, self.cohort_choice = resolve_cohort(cfg, algorithm)
        self.cfg = cfg
        self.on_round = on_round
        # Called with round 1's FLOPs when set: :meth:`run` then runs round 1 under the FLOP counter (the
        # bench's first-seed cells; engine/flops.py) and marks its row, whose seconds include the counter's cost.
        self.count_first_round: Callable[[int], None] | None = None
        apply_process_settings(cfg)
        self.federation = federation or build_federation(cfg, dataset)
        fed = self.federation
        sizes = tuple(fed.client_sizes().tolist())  # n_k of the population (FedDyn's α_k)
        self.server_runtime = ServerRuntime(
            cfg,
            dataset,
            fed.num_clients,
            run_dir,
            client_num_samples=sizes,
            client_test_indices=fed.test_indices,
            client_evaluator=self._evaluate_on_clients,
            partition_digest=fed.partition_digest(),
            algorithm=algorithm,
        )
        self.client_runtime = ClientRuntime(
            cfg,
            dataset,
            fed.train_map(),
            fed.test_map(),
            algorithm_factory=algorithm_factory,
        )
        self.dataset = dataset
        # run.resident_weights: the Message boundary leaves vectors on the device (issue 66 item 3), for the
        # methods whose code was checked for it; any other method is refused here, never run half-resident.
        self.resident_weights = cfg.run.resident_weights
        if self.resident_weights and not declares_resident_weights(self.server_runtime.algorithm):
            from ..registry import ALGORITHMS

            checked = [name for name in ALGORITHMS.names() if ALGORITHMS.get(name).__dict__.get("resident_weights", False)]
            raise ConfigError(
                f"run.resident_weights: {cfg.algorithm.display_name()} was not checked for vectors that stay on the "
                f"device; it runs {', '.join(checked)}: drop run.resident_weights"
            )
        if self.resident_weights:  # init_server made its state outside a round, on the host (SCAFFOLD's c)
            self.server_runtime.server_state_to_device()
        self._executor: SequentialExecutor | ProcessPoolExecutor | AdaptiveExecutor | None = None

    @property
    def executor(self) -> SequentialExecutor | ProcessPoolExecutor | AdaptiveExecutor:
        if self._executor is None:  # started on first use: worker processes cost a second or two
            # A worker builds the same runtime as this process's: the class with the algorithm factory bound.
            runtime_factory = functools.partial(ClientRuntime, algorithm_factory=self.client_runtime.algorithm_factory)
            planner = make_planner(self.cfg, self.dataset, self.federation) if self.cfg.run.workers == "auto" else None
            self._executor = make_executor(self.cfg, self.dataset, self.federation, self.client_runtime, runtime_factory, planner)
        return self._executor

    def core_plan(self) -> str:
        """How this run uses the cores, and why (the run header's line): ``run.workers=auto`` plans it now
        (engine/cores.py; round 1 uses this plan, later rounds their own), a fixed count says so."""
        executor = self.executor
        threads = count(client_threads(self.cfg), "thread")
        if isinstance(executor, CohortExecutor):
            return f"run.cohort={executor.size}: the round's clients of one architecture {executor.size} at a time as one batched step, in this process"
        if isinstance(executor, AdaptiveExecutor):
            planner = executor.planner
            return planner.plan(wanted=self.cfg.clients_per_round).describe() + (" (planned every round)" if planner.max_processes > 1 else "")
        if isinstance(executor, ProcessPoolExecutor):
            return f"run.workers={self.cfg.run.workers}: {self.cfg.run.workers} client processes of {threads}"
        return f"run.workers=1: clients in this process, {threads}"

    def close(self, abandon: bool = False) -> None:
        """Stop worker processes (if any). Safe to call more than once. ``abandon``: the round in progress was
        interrupted, so its running clients are stopped rather than waited for."""
        if self._executor is not None:
            executor, self._executor = self._executor, None
            executor.close(abandon=abandon)

    # The server's pieces, under the names the rest of the code and the tests use.
    @property
    def server(self) -> ServerContext:
        return self.server_runtime.server

    @property
    def algorithm(self) -> Algorithm:
        return self.server_runtime.algorithm

    @property
    def state(self) -> RunState:
        return self.server_runtime.state

    @property
    def pipeline(self) -> TensorPipeline:
        return self.client_runtime.pipeline

    @property
    def run_dir(self) -> Path | None:
        return self.server_runtime.run_dir

    @run_dir.setter
    def run_dir(self, path: Path | None) -> None:
        self.server_runtime.run_dir = path

    @property
    def checkpoint_path(self) -> Path | None:
        return self.server_runtime.checkpoint_path

    def restore(self, path: Path | None = None, **options: Any) -> bool:
        restored = self.server_runtime.restore(path, **options)
        if self.resident_weights:  # the checkpoint holds host tensors: the server's vectors go back to the device
            self.server_runtime.server_state_to_device()
        return restored

    def round_info(self, rnd: int) -> RoundInfo:
        return round_info(self.cfg, rnd)

    def run_round(self, rnd: int) -> dict[str, Any]:
        with weights_resident(self.resident_weights):
            return self._run_round(rnd)

    def _run_round(self, rnd: int) -> dict[str, Any]:
        started = time.perf_counter()
        info = self.round_info(rnd)
        selected = self.server_runtime.select_clients(rnd)
        store = self.server_runtime.client_store
        tasks = []
        for cid in selected:
            msg = self.server_runtime.broadcast(info, cid)
            tasks.append((cid, info, msg, store.load(cid)))
        results = self.executor.run(tasks)
        replies: dict[int, Message] = {}
        for (cid, _, _, _), (reply, state) in zip(tasks, results):
            replies[cid] = reply
            store.save(cid, state, rnd)
        bytes_down = sum(msg.nbytes() for _, _, msg, _ in tasks)
        bytes_up = sum(reply.nbytes() for reply in replies.values())
        labels = self.federation.class_counts_of(selected).sum(axis=0).tolist()  # the round's clients only: O(1) in K
        return self.server_runtime.complete_round(info, replies, bytes_down, bytes_up, started, train_label_counts=labels)

    def _evaluate_on_clients(self, info: RoundInfo, messages: dict[int, Message]) -> dict[int, Message]:
        store = self.server_runtime.client_store
        tasks = [(cid, info, msg, store.load(cid)) for cid, msg in messages.items()]
        return dict(zip(messages, self.executor.evaluate(tasks)))

    def _counted_round(self, rnd: int) -> dict[str, Any]:
        from .flops import FLOPS_COUNTED_KEY, counted_flops

        rows: list[dict[str, Any]] = []
        self.server_runtime.next_row_marks[FLOPS_COUNTED_KEY] = True
        count = self.count_first_round
        assert count is not None  # run() calls this only when it is set
        count(counted_flops(lambda: rows.append(self.run_round(rnd))))
        return rows[0]

    def run(self, resume: bool = False) -> list[dict[str, Any]]:
        """Run (or continue) to ``cfg.rounds``; returns the per-round metric rows."""
        if resume:
            self.restore()
        try:
            for rnd in range(self.state.round + 1, self.cfg.rounds + 1):
                row = self._counted_round(rnd) if rnd == 1 and self.count_first_round is not None else self.run_round(rnd)
                if self.on_round:
                    self.on_round(row)
        except KeyboardInterrupt:
            self.close(abandon=True)
            raise
        finally:
            self.close()
        return self.state.history


def make_planner(cfg: Any, dataset: Any, federation: Any) -> Any:
    """The core planner of a ``run.workers=auto`` run: at most one process per usable core (of ``run.threads``
    threads), per client of a round, and one (this process) when a round's training is too small to pay for
    worker processes or runs on an accelerator."""
    threads = client_threads(cfg)
    usable = usable_cores()
    most, why = max(1, min(usable // threads, cfg.clients_per_round)), None
    if usable // threads < 2:
        why = f"{count(threads, 'thread')} each"
    elif cfg.clients_per_round < 2:
        why = "one client a round"
    elif cfg.run.device != "cpu":
        most, why = 1, f"clients on {cfg.run.device}"
    elif (script := unguarded_main_script()) is not None:
        most, why = 1, f"worker processes would run {script} again (call fedistill.run under `if __name__ == \"__main__\":`)"
    else:
        flops = round_training_flops(cfg, dataset, federation)
        if flops < POOL_MIN_ROUND_FLOPS:
            most, why = 1, f"a round of about {flops / 1e9:.3g} GFLOP is too small for worker processes"
    return CorePlanner(threads, most, single_reason=why)
