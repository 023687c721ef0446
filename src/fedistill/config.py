"""Typed, validated run configuration.

A run is configured by defaults < a YAML file (``--config``) < CLI flags < ``--set key=value`` overrides.
Every value is checked here, before any work starts; a bad value raises :class:`ConfigError` with one
line naming the key and what is allowed (the CLI turns it into exit code 2).

Length (over the ~500-line guide of ARCHITECTURE.md): the whole configuration schema (one pydantic model per
section) and its loading; split, the schema a user reads would be scattered.
"""

from __future__ import annotations

import copy
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from .errors import ConfigError, closest

# Paper defaults per dataset: the model of the main experiments and the training augmentation
# (experiments-fedlmd.md §1 for MNIST/CIFAR/CINIC; DaFKD uses no augmentation for SVHN; 8x8 digits are
# too small to crop).
DATASET_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {"model": "digits_cnn", "augment": []},
    "mnist": {"model": "cnn", "augment": ["crop", "flip", "cutout"]},
    "fashion_mnist": {"model": "cnn", "augment": ["crop", "flip", "cutout"]},
    "emnist": {"model": "cnn", "augment": []},
    "cifar10": {"model": "cnn", "augment": ["crop", "flip", "cutout"]},
    "cifar100": {"model": "cnn", "augment": ["crop", "flip", "cutout"]},
    "cinic10": {"model": "cnn", "augment": ["crop", "flip"]},
    "svhn": {"model": "cnn", "augment": []},
    # FedProx trains multinomial logistic regression on its synthetic data.
    "synthetic": {"model": "logistic", "augment": []},
    # A federation read from per-client files (HtFLlib's layout): its images as stored, no augmentation.
    "npz_federation": {"model": "cnn", "augment": []},
}

# Datasets that define their own clients (partition.scheme natural) instead of being split by labels.
NATURAL_DATASETS = ("synthetic", "npz_federation")


# Strict types: a bool is not a number (``rounds: true`` would be 1 round), a float is not an int
# (``rounds: 1e23``), and no setting may be NaN or infinite (``local.lr: .inf``). Ints are still accepted
# where a float is expected.
STRICT = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

# Upper bounds that catch typos (an extra zero or exponent) long before they exhaust memory or time.
MAX_ROUNDS = 1_000_000
MAX_CLIENTS = 10_000_000


MAX_RUN_NAME_BYTES = 200


def check_run_name(name: str) -> None:
    """A run name is one directory name inside ``run.out_dir``: no separators, no ``..``, not absolute."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or Path(name).is_absolute() or "\0" in name:
        raise ValueError(
            f"{name!r} must be a single directory name inside run.out_dir (no '/', no '..'); "
            "put the parent directory in run.out_dir (--out) instead"
        )
    size = len(name.encode("utf-8"))
    if size > MAX_RUN_NAME_BYTES:
        # File systems allow 255 bytes per name (ext4, APFS, NTFS); the seed groups add "-seedN" and reproduce
        # its own suffixes, so a longer name would end in the operating system's error after the checks passed.
        raise ValueError(
            f"is {size} bytes long; a run name may have at most {MAX_RUN_NAME_BYTES} (it becomes a directory name)"
        )


def check_device(device: str) -> None:
    """``run.device`` must name a device torch knows and this machine has."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{device!r} is not a device name (e.g. cpu, cuda, cuda:1, mps)") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{device!r} asks for CUDA, but this machine has no usable CUDA device; use cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"{device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{device!r} asks for MPS, which this machine does not have; use cpu")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{device!r} is not supported (cpu, cuda, cuda:N or mps)")


class _Section(BaseModel):
    model_config = STRICT


class SyntheticConfig(_Section):
    """FedProx's Synthetic(alpha, beta) (data/synthetic.py); the clients are partition.num_clients, the seed
    the partition seed."""

    alpha: float = Field(1.0, ge=0, description="spread of u_k (the models' mean); does not change the data (softmax shift)")
    beta: float = Field(1.0, ge=0, description="spread of B_k (the inputs' mean): label and feature skew")
    spread: Literal["std", "variance"] = Field("std", description="alpha, beta as standard deviations (authors' code) or variances")
    dim: int = Field(60, ge=1, description="input dimension")
    classes: int = Field(10, ge=2)
    size_log_mean: float = Field(4.0, description="client sizes: floor(lognormal(size_log_mean, size_log_sigma)) + min_samples")
    size_log_sigma: float = Field(2.0, ge=0)
    min_samples: int = Field(50, ge=1)
    max_samples: int | None = Field(None, ge=1, description="cap on a client's size (none in FedProx)")
    test_samples: int = Field(10_000, ge=1, description="held-out global test set, clients drawn by size")
    iid: bool = Field(False, description="FedProx's Synthetic-IID: one W, b for every client, x ~ N(0, Sigma) (alpha, beta unused)")

    @model_validator(mode="after")
    def _cap_above_floor(self) -> "SyntheticConfig":
        if self.max_samples is not None and self.max_samples < self.min_samples:
            raise ValueError(f"max_samples ({self.max_samples}) is below min_samples ({self.min_samples})")
        return self


