"""Config parsing and validation: overrides, shorthands, cross-field checks."""

from __future__ import annotations

import json

import pytest

from fedistill.config import build_config, parse_override, read_yaml
from fedistill.errors import ConfigError
from fedistill import algorithms as _algorithms  # noqa: F401  (registers every method before the parametrisation below)
from fedistill.registry import ALGORITHMS


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


@pytest.mark.parametrize(
    "text, expected",
    [("1e-3", 0.001), ("5E4", 50000.0), ("-2e-1", -0.2), ("1.5e3", 1500.0), (".5", 0.5), ("0.1", 0.1), ("3", 3),
     ("1_000", 1000), ("v1e3", "v1e3"), ("'1e-3'", "1e-3"), (".", "."), ("-.", "-."), ("1.0.0", "1.0.0"),
     ("-.5e2", -50.0)],
)  # fmt: skip
def test_exponent_floats_are_numbers_as_in_yaml_1_2(text, expected):
    """Issue 27: PyYAML's YAML 1.1 resolver reads 1e-3 as a string; config files, --set and presets read a number."""
    from fedistill.config import load_yaml

    value = load_yaml(f"x: {text}")["x"]
    assert value == expected and type(value) is type(expected)


def test_exponent_learning_rates_pass_in_a_file_and_in_set(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("local:\n  lr: 1e-3\nalgorithm:\n  name: dafkd\n")
    cfg = build_config(read_yaml(path), dict([parse_override("algorithm.distill_lr=1e-4")]))
    assert cfg.local.lr == 0.001 and cfg.algorithm.params_dict()["distill_lr"] == 0.0001


def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("seed: 1\nrounds: 2\nlocal:\n  lr: 0.1\nrounds: 3\n")
    with pytest.raises(ConfigError, match=r"line 5.*'rounds' is given twice \(first on line 2\)"):
        read_yaml(path)
    path.write_text("local:\n  lr: 0.1\n  epochs: 2\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"'lr' is given twice \(first on line 2\)"):
        read_yaml(path)
    # the same key in two different mappings is fine
    path.write_text("local:\n  epochs: 2\neval:\n  every: 2\n")
    assert read_yaml(path)["eval"]["every"] == 2


def test_every_registered_method_builds_from_the_defaults_alone(digits):
    """Issue 27: ``fedistill run --algorithm NAME`` on the default dataset refused fedgkt, feddkc, fedict (no
    model.server, no split model) and pfedme (momentum 0.9). Each method's ``config_defaults`` fill what it needs;
    the whole setup (models, architectures, partition) is built here for every registered name."""
    from fedistill.registry import ALGORITHMS
    from fedistill.simulation import Simulation

    for name in ALGORITHMS:
        cfg = build_config({"algorithm": {"name": name}, "rounds": 1, "run": {"progress": False}})
        Simulation(cfg, digits).close()
    assert build_config({"algorithm": "pfedme"}).local.momentum == 0.0
    fd = build_config({"algorithm": "fedict"})
    assert (fd.model.name, fd.model.server, fd.partition.per_client_test) == ("fd_resnet8", "fd_server_resnet56", True)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_method_runs_one_round_with_only_its_name(name, tmp_path, capsys):
    """Issue 27's promise, as the user types it: ``fedistill run --algorithm NAME --rounds 1`` on the default
    dataset (digits) finishes and records an accuracy."""
    from fedistill.cli import main

    assert len(ALGORITHMS.names()) >= 25  # the parametrisation saw every method, not an empty registry
    assert main(["run", "--algorithm", name, "--rounds", "1", "--no-progress", "--set", "run.threads=1", "--out", str(tmp_path), "--name", "r"]) == 0
    row = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    accuracy = row.get("personal_accuracy") if row.get("test_accuracy") is None else row["test_accuracy"]
    assert accuracy is not None and 0.0 <= accuracy <= 100.0
    header = capsys.readouterr().out.splitlines()[0]
    assert name in header  # the header names the method, and what it set where the run's defaults did not suit it
    assert (f"{name} sets local.momentum=0.0" in header) == (name in ("pfedme", "fedgen"))


def test_a_method_that_cannot_run_a_dataset_says_why_in_list_and_in_one_line(tmp_path, capsys, monkeypatch):
    from fedistill.cli import main

    monkeypatch.setenv("COLUMNS", "400")  # one line per row, so the sentence is not folded inside its cell
    assert main(["list"]) == 0
    listed = " ".join(capsys.readouterr().out.split())
    assert listed.count("Cannot run synthetic: its generator") == 3  # dafkd, feddf, fedftg; no other method
    args = ["run", "--algorithm", "dafkd", "--rounds", "1", "--set", "dataset.name=synthetic", "--set", "partition.scheme=natural",
            "--set", "partition.num_clients=6", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: generator 'dcgan' makes square images") and err.count("\n") == 1


def test_a_methods_defaults_never_override_what_the_user_set(tmp_path):
    assert build_config({"algorithm": "pfedme"})._method_settings == {"local.momentum": 0.0}  # said in the header
    assert build_config({"algorithm": "pfedme", "local": {"momentum": 0.0}})._method_settings == {}
    assert build_config({"algorithm": "fedgkt", "model": {"name": "fd_resnet4"}})._method_settings == {
        "model.server": "fd_server_resnet56", "partition.per_client_test": True}  # fmt: skip
    assert build_config({"algorithm": "fedavg"}).local.momentum == 0.9  # other methods keep the run's default
    # FedGen's card trains its clients with plain SGD; a run (or preset) that sets momentum keeps it
    assert build_config({"algorithm": "fedgen"}).local.momentum == 0.0
    assert build_config({"algorithm": "fedgen", "local": {"momentum": 0.9}}).local.momentum == 0.9
    with pytest.raises(ConfigError, match="local.momentum: pfedme runs momentum-free"):
        build_config({"algorithm": "pfedme", "local": {"momentum": 0.9}})
    with pytest.raises(ConfigError, match="local.momentum"):
        build_config({"algorithm": "pfedme"}, ["local.momentum=0.5"])
    cfg = build_config({"algorithm": "fedgkt", "model": {"name": "fd_resnet4"}})
    assert (cfg.model.name, cfg.model.server) == ("fd_resnet4", "fd_server_resnet56")
    # named client architectures keep model.name unset (the run's own choice stays what it was)
    tree = {"algorithm": "fedgkt", "model": {"clients": ["fd_resnet2", "fd_resnet4"]}}
    assert build_config(tree).model.name is None
