"""Config parsing and validation: overrides, shorthands, cross-field checks."""

from __future__ import annotations

import pytest

from fedistill.config import build_config, parse_override
from fedistill.errors import ConfigError


def test_override_values_are_typed_as_yaml():
    assert parse_override("local.lr=0.05") == ("local.lr", 0.05)
    assert parse_override("dataset.download=true") == ("dataset.download", True)
    assert parse_override("dataset.augment=[crop, flip]") == ("dataset.augment", ["crop", "flip"])
    assert parse_override("run.name=abc") == ("run.name", "abc")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("local.lr")


def test_defaults_are_the_main_job_shape():
    cfg = build_config()
    assert cfg.dataset.name == "digits" and cfg.model_name() == "digits_cnn" and cfg.algorithm.name == "fedavg"
    assert cfg.augmentations() == []
    assert build_config({}, {"dataset.name": "mnist"}).augmentations() == ["crop", "flip", "cutout"]


def test_algorithm_string_shorthand_and_parameters():
    cfg = build_config({"algorithm": "fedavgm"}, ["algorithm.server_momentum=0.9"])
    assert cfg.algorithm.name == "fedavgm" and cfg.algorithm.params_dict() == {"server_momentum": 0.9}
    with pytest.raises(ConfigError, match=r"algorithm.server_momentum: .*less than 1"):
        build_config({"algorithm": {"name": "fedavgm", "server_momentum": 1.5}})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"partition.scheme": "shards"}, "partition.shards_per_client: required"),
        ({"partition.scheme": "iid", "partition.min_size": 5}, "partition.min_size: only used by the lda scheme"),
        ({"partition.scheme": "lda", "partition.alpha": None}, "partition.alpha: required"),
        ({"partition.scheme": "dirichlet"}, "partition.scheme: unknown partition 'dirichlet'"),
        ({"model.kwargs": {"bogus": 1}}, "model.kwargs.bogus: not an option"),
        ({"rounds": 0}, "rounds: Input should be greater than or equal to 1"),
        ({"eval.target_accuracy": 150}, "eval.target_accuracy"),
        ({"local.momentum": 1.0}, "local.momentum"),
        ({"unknown_section.x": 1}, "unknown_section: unknown key"),
    ],
)
def test_invalid_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config({}, overrides)


def test_set_path_into_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match="is a value, not a section"):
        build_config({"rounds": 5}, ["rounds.x=1"])
    with pytest.raises(ConfigError, match="rounds: Input should be a valid integer"):
        build_config({}, ["rounds.x=1"])
