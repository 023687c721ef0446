"""Client state on disk (engine/state_store.py): same numbers as in memory, bounded memory, exact resume."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_rounds, small_config

from fedistill.simulation import Simulation
from fedistill.engine.state_store import DiskStateStore, MemoryStateStore
from fedistill.errors import ConfigError
from fedistill.models.flat import get_flat


@pytest.mark.parametrize("algorithm", ["moon", "scaffold"])
def test_disk_and_memory_stores_give_identical_runs(digits, algorithm):
    memory = small_config(algorithm=algorithm, **{"run.client_state": "memory"})
    disk = small_config(algorithm=algorithm, **{"run.client_state": "disk"})
    assert_same_rounds(memory, disk, digits, rounds=3)


def test_disk_store_keeps_states_on_disk_with_at_most_two_versions_per_client(tmp_path):
    store = DiskStateStore(tmp_path / "s")
    store.save(3, {"c": torch.ones(4)}, 1)
    store.committed()  # a checkpoint now refers to round 1's file
    store.save(3, {"c": 2 * torch.ones(4)}, 2)
    store.save(3, {"c": 3 * torch.ones(4)}, 3)  # round 2's file was never checkpointed: deleted
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["client-000003.r000001.pt", "client-000003.r000003.pt"]
    assert torch.equal(store.load(3)["c"], 3 * torch.ones(4))
    assert store.load(7) == {}  # never saved: empty state, no file
    store.committed()
    assert [p.name for p in (tmp_path / "s").iterdir()] == ["client-000003.r000003.pt"]
    # The store holds only the index in memory.
    assert store.snapshot() == {"kind": "disk", "index": {3: 3}}


def test_restoring_an_older_checkpoint_drops_newer_versions(tmp_path):
    store = DiskStateStore(tmp_path)
    store.save(0, {"c": torch.zeros(2)}, 1)
    snapshot = store.snapshot()
    store.committed()
    store.save(0, {"c": torch.ones(2)}, 2)
    store.save(1, {"c": torch.ones(2)}, 2)
    fresh = DiskStateStore(tmp_path)
    fresh.restore(snapshot, None)
    assert torch.equal(fresh.load(0)["c"], torch.zeros(2)) and fresh.load(1) == {}
    assert [p.name for p in tmp_path.iterdir()] == ["client-000000.r000001.pt"]


def test_restoring_removes_the_saves_a_killed_run_left_half_written(tmp_path):
    store = DiskStateStore(tmp_path)
    store.save(0, {"c": torch.zeros(2)}, 1)
    snapshot = store.snapshot()
    store.committed()
    (tmp_path / ".client-000001.r000002.pt.0123456789ab.tmp").write_bytes(b"PK half")  # killed in round 2's save
    (tmp_path / "client-000002.r000002.pt.tmp").write_bytes(b"PK half")  # the same, by an earlier fedistill
    (tmp_path / "README.txt").write_text("a user's note")
    DiskStateStore(tmp_path).restore(snapshot, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.txt", "client-000000.r000001.pt"]


def test_resume_after_a_crash_between_checkpoints_is_exact_with_the_disk_store(digits, tmp_path):
    """Checkpoint at round 2, crash after round 3 (its files written), resume: equal to an uninterrupted run."""

    def cfg(**extra):
        return small_config(rounds=4, algorithm="moon", **{"run.checkpoint_every": 2, "run.client_state": "disk", **extra})

    full = Simulation(cfg(), digits, run_dir=tmp_path / "full")
    full.run()
    crashed = Simulation(cfg(), digits, run_dir=tmp_path / "crash")
    for rnd in (1, 2, 3):
        crashed.run_round(rnd)
    crashed.close()
    resumed = Simulation(cfg(), digits, run_dir=tmp_path / "crash")
    resumed.run(resume=True)
    assert torch.equal(get_flat(full.server.model), get_flat(resumed.server.model))
    for cid in full.state.client_states:
        assert torch.equal(full.state.client_states[cid]["moon_prev"], resumed.state.client_states[cid]["moon_prev"])


def test_a_memory_checkpoint_resumes_into_a_disk_store(digits, tmp_path):
    def cfg(rounds, store):
        return small_config(rounds=rounds, algorithm="scaffold", **{"run.client_state": store})

    full = Simulation(cfg(4, "memory"), digits)
    full.run()
    Simulation(cfg(2, "memory"), digits, run_dir=tmp_path).run()
    resumed = Simulation(cfg(4, "disk"), digits, run_dir=tmp_path)
    resumed.run(resume=True)
    assert isinstance(resumed.state.client_states, DiskStateStore)
    assert torch.equal(get_flat(full.server.model), get_flat(resumed.server.model))


def test_missing_state_files_are_reported_on_resume(digits, tmp_path):
    Simulation(small_config(rounds=2, algorithm="scaffold"), digits, run_dir=tmp_path).run()
    files = sorted((tmp_path / "client_states").iterdir())
    assert files  # auto + run directory = disk
    files[0].unlink()
    with pytest.raises(ConfigError, match="client state files that are missing"):
        Simulation(small_config(rounds=3, algorithm="scaffold"), digits, run_dir=tmp_path).run(resume=True)


def test_stateless_methods_write_no_state_and_auto_without_a_directory_is_memory(digits, tmp_path):
    sim = Simulation(small_config(rounds=1), digits, run_dir=tmp_path)
    sim.run()
    assert not (tmp_path / "client_states").exists()
    assert isinstance(Simulation(small_config(rounds=1), digits).server_runtime.client_store, MemoryStateStore)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_as_stored_is_what_a_save_and_load_give_back(tmp_path, dtype):
    """What a client forms its uploaded change from (SCAFFOLD's c_k, FedCurv's u_k) must be exactly what the
    store returns; for bf16 that is a value bf16 represents, within 2^-8 relative of the original."""
    from fedistill.engine.state_store import as_stored

    value = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-3
    for store in (MemoryStateStore(dtype=dtype), DiskStateStore(tmp_path / dtype, dtype=dtype)):
        store.save(3, {"c": value}, 1)
        assert torch.equal(store.load(3)["c"], as_stored(value, dtype))
    rounded = as_stored(value, dtype)
    assert torch.equal(as_stored(rounded, dtype), rounded)  # idempotent: a kept value rounds to itself
    assert float(((rounded - value).abs() / value.abs()).max()) <= (2.0**-8 if dtype == "bf16" else 0.0)
    assert torch.equal(rounded, value) == (dtype == "fp32")
