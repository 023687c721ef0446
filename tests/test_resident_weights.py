"""``run.resident_weights`` (issue 66 item 3): the flat vectors stay on the model's device across the Message
boundary of the in-process simulation. On a CPU the device is the host, so what these tests can check here is
that the switch changes no number, that the boundary's host copies are the ones it removes (counted by a torch
function mode), that checkpoints hold host tensors, and that what it cannot do is refused in one line. The GPU
half, the same bits with the vectors on the device, is tests/test_cuda.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_resume_is_exact, small_config, without_timings
from torch.overrides import TorchFunctionMode

from fedistill.errors import ConfigError
from fedistill.models.flat import flat_parameters, get_flat, resident, weights_resident
from fedistill.protocol import declares_resident_weights
from fedistill.registry import ALGORITHMS
from fedistill.simulation import Simulation

DECLARED = ["fedavg", "fedavgm", "fedadam", "fedprox", "fedntd", "fedlmd", "fedlmd_tf", "scaffold"]
FLAT_MODULE = str(Path(sys.modules[get_flat.__module__].__file__).resolve())


def test_the_switch_is_scoped_and_leaves_the_default_on_the_host():
    model = torch.nn.Linear(3, 2)
    assert not resident()
    with weights_resident():
        assert resident()
        with weights_resident(False):  # a no-op inside: it never turns an enclosing switch off
            assert resident()
        assert get_flat(model, host=True).device.type == "cpu"  # an explicit host copy stays one
    assert not resident()
    with weights_resident(False):
        assert not resident()
    # The values do not depend on the switch.
    with weights_resident():
        inside, inside_params = get_flat(model), flat_parameters(model)
    assert torch.equal(inside, get_flat(model)) and torch.equal(inside_params, flat_parameters(model))


def test_only_the_methods_checked_for_it_declare_it_and_a_subclass_does_not_inherit_it():
    assert {name for name in ALGORITHMS.names() if declares_resident_weights(ALGORITHMS.get(name).__new__(ALGORITHMS.get(name)))} == set(DECLARED)


def _run(algorithm: str, digits, resident_weights: bool, **overrides):
    cfg = small_config(**{"algorithm.name": algorithm, "run.workers": 1, "run.resident_weights": resident_weights,
                          "local.momentum": 0.9, "rounds": 2, **overrides})  # fmt: skip
    sim = Simulation(cfg, digits)
    return sim, sim.run()


@pytest.mark.parametrize("algorithm", DECLARED)
def test_resident_weights_change_no_number(digits, algorithm):
    """Two rounds with and without the switch: the same global model bit for bit, the same metric rows."""
    plain_sim, plain = _run(algorithm, digits, False)
    resident_sim, kept = _run(algorithm, digits, True)
    assert torch.equal(get_flat(plain_sim.server.model), get_flat(resident_sim.server.model))
    assert without_timings(plain) == without_timings(kept)
    for key, value in plain_sim.server.state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, resident_sim.server.state[key]), key


def test_a_cohort_run_with_resident_weights_gives_the_cohort_runs_numbers(digits):
    plain_sim, plain = _run("fedprox", digits, False, **{"run.cohort": 3})
    resident_sim, kept = _run("fedprox", digits, True, **{"run.cohort": 3})
    assert torch.equal(get_flat(plain_sim.server.model), get_flat(resident_sim.server.model))
    assert [r["test_accuracy"] for r in plain] == [r["test_accuracy"] for r in kept]


class HostCopies(TorchFunctionMode):
    """Counts the host reads made from models/flat.py while it is active: ``Tensor.cpu`` (a client's upload, the
    server's vector) and ``float(tensor)`` (a client's mean loss), each a wait for the device on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.from_flat = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.cpu, torch.Tensor.__float__) and str(Path(sys._getframe(1).f_code.co_filename).resolve()) == FLAT_MODULE:
            self.from_flat += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_a_resident_round_makes_no_host_copy_at_the_message_boundary(digits, algorithm):
    """Without the switch a round copies every client's upload and the server's vectors to the host and reads every
    client's mean loss (3 clients: at least 7 reads); with it, none: the server reads the losses at the round's end
    (protocol.reported_train_loss). On a GPU each of those reads is a wait for the device."""
    counts = {}
    for switch in (False, True):
        cfg = small_config(**{"algorithm.name": algorithm, "run.workers": 1, "run.resident_weights": switch, "rounds": 1})
        sim = Simulation(cfg, digits)
        with HostCopies() as copies:
            sim.run_round(1)
        counts[switch] = copies.from_flat
    assert counts[False] >= 7 and counts[True] == 0, counts


def test_a_resident_run_resumes_bit_for_bit_and_checkpoints_host_tensors(digits, tmp_path):
    overrides = {"run.workers": 1, "run.resident_weights": True, "local.momentum": 0.9}
    assert_resume_is_exact(digits, tmp_path, "scaffold", server_keys=("scaffold_c",), client_keys=("scaffold_c",), **overrides)
    raw = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    assert all(t.device.type == "cpu" for t in raw["server_state"].values() if isinstance(t, torch.Tensor))


def test_a_method_not_checked_for_it_is_refused_in_one_line(digits):
    with pytest.raises(ConfigError, match=r"(?i)run.resident_weights: feddyn was not checked") as error:
        Simulation(small_config(**{"algorithm.name": "feddyn", "run.workers": 1, "run.resident_weights": True}), digits)
    assert "\n" not in str(error.value)
    with pytest.raises(Exception, match=r"resident_weights: .*run.workers is 2"):
        small_config(**{"run.workers": 2, "run.resident_weights": True})
