"""The long-running ClientApp (``python -m fedistill.flower clientapp``) and the faster SuperNode polling.

- the ClientApp's cache: one process handling several messages of a run loads the client's data once; a
  new run, another configuration or another node identity builds afresh;
- the worker's task handling against a fake Runtime API: fedistill's ClientApp runs in the process and its
  context goes back, another app is refused with an error reply, an exception becomes an error reply and
  the worker goes on;
- the SuperNode's shorter waits (idle: Flower's 3 s; during a run: the poll interval) and quicker pulls;
- a real local federation in the long-running mode equals the simulation, each worker loaded its client's
  data once for the whole run, and a second run on it survives a SuperNode killed mid-round.

No timing is asserted: benchmarks/bench_flower_round.py measures the rounds.
"""

from __future__ import annotations

import io
import json
import time
import types
import zipfile

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed: pip install 'fedistill[flower]' (flwr==1.41.0)")

from flwr.app import ConfigRecord, Context, Message as FlowerMessage, RecordDict  # noqa: E402

from fedistill.simulation import ServerRuntime, build_federation, round_info  # noqa: E402
from fedistill.flower import app as flower_app  # noqa: E402
from fedistill.flower import supernode as fast_supernode  # noqa: E402
from fedistill.flower import worker as flower_worker  # noqa: E402
from fedistill.flower.records import message_to_records, records_to_message  # noqa: E402
from fedistill.runner import load_dataset_for  # noqa: E402
from conftest import flower_config  # noqa: E402






@pytest.fixture
def counted_loads(monkeypatch):
    """Counts the ClientApp's dataset loads (``fedistill.runner.load_dataset_for``) and starts from an empty cache."""
    import fedistill.runner

    calls = []
    real = fedistill.runner.load_dataset_for

    def counting(cfg, *args, **kwargs):
        calls.append(cfg.dataset.name)
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(fedistill.runner, "load_dataset_for", counting)
    monkeypatch.setattr(flower_app, "_CLIENT_CACHE", {})
    monkeypatch.setattr(flower_app, "_CACHE_COUNTS", {"builds": 0, "hits": 0})
    return calls


def _message(content: RecordDict, message_type: str, group: str = "") -> FlowerMessage:
    """A server Message as the ClientApp receives it (the SuperLink sets its id)."""
    message = FlowerMessage(content, dst_node_id=7, message_type=message_type, group_id=group, ttl=60.0)
    message.metadata.__dict__["_message_id"] = f"m-{time.monotonic_ns()}"
    return message


class Node:
    """One SuperNode's view: its context (state kept between messages, as the SuperNode keeps it)."""

    def __init__(self, cfg, run_id: int, partition_id: int = 0, **node_config):
        self.cfg = cfg
        self.run_id = run_id
        self.context = Context(
            run_id=run_id,
            node_id=7,
            node_config={"partition-id": partition_id, "num-partitions": cfg.partition.num_clients, **node_config},
            state=RecordDict(),
            run_config={},
        )
        self.cid = partition_id
        self.server = ServerRuntime(cfg, load_dataset_for(cfg), cfg.partition.num_clients, None)

    def hello(self) -> FlowerMessage:
        content = RecordDict({flower_app._CONFIG: ConfigRecord({"json": json.dumps(self.cfg.to_dict()), "num_clients": 3})})
        return _message(content, flower_app.HELLO)

    def train(self, rnd: int) -> FlowerMessage:
        info = round_info(self.cfg, rnd)
        return _message(message_to_records(self.server.broadcast(info, self.cid), info, self.cid), flower_app.TRAIN, str(rnd))


# =============================================================================== the ClientApp cache
def test_one_process_loads_the_client_data_once_per_run(counted_loads, keep_threads, task_identity):
    cfg = flower_config(rounds=3)
    node = Node(cfg, run_id=11)
    flower_app.client_app(node.hello(), node.context)
    assert counted_loads == []  # the discovery query alone loads nothing (Flower's process-per-message mode)
    replies = [flower_app.client_app(node.train(rnd), node.context) for rnd in (1, 2, 3)]
    assert counted_loads == ["digits"]
    assert flower_app.client_cache_info() == {"builds": 1, "hits": 2, "entries": 1}
    assert all(not r.has_error() and records_to_message(r.content)["num_samples"] > 0 for r in replies)


