"""Combining methods from the configuration (algorithms/compose.py): ``algorithm.plus``."""

from __future__ import annotations

import pytest
from conftest import assert_learns, assert_resume_is_exact, assert_same_rounds

from fedistill.algorithms.aggregate import ServerMomentum
from fedistill.algorithms.fedntd import FedNTD
from fedistill.algorithms.fedprox import FedProx
from fedistill.errors import ConfigError
from fedistill.losses import proximal_term
from fedistill.registry import ALGORITHMS


@pytest.fixture
def registered(monkeypatch):
    """Register hand-written combined methods for the duration of one test."""

    def register(name, cls):
        monkeypatch.setitem(ALGORITHMS._entries, name, cls)

    return register


class ProxWithMomentum(FedProx):
    """FedProx's client with FedAvgM's server, written by hand as a subclass."""

    Params = type("P", (FedProx.Params,), {"__annotations__": {"server_momentum": float}, "server_momentum": 0.9})

    def server_optimizer(self, server):
        return ServerMomentum(self.params.server_momentum, 1.0)


class NTDWithProx(FedNTD):
    """FedNTD's term plus FedProx's term (μ = 0.3), summed by hand."""

    def extra_loss(self, client, msg):
        ntd = super().extra_loss(client, msg)
        params = [p for p in client.model.parameters() if p.requires_grad]
        anchors = [p.detach().clone() for p in params]
        return lambda model, x, y, logits, f: ntd(model, x, y, logits, f) + proximal_term(params, anchors, 0.3)


def test_a_method_plus_nothing_effective_is_the_method(make_config, digits):
    plain = make_config(**{"algorithm.name": "scaffold"})
    with_zero_prox = make_config(**{"algorithm.name": "scaffold", "algorithm.plus": {"fedprox": {"mu": 0.0}}})
    assert_same_rounds(plain, with_zero_prox, digits)


def test_fedavg_plus_fedprox_is_fedprox(make_config, digits):
    composed = make_config(**{"algorithm.name": "fedavg", "algorithm.plus": {"fedprox": {"mu": 0.3}}})
    assert_same_rounds(make_config(**{"algorithm.name": "fedprox", "algorithm.mu": 0.3}), composed, digits)


def test_prox_plus_avgm_equals_the_hand_written_combination(make_config, digits, registered):
    registered("prox_momentum_by_hand", ProxWithMomentum)
    by_hand = make_config(**{"algorithm.name": "prox_momentum_by_hand", "algorithm.mu": 0.1})
    composed = make_config(
        **{"algorithm.name": "fedprox", "algorithm.mu": 0.1, "algorithm.plus": {"fedavgm": {"server_momentum": 0.9}}}
    )
    assert_same_rounds(by_hand, composed, digits, rounds=3)


def test_two_loss_terms_are_summed(make_config, digits, registered):
    registered("ntd_prox_by_hand", NTDWithProx)
    by_hand = make_config(**{"algorithm.name": "ntd_prox_by_hand"})
    composed = make_config(**{"algorithm.name": "fedntd", "algorithm.plus": {"fedprox": {"mu": 0.3}}})
    assert_same_rounds(by_hand, composed, digits)


def test_combined_messages_carry_every_parts_fields_and_are_counted(make_config, digits):
    from fedistill.simulation import Simulation

    # FedDyn's adaptive α_k adds a scalar to the broadcast (FedNova, which adds one to the reply, may not be
    # combined with FedCurv's quadratic term: compose.py).
    plus = {"fedcurv": {}, "feddyn": {"adaptive_alpha": True}}
    cfg = make_config(**{"algorithm.name": "scaffold", "algorithm.plus": plus})
    sim = Simulation(cfg, digits)
    row = sim.run_round(1)
    info = sim.round_info(2)
    msg = sim.server_runtime.broadcast(info, 0)
    assert set(msg) == {"weights", "control", "fisher_p", "fisher_q", "feddyn_alpha"}
    reply = sim.client_runtime.update(0, info, msg, {})
    assert {"weights", "num_samples", "train_loss", "control_delta", "fisher_u", "fisher_v"} <= set(reply)
    # Down: weights + c + P + Q + α_k per client; up: weights + Δc + u + v + two scalars.
    w = sum(p.numel() for p in sim.server.model.state_dict().values()) * 4
    p = sum(p.numel() for p in sim.server.model.parameters()) * 4
    clients = row["clients"]
    assert row["bytes_down"] == clients * (w + 3 * p + 8)
    assert row["bytes_up"] == clients * (w + 3 * p + 2 * 8)


def test_stateful_combination_resumes_exactly(digits, tmp_path):
    assert_resume_is_exact(
        digits,
        tmp_path,
        "feddyn",
        server_keys=("feddyn_h", "scaffold_c"),
        client_keys=("feddyn_g", "scaffold_c"),
        **{"algorithm.plus": {"scaffold": {}, "fedavgm": {"server_momentum": 0.5}}},
    )


def test_fedntd_plus_prox_plus_avgm_learns(digits):
    assert_learns(digits, "fedntd", **{"algorithm.plus": {"fedprox": {"mu": 0.01}, "fedavgm": {"server_momentum": 0.5}}})


@pytest.mark.parametrize(
    "plus, message",
    [
        ({"fedadam": {}}, "fedavgm and fedadam both define the server optimiser"),
        ({"fedlmd_unknown": {}}, "algorithm.plus.fedlmd_unknown: unknown algorithm"),
        ({"fedprox": {"mu": -1}}, "algorithm.plus.fedprox.mu"),
        ({"fedprox": {"nu": 1}}, "algorithm.plus.fedprox.nu: not a parameter of fedprox"),
        ({"fedavgm": {}}, "each method may appear once"),
    ],
)
def test_bad_combinations_are_refused_up_front(make_config, plus, message):
    with pytest.raises(ConfigError, match=message):
        make_config(**{"algorithm.name": "fedavgm", "algorithm.plus": plus})


def test_cli_accepts_a_comma_list_and_names_the_run_after_all_parts(tmp_path):
    from fedistill.cli import main

    code = main(
        [
            "run", "--dataset", "digits", "--rounds", "1", "--clients-per-round", "2", "--set", "partition.num_clients=4",
            "--out", str(tmp_path), "--set", "algorithm.name=fedprox", "--set", "algorithm.plus=fedavgm,fedrs",
            "--set", "run.progress=false",
        ]
    )  # fmt: skip
    assert code == 0
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.startswith("fedprox+fedavgm+fedrs-digits")
    import yaml

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert list(saved["algorithm"]["plus"]) == ["fedavgm", "fedrs"]  # in the given order, every parameter written out
    assert saved["algorithm"]["plus"]["fedavgm"]["server_momentum"] == 0.7
