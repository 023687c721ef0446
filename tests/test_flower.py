"""The Flower adapter: records, the server loop against an in-process fake Grid, and a real local federation.

The real-federation tests start a SuperLink and three SuperNodes as subprocesses on 127.0.0.1 (free ports,
insecure mode, private FLWR_HOME) and kill their process groups at the end, whatever happens.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed: pip install 'fedistill[flower]' (flwr==1.41.0)")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto  # noqa: E402

from fedistill.algorithms.base import Message, RoundInfo  # noqa: E402
from fedistill.config import build_config  # noqa: E402
from fedistill.engine.seeding import INIT  # noqa: E402
from fedistill.engine.simulation import Simulation, build_model_for  # noqa: E402
from fedistill.models.flat import get_flat  # noqa: E402
from fedistill.runner import load_dataset_for  # noqa: E402

from fedistill.flower import app as flower_app  # noqa: E402
from fedistill.flower.records import (  # noqa: E402
    load_client_state,
    message_to_records,
    records_to_message,
    records_to_round,
    save_client_state,
)
from fedistill.flower.settings import FlowerSettings  # noqa: E402


def flower_config(**overrides):
    """conftest's small config with 3 clients (one SuperNode each) and one thread per process."""
    from conftest import small_config

    return small_config(**{"partition.num_clients": 3, "run.threads": 1, **overrides})


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def simulate(cfg):
    sim = Simulation(cfg, load_dataset_for(cfg))
    history = sim.run()
    return get_flat(sim.server.model), history


def checkpoint_flat(cfg, run_dir: Path) -> torch.Tensor:
    payload = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    model = build_model_for(cfg, load_dataset_for(cfg), (INIT,))
    model.load_state_dict(payload["global_model"])
    return get_flat(model)


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ============================================================================================ records
def test_message_round_trip_through_flower_serialisation():
    msg = Message(
        weights=torch.randn(7, 3),
        half=torch.randn(4).to(torch.bfloat16),
        counts=torch.tensor([3, 0, 9]),
        mask=torch.tensor([True, False]),
        scalar_tensor=torch.tensor(2.5, dtype=torch.float64),
        empty=torch.empty(0, 5),
        num_samples=123,
        train_loss=0.1 + 0.2,
        flag=True,
        note="héllo",
        big=2**62 + 1,
    )
    content = recorddict_from_proto(recorddict_to_proto(message_to_records(msg, RoundInfo(4, 0.05 * 0.99**3), cid=2)))
    back = records_to_message(content)
    assert set(back) == set(msg)
    for key, value in msg.items():
        got = back[key]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), key
        else:
            assert type(got) is type(value) and got == value, key
    assert back.nbytes() == msg.nbytes()
    assert records_to_round(content) == (RoundInfo(4, 0.05 * 0.99**3), 2)
    assert len(records_to_message(message_to_records(Message()))) == 0


def test_client_state_survives_in_context_state():
    state = {"c_i": torch.randn(5), "nested": {"step": 3, "head": torch.ones(2, dtype=torch.bfloat16)}, "seen": [1, 2]}
    store = RecordDict()
    assert load_client_state(store, 1) == {}
    save_client_state(store, 1, state)
    back = load_client_state(recorddict_from_proto(recorddict_to_proto(store)), 1)
    assert torch.equal(back["c_i"], state["c_i"]) and back["nested"]["step"] == 3 and back["seen"] == [1, 2]
    assert torch.equal(back["nested"]["head"], state["nested"]["head"])


def test_settings_read_run_config_and_required_replies():
    cfg = flower_config()
    s = FlowerSettings.from_run_config({"config-json": json.dumps(cfg.to_dict()), "overrides": "rounds=5 local.lr=0.1"})
    got = s.config()
    assert got.rounds == 5 and got.local.lr == 0.1 and got.partition.num_clients == 3
    assert FlowerSettings(min_fraction=1.0).required_replies(3) == 3
    assert FlowerSettings(min_fraction=0.6).required_replies(3) == 2
    assert FlowerSettings(min_fraction=0.0, min_replies=5).required_replies(3) == 3
    with pytest.raises(Exception, match="unknown key"):
        FlowerSettings.from_run_config({"round-timout": 3})


