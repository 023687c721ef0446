"""Settings every part of ``algorithm.plus`` has (weighting, grad_clip) and combinations FedNova refuses.

compose.py's rule: a value set explicitly on any part wins (parts that set it must agree); else the value of a
part whose class default differs from FedAvg's (FedDyn: weighting=uniform); else FedAvg's default. The
resolved value is written into every part, so the aggregation and the local training both use it.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import assert_same_rounds, global_vectors, small_config

from fedistill.algorithms.base import Message
from fedistill.algorithms.fedavg import FedAvg, FedAvgParams
from fedistill.simulation import make_algorithm
from fedistill.errors import ConfigError
from fedistill.registry import ALGORITHMS


@pytest.fixture
def registered(monkeypatch):
    def register(name, cls):
        monkeypatch.setitem(ALGORITHMS._entries, name, cls)

    return register


# -- weighting -----------------------------------------------------------------------------------------
def test_feddyn_added_to_fedavg_brings_its_uniform_mean(digits):
    composed = small_config(**{"algorithm.name": "fedavg", "algorithm.plus": {"feddyn": {}}})
    algorithm = make_algorithm(composed)
    assert algorithm.params.weighting == "uniform"
    assert all(part.params.weighting == "uniform" for part in algorithm.parts)
    # fedavg + feddyn has exactly feddyn's ingredients: with the same (uniform) mean it is feddyn, bit for bit.
    assert_same_rounds(small_config(**{"algorithm.name": "feddyn"}), composed, digits)


def test_the_combined_aggregation_is_the_uniform_mean_of_hand_made_replies():
    algorithm = make_algorithm(small_config(**{"algorithm.name": "fedavg", "algorithm.plus": {"feddyn": {}}}))
    g = torch.zeros(3)
    replies = [
        Message(weights=torch.tensor([1.0, 2.0, 4.0]), num_samples=1),
        Message(weights=torch.tensor([3.0, 6.0, 0.0]), num_samples=3),
    ]
    assert torch.equal(algorithm.combine(g, replies), torch.tensor([2.0, 4.0, 2.0]))  # not (2.5, 5, 1)


def test_an_explicit_weighting_on_one_part_wins_over_feddyns_default(digits):
    plus = {"fedprox": {"mu": 0.0, "weighting": "samples"}}
    composed = small_config(**{"algorithm.name": "feddyn", "algorithm.plus": plus})
    assert all(part.params.weighting == "samples" for part in make_algorithm(composed).parts)
    by_samples = small_config(**{"algorithm.name": "feddyn", "algorithm.weighting": "samples"})
    assert_same_rounds(by_samples, composed, digits)
    # The same value set on both parts is no conflict.
    both = {"algorithm.name": "feddyn", "algorithm.weighting": "samples"}
    both["algorithm.plus"] = {"fedprox": {"mu": 0.0, "weighting": "samples"}}
    assert make_algorithm(small_config(**both)).params.weighting == "samples"


@pytest.mark.parametrize(
    "base, plus",
    [
        ({"algorithm.name": "fedavg", "algorithm.weighting": "samples"}, {"feddyn": {"weighting": "uniform"}}),
        ({"algorithm.name": "fedavg", "algorithm.weighting": "samples"}, {"fedprox": {"weighting": "uniform"}}),
    ],
)
def test_conflicting_explicit_weightings_are_refused(base, plus):
    (part,) = plus
    message = (
        f"algorithm.plus: fedavg sets weighting=samples and {part} sets weighting=uniform; "
        "set the same value on both or on one only"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        small_config(**{**base, "algorithm.plus": plus})



# -- grad_clip -----------------------------------------------------------------------------------------
def test_a_parts_grad_clip_is_honoured(digits):
    plain = small_config(**{"algorithm.name": "fedavg", "algorithm.plus": {"scaffold": {}}})
    part_clips = small_config(**{"algorithm.name": "fedavg", "algorithm.plus": {"scaffold": {"grad_clip": 1e-6}}})
    base_clips = small_config(
        **{"algorithm.name": "fedavg", "algorithm.grad_clip": 1e-6, "algorithm.plus": {"scaffold": {}}}
    )
    assert make_algorithm(part_clips).params.grad_clip == 1e-6
    assert not torch.equal(global_vectors(plain, digits, 1)[0], global_vectors(part_clips, digits, 1)[0])
    assert_same_rounds(base_clips, part_clips, digits)


def test_conflicting_explicit_grad_clips_are_refused():
    with pytest.raises(ConfigError, match="fedprox sets grad_clip=10.0 and scaffold sets grad_clip=1.0"):
        small_config(
            **{"algorithm.name": "fedprox", "algorithm.grad_clip": 10.0, "algorithm.plus": {"scaffold": {"grad_clip": 1.0}}}
        )


class ClipTen(FedAvg):
    name = "clip_ten"
    Params = type("ClipTenParams", (FedAvgParams,), {"__annotations__": {"grad_clip": float | None}, "grad_clip": 10.0})


class ClipFive(FedAvg):
    name = "clip_five"
    Params = type("ClipFiveParams", (FedAvgParams,), {"__annotations__": {"grad_clip": float | None}, "grad_clip": 5.0})


def test_a_parts_own_default_owns_the_setting_and_two_different_ones_are_refused(registered):
    registered("clip_ten", ClipTen)
    registered("clip_five", ClipFive)
    cfg = small_config(**{"algorithm.name": "fedavg", "algorithm.plus": {"clip_ten": {}}})
    assert all(part.params.grad_clip == 10.0 for part in make_algorithm(cfg).parts)
    with pytest.raises(ConfigError, match="clip_ten defaults to grad_clip=10.0 and clip_five to grad_clip=5.0"):
        small_config(**{"algorithm.name": "clip_ten", "algorithm.plus": {"clip_five": {}}})
    # Setting it explicitly settles it.
    cfg = small_config(**{"algorithm.name": "clip_ten", "algorithm.plus": {"clip_five": {"grad_clip": 1.0}}})
    assert make_algorithm(cfg).params.grad_clip == 1.0


# -- FedNova and proximal terms ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "base, other", [("fednova", "fedprox"), ("fednova", "feddyn"), ("fednova", "fedcurv"), ("fedprox", "fednova")]
)
def test_fednova_with_a_proximal_term_is_refused(base, other):
    with pytest.raises(ConfigError) as err:
        small_config(**{"algorithm.name": base, "algorithm.plus": {other: {}}})
    text = str(err.value)
    assert "\n" not in text
    assert "fednova cannot be combined with" in text and "normaliser" in text
    assert ("fedprox" if "fedprox" in (base, other) else other) in text