class DatasetConfig(_Section):
    name: str = "digits"
    data_dir: str | None = Field(None, description="directory of the official files (default: $FEDISTILL_DATA or ./data)")
    download: bool = Field(False, description="fetch missing official files (with checksum)")
    verify: bool = Field(True, description="check official md5 checksums")
    augment: list[str] | None = Field(None, description="subset of crop, flip, cutout; null = the paper default")
    split: str | None = Field(None, description="dataset variant, e.g. the EMNIST split (balanced, letters, ...)")
    resize: int | None = Field(
        None, ge=4, le=1024, description="resize every image to resize x resize, bilinear, once at load (DaFKD: 32)"
    )
    synthetic: SyntheticConfig | None = Field(None, description="options of the synthetic dataset (default: Synthetic(1, 1))")
    train_samples: int | None = Field(
        None,
        ge=1,
        description="train on a fixed random subset of this many training samples (seed 0, the same for every run "
        "seed and method; the test set stays whole): for reduced protocols",
    )
    num_classes: int | None = Field(
        None, ge=2, description="npz_federation: the number of classes (default: the largest label in the files + 1)"
    )


class PartitionConfig(_Section):
    scheme: str = "lda"
    num_clients: int = Field(20, ge=1, le=MAX_CLIENTS)
    alpha: float | None = Field(0.5, gt=0, description="Dirichlet concentration (lda, client_dirichlet)")
    shards_per_client: int | None = Field(None, ge=1, description="shards scheme")
    min_size: int | None = Field(None, ge=1, description="lda: minimum samples per client (default 10); empty clients are not allowed")
    max_retries: int | None = Field(None, ge=1, description="lda: redraw budget before giving up (default: automatic)")
    ways: int | None = Field(None, ge=1, description="nway_kshot: the classes a client holds on average (FedProto's n)")
    shots: int | None = Field(None, ge=1, description="nway_kshot: the samples of each held class (default 100)")
    stdev: int | None = Field(None, ge=0, description="nway_kshot: the spread of the ways and shots drawn per client (default 2)")
    per_client_test: bool = Field(False, description="split the test set per client following train proportions")
    seed: int | None = Field(None, ge=0, description="partition seed (default: the run seed)")


class ModelConfig(_Section):
    name: str | None = Field(None, description="model name; null = the dataset's default")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    # Per-client architectures (FedICT's heterogeneous setting, experiments-fedict.md §4; HtFLlib's model groups).
    # At most one of the three; with none, every client uses ``name``.
    group: str | None = Field(
        None,
        description="a model group (fedistill list: model groups): client k uses member k mod M, all with one feature "
        "dimension and a linear head (HtFLlib's HtFE groups)",
    )
    group_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="options for the group's members, each given to those that take it, e.g. {feature_dim: 256}"
    )
    clients: list[str] | None = Field(
        None, min_length=1, description="client k uses clients[k mod len] (FedICT Table V: five models, five clients)"
    )
    client_mix: dict[str, float] | None = Field(
        None, description="each client draws its model with these probabilities, seeded (FedICT's TMD setting)"
    )
    server: str | None = Field(None, description="the server's predictor on uploaded features (FedGKT/FedDKC/FedICT)")
    shared: str | None = Field(
        None,
        description="the shared model every client trains beside its own, for methods that average one (FML's meme); "
        "null: the first member of the assignment (client 0's architecture, HtFLlib's models[0])",
    )
    server_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_assignment(self) -> "ModelConfig":
        if self.clients is not None and self.client_mix is not None:
            raise ValueError("model.clients and model.client_mix: set one of them, not both")
        if self.group is not None and (self.clients is not None or self.client_mix is not None):
            other = "clients" if self.clients is not None else "client_mix"
            raise ValueError(f"model.group and model.{other}: set one of them, not both")
        if self.client_mix is not None:
            if not self.client_mix:
                raise ValueError("model.client_mix: give at least one model name with its probability")
            bad = {k: v for k, v in self.client_mix.items() if not v > 0}
            if bad:
                raise ValueError(f"model.client_mix: probabilities must be > 0, got {bad}")
            total = sum(self.client_mix.values())
            if abs(total - 1.0) > 1e-9:
                raise ValueError(f"model.client_mix: probabilities must sum to 1, they sum to {total:g}")
        return self

    def client_model_names(self) -> list[str]:
        """Every architecture a client may use (in first-use order)."""
        names = self.clients or list(self.client_mix or {}) or self.group_members()
        return list(dict.fromkeys(names))

    def group_members(self) -> list[str]:
        """The members of ``group`` in assignment order (none without a group); an unknown group is a ConfigError."""
        if self.group is None:
            return []
        from .models.group import group_members

        return list(group_members(self.group))

    def kwargs_for(self, name: str, default_name: str) -> dict[str, Any]:
        """The options model ``name`` is built with: for a member of ``group`` the ``group_kwargs`` it takes, for
        ``default_name`` (the run's model.name) ``kwargs``, else none."""
        if name in self.group_members():
            from .models import model_options

            accepted = model_options(name)
            return {key: value for key, value in self.group_kwargs.items() if key in accepted}
        return dict(self.kwargs) if name == default_name else {}