def test_a_new_run_another_configuration_or_node_does_not_reuse_the_cache(counted_loads, keep_threads, task_identity):
    cfg = flower_config(rounds=2)
    first = Node(cfg, run_id=21)
    flower_app.client_app(first.hello(), first.context)
    flower_app.client_app(first.train(1), first.context)
    assert len(counted_loads) == 1

    # the same configuration in a new Flower run (a resume is one): loaded again, the site's files re-read
    again = Node(cfg, run_id=22)
    flower_app.client_app(again.hello(), again.context)
    flower_app.client_app(again.train(1), again.context)
    assert len(counted_loads) == 2

    # another configuration in the same run id (config-json differs): loaded again, and trained with it
    other_cfg = flower_config(rounds=2, **{"local.lr": 0.01})
    other = Node(other_cfg, run_id=22)
    flower_app.client_app(other.hello(), other.context)
    flower_app.client_app(other.train(1), other.context)
    assert len(counted_loads) == 3
    runtime, _ = next(iter(flower_app._CLIENT_CACHE.values()))
    assert runtime.cfg.local.lr == 0.01

    # another partition-id of the same run (a Ray simulation worker serves many): the same runtime, nothing
    # loaded again, and the reply is that partition's own update
    third = Node(other_cfg, run_id=22, partition_id=1)
    flower_app.client_app(third.hello(), third.context)
    reply = flower_app.client_app(third.train(1), third.context)
    assert len(counted_loads) == 3
    runtime, _ = next(iter(flower_app._CLIENT_CACHE.values()))
    fed = build_federation(other_cfg, load_dataset_for(other_cfg))
    assert records_to_message(reply.content)["num_samples"] == int(fed.client_sizes()[1])
    assert torch.equal(runtime.train_indices[1], fed.train_indices[1])
    assert flower_app.client_cache_info()["entries"] == 1  # one run's data at a time


def test_warm_up_after_the_discovery_query_serves_round_1(counted_loads, keep_threads, task_identity):
    cfg = flower_config(rounds=1)
    node = Node(cfg, run_id=31)
    assert flower_app.warm_up(node.context) is False  # no configuration yet: nothing to build
    flower_app.client_app(node.hello(), node.context)
    assert flower_app.warm_up(node.context) is True
    assert counted_loads == ["digits"]
    flower_app.client_app(node.train(1), node.context)
    assert counted_loads == ["digits"] and flower_app.client_cache_info()["hits"] == 1


def test_a_failed_warm_up_leaves_the_error_to_the_train_message(counted_loads, keep_threads, task_identity):
    cfg = flower_config(rounds=1)
    node = Node(cfg, run_id=41)
    flower_app.client_app(node.hello(), node.context)
    node.context.node_config["num-partitions"] = 5  # does not match partition.num_clients
    assert flower_app.warm_up(node.context) is False
    with pytest.raises(Exception, match="num-partitions=5"):
        flower_app.client_app(node.train(1), node.context)


# ================================================================ the worker, against a fake Runtime API
def fab_with_clientapp(component: str) -> bytes:
    """A FAB (zipped pyproject.toml) as fedistill writes it, with ``component`` as its ClientApp."""
    import tomli_w

    from fedistill.flower.project import app_pyproject

    pyproject = app_pyproject(flower_config())
    pyproject["tool"]["flwr"]["app"]["components"]["clientapp"] = component
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("pyproject.toml", tomli_w.dumps(pyproject))
    return buffer.getvalue()


class FakeRuntime:
    """The SuperNode side of one task: hands out the message and context, records what comes back."""

    def __init__(self, message: FlowerMessage, context: Context, fab: bytes, fab_hash: str = "h"):
        self.message, self.context = message, context
        self.fab = types.SimpleNamespace(hash_str=fab_hash, content=fab)
        self.run = types.SimpleNamespace(run_id=context.run_id)
        self.replies: list[FlowerMessage] = []
        self.outputs: list[tuple[str, str]] = []
        self.closed = 0

    # the Runtime API calls the worker makes itself
    def SendTaskHeartbeat(self, request):
        return types.SimpleNamespace(success=True)

    def close(self):
        self.closed += 1


@pytest.fixture
def fake_runtime(monkeypatch):
    """Routes the worker's task calls to a FakeRuntime (set ``.current``), not to a SuperNode."""
    import flwr.supernode.runtime.run_clientapp as run_clientapp

    holder = types.SimpleNamespace(current=None)
    monkeypatch.setattr(flower_worker, "_runtime_client", lambda *args, **kwargs: holder.current)
    monkeypatch.setattr(
        flower_worker, "_pull_input", lambda client, wait: (client.message, client.context, client.run, client.fab)
    )
    monkeypatch.setattr(run_clientapp, "push_message", lambda client, message, context: client.replies.append(message))
    monkeypatch.setattr(
        run_clientapp,
        "push_task_output",
        lambda client, context, sub_status, details: client.outputs.append((sub_status, details)),
    )
    return holder


