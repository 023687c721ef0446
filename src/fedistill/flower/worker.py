"""A long-running ClientApp process: ``python -m fedistill.flower clientapp --runtime-api-address HOST:PORT``.

Flower 1.41 runs every message in a process of its own: the SuperNode's SuperExec (started by the
SuperNode, or separately with ``--isolation process``) claims each ClientApp task from the SuperNode's
Runtime API and starts ``flwr-clientapp --token T``, which handles that one message and exits. Each
message therefore pays the start of Python, the imports of flwr, PyTorch and fedistill, and the loading of
the client's dataset (about 4-10 s on 2 cores). Flower 1.41 has no mode that keeps ``flwr-clientapp``
alive: ``flwr/supernode/runtime/run_clientapp.py`` pulls one task input and ends in ``flwr_exit``.

This worker takes the SuperExec's place next to one SuperNode started with ``--isolation process``. It
claims ClientApp tasks itself (``AcquireTask``, as SuperExec does) and runs each one *in this process*
with the task's token, as ``flwr-clientapp`` would: pull the message and the run's context, call
fedistill's ``client_app``, push the reply and the updated context (``context.state``, the client
state) back to the SuperNode. Flower's message path, tokens, context handling and error replies are
unchanged; only the process no longer ends. The imports happen once, and fedistill's ClientApp keeps the
client's dataset, partition and model loaded for the whole run (:func:`fedistill.flower.app.warm_up`
builds them right after the discovery query, which brings the run's configuration, rather than while
round 1 waits for this client's reply).

Only fedistill's ClientApp runs here (the FAB's ``clientapp`` component must be
``fedistill.flower.app:client_app``): a task of any other app is answered with an error reply and marked
failed, so that no other code ever runs inside this long-lived process. Start such apps' SuperNodes
without ``--isolation process`` (or with Flower's own ``flower-superexec``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

FEDISTILL_CLIENTAPP = "fedistill.flower.app:client_app"
# The worker drives Flower's private modules (flwr.proto, flwr.supercore, flwr.supernode.runtime), which change
# between releases without notice: it runs only on the release it was written against. Flower's own
# per-message ClientApp (the default path, public API only) has no such limit.
SUPPORTED_FLWR = "1.41."


def flwr_version_error() -> str | None:
    """Why this worker refuses the installed flwr, or None where it is the supported release."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("flwr")
    except importlib.metadata.PackageNotFoundError:
        return "flwr is not installed: pip install 'fedistill[flower]'"
    if not version.startswith(SUPPORTED_FLWR):
        return (
            f"the long-running ClientApp drives Flower {SUPPORTED_FLWR}x's private modules and flwr {version} is "
            f"installed: install flwr=={SUPPORTED_FLWR}0 or start the SuperNode without --isolation process "
            "(Flower's per-message ClientApp works with any supported flwr)"
        )
    return None

log = logging.getLogger("fedistill.flower.worker")


@dataclass
class WorkerStats:
    """What the worker did (for its log line and the tests)."""

    tasks: int = 0
    failed: int = 0
    refused: int = 0
    seconds: list[float] = field(default_factory=list)  # per task: claim to output pushed


def clientapp_component(fab_content: bytes) -> str:
    """The ``[tool.flwr.app.components] clientapp`` reference of a FAB (its zipped pyproject.toml)."""
    from flwr.common.config import get_fab_config

    try:
        return str(get_fab_config(fab_content)["tool"]["flwr"]["app"]["components"]["clientapp"])
    except Exception as exc:  # pylint: disable=broad-exception-caught  (not a zip, no pyproject.toml, bad TOML ...)
        return f"<unreadable FAB: {exc}>"


def _http_failure(exc: BaseException) -> tuple[bool, int | None]:
    """(is it an error of httpx, the client Flower's Runtime API uses; its HTTP status if it has one).

    Told apart by the class's module, so that fedistill needs no import of httpx (a dependency of flwr's)."""
    from_httpx = any(cls.__module__.split(".")[0] == "httpx" for cls in type(exc).__mro__)
    response = getattr(exc, "response", None) if from_httpx else None
    return from_httpx, getattr(response, "status_code", None)