class LocalConfig(_Section):
    epochs: int = Field(5, ge=0)
    batch_size: int = Field(50, ge=1)
    lr: float = Field(0.01, ge=0)
    lr_decay: float = Field(0.99, gt=0, le=1, description="per-round factor γ: η_t = η_0 γ^(t-1)")
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(1e-5, ge=0)
    batch_order: Literal["shuffled", "sequential"] = Field(
        "shuffled",
        description="shuffled: a fresh permutation per (seed, round, client) epoch, the last partial batch kept; "
        "sequential: the client's samples in their stored order, the last partial batch dropped (HtFLlib's "
        "DataLoader(shuffle=False, drop_last=True): for like-for-like checks against its code)",
    )


class EvalConfig(_Section):
    every: int = Field(1, ge=1, description="evaluate the global model every N rounds (and after the last)")
    batch_size: int = Field(100, ge=1, description="small batches stay in cache: 1000 was 2x slower on CPU")
    target_accuracy: float | None = Field(None, gt=0, le=100, description="percent; reported as rounds to target")
    metric: Literal["auto", "global", "personal"] = Field(
        "auto",
        description="what final/best accuracy and rounds to target use: the global model on the test set, or the "
        "clients' average accuracy on their own test splits (personal; needs partition.per_client_test); "
        "auto = personal when the partition has per-client test splits",
    )


def whole_number(value: Any, minimum: int, expected: str) -> int:
    """``value`` (an int or its text, as ``--set`` gives it) as an int of at least ``minimum``; else a ValueError
    that says what was got and ``expected``."""
    try:
        number = int(str(value).strip()) if not isinstance(value, (bool, float)) else None
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"got {value!r}; {expected}")
    return number


