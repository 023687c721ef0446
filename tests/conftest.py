"""Shared fixtures: a small real dataset (scikit-learn's digits) and tiny configs that run in seconds."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the suite in two processes (pytest-xdist) on the CI's two cores: one intra-op thread
    # each, set before fedistill reads torch's default; two threads per process oversubscribe the cores.
    torch.set_num_threads(1)

import fedistill.algorithms  # noqa: F401  (registers algorithms)
import fedistill.models  # noqa: F401
from fedistill.config import build_config
from fedistill.data.dataset import Dataset
from fedistill.models.flat import set_flat


def _digits() -> Dataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(np.round(d.images * 255 / 16), dtype=torch.uint8)[:, None]
    y = torch.tensor(d.target, dtype=torch.int64)
    return Dataset("digits", x[:1500], y[:1500], x[1500:], y[1500:], 10, (0.3,), (0.4,))


@pytest.fixture(scope="session")
def digits() -> Dataset:
    return _digits()


def small_config(**overrides):
    """A config that trains a few clients for a few rounds on digits in well under a second a round."""
    base = {
        "rounds": 3,
        "clients_per_round": 3,
        "partition": {"scheme": "lda", "num_clients": 6, "alpha": 0.5},
        "local": {"epochs": 1, "batch_size": 32, "lr": 0.05},
        # No figures: a run's three figures cost about 0.6 s, as much as its training here (issue 62 item 9); the
        # tests of the figures set run.figures=true, and tests/test_figures.py checks that false draws none.
        "run": {"progress": False, "checkpoint_every": 1, "figures": False},
    }
    return build_config(base, overrides)


def flower_config(**overrides):
    """small_config with 3 clients (one SuperNode each) and one thread per process (the Flower tests)."""
    return small_config(**{"partition.num_clients": 3, "run.threads": 1, **overrides})


def pytest_configure(config):
    config.addinivalue_line("markers", "draw_figures: rasterise the figures a run writes (see _figures_built_not_drawn)")
    config.addinivalue_line("markers", "measure_peak: measure the bf16 peak in a bench (see _bf16_peak_not_measured)")


@pytest.fixture(autouse=True)
def _figures_built_not_drawn(request, monkeypatch):
    """Every figure a test's run writes is built (its data, axes and colour scales: where a history of a method
    would break it) but not drawn: drawing (text layout, constrained layout, PNG encoding) costs about a second a
    run, half of a one-round run here. The drawing itself is what the tests marked ``draw_figures``
    (tests/test_figures.py, test_diagnostics.py) check, on the same functions. The file is still written, so a
    run directory holds the same names; a run in a subprocess draws as usual."""
    if request.node.get_closest_marker("draw_figures"):
        yield
        return
    import fedistill.report.plots as plots

    def build_only(fig, path):
        plots.figure_format(path)  # an unwritable format is still refused
        assert fig.axes, "a figure without axes"
        Path(path).write_bytes(b"figure built, not drawn (tests/conftest.py)")

    monkeypatch.setattr(plots, "save_figure", build_only)
    yield


@pytest.fixture(autouse=True)
def _bf16_peak_not_measured(request, monkeypatch):
    """A bench measures this machine's bf16 matmul peak for a second after its cells (the "% of peak" column):
    in the tests that second, on every in-process bench call, added up to about 15 s of the suite, and no test
    reads the value. In-process benches get a fixed 100 GFLOP/s instead; the measurement itself is checked
    (tests/test_bench.py, marked ``measure_peak``) on small matmuls, and a bench in a subprocess measures as usual."""
    if request.node.get_closest_marker("measure_peak"):
        yield
        return
    import fedistill.studies.bench as bench_module

    monkeypatch.setattr(bench_module, "measure_bf16_peak", lambda threads, **_: 100.0)
    yield


@pytest.fixture
def keep_threads():
    """Restore torch's thread count after a test that builds runtimes setting it."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def task_identity():
    """What a Flower process sets before app code creates Messages (flwr internals; the Flower tests only)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def toy_dataset(n=20, c=3, h=8, w=8, classes=4, seed=0, mean=0.5, std=0.25, test=5) -> Dataset:
    """n random uint8 images, labels 0..classes-1 in turn; the first ``test`` double as the test split."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=g)
    y = torch.arange(n) % classes
    return Dataset("toy", x, y, x[:test], y[:test], classes, (mean,) * c, (std,) * c)


@pytest.fixture
def make_config():
    return small_config


# -- helpers shared by the per-method test files ------------------------------------------------
def global_vectors(cfg, dataset, rounds):
    """The global model's flat vector after each of the first ``rounds`` rounds."""
    from fedistill.simulation import Simulation
    from fedistill.models.flat import get_flat

    sim = Simulation(cfg, dataset)
    out = []
    for rnd in range(1, rounds + 1):
        sim.run_round(rnd)
        out.append(get_flat(sim.server.model))
    return out


def assert_same_rounds(cfg_a, cfg_b, dataset, rounds=2):
    """Two configurations produce bit-identical global models round for round."""
    for va, vb in zip(global_vectors(cfg_a, dataset, rounds), global_vectors(cfg_b, dataset, rounds)):
        assert torch.equal(va, vb)