def _task_retry_invoker(max_time: float = 60.0) -> Any:
    """Retries for one task's calls: connection errors and 502/503/504 for at most ``max_time`` seconds.

    Flower's ``make_simple_http_retry_invoker`` ends the process on a refused token (401: SIGINT) and
    raises a BaseException on a stopped run (403); for a worker that outlives its tasks both only end
    the task, so here every other HTTP error is raised to ``run_task`` as an ordinary exception.
    """
    from flwr.supercore.retry import RetryInvoker, exponential

    def give_up(exc: Exception) -> bool:
        from_httpx, status = _http_failure(exc)
        return not from_httpx or (status is not None and status not in (502, 503, 504))

    return RetryInvoker(
        lambda: exponential(base_delay=0.2, max_delay=5),
        Exception,
        max_tries=None,
        max_time=max_time,
        should_giveup=give_up,
    )


def _runtime_client(address: str, insecure: bool, root_certificates: str | None, interceptors: list[Any], retry_invoker: Any) -> Any:
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.tls import validate_and_resolve_root_certificates

    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=validate_and_resolve_root_certificates(root_certificates, insecure),
        interceptors=interceptors,
        retry_invoker=retry_invoker,
    )


def _pull_input(client: Any, message_wait: float) -> tuple[Any, Any, Any, Any]:
    """(message, context, run, fab) of the claimed task, as ``flwr-clientapp``'s ``pull_task_input``.

    A SuperNode creates the task a moment before it stores the task's message; ``flwr-clientapp`` starts
    too slowly to notice, a warm worker does not. So an empty message list is asked again for up to
    ``message_wait`` seconds instead of failing the task.
    """
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest  # pylint: disable=E0611
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context = context_from_proto(res.context)
    run = run_from_proto(res.run)
    fab = fab_from_proto(res.fab)
    deadline = time.monotonic() + message_wait
    while True:
        pulled = client.PullMessages(PullAppMessagesRequest())
        if pulled.messages_list:
            break
        if time.monotonic() >= deadline:
            raise RuntimeError("No messages received from Runtime API")
        time.sleep(0.01)
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    # The SuperNode may still be fetching the message's objects from the SuperLink: ask again soon (Flower's
    # defaults, 1 s doubling to 10 s, suit a process that took seconds to start, not one that is waiting).
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message,
        max_tries_per_object=None,
        initial_backoff=0.01,
        backoff_cap=0.2,
    )
    message.metadata.__dict__["_message_id"] = tree.object_id  # the deflated message lacks its own id
    return message, context, run, fab


def _task_heartbeat(client: Any) -> Callable[[], bool]:
    """Flower's task heartbeat, except that a refused heartbeat (the task was cancelled, e.g. ``flwr stop``)
    is logged instead of raising SIGINT, which would end this long-lived worker rather than one task."""
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest  # pylint: disable=E0611

    def beat() -> bool:
        try:
            res = client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except Exception as exc:  # pylint: disable=broad-exception-caught
            if _http_failure(exc)[0]:
                return False  # retried with backoff by HeartbeatSender
            raise
        if not res.success:
            log.warning("the SuperNode no longer accepts this task's heartbeat (cancelled or expired)")
        return True

    return beat