class RunConfig(_Section):
    out_dir: str = "runs"
    name: str | None = None
    checkpoint_every: int = Field(10, ge=0, description="0 = only at the end")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="bf16 = autocast with fp32 master weights")
    channels_last: bool = True
    device: str = "cpu"
    cuda_graphs: bool = Field(
        False,
        description="replay the clients' SGD step (the plain one, and a loss term or correction whose method declares a "
        "graph_key), batch making included, from a captured CUDA graph: one launch per step instead of about a hundred "
        "(needs a cuda device)",
    )
    cohort: Annotated[int, Field(ge=2)] | Literal["auto"] | None = Field(
        None,
        description="train a round's clients of one architecture K at a time as one batched step (engine/cohort.py; "
        "methods that declare a batchable client step, models without BatchNorm statistics; in this process). A GPU "
        "lever: on a CPU the batched step is slower; unset = one client after another; auto = cohorts of the round's "
        "clients where a measurement on this GPU model found them faster than the graphed sequential step "
        "(engine/cohort_choice.py), one client after another elsewhere",
    )
    resident_weights: bool = Field(
        False,
        description="keep the broadcast, the clients' uploads and the server's vectors on run.device across the Message "
        "boundary of the in-process simulation (no host copy or wait per client; a checkpoint still writes host "
        "tensors). A GPU lever for the methods that declare it (FedAvg, FedAvgM, FedAdam, FedProx, FedNTD, FedLMD, FedLMD-Tf, "
        "SCAFFOLD); "
        "the same numbers; on a CPU the vectors are on the host either way",
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="intra-op threads of every process of the run; unset = 1 (parallelism comes from run.workers, and the "
        "numbers do not depend on the machine's core count or load)",
    )
    client_state: Literal["auto", "memory", "disk"] = Field(
        "auto", description="where the simulation keeps client state; auto = disk when the run has a directory"
    )
    client_state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16 = client states rounded to bfloat16 when stored (half the bytes), float32 in use"
    )
    workers: int | Literal["auto"] = Field(
        "auto",
        description="client processes: auto = one per usable core that no other process is using, planned every round "
        "(clients in this process when a round is too small to pay for processes); N = a fixed pool (workers x threads "
        "must not exceed the cores)",
    )
    tune_allocator: bool = Field(True, description="keep freed memory in glibc's heap (fewer page faults)")
    progress: bool = True
    figures: bool = Field(
        True,
        description="draw partition.png, accuracy.png, class_distributions.png (and personal_accuracy.png) in the run "
        "directory; false: the CSV and JSON files only, about 0.6 s less a run (`fedistill compare RUN` draws the curves later)",
    )
    tensorboard: bool = Field(False, description="also write the per-round metrics for TensorBoard (extra: tensorboard)")

    @field_validator("name")
    @classmethod
    def _single_directory_name(cls, value: str | None) -> str | None:
        if value is not None:
            check_run_name(value)
        return value

    @field_validator("workers", mode="before")
    @classmethod
    def _auto_or_count(cls, value: Any) -> Any:
        if value == "auto":
            return value
        return whole_number(value, 1, "give auto (one process per free core, planned every round) or a whole number >= 1")

    @field_validator("cohort", mode="before")
    @classmethod
    def _cohort_size_or_auto(cls, value: Any) -> Any:
        if value is None or value == "auto":
            return value
        return whole_number(value, 2, "give a whole number >= 2 (clients per batched step), auto, or null (one client after another)")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        check_device(value)
        return value

    @model_validator(mode="after")
    def _graphs_need_cuda(self) -> "RunConfig":
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device, and run.device is {self.device!r}: set run.device=cuda or drop run.cuda_graphs")
        if isinstance(self.cohort, int) and self.cuda_graphs:  # auto: graphs for the sequential path it may choose
            raise ValueError("cohort: a cohort step is one batched call per step already; drop run.cuda_graphs or run.cohort")
        if self.cohort is not None and self.workers not in ("auto", 1):
            raise ValueError(f"cohort: a cohort trains in this process; run.workers is {self.workers}: set run.workers=1")
        if self.resident_weights and self.workers not in ("auto", 1):
            raise ValueError(
                f"resident_weights: the weights stay on the device of this process; run.workers is {self.workers}: set "
                "run.workers=1 (or auto) or drop run.resident_weights"
            )
        return self