def test_worker_runs_fedistill_tasks_in_process_and_returns_the_context(
    fake_runtime, counted_loads, keep_threads, task_identity
):
    cfg = flower_config(rounds=2, algorithm={"name": "scaffold"})  # client state in context.state
    node = Node(cfg, run_id=51)
    worker = flower_worker.ClientAppWorker("127.0.0.1:1", insecure=True)
    fab = fab_with_clientapp(flower_worker.FEDISTILL_CLIENTAPP)
    for message in (node.hello(), node.train(1), node.train(2)):
        fake_runtime.current = FakeRuntime(message, node.context, fab)
        assert worker.run_task("token") == "completed"
        assert fake_runtime.current.outputs == [("completed", "")]
        assert len(fake_runtime.current.replies) == 1 and not fake_runtime.current.replies[0].has_error()
        assert fake_runtime.current.closed == 1
    assert counted_loads == ["digits"]  # built right after the discovery query (warm-up), reused twice
    assert flower_app.client_cache_info()["hits"] == 2
    assert "fedistill.client_state" in "".join(node.context.state.config_records)  # SCAFFOLD's c_k, kept
    assert worker.stats.tasks == 3 and worker.stats.failed == 0


def test_worker_refuses_other_apps_and_survives_an_exception(fake_runtime, counted_loads, keep_threads, task_identity):
    cfg = flower_config(rounds=1)
    node = Node(cfg, run_id=61)
    worker = flower_worker.ClientAppWorker("127.0.0.1:1", insecure=True)

    fake_runtime.current = FakeRuntime(node.hello(), node.context, fab_with_clientapp("someone.app:client_app"), "other")
    assert worker.run_task("token") == "failed"
    (reply,) = fake_runtime.current.replies
    assert reply.has_error() and "runs only fedistill.flower.app:client_app" in reply.error.reason
    assert fake_runtime.current.outputs[0][0] == "failed"
    assert counted_loads == [] and flower_app._CONFIG not in node.context.state.config_records  # nothing ran

    fab = fab_with_clientapp(flower_worker.FEDISTILL_CLIENTAPP)
    fake_runtime.current = FakeRuntime(node.train(1), node.context, fab)  # a train message before the hello
    assert worker.run_task("token") == "failed"
    (reply,) = fake_runtime.current.replies
    assert reply.has_error() and "before the discovery query" in reply.error.reason

    fake_runtime.current = FakeRuntime(node.hello(), node.context, fab)  # and the worker goes on
    assert worker.run_task("token") == "completed"
    assert worker.stats.tasks == 3 and worker.stats.failed == 2 and worker.stats.refused == 1


def test_clientapp_component_of_a_fab():
    assert flower_worker.clientapp_component(fab_with_clientapp("a.b:c")) == "a.b:c"
    assert flower_worker.clientapp_component(b"not a zip").startswith("<unreadable FAB")


def test_worker_polls_fast_after_a_task_and_slowly_when_idle():
    worker = flower_worker.ClientAppWorker("127.0.0.1:1", poll_interval=0.05, idle_poll_interval=1.0, fast_window=30.0)
    assert worker.poll_delay() == 1.0
    worker._last_task = time.monotonic()
    assert worker.poll_delay() == 0.05
    worker._last_task = time.monotonic() - 31.0
    assert worker.poll_delay() == 1.0