class ClientAppWorker:
    """Claims ClientApp tasks from one SuperNode's Runtime API and runs them in this process."""

    def __init__(
        self,
        runtime_api_address: str,
        insecure: bool = True,
        root_certificates: str | None = None,
        superexec_auth_secret: bytes | None = None,
        poll_interval: float = 0.1,
        idle_poll_interval: float = 1.0,
        fast_window: float = 30.0,
        message_wait: float = 5.0,
    ) -> None:
        self.address = runtime_api_address
        self.insecure = insecure
        self.root_certificates = root_certificates
        self.secret = superexec_auth_secret
        self.poll_interval = poll_interval
        self.idle_poll_interval = max(idle_poll_interval, poll_interval)
        self.fast_window = fast_window
        self.message_wait = message_wait
        self.stats = WorkerStats()
        self._components: dict[str, str] = {}  # FAB hash -> clientapp component
        self._last_task = float("-inf")
        self._stop = False

    # -- the SuperExec half: claim tasks ------------------------------------------------------------
    def _claim_client(self) -> Any:
        """The SuperExec's connection: retries without end while the SuperNode is away (it may restart)."""
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
        from flwr.supercore.retry import make_simple_http_retry_invoker

        interceptors: list[Any] = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if self.secret:
            interceptors.append(
                SuperExecAuthHttpInterceptor(master_secret=self.secret, protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"}))
            )
        return _runtime_client(self.address, self.insecure, self.root_certificates, interceptors, make_simple_http_retry_invoker())

    def poll_delay(self) -> float:
        """Fast right after a task (the next round's message comes soon), Flower's pace when idle."""
        recent = time.monotonic() - self._last_task < self.fast_window
        return self.poll_interval if recent else self.idle_poll_interval

    def serve(self, max_tasks: int | None = None, until: Callable[[], bool] | None = None) -> WorkerStats:
        """Claim and run ClientApp tasks until stopped (SIGTERM/SIGINT), ``max_tasks`` ran or ``until()``."""
        from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
        from flwr.supercore.constant import TaskType

        claims = self._claim_client()
        request = AcquireTaskRequest(supported_task_types=[str(TaskType.CLIENT_APP)])
        try:
            while not self._stop:
                if max_tasks is not None and self.stats.tasks >= max_tasks:
                    break
                if until is not None and until():
                    break
                res = claims.AcquireTask(request)
                if res.HasField("task") and res.token:
                    self.run_task(res.token)
                    self._last_task = time.monotonic()
                    continue
                time.sleep(self.poll_delay())
        finally:
            claims.close()
        return self.stats

    def stop(self) -> None:
        self._stop = True

    # -- the flwr-clientapp half: run one task --------------------------------------------------------
    def run_task(self, token: str) -> str:
        """Run one claimed ClientApp task with its token; returns its sub-status (completed / failed)."""
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.heartbeat import HeartbeatSender
        from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
        from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

        started = time.perf_counter()
        client = _runtime_client(
            self.address,
            self.insecure,
            self.root_certificates,
            [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), RuntimeTokenHttpInterceptor(token)],
            _task_retry_invoker(),
        )
        heartbeat = HeartbeatSender(_task_heartbeat(client))
        message = context = reply = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        hello = False
        pulled = ran = started
        try:
            heartbeat.start()
            message, context, run, fab = _pull_input(client, self.message_wait)
            pulled = ran = time.perf_counter()
            component = self._components.get(fab.hash_str)
            if component is None:
                component = self._components[fab.hash_str] = clientapp_component(fab.content)
            if component != FEDISTILL_CLIENTAPP:
                self.stats.refused += 1
                details = (
                    f"this SuperNode's ClientApp worker (python -m fedistill.flower clientapp) runs only "
                    f"{FEDISTILL_CLIENTAPP}, not {component}: start the SuperNode without --isolation process"
                )
                log.error("run %s: %s", run.run_id, details)
                reply = Message(Error(code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION, reason=details), reply_to=message)
            else:
                from . import app

                hello = message.metadata.message_type == app.HELLO
                reply = app.client_app(message=message, context=context)
                ran = time.perf_counter()
                status, details = SubStatus.COMPLETED, ""
        except Exception as exc:  # pylint: disable=broad-exception-caught  (as flwr-clientapp: an error reply)
            log.exception("ClientApp raised an exception")
            details = f"{type(exc)}:<'{exc}'>"
            if message is not None:
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
            except Exception:  # pylint: disable=broad-exception-caught
                log.exception("failed to push the reply message")
                status = SubStatus.FAILED
            try:
                push_task_output(client=client, context=context, sub_status=status, details=details)
            except Exception:  # pylint: disable=broad-exception-caught  (the SuperNode left; the task is lost)
                log.exception("failed to push the task output")
                status = SubStatus.FAILED
            if heartbeat.is_running:
                heartbeat.stop()
            client.close()
            done = time.perf_counter()
            self.stats.tasks += 1
            self.stats.failed += status != SubStatus.COMPLETED
            self.stats.seconds.append(done - started)
            kind = message.metadata.message_type if message is not None else "?"
            log.info(
                "task %d (%s): %s in %.3f s (pull %.3f, ClientApp %.3f, push %.3f)",
                self.stats.tasks, kind, status, done - started, pulled - started, ran - pulled, done - ran,
            )
        if hello and context is not None and status == SubStatus.COMPLETED:
            from . import app

            app.warm_up(context)  # load the run's data and model now, not in round 1
        return str(status)