class AlgorithmConfig(BaseModel):
    """``name`` plus the algorithm's own hyperparameters, validated by its ``Params`` model."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str = "fedavg"
    # Methods whose ingredients are added to ``name`` (algorithms/compose.py), each with its parameters.
    plus: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("plus", mode="before")
    @classmethod
    def _names_to_mapping(cls, value: Any) -> Any:
        # ``plus: [fedprox, fedavgm]`` or ``--set algorithm.plus=fedprox,fedavgm``: default parameters.
        if isinstance(value, str):
            value = [v for v in value.replace("+", ",").split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            names = [str(v).strip() for v in value]
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ValueError(f"{', '.join(repeated)} given more than once; each method may appear once")
            return {n: {} for n in names}
        if isinstance(value, dict):
            return {k: ({} if v is None else v) for k, v in value.items()}
        return value

    def params_dict(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def display_name(self) -> str:
        return "+".join([self.name, *self.plus])


class Config(_Section):
    # What the method's config_defaults filled where the user left a key unset ({"local.momentum": 0.0}):
    # not part of the configuration (config.yaml has the values), said in the run's header.
    _method_settings: dict[str, Any] = PrivateAttr(default_factory=dict)

    seed: int = Field(0, ge=0)
    rounds: int = Field(30, ge=1, le=MAX_ROUNDS)
    clients_per_round: int = Field(5, ge=1, le=MAX_CLIENTS)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    local: LocalConfig = Field(default_factory=LocalConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        if self.clients_per_round > self.partition.num_clients:
            raise ValueError(
                f"clients_per_round: {self.clients_per_round} is more than partition.num_clients "
                f"({self.partition.num_clients}); allowed 1..{self.partition.num_clients}"
            )
        p = self.partition
        if p.scheme == "shards" and p.shards_per_client is None:
            raise ValueError("partition.shards_per_client: required by the shards scheme (e.g. 2)")
        if p.scheme in ("lda", "client_dirichlet") and p.alpha is None:
            raise ValueError(f"partition.alpha: required by the {p.scheme} scheme (a value > 0)")
        for key in ("min_size", "max_retries"):
            if getattr(p, key) is not None and p.scheme != "lda":
                raise ValueError(f"partition.{key}: only used by the lda scheme, not {p.scheme}")
        if p.scheme == "nway_kshot" and p.ways is None:
            raise ValueError("partition.ways: required by the nway_kshot scheme (FedProto's n, e.g. 3)")
        for key in ("ways", "shots", "stdev"):
            if getattr(p, key) is not None and p.scheme != "nway_kshot":
                raise ValueError(f"partition.{key}: only used by the nway_kshot scheme, not {p.scheme}")
        if self.dataset.name == "npz_federation":
            # The files are the clients and each test file is its client's own split: what the run uses unless
            # the user said otherwise (an explicit other scheme is refused below; per_client_test false tests the
            # global model on all the test files pooled).
            if "scheme" not in p.model_fields_set:
                p.scheme = "natural"
            if "per_client_test" not in p.model_fields_set:
                p.per_client_test = True
        elif self.dataset.num_classes is not None:
            raise ValueError(
                f"dataset.num_classes: only npz_federation takes it (dataset {self.dataset.name} knows its classes); remove it"
            )
        natural = self.dataset.name in NATURAL_DATASETS
        if natural and p.scheme != "natural":
            raise ValueError(
                f"partition.scheme: dataset {self.dataset.name} makes its own clients; use partition.scheme: natural, not {p.scheme}"
            )
        if p.scheme == "natural" and not natural:
            raise ValueError(
                f"partition.scheme: natural needs a dataset that makes its own clients ({', '.join(NATURAL_DATASETS)}); "
                f"{self.dataset.name} is split by labels (iid, shards, lda, client_dirichlet)"
            )
        if self.dataset.synthetic is not None and self.dataset.name != "synthetic":
            raise ValueError(f"dataset.synthetic: options of the synthetic dataset, but dataset.name is {self.dataset.name}")
        if self.dataset.name == "npz_federation":
            if self.dataset.resize is not None:
                raise ValueError("dataset.resize: npz_federation takes its files' images as they are; resize them in the files")
            if self.dataset.train_samples is not None:
                raise ValueError(
                    "dataset.train_samples: npz_federation's clients are its files, taken whole; subsample them in the files"
                )
        elif natural:
            if self.dataset.resize is not None:
                raise ValueError(f"dataset.resize: dataset {self.dataset.name} has feature vectors, not images")
            if self.dataset.augment:
                raise ValueError(f"dataset.augment: dataset {self.dataset.name} has feature vectors, not images; use []")
            if self.dataset.train_samples is not None:
                raise ValueError(
                    f"dataset.train_samples: dataset {self.dataset.name} generates each client's samples; "
                    "set its size through dataset.synthetic instead"
                )
        if self.eval.metric == "personal" and not p.per_client_test:
            raise ValueError(
                "eval.metric: personal accuracy needs per-client test splits; set partition.per_client_test: true"
            )
        return self

    # Resolved views -----------------------------------------------------------------------------
    def model_name(self) -> str:
        return self.model.name or DATASET_DEFAULTS.get(self.dataset.name, {}).get("model", "cnn")

    def augmentations(self) -> list[str]:
        if self.dataset.augment is not None:
            return list(self.dataset.augment)
        return list(DATASET_DEFAULTS.get(self.dataset.name, {}).get("augment", []))

    def accuracy_metric(self) -> str:
        """``global`` or ``personal``: the accuracy that summaries, tables and targets use."""
        if self.eval.metric == "auto":
            return "personal" if self.partition.per_client_test else "global"
        return self.eval.metric

    def partition_seed(self) -> int:
        return self.seed if self.partition.seed is None else self.partition.seed

    def dataset_options(self) -> dict[str, Any]:
        """The options the dataset's loader takes besides the data directory (fedistill.data.sources.load_dataset)."""
        options: dict[str, Any] = {"split": self.dataset.split} if self.dataset.split is not None else {}
        if self.dataset.name == "synthetic":
            # The synthetic federation is generated, with its clients, from the partition seed.
            synthetic = self.dataset.synthetic or SyntheticConfig()
            options.update(num_clients=self.partition.num_clients, seed=self.partition_seed(), **synthetic.model_dump())
        if self.dataset.name == "npz_federation":
            # The files are checked against the configured client count; the classes default to the labels'.
            options.update(num_clients=self.partition.num_clients, num_classes=self.dataset.num_classes)
        return options

    def to_dict(self) -> dict[str, Any]:
        tree = self.model_dump(mode="json")
        if not tree["algorithm"]["plus"]:
            del tree["algorithm"]["plus"]  # a plain method's saved config stays {name, params}
        return tree

    def resolved_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` with every default the run resolves written out, as ``config.yaml`` holds it: the
        model, the augmentations, the partition seed, and every parameter of the algorithm and of each
        ``plus`` part, after the combination settled their shared settings (compose.py), so that all parts
        state the one value the run used. Building a config from it gives the same run."""
        from .algorithms.build import make_algorithm

        tree = self.to_dict()
        if not (self.model.clients or self.model.client_mix or self.model.group):
            tree["model"]["name"] = self.model_name()
        tree["dataset"]["augment"] = self.augmentations()
        if self.dataset.name == "synthetic" and self.dataset.synthetic is None:
            tree["dataset"]["synthetic"] = SyntheticConfig().model_dump(mode="json")
        tree["partition"]["seed"] = self.partition_seed()
        algorithm = make_algorithm(self)
        parts = getattr(algorithm, "parts", [algorithm])
        tree["algorithm"] = {"name": self.algorithm.name, **parts[0].params.model_dump(mode="json")}
        if len(parts) > 1:
            tree["algorithm"]["plus"] = {part.name: part.params.model_dump(mode="json") for part in parts[1:]}
        return tree


def _section_fields(loc: tuple[Any, ...]) -> list[str]:
    """The valid keys of the section that ``loc`` (minus its last element) points into."""
    model: Any = Config
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(getattr(model, "model_fields", {}))


def _format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if first["type"] == "extra_forbidden":
        valid = _section_fields(first["loc"])
        hint = closest(first["loc"][-1], valid) or (f" (valid keys here: {', '.join(valid)})" if valid else "")
        return f"{loc}: unknown key{hint}"
    got = first.get("input")
    # A validator's own message already names the value.
    shown = "" if isinstance(got, (dict, list)) or got is None or first["type"] == "value_error" else f" (got {got!r})"
    return f"{loc}: {msg}{shown}" if loc else f"{msg}"


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        nxt = node.get(key)
        if nxt is None:
            nxt = node[key] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is a value, not a section")
        node = nxt
    node[keys[-1]] = value


class ConfigLoader(yaml.SafeLoader):
    """YAML as researchers write it (issue 27), for config files, ``--set`` values and presets alike.

    - ``1e-3`` is a number: PyYAML resolves YAML 1.1, whose float needs a dot (``1.0e-3``), so ``lr: 1e-3`` was the
      string ``'1e-3'`` and refused; YAML 1.2 (and JSON) read it as a float, and so does this loader.
    - A key given twice in one mapping (``rounds: 2`` then ``rounds: 3``) is an error naming both lines, not the last
      value kept silently.
    """

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:  # the keys written in this mapping (not those a << merge brings)
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first_line.get(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if seen is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (first on line {seen + 1}); keep one", key_node.start_mark
                    )
                first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's float: a dot or an exponent (1e-3, 5E4, .5, 1.), plus .inf/.nan; YAML 1.1's resolver stays for the rest.
_YAML12_FLOAT = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """``text`` parsed with :class:`ConfigLoader` (exponent floats are numbers, duplicate keys are errors)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506  (ConfigLoader is a SafeLoader)


def parse_override(text: str) -> tuple[str, Any]:
    """``key.sub=value`` with the value parsed as YAML (so 0.1 is a float, true a bool, [a, b] a list)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. --set local.lr=0.05")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r} ({exc.__class__.__name__})") from None
    return key, value


def parse_yaml_text(path: str | Path, text: str, what: str | None = None) -> dict[str, Any]:
    """A YAML mapping from ``text`` (read from ``path``); errors keep YAML's line and column."""
    what = what or str(path)
    try:
        data = load_yaml(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise ConfigError(f"{what}: not valid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: the top level must be a mapping of keys to values, not a {type(data).__name__}")
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: file {str(path)!r} does not exist")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not a YAML file (it holds binary data)") from None
    return parse_yaml_text(path, text, what=f"--config {path}")


def build_config(
    base: dict[str, Any] | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    source: str | None = None,
) -> Config:
    """Validate ``base`` (e.g. a YAML file's content) with dotted ``overrides`` applied on top.

    ``source`` names where ``base`` came from (a run directory's config.yaml): an error in a key that no
    override set says it came from that file.
    """
    tree = copy.deepcopy(base or {})
    if isinstance(tree.get("algorithm"), str):
        tree["algorithm"] = {"name": tree["algorithm"]}
    items = list(overrides.items() if isinstance(overrides, dict) else (parse_override(o) for o in overrides or []))
    for key, value in items:
        if key == "algorithm" and isinstance(value, str):
            key = "algorithm.name"
        _set_path(tree, key, value)
    overridden = [key for key, _ in items]
    tree, filled = _with_method_defaults(tree)
    try:
        try:
            cfg = Config.model_validate(tree)
            cfg._method_settings = filled
        except ValidationError as err:
            raise ConfigError(_format_validation_error(err)) from None
        validate_names(cfg)
    except ConfigError as exc:
        message = str(exc)
        failing = message.split(":", 1)[0]
        from_override = any(failing == k or failing.startswith(k + ".") or k.startswith(failing + ".") for k in overridden)
        if source and not from_override:
            raise ConfigError(f"{source}: {message}") from None
        raise
    return cfg


def _with_method_defaults(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``tree`` over the configured method's ``config_defaults`` (the registry's class; an unknown name is left
    for validation to report): what the user set wins, the method fills only what was left unset. Also returns
    what it filled, as dotted keys."""
    from . import algorithms as _algorithms  # noqa: F401  (registers algorithms)
    from .plugins import load_plugins
    from .registry import ALGORITHMS

    load_plugins()  # a plugin's method, dataset, model or partition is known before the names are checked
    section = tree.get("algorithm")
    name = section.get("name", AlgorithmConfig.model_fields["name"].default) if isinstance(section, dict) else section
    if not isinstance(name, str) or name not in ALGORITHMS:
        return tree, {}
    defaults = ALGORITHMS.get(name).config_defaults(tree)
    return _merged(defaults, tree), _unset_leaves(defaults, tree)


def _unset_leaves(under: dict[str, Any], over: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The leaves of ``under`` that ``over`` does not set, as ``{"section.key": value}``."""
    out: dict[str, Any] = {}
    for key, value in under.items():
        if key not in over:
            if isinstance(value, dict):
                out.update(_unset_leaves(value, {}, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        elif isinstance(value, dict) and isinstance(over[key], dict):
            out.update(_unset_leaves(value, over[key], f"{prefix}{key}."))
    return out


def _merged(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` with the keys it lacks taken from ``under``, recursively into mappings present in both."""
    out = copy.deepcopy(over)
    for key, value in under.items():
        if key not in out:
            out[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _merged(value, out[key])
    return out


def validate_names(cfg: Config) -> None:
    """Resolve every registered name and the algorithm's parameters now, not in round 1."""
    from . import algorithms as _algorithms  # noqa: F401  (registers algorithms)
    from . import models as _models  # noqa: F401
    from .data import partition as _partition  # noqa: F401
    from .data import sources as _sources  # noqa: F401
    from .data.pipeline import AugmentSpec
    from .registry import ALGORITHMS, DATASETS, MODELS, PARTITIONS

    from .algorithms.build import algorithm_params, part_params

    algo_cls = ALGORITHMS.get(cfg.algorithm.name, key="algorithm.name")
    algorithm_params(algo_cls, cfg)
    for name, params in cfg.algorithm.plus.items():
        part_params(ALGORITHMS.get(name, key=f"algorithm.plus.{name}"), name, params)
    from .algorithms.build import make_algorithm

    # Refuses parts that cannot be combined and settings a method cannot honour (pFedMe's momentum-free
    # inner steps), now rather than when the run starts.
    make_algorithm(cfg)
    DATASETS.get(cfg.dataset.name, key="dataset.name")
    MODELS.get(cfg.model_name(), key="model.name")
    from .models import model_options

    accepted = model_options(cfg.model_name())
    for key in cfg.model.kwargs:
        if key not in accepted:
            raise ConfigError(
                f"model.kwargs.{key}: not an option of model {cfg.model_name()!r} (accepted: {', '.join(accepted) or 'none'})"
            )
    assigned_by = "model.clients" if cfg.model.clients else "model.client_mix" if cfg.model.client_mix else "model.group"
    for name in cfg.model.client_model_names():  # an unknown model.group is refused here, with the groups listed
        MODELS.get(name, key=assigned_by)
    if cfg.model.group is not None:
        members = cfg.model.group_members()
        for key in cfg.model.group_kwargs:
            if not any(key in model_options(name) for name in members):
                options = sorted({option for name in members for option in model_options(name)})
                raise ConfigError(
                    f"model.group_kwargs.{key}: no member of group {cfg.model.group!r} takes it (accepted: {', '.join(options)})"
                )
    elif cfg.model.group_kwargs:
        raise ConfigError("model.group_kwargs: set model.group too (the options belong to the group's members)")
    if cfg.model.server is not None:
        MODELS.get(cfg.model.server, key="model.server")
        accepted = model_options(cfg.model.server)
        for key in cfg.model.server_kwargs:
            if key not in accepted:
                raise ConfigError(
                    f"model.server_kwargs.{key}: not an option of model {cfg.model.server!r} (accepted: {', '.join(accepted) or 'none'})"
                )
    elif cfg.model.server_kwargs:
        raise ConfigError("model.server_kwargs: set model.server too (the options belong to the server's model)")
    PARTITIONS.get(cfg.partition.scheme, key="partition.scheme")
    AugmentSpec.from_names(cfg.augmentations())