# ============================================================================ the SuperNode's waits
def test_supernode_sleeps_short_during_a_run_and_as_flower_when_idle(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    clock = fast_supernode._FastTime(poll_interval=0.1, fast_window=30.0)
    clock.sleep(3)  # idle: no message yet
    clock.sleep(0.5)  # waiting for a ClientApp's reply
    clock.touch()  # a message came or went
    clock.sleep(3)
    clock.last_activity -= 31.0
    clock.sleep(3)
    assert slept == [3, 0.1, 0.1, 3]
    assert clock.monotonic is time.monotonic and clock.time is time.time  # the rest of `time` is unchanged


def test_shorten_polling_patches_flowers_supernode_loop(monkeypatch):
    import flwr.supernode.start_client_internal as loop

    for name in ("time", "_pull_and_store_message", "_push_messages", "pull_objects"):
        monkeypatch.setattr(loop, name, getattr(loop, name))  # restored after the test
    clock = fast_supernode.shorten_polling(0.1, 30.0)
    assert clock is not None and loop.time is clock
    assert loop.pull_objects.keywords == fast_supernode.QUICK_PULL
    assert fast_supernode.quicker_object_pulls(loop) and loop.pull_objects.keywords == fast_supernode.QUICK_PULL  # once
    assert fast_supernode.shorten_polling(0.1, 30.0) is None and loop.time is clock  # once per process

    # an empty pull leaves the node idle; a pulled message (its run id) marks it active
    pulled = fast_supernode._recording(lambda result: result, clock, lambda run_id: run_id is not None)
    assert pulled(None) is None and clock.last_activity == float("-inf")
    assert pulled(42) == 42 and clock.last_activity > 0


def test_quicker_object_pulls_needs_a_pull_objects():
    assert fast_supernode.quicker_object_pulls(types.ModuleType("empty")) is False


# ============================================================================ a real local federation
def test_real_federation_of_long_running_clientapps_matches_the_simulation_then_survives_a_killed_supernode(tmp_path, keep_threads):
    """Two runs on one federation (its start, eight processes, costs about 15 s of CPU: once for both checks).
    Three SuperNodes with --isolation process and fast polling, one ClientApp worker each.

    1. The run equals the simulation bit for bit, and every worker handles all its messages with one load of its
       data (a second run builds it once more).
    2. A SuperNode dies holding round 2's message of a second run: the round waits out its timeout and goes on
       with the two replies (min_fraction 0.6), and the run finishes. The node is frozen first to make its death
       land inside round 2 whatever the machine's speed: its worker is stopped (SIGSTOP) right after its round-1
       reply went out, so it can never answer round 2, and the node is killed once round 1 is recorded."""
    import os
    import signal

    from fedistill.engine.seeding import INIT
    from fedistill.simulation import Simulation, build_model_for
    from fedistill.flower.local import LocalFederation
    from fedistill.flower.project import write_app
    from fedistill.models.flat import get_flat

    cfg = flower_config(rounds=2)
    run_dir, killed_dir = tmp_path / "run", tmp_path / "killed"
    app = write_app(tmp_path / "app", cfg, run_dir=str(run_dir), round_timeout=120, discovery_timeout=90)
    timeout = 12.0  # a healthy round takes 1-3 s here; the round that loses a node waits all of it
    killed_app = write_app(tmp_path / "killed-app", cfg, run_dir=str(killed_dir), round_timeout=timeout, min_fraction=0.6, discovery_timeout=60)
    fed = LocalFederation(tmp_path / "federation", 3, clientapp="worker", poll_interval=0.1)
    try:
        fed.start()
        fed.submit(app)
        _wait_for_file(run_dir / "summary.json", 180, fed)  # sooner than asking `flwr ls`
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "finished", (summary, _logs(fed))
        commands = [" ".join(p.args) for p in fed.supernodes.values()]
        assert all("--isolation process" in c and "fedistill.flower supernode" in c for c in commands), commands
        worker_log = fed.workdir / "clientapp-2.log"
        first_run = worker_log.read_text().count("(train.fedistill): completed")
        assert first_run == 2, _logs(fed)

        fed.submit(killed_app)
        deadline = time.monotonic() + 90
        while worker_log.read_text().count("(train.fedistill): completed") <= first_run:
            assert time.monotonic() < deadline, _logs(fed)
            time.sleep(0.02)
        os.kill(fed.workers[2].pid, signal.SIGSTOP)  # its round-1 reply was pushed before the line was written
        _wait_for_file(killed_dir / "metrics.jsonl", 60, fed, lambda p: p.exists() and len(p.read_text().splitlines()) >= 1)
        fed.kill_supernode(2)
        _wait_for_file(killed_dir / "summary.json", timeout + 30, fed)  # fails if the run does not finish by then
        summary = json.loads((killed_dir / "summary.json").read_text())
        assert summary["status"] == "finished", (summary, _logs(fed))
    finally:
        fed.close()
    assert [json.loads(line)["clients"] for line in (killed_dir / "metrics.jsonl").read_text().splitlines()] == [3, 2]

    sim = Simulation(cfg, load_dataset_for(cfg))
    history = sim.run()
    payload = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    model = build_model_for(cfg, load_dataset_for(cfg), (INIT,))
    model.load_state_dict(payload["global_model"])
    assert torch.equal(get_flat(model), get_flat(sim.server.model))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in history]

    for i in range(2):  # the nodes that lived: each run's data built once and reused for its other messages
        log = (tmp_path / "federation" / f"clientapp-{i}.log").read_text()
        assert log.count("(train.fedistill): completed") == 4, log
        assert "stops after 6 task(s), 0 failed; client data built 2 time(s), reused 4 time(s)" in log, log


def _wait_for_file(path, timeout: float, fed, predicate=lambda p: p.exists()) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(path):
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {path}\n{_logs(fed)}"
        time.sleep(0.2)


def _logs(fed) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(fed.workdir.glob("*.log")))


def test_the_worker_refuses_a_flower_release_it_was_not_written_for(monkeypatch, capsys):
    """The long-running ClientApp drives Flower's private modules: on another flwr it exits 2 with the fix, before
    connecting anywhere (the per-message ClientApp, public API only, is the path for other releases)."""
    import importlib.metadata

    assert flower_worker.flwr_version_error() is None  # the pinned release (flwr==1.41.0) is accepted
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.42.0" if name == "flwr" else "0")
    with pytest.raises(SystemExit) as exit_info:
        flower_worker.main(["--insecure"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "flwr 1.42.0" in err and "flwr==1.41.0" in err and "--isolation process" in err
