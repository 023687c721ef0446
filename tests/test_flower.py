"""The Flower adapter: records, the server loop against an in-process fake Grid, and a real local federation.

The real-federation tests start a SuperLink and two or three SuperNodes as subprocesses on 127.0.0.1 (free ports,
insecure mode, private FLWR_HOME) and kill their process groups at the end, whatever happens.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("flwr", reason="flwr is not installed: pip install 'fedistill[flower]' (flwr==1.41.0)")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto  # noqa: E402

from fedistill.algorithms.base import Message, RoundInfo  # noqa: E402
from fedistill.config import build_config  # noqa: E402
from fedistill.engine.seeding import INIT  # noqa: E402
from fedistill.simulation import Simulation, build_model_for  # noqa: E402
from fedistill.errors import ConfigError  # noqa: E402
from fedistill.models.flat import get_flat  # noqa: E402
from fedistill.runner import load_dataset_for  # noqa: E402
from conftest import flower_config  # noqa: E402

from fedistill.flower import app as flower_app  # noqa: E402
from fedistill.flower.records import (  # noqa: E402
    load_client_state,
    message_to_records,
    records_to_message,
    records_to_round,
    save_client_state,
)
from fedistill.flower.settings import FlowerSettings  # noqa: E402




def simulate(cfg):
    sim = Simulation(cfg, load_dataset_for(cfg))
    history = sim.run()
    return get_flat(sim.server.model), history


def checkpoint_flat(cfg, run_dir: Path) -> torch.Tensor:
    payload = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
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


def test_knowledge_messages_survive_the_transport():
    """What FedGKT/FedDKC/FedICT exchange: an empty broadcast, N x 16 x H x W features, int32 labels and count,
    eval.* reports and int/float scalars, through Flower's proto encoding and its transport objects; and the
    client state (its model, momentum and the bool setup_sent) through the transport encoding of context.state."""
    upload = Message(
        features=torch.randn(5, 16, 8, 8),
        logits=torch.randn(5, 10),
        labels=torch.tensor([3, 0, 9, 9, 1], dtype=torch.int32),
        distribution=torch.rand(10),
        count=torch.tensor([5], dtype=torch.int32),
        train_loss=0.1 + 0.2,
        num_samples=5,
        **{"eval.correct": 3, "eval.count": 4},
    )
    for carry in (lambda c: recorddict_from_proto(recorddict_to_proto(c)), over_the_wire):
        back = records_to_message(carry(message_to_records(upload)))
        assert set(back) == set(upload)
        for key, value in upload.items():
            got = back[key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), key
            else:
                assert type(got) is type(value) and got == value, key
        assert back.nbytes() == upload.nbytes() == 4 * (5 * 16 * 64 + 5 * 10 + 5 + 10 + 1) + 2 * 8  # eval.* not counted
        empty = carry(message_to_records(Message(), RoundInfo(1, 0.05), cid=2))
        assert len(records_to_message(empty)) == 0 and records_to_round(empty) == (RoundInfo(1, 0.05), 2)
    store = RecordDict()
    save_client_state(store, 2, {"model": torch.randn(7), "momentum": torch.zeros(7), "setup_sent": True})
    state = load_client_state(over_the_wire(store), 2)
    assert state["setup_sent"] is True and state["model"].shape == (7,)


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
    With ``wire``, every message (both ways) and each node's ``context.state`` between two messages go
    through Flower 1.41's own transport encoding (deflated objects, inflated again), as between processes.
    """

    def __init__(self, cfg, node_configs: dict[int, dict], wire: bool = False):
        self.wire = wire
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
            handler = {flower_app.HELLO: flower_app.client_hello, flower_app.EVALUATE: flower_app.client_evaluate}.get(
                m.metadata.message_type, flower_app.client_train
            )
            if self.wire:
                context = self.contexts[node]
                context.state = over_the_wire(context.state)
                self.replies[mid] = over_the_wire(handler(over_the_wire(m), context))
            else:
                self.replies[mid] = handler(m, self.contexts[node])
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def over_the_wire(obj):
    """A Flower Message or RecordDict after the SuperLink/SuperNode transport: its objects deflated to bytes
    (arrays in chunks), content-addressed, and inflated again on the other side."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    contents = {oid: part.deflate() for oid, part in get_all_nested_objects(obj).items()}
    back = inflate_object_from_contents(obj.object_id, contents)
    if hasattr(obj, "metadata"):  # the message id is not part of the object; the SuperLink sets it
        back.metadata.__dict__["_message_id"] = obj.metadata.message_id
    return back




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
    assert torch.load(run_c / "checkpoint.pt", weights_only=True)["round"] == 1

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


# ============================================ resume: no checkpoint yet, refused resumes, messages
def test_fake_grid_resume_without_checkpoint_starts_from_round_1(tmp_path, keep_threads, task_identity):
    """A run that stopped before its first checkpoint is continued from round 1 with its saved config."""
    cfg = flower_config(rounds=3, **{"run.checkpoint_every": 2})
    expected, sim_history = simulate(cfg)
    run = tmp_path / "run"
    grid = FakeGrid(cfg, nodes_for(3))
    grid.silent_from_round[1002] = 2  # round 1 is written to metrics.jsonl, round 2 fails before any checkpoint
    with pytest.raises(flower_app.RoundFailed, match="no checkpoint was written yet"):
        flower_app.run_server(grid, cfg, FlowerSettings(run_dir=str(run), round_timeout=1.0))
    assert not (run / "checkpoint.pt").exists() and [r["round"] for r in read_rows(run)] == [1]
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"

    # Without a checkpoint to compare with, the saved config.yaml says which run this is: another one is refused.
    saved = (run / "config.yaml").read_bytes()
    other = flower_config(rounds=3, **{"run.checkpoint_every": 2, "local.lr": 0.1})
    with pytest.raises(ConfigError, match=r"resume: local.lr is 0.1 in the submitted configuration but 0.05 in .*config.yaml"):
        flower_app.run_server(FakeGrid(other, nodes_for(3)), other, FlowerSettings(run_dir=str(run), resume=True, round_timeout=5))
    assert (run / "config.yaml").read_bytes() == saved and [r["round"] for r in read_rows(run)] == [1]

    grid = FakeGrid(cfg, nodes_for(3))
    summary = flower_app.run_server(grid, cfg, FlowerSettings(run_dir=str(run), resume=True, round_timeout=5))
    assert summary["status"] == "finished"
    rows = read_rows(run)
    assert [r["round"] for r in rows] == [1, 2, 3]  # the earlier attempt's row 1 is not kept twice
    assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in sim_history]
    assert torch.equal(checkpoint_flat(cfg, run), expected)


def test_resume_and_run_dir_messages_name_run_config_keys(tmp_path):
    """Every message of a refused start says what to type on Flower (run-config keys), never CLI flags."""
    cfg = flower_config(rounds=1)
    missing = tmp_path / "no-such-run"
    not_a_run = tmp_path / "not-a-run"
    (not_a_run / "notes").mkdir(parents=True)
    cases = [
        (FlowerSettings(resume=True), r"resume=true needs run-dir.*--run-config 'resume=true run-dir="),
        (FlowerSettings(resume=True, run_dir=str(missing)), r"run-dir: .*no-such-run does not exist.*--run-config 'run-dir="),
        (FlowerSettings(resume=True, run_dir=str(not_a_run)), r"run-dir: .*not-a-run has no config.yaml.*--run-config 'run-dir="),
        (FlowerSettings(run_dir=str(not_a_run)), r"run-dir: .*not-a-run is a run directory that already exists; choose another "
         r"run-dir, or continue it with flwr run <app> <connection> --run-config 'resume=true run-dir=\".*not-a-run\"'"),
    ]
    for settings, pattern in cases:
        with pytest.raises(ConfigError) as info:
            flower_app.run_server(None, cfg, settings)  # refused before the grid is used or anything is written
        message = str(info.value)
        assert re.search(pattern, message), message
        assert "\n" not in message and not re.search(r"--(resume|name|out)\b", message), message
    assert not missing.exists() and sorted(p.name for p in not_a_run.iterdir()) == ["notes"]
    with pytest.raises(ConfigError, match="run.cohort: cohort training stacks clients in one process"):
        flower_app.run_server(None, flower_config(rounds=1, **{"run.cohort": 2, "run.workers": 1}), FlowerSettings(run_dir=str(tmp_path / "cohort")))
    assert not (tmp_path / "cohort").exists()
    with pytest.raises(ConfigError, match="run.resident_weights: .* on Flower every Message crosses the network"):
        flower_app.run_server(None, flower_config(rounds=1, **{"run.resident_weights": True, "run.workers": 1}), FlowerSettings(run_dir=str(tmp_path / "resident")))
    assert not (tmp_path / "resident").exists()


def test_fake_grid_refused_resumes_rewrite_nothing_and_numeric_changes_are_recorded(tmp_path, keep_threads, task_identity):
    cfg = flower_config(rounds=2)
    run = tmp_path / "run"
    assert flower_app.run_server(FakeGrid(cfg, nodes_for(3)), cfg, FlowerSettings(run_dir=str(run), round_timeout=5))["status"] == "finished"
    saved = {name: (run / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "summary.json", "checkpoint.pt")}

    def resume(cfg, **options):
        return flower_app.run_server(FakeGrid(cfg, nodes_for(3)), cfg, FlowerSettings(run_dir=str(run), resume=True, round_timeout=5, **options))

    refusals = [
        # fewer rounds than done: rewriting config.yaml with rounds=1 would misdescribe the run
        (flower_config(rounds=1), r"already has 2 rounds; rounds=1 cannot take them back.*overrides='rounds="),
        # another learning rate is another run
        (flower_config(rounds=3, **{"local.lr": 0.1}), r"resume: local.lr is 0.1 in the submitted configuration but 0.05 in .*config.yaml"),
        # another thread count changes the numbers: allowed only explicitly
        (flower_config(rounds=3, **{"run.threads": 2}), r"client_threads: 1 -> 2 .*--run-config 'resume=true run-dir=\".*\" allow-numeric-change=true'"),
    ]
    for other, pattern in refusals:
        with pytest.raises(ConfigError, match=pattern):
            resume(other)
        assert {name: (run / name).read_bytes() for name in saved} == saved, pattern
        assert not (run / "resumes.jsonl").exists()

    summary = resume(flower_config(rounds=3, **{"run.threads": 2}), allow_numeric_change=True)
    assert summary["status"] == "finished" and summary["rounds"] == 3
    entries = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert [(e["after_round"], e["changed"]) for e in entries] == [(2, ["client_threads: 1 -> 2"])]
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["rounds"] == 3 and config["run"]["threads"] == 2


def test_allow_numeric_change_setting():
    s = FlowerSettings.from_run_config({"resume": True, "run-dir": "runs/x", "allow-numeric-change": True})
    assert s.allow_numeric_change and s.resume
    assert FlowerSettings.from_run_config({}).allow_numeric_change is False
    with pytest.raises(ConfigError, match="allow-numeric-change=true goes with resume=true"):
        FlowerSettings.from_run_config({"allow-numeric-change": True})
    with pytest.raises(ConfigError, match="resume: must be true or false"):
        FlowerSettings.from_run_config({"resume": "false"})  # bool("false") would have resumed


# ==================================================== a failed run: one line, no traceback, failed
def test_server_main_prints_one_line_and_flower_logs_no_traceback(tmp_path, capsys, task_identity):
    """What flwr-serverapp does with an exception (flwr/superlink/runtime/run_serverapp.py): it logs it
    with exc_info on the "flwr" logger and marks the run failed. Ours arrive there without a traceback."""
    from flwr.supercore.logger import log as flower_log

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={"resume": True, "run-dir": str(tmp_path / "gone")})
    with pytest.raises(ConfigError) as info:
        flower_app.server_main(None, context)
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "[fedistill]" in line] == [f"[fedistill] error: {info.value}"]

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)  # formats exc_info as a traceback, as Flower's console handler does
    logging.getLogger("flwr").addHandler(handler)
    try:
        flower_log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=info.value)
        text = stream.getvalue()
        assert "ServerApp stopped by the fedistill error above (ConfigError)" in text and "Traceback" not in text, text
        # A bug is still logged with its traceback.
        try:
            raise ValueError("a bug")
        except ValueError as bug:
            flower_log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=bug)
        assert "Traceback" in stream.getvalue()
    finally:
        logging.getLogger("flwr").removeHandler(handler)


# =================================================== thread count: same config, same numbers
def test_fake_grid_default_threads_equal_the_simulation(tmp_path, keep_threads, task_identity):
    """No run.threads in the config: the ClientApps train with the count `fedistill run` uses, bit for bit."""
    from fedistill.engine.cores import client_threads

    cfg = flower_config(rounds=3, algorithm={"name": "fedlmd"}, **{"run.threads": None})
    torch.set_num_threads(client_threads(cfg))  # what `fedistill run` trains with when run.threads is unset
    expected, sim_history = simulate(cfg)
    run = tmp_path / "run"
    assert flower_app.run_server(FakeGrid(cfg, nodes_for(3)), cfg, FlowerSettings(run_dir=str(run), round_timeout=5))["status"] == "finished"
    rows = read_rows(run)
    assert [(r["test_accuracy"], r["test_loss"]) for r in rows] == [(r["test_accuracy"], r["test_loss"]) for r in sim_history]
    assert torch.equal(checkpoint_flat(cfg, run), expected)
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["threads"] == client_threads(cfg)


def test_app_writer_and_client_thread_count():
    from fedistill.engine.cores import client_threads
    from fedistill.flower.project import app_pyproject

    def embedded(cfg):
        return json.loads(app_pyproject(cfg)["tool"]["flwr"]["app"]["config"]["config-json"])["run"]["threads"]

    unset = flower_config(**{"run.threads": None})
    # One thread whatever the machine and the workers, as `fedistill run` (engine/cores.py)
    assert embedded(unset) == client_threads(unset) == 1
    assert embedded(flower_config(**{"run.threads": None, "run.workers": 2})) == 1
    assert embedded(flower_config(**{"run.threads": 3})) == 3
    # The ClientApp trains with the run's count; a node's threads key overrides it explicitly.
    assert flower_app._client_threads(flower_config(**{"run.threads": 3}), {"partition-id": 0}) == 3
    assert flower_app._client_threads(flower_config(**{"run.threads": 3}), {"partition-id": 0, "threads": 1}) == 1
    with pytest.raises(ConfigError, match="node config threads"):
        flower_app._client_threads(unset, {"threads": 0})


# ========================================================================= a real local federation
@pytest.fixture
def federation(tmp_path):
    from fedistill.flower.local import LocalFederation

    # One node of Flower's own (each message starts a ClientApp process, about 3 s of CPU): the aggregation of
    # several nodes' replies is checked bit for bit on the long-running workers (test_flower_longrunning.py).
    fed = LocalFederation(tmp_path / "federation", 1)
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


def test_real_federation_matches_simulation_then_a_failed_run_is_marked_failed_in_one_line(federation, tmp_path, keep_threads):
    from fedistill.flower.project import write_app

    # Flower's own SuperNodes start a ClientApp process per message (about 20-35 s a round on two cores): one round
    # here; two rounds bit for bit are the long-running workers' test (test_flower_longrunning.py), and the state
    # carried from round to round is the fake grid's (test_fake_grid_*), both through the same ServerApp.
    cfg = flower_config(rounds=1, clients_per_round=1, **{"partition.num_clients": 1, "partition.scheme": "iid"})
    run_dir = tmp_path / "run"
    app = write_app(tmp_path / "app", cfg, run_dir=str(run_dir), round_timeout=120, discovery_timeout=60)
    run_id = federation.submit(app)
    _wait_for(run_dir / "summary.json", 150, federation)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished", summary

    expected, sim_history = simulate(cfg)
    assert torch.allclose(checkpoint_flat(cfg, run_dir), expected, atol=1e-6)
    rows = read_rows(run_dir)
    assert [r["clients"] for r in rows] == [1]
    assert [(r["bytes_down"], r["bytes_up"]) for r in rows] == [(r["bytes_down"], r["bytes_up"]) for r in sim_history]

    # No runtime dependency installation: the SuperLink's SuperExec runs without the allow flag.
    superexec = [c for c in _child_cmdlines(federation.superlink.pid) if "flower-superexec" in c]
    assert superexec and not any("--allow-runtime-dependency-installation" in c for c in superexec)
    assert federation.wait(run_id, 30)["status"] == "finished:completed"

    # A fedistill error in the next run's ServerApp, on the same SuperLink (a start saved): `flwr ls` says
    # finished:failed with the reason, the log shows the reason in one line and no traceback (`flwr run` itself
    # exits 0: Flower gives the app no say in that).
    from fedistill.flower.local import CONNECTION

    gone = tmp_path / "no-such-run"
    failing = write_app(tmp_path / "failing-app", flower_config(rounds=1))
    submitted = federation.flwr("run", str(failing), CONNECTION, "--format", "json", "--run-config", f"resume=true run-dir={json.dumps(str(gone))}")
    assert submitted.returncode == 0, submitted.stderr  # Flower's choice: the README says how scripts check instead
    failed_id = int(json.loads(submitted.stdout)["run-id"])
    # `flwr log --stream` returns once the run has ended (the README's recipe for scripts relies on it), so one
    # `flwr ls` after it tells the status, where polling would start a process (1.5 s of CPU) every 2 s.
    log = federation.flwr("log", str(failed_id), CONNECTION, "--stream", timeout=90).stdout
    info = federation.run_info(failed_id)
    assert info["status"] == "finished:failed", info
    assert "does not exist" in info["status-details"], info
    errors = [line for line in log.splitlines() if "[fedistill] error:" in line]
    assert len(errors) == 1 and "run config run-dir:" in errors[0] and "resume=true has nothing to continue" in errors[0], log
    assert "Traceback" not in log and "ServerApp stopped by the fedistill error above (ConfigError)" in log, log
    assert not gone.exists()


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
        # a server refiner: label counts travel as tensors, the generator lives in server state (issue 10)
        {"name": "scaffold", "plus": {"fedftg": {"iterations": 2, "batch_size": 16, "generator_width": 16}}},
        # per-client discriminators in context.state, a generator both ways (issue 11); and Appendix B's
        # privacy variant, whose clients regenerate the server's distillation inputs from a broadcast seed
        {"name": "dafkd", "distill_samples": 32, "distill_epochs": 2, "noise_dim": 8, "generator_width": 8},
        {"name": "dafkd", "privacy": True, "distill_samples": 32, "distill_epochs": 2, "noise_dim": 8, "generator_width": 8},
    ],
)
def test_stateful_algorithms_keep_client_state_in_context_state(tmp_path, keep_threads, task_identity, algorithm):
    """SCAFFOLD's c_k, MOON's previous model, FedCurv's own statistics live in each node's context.state. Two
    rounds: every node is in both (3 of 3), so round 2 trains from the state round 1 left in context.state."""
    cfg = flower_config(rounds=2, algorithm=algorithm)
    expected, _ = simulate(cfg)
    run = tmp_path / "run"
    grid = FakeGrid(cfg, nodes_for(3))
    assert flower_app.run_server(grid, cfg, FlowerSettings(run_dir=str(run), round_timeout=5))["status"] == "finished"
    assert torch.allclose(checkpoint_flat(cfg, run), expected, atol=1e-6), algorithm


# ====================================================== federated distillation: no weights travel
def fd_config(algorithm, clients):
    """Three clients, two rounds of a knowledge-exchange method on digits (own models, per-client tests)."""
    return flower_config(
        rounds=2,
        algorithm=algorithm,
        **{
            "partition.per_client_test": True,
            "model.clients": clients,
            "model.server": "fd_server_resnet56",
            "model.server_kwargs": {"blocks_per_stage": 1},
            "local.weight_decay": 5e-4,
            "run.figures": True,  # the Flower app's personal-accuracy figure is checked below
        },
    )


def simulation_and_wire_run(cfg, tmp_path):
    """The same configuration simulated and run through the fake grid over Flower's transport encoding:
    (simulation, its rows, the grid, the Flower run's rows, its run directory, its summary)."""
    sim = Simulation(cfg, load_dataset_for(cfg))
    sim_history = sim.run()
    run = tmp_path / "run"
    grid = FakeGrid(cfg, nodes_for(3), wire=True)
    summary = flower_app.run_server(grid, cfg, FlowerSettings(run_dir=str(run), round_timeout=5))
    assert summary["status"] == "finished"
    return sim, sim_history, grid, read_rows(run), run, summary


@pytest.mark.parametrize(
    "algorithm, clients",
    [
        # labels, d^k and N^k (int32, float32) go up once; three architectures, derived on each side
        ({"name": "fedict", "variant": "balance"}, ["fd_resnet2", "fd_resnet4", "fd_resnet8"]),
        # labels with every upload, one architecture
        ({"name": "fedgkt"}, ["fd_resnet8"]),
    ],
    ids=["fedict-heterogeneous", "fedgkt"],
)
def test_fake_grid_federated_distillation_equals_the_simulation(tmp_path, keep_threads, task_identity, algorithm, clients):
    """Features, logits and labels up, an empty broadcast then the server's knowledge down, every message and
    each node's context.state through Flower's transport encoding: the rows (personalised accuracies from
    the eval.* scalars, bytes, server loss), the server predictor and the clients' own models equal the
    simulation's exactly."""
    sim, sim_history, grid, rows, run, summary = simulation_and_wire_run(fd_config(algorithm, clients), tmp_path)
    keys = (
        "clients", "train_loss", "server_loss", "bytes_down", "bytes_up", "bytes_weight_exchange",
        "personal_clients", "personal_accuracies", "personal_accuracy",
    )
    assert [{k: r[k] for k in keys} for r in rows] == [{k: r[k] for k in keys} for r in sim_history]
    assert rows[0]["bytes_down"] == 0 < rows[1]["bytes_down"]  # nothing to send before a client's first upload
    assert rows[1]["personal_clients"] == [0, 1, 2] and rows[1]["test_accuracy"] is None
    if algorithm["name"] == "fedict":
        assert rows[0]["bytes_up"] > rows[1]["bytes_up"]  # the setup upload went once: setup_sent persisted
    assert summary["final_accuracy"] == sim_history[-1]["personal_accuracy"] and summary["accuracy_metric"] == "personal"
    assert (run / "personal_accuracy.png").exists()

    payload = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)
    expected = sim.server.model.state_dict()
    assert payload["global_model"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(payload["global_model"][key], value), key
    for cid in range(3):
        assert torch.equal(payload["server_state"]["knowledge"][cid], sim.server.state["knowledge"][cid])
        # each client's own model and momentum persisted in its node's context.state, as in the simulation's store
        state = load_client_state(grid.contexts[1000 + cid].state, cid)
        sim_state = sim.server_runtime.client_store.load(cid)
        assert state.keys() == sim_state.keys() and state["setup_sent"] is True
        assert torch.equal(state["model"], sim_state["model"]) and torch.equal(state["momentum"], sim_state["momentum"])

# ============ own models and class statistics or a shared part (local_only, fd, fedproto, fedgh, fedtgp, lg_fedavg, fml, fedmrl, fedkd, fedgen htfllib)
@pytest.mark.parametrize(
    "algorithm, clients",
    [
        ("local_only", ["digits_cnn", "mlp", "resnet8"]),  # empty Messages both ways
        ("fd", ["digits_cnn", "mlp", "resnet8"]),  # per-class logits with ids and counts up, the table down
        ("fedproto", ["digits_cnn", "resnet8", "logistic"]),  # prototypes, and the evaluate phase scores with the new ones
        ("fedgh", ["digits_cnn", "resnet8", "logistic"]),  # prototypes up, the server's trained header down
        ("fedtgp", ["digits_cnn", "resnet8", "logistic"]),  # prototypes up, the server generator's prototypes down
        ("lg_fedavg", ["digits_cnn", "resnet8", "logistic"]),  # a head and n_k up, the averaged head down
        ("fml", ["digits_cnn", "resnet8", "logistic"]),  # the meme both ways, the private models in context.state
        ("fedmrl", ["digits_cnn", "resnet8", "logistic"]),  # the shared small model both ways, fused on the clients
        ("fedkd", ["digits_cnn", "resnet8", "logistic"]),  # the mentee's SVD factors both ways (empty ones at rank 0)
        # a head, n_k and counts up; the averaged head, the generator and the summed counts down (HtFLlib's FedGen)
        ({"name": "fedgen", "variant": "htfllib", "hidden_dim": 32}, ["digits_cnn", "resnet8", "logistic"]),
    ],
    ids=lambda value: (value if isinstance(value, str) else f"{value['name']}-{value['variant']}") if not isinstance(value, list) else "",
)
def test_fake_grid_own_model_methods_equal_the_simulation(tmp_path, keep_threads, task_identity, algorithm, clients):
    """Three architectures, two rounds, over Flower's transport encoding: the rows (personal accuracies, bytes from
    the same Messages, the uncounted training loss) and every client's own model in its node's context.state
    equal the simulation's exactly."""
    algorithm = algorithm if isinstance(algorithm, dict) else {"name": algorithm}
    cfg = flower_config(rounds=2, algorithm=algorithm, **{"model.clients": clients, "local.lr": 0.01})
    sim, sim_history, grid, rows, _, _ = simulation_and_wire_run(cfg, tmp_path)
    keys = ("clients", "train_loss", "bytes_down", "bytes_up", "test_accuracy", "personal_clients", "personal_accuracies")
    assert [{k: r[k] for k in keys} for r in rows] == [{k: r[k] for k in keys} for r in sim_history]
    assert rows[-1]["personal_clients"] == [0, 1, 2] and (rows[-1]["bytes_up"] > 0) == (algorithm["name"] != "local_only")
    for cid in range(3):
        state = load_client_state(grid.contexts[1000 + cid].state, cid)
        assert torch.equal(state["model"], sim.server_runtime.client_store.load(cid)["model"])


# ================================== personalised models assembled on the clients: Flower's evaluate phase
@pytest.mark.parametrize(
    "algorithm, model",
    [
        ({"name": "mtfl"}, "resnet8"),  # BatchNorm patches in context.state
        ({"name": "demlearn"}, "cnn"),  # own weights in context.state, a group model per client down
        ({"name": "pfedme", "inner_steps": 2, "personal_lr": 0.05}, "cnn"),  # θ_k evaluated on the client with its reply (no evaluate phase)
    ],
    ids=["mtfl", "demlearn", "pfedme"],
)
def test_fake_grid_assembled_personal_models_equal_the_simulation(tmp_path, keep_threads, task_identity, algorithm, model):
    """After each round's aggregation the server sends every client an evaluate message; the client assembles
    its personalised model from it and its context.state and answers with counts, over Flower's transport:
    the personalised accuracies, bytes and the clients' states equal the simulation's."""
    cfg = flower_config(
        rounds=2, algorithm=algorithm, **{"partition.per_client_test": True, "model.name": model, "local.momentum": 0.0}
    )
    sim, sim_history, grid, rows, run, _ = simulation_and_wire_run(cfg, tmp_path)
    keys = ("clients", "train_loss", "bytes_down", "bytes_up", "test_accuracy", "personal_clients", "personal_accuracies")
    assert [{k: r[k] for k in keys} for r in rows] == [{k: r[k] for k in keys} for r in sim_history]
    assert rows[-1]["personal_clients"] == [0, 1, 2]
    assert torch.equal(checkpoint_flat(cfg, run), get_flat(sim.server.model))
    for cid in range(3):
        state = load_client_state(grid.contexts[1000 + cid].state, cid)
        sim_state = sim.server_runtime.client_store.load(cid)
        assert state.keys() == sim_state.keys()
        for key in state:
            assert torch.equal(state[key], sim_state[key]), key


def test_sites_with_their_own_files_measure_the_global_models_personal_accuracy_themselves(tmp_path, keep_threads, task_identity):
    """A site's test split is its own test file, which the server never saw: FedAvg's personalised accuracy
    (the global model on each client's test split) is measured by the clients in the evaluate phase."""
    from test_datasets import make_mnist_dir

    from fedistill.simulation import ClientRuntime

    make_mnist_dir(tmp_path / "server" / "mnist", n_train=30, n_test=10, seed=1)
    nodes = {}
    for cid in range(3):
        make_mnist_dir(tmp_path / f"site{cid}" / "mnist", n_train=12, n_test=6 + 3 * cid, seed=10 + cid)
        nodes[1000 + cid] = {"partition-id": cid, "num-partitions": 3, "data-dir": str(tmp_path / f"site{cid}")}
    cfg = build_config(
        {
            "rounds": 2, "clients_per_round": 3,
            "dataset": {"name": "mnist", "verify": False, "augment": [], "data_dir": str(tmp_path / "server"), "download": False},
            "partition": {"scheme": "iid", "num_clients": 3, "per_client_test": True},
            "local": {"epochs": 1, "batch_size": 4, "lr": 0.05}, "run": {"threads": 1, "progress": False},
        }
    )  # fmt: skip
    run = tmp_path / "run"
    summary = flower_app.run_server(FakeGrid(cfg, nodes), cfg, FlowerSettings(run_dir=str(run), round_timeout=5))
    assert summary["status"] == "finished"
    row = read_rows(run)[-1]
    global_model = checkpoint_flat(cfg, run)
    expected = []
    for cid in range(3):  # written out: the final global model on each site's own test file
        site = load_dataset_for(cfg, data_dir=str(tmp_path / f"site{cid}"), download=False)
        runtime = ClientRuntime(cfg, site, {cid: torch.arange(12)}, {cid: torch.arange(len(site.test_y))})
        ctx = runtime.context(cid, 2, {})
        from fedistill.models.flat import set_flat

        set_flat(ctx.model, global_model)
        expected.append(100.0 * float(runtime.personal_correct(ctx).double().mean()))
    assert row["personal_clients"] == [0, 1, 2]
    assert row["personal_accuracies"] == pytest.approx(expected, abs=1e-9)