# Defaults that changed after runs were saved: (algorithms, key, the value before). A saved configuration of one
# of these algorithms without the key was run with the old value, and keeps it when it is resumed or compared,
# instead of silently taking the new default (a resumed run would change method half-way; reproduce and bench
# would reuse it as a run of the new default).
CHANGED_DEFAULTS: tuple[tuple[frozenset[str], str, Any], ...] = (
    # zs_mode train_pass since 2026-11-26 (issue 25): the key did not exist before, the behaviour was eval.
    (frozenset({"fedgkt", "feddkc", "fedict"}), "zs_mode", "eval"),
)


def with_saved_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved configuration with the defaults it ran with where they have changed since (:data:`CHANGED_DEFAULTS`)."""
    algorithm = saved.get("algorithm") if isinstance(saved, dict) else None
    if not isinstance(algorithm, dict):
        return saved
    name = algorithm.get("name")
    old = {key: value for names, key, value in CHANGED_DEFAULTS if name in names and key not in algorithm}
    return {**saved, "algorithm": {**algorithm, **old}} if old else saved


def resolved_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved configuration (config.yaml, a checkpoint's) with every default written out
    (:meth:`Config.resolved_dict`), so that one saved before the resolved form existed compares equal to the
    same run's; as saved if this version cannot read it (it is then reported as different by the caller).
    A default that changed since the run was saved is the one it ran with (:func:`with_saved_defaults`)."""
    saved = with_saved_defaults(saved)
    try:
        return Config.model_validate(saved).resolved_dict()
    except (ValidationError, ConfigError):
        return saved