def preload() -> None:
    """Import once, before any task, what the first message would otherwise import: flwr, PyTorch and
    fedistill (the ClientApp), and ``torch._dynamo``, which PyTorch imports lazily when the first optimizer
    is made (about 2 s on 2 cores, paid in round 1 otherwise)."""
    import torch

    importlib.import_module(f"{__package__}.app")
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedistill.flower clientapp",
        description="A long-running fedistill ClientApp next to a SuperNode started with --isolation process.",
    )
    parser.add_argument("--runtime-api-address", default="127.0.0.1:9094", help="the SuperNode's Runtime API (its --port; 127.0.0.1:9094)")
    parser.add_argument("--insecure", action="store_true", help="connect to the Runtime API without TLS")
    parser.add_argument("--root-certificates", help="CA certificate of the Runtime API's TLS certificate")
    parser.add_argument("--superexec-auth-secret-file", help="the SuperNode's --superexec-auth-secret-file, if it has one")
    parser.add_argument("--parent-pid", type=int, help="exit when this process (e.g. the SuperNode) exits")
    parser.add_argument("--poll-interval", type=float, default=0.1, help="seconds between task claims while a run is active (0.1)")
    parser.add_argument("--idle-poll-interval", type=float, default=1.0, help="seconds between claims after --fast-window idle seconds (1.0)")
    parser.add_argument("--fast-window", type=float, default=30.0, help="seconds after a task during which to poll fast (30)")
    args = parser.parse_args(argv)
    refused = flwr_version_error()
    if refused is not None:
        parser.exit(2, f"{parser.prog}: {refused}\n")
    if not args.insecure and not args.root_certificates:
        parser.error("give --insecure (local trial) or --root-certificates (TLS Runtime API)")
    if args.poll_interval <= 0 or args.idle_poll_interval <= 0:
        parser.error("poll intervals must be > 0")
    secret = None
    if args.superexec_auth_secret_file:
        from flwr.supercore.auth.superexec_secret import load_superexec_auth_secret

        secret = load_superexec_auth_secret(secret_file=args.superexec_auth_secret_file)
    flower_log = logging.getLogger("fedistill.flower")
    if not flower_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        flower_log.addHandler(handler)
        flower_log.setLevel(logging.INFO)
    if args.parent_pid is not None:
        from flwr.supercore.app_utils import start_parent_process_monitor

        start_parent_process_monitor(args.parent_pid)

    started = time.perf_counter()
    preload()

    worker = ClientAppWorker(
        args.runtime_api_address,
        insecure=args.insecure,
        root_certificates=args.root_certificates,
        superexec_auth_secret=secret,
        poll_interval=args.poll_interval,
        idle_poll_interval=args.idle_poll_interval,
        fast_window=args.fast_window,
    )

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    print(
        f"[fedistill] ClientApp worker {os.getpid()} ready in {time.perf_counter() - started:.1f} s; "
        f"claiming tasks from {args.runtime_api_address}",
        flush=True,
    )
    try:
        worker.serve()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        from .app import client_cache_info

        s, cache = worker.stats, client_cache_info()
        print(
            f"[fedistill] ClientApp worker {os.getpid()} stops after {s.tasks} task(s), {s.failed} failed; "
            f"client data built {cache['builds']} time(s), reused {cache['hits']} time(s)",
            flush=True,
        )
    return 0

