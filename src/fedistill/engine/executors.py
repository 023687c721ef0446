"""Executors: where the clients of a round run.

``SequentialExecutor`` runs them one after another in this process (``run.workers=1``).
``ProcessPoolExecutor`` runs them in ``workers`` processes with ``threads`` intra-op threads each: small
models at batch 50 use two cores poorly inside one step, so two one-thread workers do about 1.3x the work
of one two-thread process (benchmarks/RESULTS.md). ``AdaptiveExecutor`` (``run.workers=auto``, the default)
chooses between the two every round, and the pool's clients at once as clients finish, from the cores that
are free (engine/cores.py). Results do not depend on the executor's schedule:
every client draws from its own (seed, round, client) stream, replies are aggregated in client-id order,
and each worker has the same thread count, so any pool of the same thread count gives identical numbers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import ConfigError
from ..protocol import Message, RoundInfo
from .cores import client_threads, usable_cores
from .interrupts import uninterrupted
from .processes import abandon_pool, adopt_environment, exit_with_owner, process_context

Task = tuple[int, RoundInfo, Message, dict[str, Any]]  # (client id, round info, broadcast, client state)
Result = tuple[Message, dict[str, Any]]  # (reply, updated client state)
InFlight = int | Callable[[], int] | None  # clients at once: a count, a count asked again as clients finish, or all


def state_to(state: Any, device: torch.device) -> Any:
    """``state`` (a client's dict of tensors, possibly nested) with every tensor on ``device``."""
    if isinstance(state, torch.Tensor):
        return state.to(device, non_blocking=device.type == "cuda")
    if isinstance(state, dict):
        return {k: state_to(v, device) for k, v in state.items()}
    if isinstance(state, tuple) and hasattr(state, "_fields"):  # a NamedTuple takes its fields as arguments
        return type(state)(*(state_to(v, device) for v in state))
    if isinstance(state, (list, tuple)):
        return type(state)(state_to(v, device) for v in state)
    return state


class SequentialExecutor:
    def __init__(self, client_runtime: Any) -> None:
        self.client_runtime = client_runtime

    def run(self, tasks: Sequence[Task]) -> list[Result]:
        device = torch.device(self.client_runtime.device)
        results = []
        for cid, info, msg, state in tasks:
            if device.type == "cpu":
                results.append((self.client_runtime.update(cid, info, msg, state), state))
                continue
            # On an accelerator a client's state (SCAFFOLD's c_k, MOON's previous model) is on the device
            # only while that client trains: device memory holds one client at a time, whatever K is.
            on_device = state_to(state, device)
            reply = self.client_runtime.update(cid, info, msg, on_device)
            state.clear()
            state.update(state_to(on_device, torch.device("cpu")))
            results.append((reply, state))
        return results

    def evaluate(self, tasks: Sequence[Task]) -> list[Message]:
        """Each client's assembled personalised model on its test split (the states are read, not changed)."""
        return [self.client_runtime.evaluate_assembled(cid, info, msg, state) for cid, info, msg, state in tasks]

    def close(self, abandon: bool = False) -> None:
        pass


class CohortExecutor(SequentialExecutor):
    """``run.cohort = K``: a round's clients of one architecture trained K at a time as one batched step
    (engine/cohort.py), in this process. A client whose method says its step cannot batch this round
    (``cohort_term`` None, or a method without that hook) trains as the sequential executor trains it."""

    def __init__(self, client_runtime: Any, size: int) -> None:
        super().__init__(client_runtime)
        self.size = size
        self.padded_slots = 0  # masked slots so far (clients of a cohort with fewer steps than its longest)

    def run(self, tasks: Sequence[Task]) -> list[Result]:
        runtime = self.client_runtime
        algorithm = runtime.algorithm
        # A method whose step, as configured, does not batch (FedGen, a gradient clip), or one whose clients score
        # their own model right after training (personal model "local": ClientRuntime.update does that per
        # client), trains sequentially: decided for the round, so its clients load their weights once.
        from .cohort_choice import batches_clients

        if not batches_clients(algorithm):
            return super().run(tasks)
        groups: dict[str, list[int]] = {}
        for position, (cid, _, _, _) in enumerate(tasks):
            groups.setdefault(runtime.architecture(cid), []).append(position)
        results: list[Any] = [None] * len(tasks)
        for positions in groups.values():
            # Clients of similar step counts together (item 1): a cohort runs as many steps as its longest client,
            # the others masked, so with K below the round's clients the largest K train together, then the next.
            # A client's steps grow with its training-set size (E passes of ceil or floor n_k / B batches).
            positions = sorted(positions, key=lambda p: -int(runtime.train_indices[tasks[p][0]].numel()))
            for start in range(0, len(positions), self.size):
                self._train_cohort(tasks, positions[start : start + self.size], results)
        return results

    def _train_cohort(self, tasks: Sequence[Task], positions: list[int], results: list[Any]) -> None:
        from ..models.flat import get_flat, mean_loss_of, set_flat
        from .cohort import cohort_sgd

        runtime, local = self.client_runtime, self.client_runtime.cfg.local
        algorithm = runtime.algorithm
        planned: list[tuple[int, Any, Any, dict[str, torch.Tensor]]] = []
        starts, batches = [], []
        for position in positions:
            cid, info, msg, state = tasks[position]
            ctx = runtime.context(cid, info.round, state)
            algorithm.load_weights(ctx, msg["weights"])
            plan = algorithm.cohort_term(ctx, msg)
            if plan is None:  # this method's step cannot batch this round: the sequential path
                results[position] = super().run([tasks[position]])[0]
                continue
            term, fixed = plan
            planned.append((position, ctx, term, fixed))
            starts.append(get_flat(ctx.model, host=False))  # stays on the device: no host round trip per client
            # every epoch's batches, drawn from the client's stream in local_sgd's order (no draw in between)
            batches.append([b for _ in range(local.epochs) for b in ctx.data.epoch_batches(ctx.train_indices, local.batch_size, ctx.generator)])
        if not planned:
            return
        # One term for the cohort: each client may get its own closure, but of one function (its per-client
        # tensors go in ``fixed``); a method that gives clients different terms is a defect, said here.
        if len({getattr(t, "__code__", t) for _, _, t, _ in planned}) > 1:
            raise ValueError("cohort training: the clients of one cohort returned different loss terms")
        term = planned[0][2]
        keys = planned[0][3].keys()
        fixed = {key: torch.stack([f[key].to(runtime.device) for _, _, _, f in planned]) for key in keys}
        info = tasks[planned[0][0]][1]
        model = planned[0][1].model
        result = cohort_sgd(
            model, torch.stack(starts), batches, lr=info.lr, momentum=local.momentum, weight_decay=local.weight_decay,
            precision=runtime.cfg.run.precision, extra_loss=term, fixed=fixed,
        )  # fmt: skip
        self.padded_slots += result.padded_slots
        for k, (position, ctx, _, _) in enumerate(planned):
            cid, info, msg, state = tasks[position]
            set_flat(ctx.model, result.weights[k])
            seen = int(result.samples_seen[k])
            reply = algorithm.cohort_reply(
                ctx, info, msg, steps=int(result.steps[k]), samples_seen=seen, mean_loss=mean_loss_of(result.loss_sum[k], seen)
            )
            if torch.device(runtime.device).type != "cpu":  # what the client keeps goes back to the host, as sequentially
                state.update(state_to(state, torch.device("cpu")))
            results[position] = (reply, state)


# -- worker side -------------------------------------------------------------------------------
_WORKER_RUNTIME: Any = None


def _init_worker(
    runtime_factory: Callable[..., Any],
    config: dict[str, Any],
    dataset: Any,
    train_indices: Mapping[int, torch.Tensor],
    test_indices: Any,
    threads: int,
    environment: Mapping[str, str],
    owner: int,
) -> None:
    """A worker's client runtime: ``runtime_factory(cfg, dataset, train_indices, test_indices)`` (the parent's
    ClientRuntime class with its algorithm factory bound; pickled by reference, so the worker imports it)."""
    from ..config import build_config
    from .perf import keep_freed_memory_in_heap

    global _WORKER_RUNTIME
    adopt_environment(environment)
    exit_with_owner(owner)
    torch.set_num_threads(threads)
    cfg = build_config(config)
    if cfg.run.tune_allocator:
        keep_freed_memory_in_heap()
    _WORKER_RUNTIME = runtime_factory(cfg, dataset, train_indices, test_indices)


def _run_task(cid: int, info: RoundInfo, msg: dict[str, Any], state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    reply = _WORKER_RUNTIME.update(cid, info, Message(msg), state)
    return dict(reply), state


def _evaluate_task(cid: int, info: RoundInfo, msg: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    return dict(_WORKER_RUNTIME.evaluate_assembled(cid, info, Message(msg), state))


class ProcessPoolExecutor:
    """Clients in ``workers`` processes (``process_context``); the dataset tensors are shared, not copied."""

    def __init__(
        self, cfg: Any, dataset: Any, federation: Any, workers: int, threads: int, runtime_factory: Callable[..., Any]
    ) -> None:
        import torch.multiprocessing  # noqa: F401  (registers tensor sharing through shared memory)

        for tensor in (dataset.train_x, dataset.train_y, dataset.test_x, dataset.test_y):
            tensor.share_memory_()
        self._sizes = federation.client_sizes().tolist()
        # Views, not one tensor per client: a generated federation (synthetic) makes a client's indices on demand.
        train = federation.train_map()
        test = federation.test_map()
        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=workers,
            mp_context=process_context(),
            initializer=_init_worker,
            initargs=(runtime_factory, cfg.to_dict(), dataset, train, test, threads, dict(os.environ), os.getpid()),
        )

    def run(self, tasks: Sequence[Task], in_flight: InFlight = None) -> list[Result]:
        """The round's clients, at most ``in_flight`` at once (default: one per worker); each next client goes to
        the first worker that is free. Largest clients first (LPT scheduling): under label skew client sizes
        differ by 50x, and submitting in id order left one worker idle while the other trained the big client."""
        order = sorted(range(len(tasks)), key=lambda i: -self._sizes[tasks[i][0]])
        futures = self._feed(order, in_flight, lambda i: (_run_task, tasks[i][0], tasks[i][1], dict(tasks[i][2]), tasks[i][3]))
        out = []
        for i in range(len(tasks)):
            reply, state = futures[i].result()
            out.append((Message(reply), state))
        return out

    def pids(self) -> list[int]:
        """The worker processes' ids (those started so far)."""
        return list((getattr(self._pool, "_processes", None) or {}).keys())

    def _feed(self, order: list[int], in_flight: InFlight, call: Callable[[int], tuple[Any, ...]]) -> dict[int, Any]:
        """Submit ``call(i)`` for each ``i`` of ``order``, keeping at most ``in_flight`` unfinished: all at once when
        None (the pool's own queue hands them out as workers free up), or a count, or a function asked again each
        time a client finishes (engine/cores.py: another program or run took or gave back a core). Returns the
        futures by index, all done."""
        pending = collections.deque(order)
        futures: dict[int, concurrent.futures.Future[Any]] = {}
        running: set[concurrent.futures.Future[Any]] = set()

        def top_up() -> None:
            limit = len(order) if in_flight is None else in_flight() if callable(in_flight) else in_flight
            with uninterrupted():
                while pending and len(running) < max(1, limit):
                    i = pending.popleft()
                    futures[i] = self._pool.submit(*call(i))
                    running.add(futures[i])

        top_up()
        while running:
            done, running = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                future.result()  # a failed client stops the round here (the caller closes the pool)
            if pending:
                top_up()
        return futures

    def evaluate(self, tasks: Sequence[Task], in_flight: InFlight = None) -> list[Message]:
        futures = self._feed(list(range(len(tasks))), in_flight, lambda i: (_evaluate_task, tasks[i][0], tasks[i][1], dict(tasks[i][2]), tasks[i][3]))
        return [Message(futures[i].result()) for i in range(len(tasks))]

    def close(self, abandon: bool = False) -> None:
        """Stop the workers. ``abandon``: the round was interrupted and its results are thrown away, so the
        running clients are not waited for (a big client can take minutes); the workers are terminated."""
        if abandon:
            abandon_pool(self._pool)
        else:
            self._pool.shutdown(wait=True, cancel_futures=True)


def check_workers(cfg: Any) -> None:
    """Refuse worker settings this machine cannot honour; called before any work (and by make_executor)."""
    workers = cfg.run.workers
    cores = usable_cores()
    if cfg.run.threads is not None and cfg.run.threads > cores:
        raise ConfigError(
            f"run.threads: {cfg.run.threads} threads exceed the {cores} CPU cores this process may use; oversubscribing "
            f"makes rounds slower. Use run.threads={cores} or fewer (or leave it unset: 1 thread, and worker processes)"
        )
    if workers in ("auto", 1):
        return
    if cfg.run.device != "cpu":
        raise ConfigError(f"run.workers: parallel client workers run on the CPU only (run.device is {cfg.run.device!r}); use run.workers=1")
    script = unguarded_main_script()
    if script is not None:
        raise ConfigError(
            f"run.workers: {workers} worker processes would each run {script} again (a worker process imports the "
            "main script first); call fedistill.run under `if __name__ == \"__main__\":`, or use run.workers=auto or 1"
        )
    threads = client_threads(cfg)
    if workers * threads > cores:
        raise ConfigError(
            f"run.workers: {workers} workers x {threads} threads exceed the {cores} CPU cores this process may use; "
            "oversubscribing makes rounds several times slower. Lower run.workers or run.threads (or use run.workers=auto)"
        )


class AdaptiveExecutor:
    """``run.workers=auto``: each round's clients in as many one-thread worker processes as the cores that are
    free now allow (engine/cores.py), in this process when that is one. The pool is started the first time a
    round may use two processes or more, with one process per usable core; the processes a round may not use
    sleep. Which process trains a client does not change its numbers, so neither does the plan."""

    def __init__(self, client_runtime: Any, planner: Any, start_pool: Callable[[], ProcessPoolExecutor]) -> None:
        self.sequential = SequentialExecutor(client_runtime)
        self.planner = planner
        self._start_pool = start_pool
        self._pool: ProcessPoolExecutor | None = None

    def _processes(self, tasks: Sequence[Task]) -> int:
        plan = self.planner.plan(wanted=len(tasks))
        if plan.processes > 1 and self._pool is None:
            self._pool = self._start_pool()
        return plan.processes

    def pids(self) -> list[int]:
        return self._pool.pids() if self._pool is not None else []

    def _in_flight(self) -> int:
        # Asked each time a client finishes: a run started beside this one gets its share within one client's
        # training, not at the next round (a one-round run would otherwise keep both cores to the end).
        return self.planner.plan().processes

    def _as_planned(self, tasks: Sequence[Task], method: str) -> Any:
        """``method`` (run or evaluate) of the sequential executor when the plan is one process, else of the pool."""
        if self._processes(tasks) == 1:
            return getattr(self.sequential, method)(tasks)
        assert self._pool is not None
        return getattr(self._pool, method)(tasks, in_flight=self._in_flight)

    def run(self, tasks: Sequence[Task]) -> list[Result]:
        return self._as_planned(tasks, "run")

    def evaluate(self, tasks: Sequence[Task]) -> list[Message]:
        return self._as_planned(tasks, "evaluate")

    def close(self, abandon: bool = False) -> None:
        try:
            if self._pool is not None:
                self._pool.close(abandon=abandon)
        finally:
            self.planner.close()


def make_executor(
    cfg: Any,
    dataset: Any,
    federation: Any,
    client_runtime: Any,
    runtime_factory: Callable[..., Any],
    planner: Any = None,
) -> SequentialExecutor | ProcessPoolExecutor | AdaptiveExecutor:
    """The executor ``cfg.run.workers`` asks for: ``auto`` = planned every round by ``planner`` (an
    engine/cores.py ``CorePlanner``; engine/loop.py makes it), 1 = sequential, in this process, N = a fixed pool
    of N processes.
    ``runtime_factory(cfg, dataset, train_indices, test_indices)`` builds a worker's client runtime (picklable: a
    class with its algorithm factory bound)."""
    check_workers(cfg)
    if cfg.run.cohort == "auto":  # a defect of the caller, not of the user's config
        raise ValueError("run.cohort=auto is chosen once per run before the executor (engine/cohort_choice.resolve_cohort)")
    if cfg.run.workers == "auto" and cfg.run.cohort is None:
        if planner is None:
            raise ValueError("run.workers=auto needs the run's CorePlanner")
        executor = AdaptiveExecutor(
            client_runtime,
            planner,
            lambda: ProcessPoolExecutor(cfg, dataset, federation, planner.max_processes, client_threads(cfg), runtime_factory),
        )
        planner.own_pids = executor.pids
        return executor
    if cfg.run.cohort is not None:  # in this process (config: workers 1 or auto)
        from ..errors import ConfigError
        from .cohort import flat_layout

        try:  # refused before any work: a model whose BatchNorm statistics a padded batched step would corrupt
            flat_layout(client_runtime.worker_for(cfg.model_name()))
        except ValueError as exc:
            raise ConfigError(f"run.cohort: {exc}; unset run.cohort or use a model without BatchNorm") from None
        return CohortExecutor(client_runtime, cfg.run.cohort)
    if cfg.run.workers == 1:
        return SequentialExecutor(client_runtime)
    return ProcessPoolExecutor(cfg, dataset, federation, cfg.run.workers, client_threads(cfg), runtime_factory)


def unguarded_main_script() -> str | None:
    """The path of the script that worker processes would run again, or None when starting them is safe.

    A worker process, spawned or forked from the fork server (``process_context``), imports the parent's
    ``__main__`` script again before it does anything else. A script that calls ``fedistill.run`` at its top level, outside ``if __name__ ==
    "__main__":``, would start the whole run again in every worker. Safe: no script (an interactive session,
    ``python -c``, a notebook), or the call made under that guard (the CLI's entry point, pytest, a guarded
    script), or from code the script's top level did not reach directly."""
    import ast
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return None
    frame = sys._getframe()
    while frame is not None and not (frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return None  # the script has finished its top level: a worker's import of it starts nothing of this
    line = frame.f_lineno
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        return path  # cannot tell: assume the worst

    def is_main_test(test: ast.expr) -> bool:
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
            return False
        sides = [test.left, test.comparators[0]]
        return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
            isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
        )

    for node in ast.walk(tree):
        if isinstance(node, ast.If) and is_main_test(node.test) and node.body[0].lineno <= line <= (node.body[-1].end_lineno or line):
            return None
    return path