def bundled_configs_dir() -> Path | None:
    """The ``configs/`` that ships with fedistill, or None if this installation has none.

    In an installed wheel it is package data, ``fedistill/configs/`` (pyproject.toml maps the repository's
    ``configs/`` there); from the source tree (an editable install, or ``src`` on ``sys.path``) it is the
    checkout's ``configs/`` beside ``src/``.
    """
    packaged = resources.files(__package__) / "configs"
    candidates = [Path(str(packaged)), Path(__file__).resolve().parents[2] / "configs"]
    return next((c for c in candidates if c.is_dir()), None)


def bundled_configs() -> dict[str, Path]:
    """The experiment configurations that ship with fedistill (``configs/*.yaml``), by name."""
    bundled = bundled_configs_dir()
    return {p.stem: p for p in sorted(bundled.glob("*.yaml"))} if bundled is not None else {}


def find_config(path_or_name: str) -> str:
    """``run --config``'s file: the path as given where it exists, else the shipped configuration it names.

    ``configs/digits_fedavg.yaml`` (the README's spelling), ``digits_fedavg.yaml`` and ``digits_fedavg``
    all name the shipped ``digits_fedavg``, so the README's commands work from any directory with an
    installed package. Anything else is returned unchanged, for the caller's "does not exist" error.
    """
    path = Path(path_or_name)
    if path.is_file():
        return path_or_name
    parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
    if len(parts) == 1:
        name = parts[0][: -len(".yaml")] if parts[0].endswith(".yaml") else parts[0]
        shipped = bundled_configs().get(name)
        if shipped is not None:
            return str(shipped)
    return path_or_name