def hetero_config(algorithm, clients=None, **overrides):
    """small_config for a method whose clients keep their own models (local_only, fd, fedproto): three clients,
    all selected every round, two rounds; ``clients`` gives each its architecture (model.clients)."""
    tree = {"algorithm": algorithm if isinstance(algorithm, dict) else {"name": algorithm}, "rounds": 2,
            "partition.num_clients": 3, "clients_per_round": 3}  # fmt: skip
    if clients is not None:
        tree["model.clients"] = clients
    return small_config(**{**tree, **overrides})


def own_models(sim):
    """{client id: its own model's flat vector} from a simulation's client store (clients that have trained)."""
    store = sim.server_runtime.client_store
    return {cid: store.load(cid)["model"] for cid in range(sim.federation.num_clients) if "model" in store.load(cid)}


def assert_learns(dataset, algorithm, threshold=70.0, **overrides):
    """15 rounds on 10 label-skewed digit clients must end far above chance (10%)."""
    from fedistill.simulation import Simulation

    settings = {"algorithm.name": algorithm, "partition.num_clients": 10, "partition.alpha": 0.3, "local.epochs": 2}
    cfg = small_config(rounds=15, clients_per_round=5, **{**settings, **overrides})
    history = Simulation(cfg, dataset).run()
    accuracy = history[-1]["test_accuracy"]
    assert accuracy > threshold, f"{algorithm}: {accuracy:.1f}% " + str([(round(r["test_accuracy"], 1), round(r["train_loss"], 3)) for r in history])


def without_timings(history):
    """Metric rows without their timings (every key ending in "seconds"): what two runs of the same numbers share."""
    return [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in history]


def assert_resume_is_exact(dataset, tmp_path, algorithm, server_keys=(), client_keys=(), **overrides):
    """Two rounds, a checkpoint, two more rounds == four uninterrupted rounds, states included."""
    from fedistill.simulation import Simulation
    from fedistill.models.flat import get_flat

    def cfg(rounds):
        return small_config(rounds=rounds, algorithm=algorithm, **overrides)

    full = Simulation(cfg(4), dataset, run_dir=tmp_path / "full")
    full.run()
    Simulation(cfg(2), dataset, run_dir=tmp_path / "part").run()
    resumed = Simulation(cfg(4), dataset, run_dir=tmp_path / "part")
    resumed.run(resume=True)
    assert torch.equal(get_flat(full.server.model), get_flat(resumed.server.model))
    assert without_timings(full.state.history) == without_timings(resumed.state.history)
    for key in server_keys:
        assert torch.equal(full.server.state[key], resumed.server.state[key]), key
    for key in client_keys:
        for cid, state in full.state.client_states.items():
            assert torch.equal(state[key], resumed.state.client_states[cid][key]), (key, cid)


# -- processes (the tests that stop runs and benches with signals) ---------------------------------------------
def live_processes(pids) -> set[int]:
    """Those of ``pids`` still running (Linux /proc; a zombie has ended)."""
    from pathlib import Path

    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def child_processes(pid: int) -> set[int]:
    """Live process ids that descend from ``pid``: its children, theirs, and so on. Worker processes are forked
    from a fork server (engine/executors.py ``process_context``), a child of ``pid``, so they are grandchildren."""
    from pathlib import Path

    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier and child not in found}
        found |= frontier
    return found


def assert_resume_bitwise(dataset, tmp_path, algorithm, clients, state_key, **overrides):
    """A run of 3 rounds against one stopped after 2 and resumed: the same rows (timings aside), the same own
    models of the clients and the same ``server.state[state_key]``, bit for bit."""
    from fedistill.simulation import Simulation

    def run(rounds, run_dir, resume=False):
        sim = Simulation(hetero_config(algorithm, clients=clients, rounds=rounds, **overrides), dataset, run_dir=tmp_path / run_dir)
        return sim, sim.run(resume=resume)

    straight, full = run(3, "a")
    run(2, "b")
    resumed, history = run(3, "b", resume=True)
    assert without_timings(history) == without_timings(full)
    a, b = own_models(straight), own_models(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[cid], b[cid]) for cid in a)
    assert torch.equal(straight.server.state[state_key], resumed.server.state[state_key])


def own_model_accuracies(sim, architectures, prepare=None):
    """Each client's accuracy (%) on its own test split with its own model from the client store, after
    ``prepare(cid, model)`` (e.g. a global head put in place); what a method's personal accuracies must equal."""
    accuracies = []
    for cid, name in enumerate(architectures):
        model = sim.client_runtime.worker_for(name)
        set_flat(model, own_models(sim)[cid])
        if prepare is not None:
            prepare(cid, model)
        model.eval()
        with torch.no_grad():
            x, y = next(sim.client_runtime.pipeline.test_batches_of(sim.federation.test_indices[cid], 10_000))
            accuracies.append(100.0 * float((model(x).argmax(1) == y).double().mean()))
    return accuracies


def shared_model_accuracies(sim, state_key):
    """Each client's accuracy (%) on its own test split with the shared model (the engine's worker) holding the
    server's ``state[state_key]``: what FML's eval_model=meme and FedKD's eval_model=mentee must report."""
    model = sim.client_runtime.shared_worker
    set_flat(model, sim.server.state[state_key])
    model.eval()
    accuracies = []
    with torch.no_grad():
        for test in sim.federation.test_indices:
            x, y = next(sim.client_runtime.pipeline.test_batches_of(test, 10_000))
            accuracies.append(100.0 * float((model(x).argmax(1) == y).double().mean()))
    return accuracies