# ============================================================ the server loop against a fake Grid
class FakeGrid:
    """An in-process Grid: messages go straight to the ClientApp handlers of fake SuperNodes.

    ``silent`` nodes take messages but never answer (a SuperNode that died while still registered).
    """

    def __init__(self, cfg, node_configs: dict[int, dict]):
        self.run_config = {}
        self.contexts = {
            node_id: Context(run_id=1, node_id=node_id, node_config=nc, state=RecordDict(), run_config={})
            for node_id, nc in node_configs.items()
        }
        self.silent: set[int] = set()
        self.silent_from_round: dict[int, int] = {}
        self.replies: dict[str, object] = {}

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid  # what the SuperLink does on push
            ids.append(mid)
            node = m.metadata.dst_node_id
            rnd = int(m.metadata.group_id or 0)
            if node in self.silent or (node in self.silent_from_round and rnd >= self.silent_from_round[node]):
                continue
            handler = flower_app.client_hello if m.metadata.message_type == flower_app.HELLO else flower_app.client_train
            self.replies[mid] = handler(m, self.contexts[node])
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


@pytest.fixture
def task_identity():
    """What a flwr-serverapp process sets before ServerApp code creates Messages (flwr internals, tests only)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def nodes_for(k: int, **extra) -> dict[int, dict]:
    return {1000 + i: {"partition-id": i, "num-partitions": k, **extra} for i in range(k)}


def test_fake_grid_partial_round_failure_and_resume(tmp_path, keep_threads, task_identity):
    cfg = flower_config(rounds=3)
    expected, sim_history = simulate(cfg)

    # A fully answered run equals the simulation, bytes included.
    run_a = tmp_path / "a"
    grid = FakeGrid(cfg, nodes_for(3))
    summary = flower_app.run_server(grid, cfg, FlowerSettings(run_dir=str(run_a), round_timeout=5))
    assert summary["status"] == "finished"
    assert torch.allclose(checkpoint_flat(cfg, run_a), expected, atol=1e-6)
    rows = read_rows(run_a)
    assert [(r["bytes_down"], r["bytes_up"]) for r in rows] == [(r["bytes_down"], r["bytes_up"]) for r in sim_history]

    # Client 2 goes silent from round 2: with min-fraction 0.6 the round completes with 2 clients ...
    run_b = tmp_path / "b"
    grid = FakeGrid(cfg, nodes_for(3))
    grid.silent_from_round[1002] = 2
    # Returning at all shows the round timeout fired; the rows show who was counted.
    flower_app.run_server(grid, cfg, FlowerSettings(run_dir=str(run_b), round_timeout=1.0, min_fraction=0.6))
    rows = read_rows(run_b)
    assert [r["clients"] for r in rows] == [3, 2, 2]
    assert rows[1]["bytes_up"] == 2 * sim_history[1]["bytes_up"] // 3

    # ... while the default (every sampled client must reply) stops with a clear error, keeping round 1.
    run_c = tmp_path / "c"
    grid = FakeGrid(cfg, nodes_for(3))
    grid.silent_from_round[1002] = 2
    with pytest.raises(flower_app.RoundFailed, match=r"round 2: 2 of 3 sampled clients replied, 3 needed.*client 2: no reply"):
        flower_app.run_server(grid, cfg, FlowerSettings(run_dir=str(run_c), round_timeout=1.0))
    summary = json.loads((run_c / "summary.json").read_text())
    assert summary["status"] == "failed" and "round 2" in summary["error"]
    assert torch.load(run_c / "checkpoint.pt", weights_only=False)["round"] == 1

    # A restarted server resumes from the checkpoint and ends where the uninterrupted run ends.
    grid = FakeGrid(cfg, nodes_for(3))
    summary = flower_app.run_server(grid, cfg, FlowerSettings(run_dir=str(run_c), resume=True, round_timeout=5))
    assert summary["status"] == "finished" and [r["round"] for r in read_rows(run_c)] == [1, 2, 3]
    assert torch.allclose(checkpoint_flat(cfg, run_c), expected, atol=1e-6)


def test_fake_grid_rejects_mismatched_node_config(tmp_path, keep_threads, task_identity):
    cfg = flower_config(rounds=1)
    grid = FakeGrid(cfg, nodes_for(3) | {1002: {"partition-id": 2, "num-partitions": 4}})
    with pytest.raises(flower_app.FederationError, match="num-partitions=4 but the configuration has partition.num_clients=3"):
        flower_app.run_server(grid, cfg, FlowerSettings(run_dir=str(tmp_path / "r"), discovery_timeout=2))


# ========================================================================= a real local federation
@pytest.fixture
def federation(tmp_path):
    from fedistill.flower.local import LocalFederation

    fed = LocalFederation(tmp_path / "federation", 3)
    try:
        fed.start()
        yield fed
    finally:
        fed.close()


def _wait_for(path: Path, timeout: float, fed, predicate=lambda p: p.exists()) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(path):
        if time.monotonic() > deadline:
            logs = "\n".join(p.read_text()[-2000:] for p in sorted(fed.workdir.glob("*.log")))
            raise AssertionError(f"timed out after {timeout:g}s waiting for {path}\n{logs}")
        time.sleep(0.5)


def _child_cmdlines(pid: int) -> list[str]:
    from fedistill.flower.local import descendants

    out = []
    for child in descendants(pid):
        try:
            out.append(Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return out


def test_real_federation_matches_simulation(federation, tmp_path, keep_threads):
    from fedistill.flower.project import write_app

    cfg = flower_config(rounds=3)
    run_dir = tmp_path / "run"
    app = write_app(tmp_path / "app", cfg, run_dir=str(run_dir), round_timeout=120, discovery_timeout=60)
    run_id = federation.submit(app)
    _wait_for(run_dir / "summary.json", 150, federation)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished", summary

    expected, sim_history = simulate(cfg)
    assert torch.allclose(checkpoint_flat(cfg, run_dir), expected, atol=1e-6)
    rows = read_rows(run_dir)
    assert [r["clients"] for r in rows] == [3, 3, 3]
    assert [(r["bytes_down"], r["bytes_up"]) for r in rows] == [(r["bytes_down"], r["bytes_up"]) for r in sim_history]

    # No runtime dependency installation: the SuperLink's SuperExec runs without the allow flag.
    superexec = [c for c in _child_cmdlines(federation.superlink.pid) if "flower-superexec" in c]
    assert superexec and not any("--allow-runtime-dependency-installation" in c for c in superexec)
    deadline = time.monotonic() + 30
    while not federation.run_status(run_id).startswith("finished") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert federation.run_status(run_id) == "finished:completed"


def test_real_federation_survives_a_killed_supernode(federation, tmp_path, keep_threads):
    from fedistill.flower.project import write_app

    timeout = 30.0
    cfg = flower_config(rounds=2)
    run_dir = tmp_path / "run"
    app = write_app(tmp_path / "app", cfg, run_dir=str(run_dir), round_timeout=timeout, min_fraction=0.6, discovery_timeout=60)
    federation.submit(app)
    _wait_for(run_dir / "metrics.jsonl", 90, federation, lambda p: p.exists() and len(p.read_text().splitlines()) >= 1)
    federation.kill_supernode(2)  # round 2 was already sent to it: it dies holding the message
    _wait_for(run_dir / "summary.json", timeout + 30, federation)  # fails if the run does not finish by then
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished", summary
    rows = read_rows(run_dir)
    assert [r["clients"] for r in rows] == [3, 2]


def test_client_with_its_own_data_dir_trains_on_its_whole_local_split(tmp_path, keep_threads):
    """A real deployment: the site's own files (node config data-dir), not a partition of a shared dataset."""
    from test_datasets import make_mnist_dir

    from fedistill.models.flat import get_flat as flat

    site = tmp_path / "site-data"
    make_mnist_dir(site / "mnist", n_train=12, n_test=4, seed=3)
    cfg = build_config(
        {
            "dataset": {"name": "mnist", "verify": False, "augment": []},
            "partition": {"scheme": "iid", "num_clients": 3},
            "clients_per_round": 3,
            "local": {"epochs": 1, "batch_size": 4, "lr": 0.05},
        }
    )
    node_config = {"partition-id": 1, "num-partitions": 3, "data-dir": str(site)}
    runtime = flower_app._client_runtime(json.dumps(cfg.to_dict()), node_config)
    assert torch.equal(runtime.train_indices[1], torch.arange(12))
    start = flat(runtime.worker)
    reply = runtime.update(1, RoundInfo(round=1, lr=0.05), Message(weights=start), {})
    assert reply["num_samples"] == 12
    assert not torch.equal(reply["weights"], start)


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "scaffold"},
        {"name": "moon"},
        # the Tf -> LMD switch reads the round on the client; a combination sends every part's fields
        {"name": "fedlmd", "switch_round": 1, "plus": {"fedcurv": {"own_stats": "client"}, "fedavgm": {}}},
    ],
)
def test_stateful_algorithms_keep_client_state_in_context_state(tmp_path, keep_threads, task_identity, algorithm):
    """SCAFFOLD's c_k, MOON's previous model, FedCurv's own statistics live in each node's context.state."""
    cfg = flower_config(rounds=3, algorithm=algorithm)
    expected, _ = simulate(cfg)
    run = tmp_path / "run"
    grid = FakeGrid(cfg, nodes_for(3))
    assert flower_app.run_server(grid, cfg, FlowerSettings(run_dir=str(run), round_timeout=5))["status"] == "finished"
    assert torch.allclose(checkpoint_flat(cfg, run), expected, atol=1e-6), algorithm
