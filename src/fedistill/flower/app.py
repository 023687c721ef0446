"""The Flower ServerApp and ClientApp that run any fedistill algorithm unchanged.

Server (``server_app``): reads the fedistill configuration from the run config (see :mod:`.settings`),
builds the same :class:`~fedistill.simulation.ServerRuntime` the simulation uses, finds which
SuperNode holds which client (a ``query.fedistill_hello`` message answered with the node's
``partition-id``), and then, every round, sends the broadcast Messages of the sampled clients, waits for
the replies (at most ``round-timeout`` seconds, less when a SuperNode leaves) and hands them to
``ServerRuntime.complete_round``: aggregation in client-id order, evaluation, metrics and checkpoints are
the simulation's own code. The run directory is written as by ``fedistill run``.

Client (``client_app``): rebuilds the dataset and its own partition from the node config --
``partition-id`` and ``num-partitions`` with the run's partitioner and seed, or ``data-dir``, a local
directory whose whole train split is this client's data -- and runs ``ClientRuntime.update`` with the
client's persistent state kept in ``context.state``. The rebuilt runtime is kept for the rest of the run
in the process (``_CLIENT_CACHE``): Flower's own ``flwr-clientapp`` handles one message per process, the
long-running ClientApp of :mod:`.worker` all of a node's messages, loading the data once per run.

Node config keys (``flower-supernode --node-config '...'``): ``partition-id`` (this node's client id,
required), ``num-partitions`` (must equal ``partition.num_clients``), ``data-dir`` (optional, local data),
``threads`` (torch intra-op threads of the ClientApp process; by default the run's ``run.threads``, which
the server resolves to what ``fedistill run`` uses, so that the numbers equal the simulation's).

A fedistill error in the ServerApp (a failed round, a wrong run-config key) prints one line and ends the
Flower run as ``finished:failed``, without a traceback; ``flwr run`` itself exits 0 either way.

Length (over the ~500-line guide of ARCHITECTURE.md): the ServerApp and the ClientApp of one deployment and the
message handling they share; the opt-in accelerators are worker.py and supernode.py.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message as FlowerMessage, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from ..algorithms.base import Message
from ..config import Config, build_config
from ..errors import ConfigError, FedistillError, TrainingDiverged
from .records import load_client_state, message_to_records, records_to_message, records_to_round, save_client_state
from .settings import FlowerSettings, with_client_threads

log = logging.getLogger("fedistill.flower")

HELLO = "query.fedistill_hello"
TRAIN = "train.fedistill"
EVALUATE = "evaluate.fedistill"
_INFO = "fedistill.info"
_CONFIG = "fedistill.config"


class RoundFailed(FedistillError):
    """Too few clients replied in time; the run stops and keeps its last checkpoint."""


class FederationError(FedistillError):
    """The SuperNodes do not match the configuration (partition ids, counts)."""


def _say(text: str) -> None:
    # The ServerApp's stdout is what `flwr log` / `flwr run --stream` show.
    print(f"[fedistill] {text}", flush=True)


# ======================================================================================= server
@dataclass
class NodeMap:
    """Client id <-> SuperNode id, learned by asking each node for its node config."""

    grid: Grid
    num_clients: int
    config_json: str
    node_of: dict[int, int] = field(default_factory=dict)
    asked: set[int] = field(default_factory=set)
    own_data: set[int] = field(default_factory=set)  # clients whose SuperNode has its own data-dir (a site)

    def live_nodes(self) -> set[int]:
        return set(self.grid.get_node_ids())

    def discover(self, wait: float, need: set[int] | None = None) -> None:
        """Ask new nodes who they are until every client in ``need`` (default: all) has a node or ``wait`` passes."""
        need = set(range(self.num_clients)) if need is None else need
        deadline = time.monotonic() + wait
        pending: dict[str, int] = {}  # message id -> node id
        while True:
            live = self.live_nodes()
            for cid in [c for c, n in self.node_of.items() if n not in live]:
                del self.node_of[cid]  # the node left; a restarted SuperNode comes back with a new id
            new = [n for n in live if n not in self.asked]
            if new:
                msgs = [
                    FlowerMessage(
                        RecordDict({_CONFIG: ConfigRecord({"json": self.config_json, "num_clients": self.num_clients})}),
                        dst_node_id=n,
                        message_type=HELLO,
                        ttl=max(wait, 60.0),
                    )
                    for n in new
                ]
                for n, mid in zip(new, self.grid.push_messages(msgs)):
                    pending[mid] = n
                    self.asked.add(n)
            if pending:
                for reply in self.grid.pull_messages(list(pending)):
                    node = pending.pop(reply.metadata.reply_to_message_id, None)
                    if node is None:
                        continue
                    if reply.has_error():
                        _say(f"SuperNode {node} could not answer the discovery query: {reply.error.reason}")
                        continue
                    self._register(node, reply.content.config_records[_INFO])
            if need <= set(self.node_of) or time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def _register(self, node: int, info: ConfigRecord) -> None:
        if "error" in info:
            raise FederationError(f"SuperNode {node}: {info['error']}")
        cid, count = int(info["partition-id"]), int(info["num-partitions"])
        if count != self.num_clients:
            raise FederationError(
                f"SuperNode {node} has num-partitions={count} but the configuration has partition.num_clients="
                f"{self.num_clients}; start every SuperNode with --node-config 'partition-id=<0..{self.num_clients - 1}> "
                f"num-partitions={self.num_clients}'"
            )
        if not 0 <= cid < self.num_clients:
            raise FederationError(f"SuperNode {node} has partition-id={cid}, outside 0..{self.num_clients - 1}")
        other = self.node_of.get(cid)
        if other is not None and other != node and other in self.live_nodes():
            raise FederationError(f"SuperNodes {other} and {node} both have partition-id={cid}; each client needs its own")
        self.node_of[cid] = node
        if info.get("data-dir"):
            self.own_data.add(cid)
        else:
            self.own_data.discard(cid)
        where = f"data-dir {info['data-dir']}" if info.get("data-dir") else f"partition {cid}/{count}"
        _say(f"client {cid} is SuperNode {node} ({where})")


def _wait_for_replies(
    grid: Grid, sent: dict[str, int], node_of: dict[int, int], timeout: float
) -> tuple[dict[int, FlowerMessage], dict[int, str]]:
    """Pull the replies of ``sent`` (message id -> client id) until all arrived, their nodes left, or timeout."""
    start = time.monotonic()
    deadline = start + timeout
    replies: dict[int, FlowerMessage] = {}
    failed: dict[int, str] = {}
    pending = dict(sent)
    next_liveness = time.monotonic() + 1.0
    while pending:
        for reply in grid.pull_messages(list(pending)):
            cid = pending.pop(reply.metadata.reply_to_message_id, None)
            if cid is None:
                continue
            if reply.has_error():
                failed[cid] = f"error reply ({reply.error.reason})"
            else:
                replies[cid] = reply
        if not pending:
            break
        now = time.monotonic()
        if now >= deadline:
            for cid in pending.values():
                failed[cid] = f"no reply within round-timeout={timeout:g}s"
            break
        if now >= next_liveness:  # a SuperNode that left will never answer: stop waiting for it
            live = set(grid.get_node_ids())
            for mid, cid in list(pending.items()):
                if node_of.get(cid) not in live:
                    failed[cid] = "its SuperNode left the federation"
                    del pending[mid]
            next_liveness = now + 1.0
        # Replies of a small model come within a second or two: look often then, less after 10 s.
        time.sleep(0.05 if now - start < 10.0 else 0.2)
    return replies, failed


def continue_command(run_dir: str | Path, extra: str = "") -> str:
    """What to type to continue ``run_dir`` on Flower (the app directory and connection are the user's)."""
    return f"flwr run <app> <connection> --run-config 'resume=true run-dir={json.dumps(str(run_dir))}{extra}'"


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _run_to_continue(settings: FlowerSettings, cfg: Config) -> Path:
    """The run directory ``resume=true`` continues, checked before any work (one-line errors)."""
    from ..engine.checkpoint import RESUMABLE_DIFFERENCES
    from ..report.rundir import RunDirectory

    if not settings.run_dir:
        raise ConfigError(f"run config resume=true needs run-dir, the run directory to continue: {continue_command('<run directory>')}")
    path = Path(settings.run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run config run-dir: {path} is a file, not a run directory; correct run-dir")
    if not path.is_dir():
        where = "" if path.is_absolute() else f" (a relative run-dir starts at the SuperLink's working directory, {Path.cwd()})"
        raise ConfigError(
            f"run config run-dir: {path} does not exist on the SuperLink machine{where}, so resume=true has nothing "
            f"to continue; correct run-dir, or start a new run there without resume=true: "
            f"--run-config 'run-dir={json.dumps(str(path))}'"
        )
    if not (path / "config.yaml").is_file():
        raise ConfigError(
            f"run config run-dir: {path} has no config.yaml, so it holds no fedistill run to continue; correct run-dir, "
            "or start a new run in another directory without resume=true: --run-config 'run-dir=\"<new run directory>\"'"
        )
    saved_path = path / "config.yaml"
    saved = _flat(build_config(RunDirectory(path).read_config(), {}, source=str(saved_path)).resolved_dict())
    current = _flat(cfg.resolved_dict())
    for key in sorted(set(saved) | set(current)):
        if key.split(".")[0] in RESUMABLE_DIFFERENCES or saved.get(key) == current.get(key):
            continue
        value = saved.get(key)
        text = str(value).lower() if isinstance(value, bool) else str(value) if isinstance(value, (int, float)) else "<value>"
        raise ConfigError(
            f"resume: {key} is {current.get(key)!r} in the submitted configuration but {value!r} in {saved_path}; "
            "only rounds and run.* may change when a run is continued: submit the app that started it (or set it back "
            f"with --run-config \"overrides='{key}={text}'\" besides resume and run-dir), or start a new run with another run-dir"
        )
    return path


def _new_run_path(settings: FlowerSettings, cfg: Config) -> tuple[Path, str]:
    """(path, run-config key that chose it) of a new run directory; an existing non-empty one is refused."""
    if settings.run_dir:
        path, key = Path(settings.run_dir), "run-dir"
        if path.name in ("", ".", ".."):
            raise ConfigError(f"run config run-dir: {settings.run_dir!r} must name the run's own directory, e.g. runs/digits-flower")
        other = "another run-dir"
    else:
        default = f"{cfg.algorithm.display_name()}-{cfg.dataset.name}-flower"
        path, key = Path(cfg.run.out_dir) / (cfg.run.name or f"{default}-{time.strftime('%Y%m%d-%H%M%S')}"), "run.name"
        other = "another run-dir (or --run-config \"overrides='run.name=<name>'\")"
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        what = "a file, not a run directory" if not path.is_dir() else "a run directory that already exists"
        raise ConfigError(f"{'run config ' if key == 'run-dir' else ''}{key}: {path} is {what}; choose {other}, or continue it with {continue_command(path)}")
    return path, key


def run_server(grid: Grid, cfg: Config, settings: FlowerSettings) -> dict[str, Any]:
    """The round loop of a fedistill run on Flower; returns the summary (also written to summary.json).

    Everything a user can get wrong (run directory, configuration of a continued run, dataset, partition,
    model) is checked before anything is written. A continued run (``resume=true``) rewrites its
    config.yaml only once its checkpoint is restored; without a checkpoint (it stopped before the first
    one) it starts again from round 1.
    """
    from ..engine.federation import build_federation
    from ..engine.run_setup import apply_process_settings, round_info
    from ..engine.summary import summarise
    from ..simulation import ServerRuntime  # the engine's, with the configured method plugged in
    from ..report.plots import accuracy_label, config_title, plot_accuracy, plot_class_distributions, plot_partition, plot_personal_accuracy
    from ..report.rundir import RunDirectory
    from ..report.environment import environment_info
    from ..report.runlog import ROUND_LINE_WIDTH, round_line
    from ..runner import load_dataset_for, model_parameters

    cfg = with_client_threads(cfg)
    if cfg.run.resident_weights:  # refused, not ignored: a Flower Message leaves the process, so it is on the host
        raise ConfigError("run.resident_weights: the weights stay on one process's device in the in-process simulation; "
                          "on Flower every Message crosses the network from the host, so drop run.resident_weights")  # fmt: skip
    if isinstance(cfg.run.cohort, int):  # refused, not ignored: Flower trains each client on its own node (auto: sequential)
        raise ConfigError("run.cohort: cohort training stacks clients in one process (the in-process simulation); "
                          "on Flower each client trains on its node, so unset run.cohort")  # fmt: skip
    if settings.resume:
        path, key = _run_to_continue(settings, cfg), "run-dir"
    else:
        path, key = _new_run_path(settings, cfg)
    apply_process_settings(cfg)
    dataset = load_dataset_for(cfg)
    federation = build_federation(cfg, dataset)  # the partition statistics of the run directory
    num_clients = federation.num_clients
    # Client sizes from the server's copy of the partition (exact with partition-id nodes; with node-local
    # data-dir files the server does not know them, so FedDyn's adaptive α_k uses the partition's sizes).
    sizes = tuple(federation.client_sizes().tolist())
    runtime = ServerRuntime(
        cfg, dataset, num_clients, path, client_num_samples=sizes, client_test_indices=federation.test_indices,
        partition_digest=federation.partition_digest(),
    )
    note = ""
    if settings.resume:
        run_dir = RunDirectory(path)
        hint = (
            f"allow it with {continue_command(path, ' allow-numeric-change=true')} "
            f"(the change is recorded in {path / 'resumes.jsonl'})"
        )
        restored = runtime.restore(allow_numeric_change=settings.allow_numeric_change, hint=hint)
        done = runtime.state.round
        if restored and cfg.rounds < done:
            raise ConfigError(
                f"resume: {path} already has {done} rounds; rounds={cfg.rounds} cannot take them back: continue it with "
                f"more rounds (--run-config \"overrides='rounds=<more than {done}>'\" besides resume and run-dir) "
                "or leave rounds as they were"
            )
        note = run_dir.begin_resume(runtime.state.history, restored, cfg.rounds, runtime.numeric_changes)
    else:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if key == "run-dir":
                raise ConfigError(f"run config run-dir: cannot create {path} ({exc.strerror}); choose another run-dir") from None
            raise ConfigError(
                f"run.out_dir: cannot create {path} ({exc.strerror}); choose a run-dir, or another run.out_dir with "
                "--run-config \"overrides='run.out_dir=<directory>'\""
            ) from None
        run_dir = RunDirectory.create(path.parent, path.name, path.name, continue_hint=continue_command(path))
    if not settings.resume or runtime.state.round < cfg.rounds:
        run_dir.write_config(cfg.resolved_dict())
        run_dir.write_environment(environment_info(cfg))
    counts, partial = federation.report_counts()  # a generated federation's first 1,000 clients (as fedistill run)
    run_dir.write_partition(counts)
    title = config_title(cfg)  # as `fedistill run` and `partition`
    if partial:
        title += f" (first {counts.shape[0]:,} of {federation.num_clients:,} clients)"
    if cfg.run.figures:
        plot_partition(counts, run_dir.path / "partition.png", title)
    # The accuracy that rounds, summaries and plots report, as `fedistill run`: the global model's on the
    # test set, or (partition.per_client_test) the clients' mean on their own test splits.
    accuracy_key, accuracy_name = (
        ("personal_accuracy", "personal accuracy") if cfg.accuracy_metric() == "personal" else ("test_accuracy", "accuracy")
    )
    _say(
        f"{cfg.algorithm.display_name()} on {cfg.dataset.name}, {num_clients} clients, {cfg.clients_per_round}/round, "
        f"{cfg.rounds} rounds, {cfg.run.threads} thread(s) per client -> {run_dir.path}{note}"
    )

    def finish(status: str, error: str | None = None) -> dict[str, Any]:
        history = runtime.state.history
        summary = summarise(history, cfg.eval.target_accuracy, cfg.accuracy_metric())
        summary.update(status=status, run_dir=str(run_dir.path), **model_parameters(cfg, dataset, runtime.server.model, num_clients))
        if error:
            summary["error"] = error
        run_dir.write_csv(history)
        run_dir.write_summary(summary)
        return summary

    try:
        nodes = NodeMap(grid, num_clients, json.dumps(cfg.to_dict()))
        nodes.discover(settings.discovery_timeout)

        def evaluate_on_clients(info: Any, messages: dict[int, Message]) -> dict[int, Message]:
            """Flower's evaluate phase for personalised models the clients assemble (MTFL, DemLearn): each
            client builds its model from the message and its context.state and answers with its counts."""
            reachable = [cid for cid in messages if cid in nodes.node_of]
            outgoing = [
                FlowerMessage(
                    message_to_records(messages[cid], info, cid),
                    dst_node_id=nodes.node_of[cid],
                    message_type=EVALUATE,
                    group_id=str(info.round),
                    ttl=settings.round_timeout,
                )
                for cid in reachable
            ]
            sent = dict(zip(grid.push_messages(outgoing), reachable)) if outgoing else {}
            arrived, lost = _wait_for_replies(grid, sent, nodes.node_of, settings.round_timeout)
            if lost or len(reachable) < len(messages):
                missing = sorted(set(messages) - set(arrived))
                _say(f"round {info.round}: no personalised evaluation from client(s) {missing}; the metrics cover the others")
            return {cid: records_to_message(arrived[cid].content) for cid in sorted(arrived)}

        runtime.client_evaluator = evaluate_on_clients
        # Sites with their own files have test splits the server never saw: the global model's personalised
        # accuracy must then be measured on the clients too.
        runtime.personal_on_clients = bool(nodes.own_data)
        missing = sorted(set(range(num_clients)) - set(nodes.node_of))
        if missing:
            _say(f"after {settings.discovery_timeout:g}s no SuperNode holds client(s) {missing}; rounds go on without them")
        for rnd in range(runtime.state.round + 1, cfg.rounds + 1):
            started = time.perf_counter()
            info = round_info(cfg, rnd)
            selected = runtime.select_clients(rnd)
            live = nodes.live_nodes()
            unmapped = {c for c in selected if nodes.node_of.get(c) not in live}
            if unmapped:  # a SuperNode restarted (new node id) or joined late: ask the new ones, briefly
                nodes.discover(min(10.0, settings.round_timeout), need=unmapped)
                runtime.personal_on_clients = bool(nodes.own_data)
            messages: dict[int, Message] = {cid: runtime.broadcast(info, cid) for cid in selected}
            reachable = [cid for cid in selected if cid in nodes.node_of]
            failed: dict[int, str] = {cid: "no SuperNode holds this client" for cid in selected if cid not in nodes.node_of}
            outgoing = [
                FlowerMessage(
                    message_to_records(messages[cid], info, cid),
                    dst_node_id=nodes.node_of[cid],
                    message_type=TRAIN,
                    group_id=str(rnd),
                    ttl=settings.round_timeout,
                )
                for cid in reachable
            ]
            sent = dict(zip(grid.push_messages(outgoing), reachable)) if outgoing else {}
            arrived, lost = _wait_for_replies(grid, sent, nodes.node_of, settings.round_timeout)
            failed.update(lost)
            replies = {cid: records_to_message(arrived[cid].content) for cid in sorted(arrived)}
            need = settings.required_replies(len(selected))
            if failed:
                detail = "; ".join(f"client {c}: {why}" for c, why in sorted(failed.items()))
                if len(replies) < need:
                    last = runtime.state.round
                    ckpt = runtime.checkpoint_path
                    kept = f"the last checkpoint (round {last}) is {ckpt}" if ckpt and ckpt.exists() else "no checkpoint was written yet"
                    raise RoundFailed(
                        f"round {rnd}: {len(replies)} of {len(selected)} sampled clients replied, {need} needed "
                        f"(min-fraction={settings.min_fraction:g}, min-replies={settings.min_replies}): {detail}. "
                        f"The run stops; {kept}. Restart the SuperNodes and continue with {continue_command(run_dir.path)}"
                    )
                _say(f"round {rnd}: continuing with {len(replies)} of {len(selected)} clients ({detail})")
            bytes_down = sum(messages[cid].nbytes() for cid in reachable)
            bytes_up = sum(reply.nbytes() for reply in replies.values())
            row = runtime.complete_round(info, replies, bytes_down, bytes_up, started)
            run_dir.append_metrics(row)
            # The simulation's round line (at most 80 columns; metrics.csv keeps every field), with the replies.
            _say(f"{round_line(row, cfg.rounds, accuracy_key, width=ROUND_LINE_WIDTH - 13)}  {len(replies):>3} clients")
    except TrainingDiverged as exc:
        finish("diverged", str(exc))
        raise
    except FedistillError as exc:  # RoundFailed, FederationError: the reason, in one line
        finish("failed", str(exc))
        raise
    except Exception as exc:  # anything else (a bug) still leaves a summary saying so
        finish("failed", f"{exc.__class__.__name__}: {exc}")
        raise
    except (KeyboardInterrupt, SystemExit):  # `flwr stop`, Ctrl-C, SIGTERM
        finish("stopped", "the run was stopped before its last round")
        raise
    summary = finish("finished")
    history = runtime.state.history
    if cfg.run.figures:
        curve = [(r["round"], r[accuracy_key]) for r in history if r.get(accuracy_key) is not None]
        algorithm = cfg.algorithm.display_name()
        title = config_title(cfg, extra=algorithm)
        plot_accuracy({algorithm: curve}, run_dir.path / "accuracy.png", cfg.eval.target_accuracy, ylabel=accuracy_label(accuracy_key), title=title)
        plot_personal_accuracy(history, run_dir.path / "personal_accuracy.png", algorithm, title=title)
        plot_class_distributions({algorithm: history}, run_dir.path / "class_distributions.png", title=config_title(cfg))
    _say(f"finished: final {accuracy_name} {summary['final_accuracy']}, run directory {run_dir.path}")
    return summary


class _NoTracebackForFedistillErrors(logging.Filter):
    """Drops the traceback Flower logs under "ServerApp raised an exception" when the exception is a
    fedistill error: its one-line reason was printed just before, and Flower still marks the run
    ``finished:failed`` with the reason as its status details (``flwr ls``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, FedistillError):
            record.exc_info = None
            record.exc_text = None
            record.msg = "ServerApp stopped by the fedistill error above (%s); the run is marked failed"
            record.args = (exc.__class__.__name__,)
        return True


_QUIET = _NoTracebackForFedistillErrors()


def _quicker_reply_pulls() -> None:
    """A reply's arrays reach the SuperLink just after the reply itself; Flower's grid then waits 1 s
    before asking again. Ask after 0.01 s instead (flwr 1.41 only: see :mod:`.supernode`)."""
    try:
        from flwr.superlink.grid import http_grid
    except ImportError:
        return
    from .supernode import quicker_object_pulls

    quicker_object_pulls(http_grid)


server_app = ServerApp()


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    """Run the configured fedistill run; a fedistill error ends it with one line and a failed Flower run.

    ``flwr run`` itself exits 0 whatever the run does (it only submits, and ``--stream`` only follows the
    logs), so a script reads the outcome from ``flwr ls`` (status ``finished:failed``) or from the run
    directory's summary.json (docs/flower.md, "Failures and resume").
    """
    _quicker_reply_pulls()
    try:
        settings = FlowerSettings.from_run_config(context.run_config)
        run_server(grid, settings.config(), settings)
    except FedistillError as exc:
        _say(f"error: {exc}")
        # Flower logs an exception leaving the ServerApp with its traceback (logger "flwr"); for our own
        # errors that is noise above the reason. The exception still propagates: the run is "failed".
        flower_logger = logging.getLogger("flwr")
        if _QUIET not in flower_logger.filters:
            flower_logger.addFilter(_QUIET)
        raise


# ======================================================================================= client
# The ClientRuntime of this process (dataset, partition, worker model), kept between messages. Flower's own
# `flwr-clientapp` handles one message per process, so there the cache lives for one message; in the
# long-running worker (`python -m fedistill.flower clientapp`, :mod:`.worker`) and in Ray's simulation
# workers it lives for the whole run. The key holds everything the runtime is built from -- the run id,
# the run's configuration (JSON), num-partitions, data-dir (with the partition-id of a site with its own
# files) and threads -- so a new run (a resume included), another configuration or another data directory
# builds afresh, the files of a site are read again for every run, and one runtime serves every partition-id
# of the run's dataset that reaches this process. One entry at a time: a finished run's data is dropped.
_CLIENT_CACHE: dict[tuple[Any, ...], Any] = {}
_CACHE_COUNTS = {"builds": 0, "hits": 0}


def client_cache_info() -> dict[str, int]:
    """How often this process built a ClientRuntime (loaded the data) and how often it reused one."""
    return {**_CACHE_COUNTS, "entries": len(_CLIENT_CACHE)}


def _node_identity(node_config: dict[str, Any]) -> tuple[int, int, str]:
    if "partition-id" not in node_config:
        raise ConfigError(
            "node config: partition-id is missing; start the SuperNode with "
            "--node-config 'partition-id=<client id> num-partitions=<number of clients>'"
        )
    pid = int(node_config["partition-id"])
    count = int(node_config.get("num-partitions", -1))
    return pid, count, str(node_config.get("data-dir", "") or "")


def _client_threads(cfg: Config, node_config: dict[str, Any]) -> int:
    """Torch threads of this ClientApp: node config ``threads`` if given, else the run's ``run.threads``.

    The ServerApp sends ``run.threads`` resolved (see :func:`with_client_threads`), so by default every
    client trains with the thread count of ``fedistill run`` and the numbers equal the simulation's. A
    node's ``threads`` overrides it (e.g. fewer threads on a small machine), at the price of that equality.
    """
    if "threads" in node_config:
        try:
            threads = int(node_config["threads"])
        except (TypeError, ValueError):
            threads = 0
        if threads < 1:
            raise ConfigError(f"node config threads: must be a whole number >= 1 (got {node_config['threads']!r})")
        return threads
    if cfg.run.threads is not None:
        return cfg.run.threads
    from ..engine.cores import client_threads

    return client_threads(cfg)


def _client_runtime(config_json: str, node_config: dict[str, Any], run_id: int | None = None) -> Any:
    """The ClientRuntime of this node for run ``run_id`` (cached in the process: see ``_CLIENT_CACHE``)."""
    pid, count, data_dir = _node_identity(node_config)
    # A partition of the run's dataset is one view of a federation every partition-id shares: the key leaves
    # the partition-id out, so a process that serves many of them (a Ray simulation worker) builds once. A
    # site's own files are that site's alone.
    key = (run_id, config_json, pid if data_dir else None, count, data_dir, str(node_config.get("threads", "")))
    cached = _CLIENT_CACHE.get(key)
    if cached is not None:
        runtime, threads = cached
        torch.set_num_threads(threads)  # another client's runtime in this process may have changed it
        _CACHE_COUNTS["hits"] += 1
        return runtime
    from ..engine.perf import keep_freed_memory_in_heap
    from ..engine.federation import build_federation
    from ..simulation import ClientRuntime  # the engine's, with the configured method plugged in
    from ..runner import load_dataset_for

    cfg = build_config(json.loads(config_json))
    threads = _client_threads(cfg, node_config)
    torch.set_num_threads(threads)
    if cfg.run.tune_allocator:
        keep_freed_memory_in_heap()
    if data_dir:
        # A site with its own files: its whole train split is this client's data.
        dataset = load_dataset_for(cfg, data_dir=data_dir, download=False)
        train = {pid: torch.arange(len(dataset.train_y), dtype=torch.int64)}
        test = {pid: torch.arange(len(dataset.test_y), dtype=torch.int64)} if cfg.partition.per_client_test else None
    else:
        if count != cfg.partition.num_clients:
            raise ConfigError(
                f"node config: num-partitions={count} but the run has partition.num_clients={cfg.partition.num_clients}"
            )
        dataset = load_dataset_for(cfg)
        fed = build_federation(cfg, dataset)
        train = fed.train_map()  # every partition's indices (views): any partition-id this process serves
        test = fed.test_map()
    runtime = ClientRuntime(cfg, dataset, train, test)
    _CLIENT_CACHE.clear()
    _CLIENT_CACHE[key] = (runtime, threads)
    _CACHE_COUNTS["builds"] += 1
    return runtime


def warm_up(context: Context) -> bool:
    """Build this node's ClientRuntime for the context's run ahead of its first train message.

    The long-running worker calls it once it has answered the discovery query (which brings the run's
    configuration), so that round 1 does not wait for the data. An error is left for the first train
    message to report, as it would without the warm-up; returns whether the runtime is ready.
    """
    if _CONFIG not in context.state.config_records:
        return False
    try:
        _client_runtime(str(context.state.config_records[_CONFIG]["json"]), dict(context.node_config), context.run_id)
    except Exception:  # pylint: disable=broad-exception-caught  (reported by the train message)
        log.debug("warm-up failed; the first train message reports the error", exc_info=True)
        return False
    return True


client_app = ClientApp()


@client_app.query("fedistill_hello")
def client_hello(msg: FlowerMessage, context: Context) -> FlowerMessage:
    """Tell the server which client this node is; keep the run's configuration for the train messages."""
    try:
        pid, count, data_dir = _node_identity(dict(context.node_config))
        info: dict[str, Any] = {"partition-id": pid, "num-partitions": count, "data-dir": data_dir}
    except FedistillError as exc:
        info = {"error": str(exc)}
    context.state.config_records[_CONFIG] = ConfigRecord({"json": str(msg.content.config_records[_CONFIG]["json"])})
    return FlowerMessage(RecordDict({_INFO: ConfigRecord(info)}), reply_to=msg)


def _client_of(msg: FlowerMessage, context: Context, what: str) -> tuple[Any, Any, int, dict[str, Any]]:
    """(ClientRuntime, RoundInfo, client id, client state) for a server message to this node."""
    if _CONFIG not in context.state.config_records:
        raise RuntimeError(f"fedistill: a {what} message arrived before the discovery query (no configuration)")
    info, cid = records_to_round(msg.content)
    node_config = dict(context.node_config)
    pid, _, _ = _node_identity(node_config)
    if cid != pid:
        raise RuntimeError(f"fedistill: message for client {cid} reached the SuperNode of client {pid}")
    runtime = _client_runtime(str(context.state.config_records[_CONFIG]["json"]), node_config, context.run_id)
    return runtime, info, cid, load_client_state(context.state, cid)


@client_app.train("fedistill")
def client_train(msg: FlowerMessage, context: Context) -> FlowerMessage:
    """One ``local_update`` of this node's client with its persistent state from ``context.state``."""
    runtime, info, cid, state = _client_of(msg, context, "train")
    reply = runtime.update(cid, info, records_to_message(msg.content), state)
    save_client_state(context.state, cid, state)
    return FlowerMessage(message_to_records(reply), reply_to=msg)


@client_app.evaluate("fedistill")
def client_evaluate(msg: FlowerMessage, context: Context) -> FlowerMessage:
    """The client's personalised model assembled from the message and its state, on its own test split; the
    state is read, not written."""
    runtime, info, cid, state = _client_of(msg, context, "evaluate")
    reply = runtime.evaluate_assembled(cid, info, records_to_message(msg.content), state)
    return FlowerMessage(message_to_records(reply), reply_to=msg)
