"""The protocol between the engine and the methods: Messages, client and server contexts, RoundInfo and the
Algorithm base class.

It sits below both (issue 26): the engine runs any object with this interface and imports nothing from
``algorithms/``; the methods subclass :class:`Algorithm`. ``fedistill.algorithms.base`` re-exports it.

An algorithm is three functions around a round (DESIGN.md, "Data flow"):

``broadcast(server, rnd, cid) -> Message`` on the server, ``local_update(client, rnd, msg) -> Message`` on
the client, ``aggregate(server, rnd, {cid: Message})`` on the server. A :class:`Message` is the only thing
that crosses between them, so the same code runs in the in-process simulation and on Flower, and the bytes
of every round are counted from the Messages exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from .models.flat import set_flat

Scalar = int | float | bool | str

# Bytes charged for a plain scalar on the wire: ints and floats travel as 64-bit values.
SCALAR_BYTES = 8
# Reply keys the engine adds for personalised evaluation (not counted as communication, Message.nbytes).
EVAL_PREFIX = "eval."
# Reply keys a method adds only for the run's metrics (its training loss and the samples it averages over, from
# :func:`metric_items`): a report, not the method's payload, so not counted either. Methods whose card counts
# every byte that travels (FD, FedProto: rows, class ids and counts, nothing else) report their loss this way;
# FedAvg's ``num_samples`` is its aggregation weight and stays payload.
METRIC_PREFIX = "metric."
UNCOUNTED_PREFIXES = (EVAL_PREFIX, METRIC_PREFIX)


class Message(Mapping[str, Any]):
    """A flat, immutable mapping of names to tensors and plain scalars.

    Nested containers are rejected on purpose: a Message must map one-to-one onto Flower's
    ``ArrayRecord`` (tensors) and ``ConfigRecord`` (scalars).
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        merged = dict(items or {}, **kwargs)
        for key, value in merged.items():
            if not isinstance(key, str):
                raise TypeError(f"Message keys must be str, got {key!r}")
            if not isinstance(value, (torch.Tensor, int, float, bool, str)):
                raise TypeError(f"Message[{key!r}] must be a tensor or a plain scalar, got {type(value).__name__}")
        self._items = merged

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        parts = [
            f"{k}=tensor{tuple(v.shape)}" if isinstance(v, torch.Tensor) else f"{k}={v!r}" for k, v in self._items.items()
        ]
        return f"Message({', '.join(parts)})"

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self._items.items() if isinstance(v, torch.Tensor)}

    def scalars(self) -> dict[str, Scalar]:
        return {k: v for k, v in self._items.items() if not isinstance(v, torch.Tensor)}

    def nbytes(self) -> int:
        """Payload bytes: tensor elements times element size, 8 per number, UTF-8 length per string.

        Evaluation reports (keys under ``eval.``, added by the engine after a client's update) and metric
        reports (keys under ``metric.``, :func:`metric_items`) are not the algorithm's payload and are not counted:
        a deployment would send them only when asked to evaluate or to monitor.
        """
        total = 0
        for key, value in self._items.items():
            if key.startswith(UNCOUNTED_PREFIXES):
                continue
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif isinstance(value, str):
                total += len(value.encode())
            else:
                total += SCALAR_BYTES
        return total


def metric_items(train_loss: float, num_samples: int) -> dict[str, Scalar]:
    """A reply's training report as uncounted keys (``metric.train_loss``, ``metric.num_samples``)."""
    return {f"{METRIC_PREFIX}train_loss": float(train_loss), f"{METRIC_PREFIX}num_samples": int(num_samples)}


def reported_train_loss(reply: Mapping[str, Any]) -> tuple[float, int] | None:
    """(training loss, samples it averages over) of a reply: its payload keys ``train_loss``/``num_samples``
    (FedAvg's family) or its uncounted :func:`metric_items`; None when it reports none."""
    for prefix in ("", METRIC_PREFIX):
        if f"{prefix}train_loss" in reply:
            return float(reply[f"{prefix}train_loss"]), int(reply.get(f"{prefix}num_samples", 1))
    return None


# -- per-class rows: the general form of "these tensors, with these counts" ----------------------------------
CLASSES, ROWS, COUNTS = "classes", "rows", "counts"


@dataclass(frozen=True)
class ClassRows:
    """Per-class tensors for the classes a side holds: FD's mean logits, FedProto's prototypes, a server's table.

    ``classes`` (n,) int64 ascending class ids, ``rows`` (n, d) float32 (row i belongs to ``classes[i]``),
    ``counts`` (n,) int64 how many samples (or forward passes) made each row, or None where the receiver needs
    none (a server's table). On the wire they are the Message keys ``{prefix}classes``, ``{prefix}rows`` and
    ``{prefix}counts``, so the byte count is what travels: ``n·(4d + 8)`` without counts, ``n·(4d + 16)`` with,
    never a dense C × d table.
    """

    classes: torch.Tensor
    rows: torch.Tensor
    counts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = int(self.classes.numel())
        if self.classes.dim() != 1 or self.classes.dtype != torch.int64:
            raise ValueError(f"ClassRows: classes must be a 1-d int64 tensor, got {self.classes.dtype} {tuple(self.classes.shape)}")
        if self.rows.dim() != 2 or self.rows.shape[0] != n:
            raise ValueError(f"ClassRows: {n} classes need rows of shape ({n}, d), got {tuple(self.rows.shape)}")
        if self.counts is not None and (self.counts.dtype != torch.int64 or tuple(self.counts.shape) != (n,)):
            raise ValueError(f"ClassRows: counts must be ({n},) int64, got {self.counts.dtype} {tuple(self.counts.shape)}")
        if n > 1 and not bool((self.classes[1:] > self.classes[:-1]).all()):
            raise ValueError("ClassRows: class ids must be strictly ascending (one row per class)")

    def __len__(self) -> int:
        return int(self.classes.numel())

    def items(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The Message entries (tensors on the CPU, float32 rows)."""
        out = {f"{prefix}{CLASSES}": self.classes.cpu(), f"{prefix}{ROWS}": self.rows.float().cpu()}
        if self.counts is not None:
            out[f"{prefix}{COUNTS}"] = self.counts.cpu()
        return out

    @classmethod
    def read(cls, msg: Mapping[str, Any], prefix: str = "") -> "ClassRows | None":
        """The rows a Message carries under ``prefix``, or None when it carries none (an empty table sends nothing)."""
        if f"{prefix}{CLASSES}" not in msg:
            return None
        return cls(msg[f"{prefix}{CLASSES}"].long(), msg[f"{prefix}{ROWS}"].float(), msg.get(f"{prefix}{COUNTS}"))

    @classmethod
    def from_dense(cls, table: torch.Tensor, present: torch.Tensor) -> "ClassRows":
        """The rows of a C × d ``table`` whose ``present`` flag is set (a server's table for the wire)."""
        classes = torch.nonzero(present.cpu()).flatten()
        return cls(classes, table.cpu()[classes].float())

    def dense(self, num_classes: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(C × d table with zero rows for absent classes, (C,) bool: which classes have a row), on ``device``."""
        if len(self) and not (0 <= int(self.classes[0]) and int(self.classes[-1]) < num_classes):
            raise ValueError(f"ClassRows: class ids outside 0..{num_classes - 1}: {self.classes.tolist()}")
        table = torch.zeros(num_classes, self.rows.shape[1], dtype=torch.float32)
        present = torch.zeros(num_classes, dtype=torch.bool)
        table[self.classes] = self.rows.float().cpu()
        present[self.classes] = True
        return table.to(device), present.to(device)


# -- what a method exchanges ---------------------------------------------------------------------------------
EXCHANGE_KINDS = ("weights", "knowledge", "class statistics", "shared sub-model", "nothing")


@dataclass(frozen=True)
class Exchange:
    """What a method's clients upload, as far as the engine must know it to set a run up; the engine reads the
    declaration, never the method's name (a method sets ``exchange = Exchange(...)``, or one of the kinds).

    ``kind``:

    - ``"weights"``: every client trains a copy of one global model (one architecture), which the server holds
      and the engine evaluates on the test set;
    - ``"knowledge"``: per-sample features and logits of split client models (``split_features``); the server
      trains ``model.server`` on them (FedGKT's protocol);
    - ``"class statistics"``: per-class tensors for the classes a client holds, with their ids and counts
      (:class:`ClassRows`: FD's mean logits, FedProto's prototypes);
    - ``"shared sub-model"``: a part every client holds in one shape beside a private rest (a head, a small
      model), which the method averages itself;
    - ``"nothing"``: no traffic at all (clients train alone).

    Every kind but ``"weights"`` lets each client keep its own model, of its own architecture, scored on its own
    test split (personal accuracy; no global model on the test set). ``uploads`` names what travels up, in the
    engine's messages ("per-class mean logits"). ``common_feature``: the uploaded rows are features added across
    clients, so every client model needs ``extract`` and one ``feature_dim`` for all. ``one_architecture``: what is
    averaged is a set of layers of one architecture (LG-FedAvg's paper form), so every client needs the same.
    ``shared_model``: every client trains a model of one architecture beside its own (``model.shared``, by default
    the assignment's first member), whose weights travel and are averaged: FML's meme. The server gets its seeded
    initial weights (``ServerContext.shared_initial``), a client a worker of it (``ClientContext.shared_model``).
    """

    kind: str = "weights"
    uploads: str = ""
    common_feature: bool = False
    one_architecture: bool = False
    shared_model: bool = False

    def __post_init__(self) -> None:
        if self.kind not in EXCHANGE_KINDS:
            raise ValueError(f"exchange kind {self.kind!r}: choose one of {', '.join(EXCHANGE_KINDS)}")
        if not self.uploads:
            words = {"weights": "its weights", "knowledge": "per-sample features and logits", "nothing": "nothing",
                     "class statistics": "per-class statistics", "shared sub-model": "a shared sub-model"}  # fmt: skip
            object.__setattr__(self, "uploads", words[self.kind])

    @property
    def global_model(self) -> bool:
        """The server holds a model of the clients' one architecture, evaluated on the test set."""
        return self.kind == "weights"

    @property
    def server_predictor(self) -> bool:
        """The server trains ``model.server`` on the clients' uploaded features."""
        return self.kind == "knowledge"

    @property
    def own_models(self) -> bool:
        """Each client keeps a model of its own (any architecture), scored on its own test split."""
        return self.kind != "weights"


def exchange_of(algorithm: Any) -> Exchange:
    """The :class:`Exchange` an algorithm (instance or class) declares; a plain kind string is read as that kind
    (``exchange = "weights"``, the default, or ``"knowledge"``)."""
    declared = getattr(algorithm, "exchange", "weights")
    return declared if isinstance(declared, Exchange) else Exchange(str(declared))


@dataclass
class ClientContext:
    """Everything a client sees during ``local_update``.

    ``state`` persists between the client's rounds (the engine stores it and checkpoints it); ``generator``
    is seeded from (seed, round, client id), so a client's randomness does not depend on which other
    clients ran before it or on the executor.
    """

    cid: int
    train_indices: torch.Tensor
    data: "Any"  # fedistill.data.pipeline.TensorPipeline (shared, read-only dataset tensors)
    model: torch.nn.Module  # a reused worker module; load weights with set_flat, never deepcopy
    generator: torch.Generator
    state: dict[str, Any] = field(default_factory=dict)
    test_indices: torch.Tensor | None = None
    device: torch.device = torch.device("cpu")
    precision: str = "fp32"
    # w_g^0: the seeded initial global model, known to every client from the config (MOON's first "previous")
    initial_weights: torch.Tensor | None = None
    # A reused worker of the shared model (``Exchange.shared_model``: FML's meme), separate from ``model`` even
    # where the architectures are the same; load its weights with set_flat. None for other methods.
    shared_model: torch.nn.Module | None = None
    shared_initial: torch.Tensor | None = None  # its seeded initial weights (flat), as the server's
    # The run seed: what a client draws once for the whole run (FedMRL's initial projector) comes from
    # make_generator(seed, TAG, 0, cid), the same in every round, process and resume.
    seed: int = 0
    round: int = 0  # the current round t (1-based), as in RoundInfo; schedules such as FedLMD's switch use it
    # How ``state`` is kept between rounds (run.client_state_dtype): "bf16" rounds its float32 tensors when
    # saved. A client uploading the change of a state entry computes it from engine.state_store.as_stored.
    state_dtype: str = "fp32"
    # run.cuda_graphs: local_sgd replays its step from a captured CUDA graph (engine/cuda_graphs.py)
    cuda_graphs: bool = False
    # With cuda_graphs, the engine's fixed_input(model, name, value) (engine/cuda_graphs.py), behind ``fixed``
    graph_inputs: Callable[[torch.nn.Module, str, torch.Tensor], torch.Tensor] | None = None

    @property
    def num_samples(self) -> int:
        return int(self.train_indices.numel())

    def fixed(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` where a captured client step can read it (``run.cuda_graphs``), else ``value`` itself.

        A loss term or gradient correction that reads a per-client tensor (an anchor, a control variate, a class
        mask) takes it through here: under CUDA graphs it is copied into a buffer of the worker model that keeps
        its address from client to client (engine/cuda_graphs.py, ``fixed_input``); the values are the same.
        The buffer is overwritten by the next client: keep nothing from it beyond the local update.
        """
        if not self.cuda_graphs:
            return value
        if self.graph_inputs is None:
            raise RuntimeError("ClientContext.cuda_graphs is on but the engine gave no graph_inputs (engine/cuda_graphs.fixed_input)")
        return self.graph_inputs(self.model, name, value.to(self.device))

    def fixed_list(self, name: str, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`fixed` of each tensor of ``values`` (an anchor per parameter tensor)."""
        if not self.cuda_graphs:
            return values
        return [self.fixed(f"{name}.{i}", v) for i, v in enumerate(values)]


@dataclass
class ServerContext:
    """The server's view: the global model, persistent server state and a seeded generator."""

    model: torch.nn.Module
    state: dict[str, Any]
    generator: torch.Generator
    num_classes: int
    device: torch.device = torch.device("cpu")
    num_clients: int = 0  # K, the whole population (SCAFFOLD's 1/N)
    # n_j of every client of the population, in client-id order, where the deployment tells the server
    # (the partition is built on the server in both the simulation and Flower); FedDyn's adaptive α_k.
    client_num_samples: tuple[int, ...] | None = None
    seed: int = 0  # the run seed: server-side randomness per round comes from make_generator(seed, purpose, round)
    input_shape: tuple[int, ...] = ()  # (C, H, W) of one sample: what a server-side generator must produce
    precision: str = "fp32"  # the run's precision (bf16 autocast for server-side training where the run uses it)
    data_dir: str | None = None  # the run's dataset.data_dir: where a server-side dataset (FedDF's proxy set) is looked up
    data_verify: bool = True  # the run's dataset.verify: check that dataset's md5s
    data_resize: int | None = None  # the run's dataset.resize: a server-side dataset gets the same resize
    # The run's per-channel normalisation (on the [0, 1] pixel scale): a server-side generator that emits pixels
    # maps them into the models' input space with it (DaFKD's code profile). Empty: unknown (DaFKD then refuses).
    input_mean: tuple[float, ...] = ()
    input_std: tuple[float, ...] = ()
    # The clients' common feature dimension d where the method declares ``Exchange.common_feature`` (every client
    # model's ``feature_dim``, checked equal): what a server module on the uploaded rows is sized by (FedGH's
    # header, FedTGP's prototypes). 0 otherwise.
    feature_dim: int = 0
    # The shared model's seeded initial weights (flat), where the method declares ``Exchange.shared_model``.
    shared_initial: torch.Tensor | None = None
    # The entries of its flat vector in order, (name, shape, is a parameter) (FedKD's per-parameter SVD on the server).
    shared_model_shapes: tuple[tuple[str, tuple[int, ...], bool], ...] | None = None
    # The round's aggregate ŵ as a flat vector, set by FedAvg-family aggregation before any server refiner
    # changes the model (FedFTG, FedDF, DaFKD): the engine evaluates it to record what the server's own step
    # did to accuracy and to tell which step threw a collapsed round to chance (issue 61). Transient: the
    # engine clears it after each round, it is never checkpointed.
    aggregate: torch.Tensor | None = None


@dataclass(frozen=True)
class RoundInfo:
    """Per-round hyperparameters the engine hands to every client of the round."""

    round: int
    lr: float


class AlgorithmParams(BaseModel):
    """Base of every algorithm's typed hyperparameters (unknown keys are an error)."""

    # Strict like the run config (config.py): no bool for a number, no float for an int, no NaN/inf.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def declares_resident_weights(algorithm: Any) -> bool:
    """Whether ``algorithm``'s own class (not a base class) sets ``resident_weights = True``."""
    return bool(type(algorithm).__dict__.get("resident_weights", False))


class Algorithm:
    """Base class; subclasses set ``name`` and ``Params`` and implement the three round functions."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[AlgorithmParams]] = AlgorithmParams
    # What travels between clients and server (:class:`Exchange`, or one of its kinds as a string). "weights":
    # every client trains a copy of one global model (one architecture), which the engine evaluates on the test
    # set. "knowledge" (federated distillation, spec/fedgkt.md): each client keeps its own model, possibly of its
    # own architecture (model.clients); the server's model is ``model.server`` over the clients' uploaded
    # features and is never evaluated on images, so accuracy is personal (each client's own model on its own
    # test split). "class statistics", "shared sub-model", "nothing": own models too, and no server model.
    exchange: ClassVar["str | Exchange"] = "weights"
    # The model whose accuracy on client k's test split is client k's personalised accuracy: "global" (the
    # aggregated model, fmtl-baselines.md §1) or "local" (the model the client holds after its update).
    # "assembled": the client builds it after aggregation from what the server sends it next (the new shared
    # weights, its group's model) and its own state (MTFL's private BatchNorm patch, DemLearn's own weights);
    # the engine then asks the client to evaluate it (an evaluation exchange, not counted as communication).
    personal_model: ClassVar[str] = "global"
    # Datasets the method cannot run, with the reason (shown by `fedistill list`): e.g. a method whose
    # generator makes images cannot run the synthetic dataset's feature vectors.
    cannot_run: ClassVar[dict[str, str]] = {}
    # Whether the method's code was checked to run with its flat vectors left on the device across the Message
    # boundary (``run.resident_weights``, issue 66 item 3): every tensor it makes on the server or client beside a
    # received vector is made where that vector lives. Declared by each class itself, never inherited: a subclass
    # that adds a term or a server state is a new method to check (:func:`declares_resident_weights`).
    resident_weights: ClassVar[bool] = False

    @classmethod
    def config_defaults(cls, tree: dict[str, Any]) -> dict[str, Any]:
        """Settings this method needs where the run's defaults do not suit it, as a config tree (``{"local":
        {"momentum": 0.0}}``), given the user's tree: applied under whatever the user set (config file, flags,
        --set), so that ``fedistill run --algorithm NAME`` runs every method and an explicit value still wins."""
        return {}

    def __init__(self, params: AlgorithmParams, local: Any) -> None:
        self.params = params
        self.local = local  # LocalConfig: epochs, batch size, lr, momentum, weight decay

    def refuse_models(self, models: Mapping[str, torch.nn.Module]) -> str | None:
        """Why the method cannot train these client models ({architecture: one built model}), or None: the engine
        refuses the assignment with it in one line before any work (FedMRL: a private feature narrower than s)."""
        return None

    def shared_model_options(self, client_models: Mapping[str, torch.nn.Module]) -> dict[str, Any]:
        """Options the shared model is built with where the method declares ``Exchange.shared_model`` and the
        model takes them (FedMRL's ``{"feature_dim": s}``), given one built model per client architecture; the
        engine refuses one that cannot have them."""
        return {}

    def init_server(self, server: ServerContext) -> None:
        """Fill ``server.state`` before round 1 (global weights are already in ``server.model``)."""

    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        raise NotImplementedError

    def local_update(self, client: ClientContext, info: RoundInfo, msg: Message) -> Message:
        raise NotImplementedError

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        """Update the global model from the replies (given in client-id order); return metrics."""
        raise NotImplementedError

    def step_sizes(self) -> dict[str, float]:
        """The method's own step sizes besides ``local.lr``, as ``{config key: value}``: a run that diverges names
        them beside local.lr in its error, since lowering local.lr alone may not help (pFedMe's inner steps run at
        ``algorithm.personal_lr``)."""
        return {}

    # -- personalised evaluation of "assembled" models ---------------------------------------------------------
    def personal_message(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        """What client ``cid`` needs after round ``info.round``'s aggregation to assemble its personalised model:
        by default the broadcast it would get at the start of the next round."""
        return self.broadcast(server, RoundInfo(info.round + 1, info.lr), cid)

    def personal_predictor(self, client: ClientContext) -> torch.nn.Module:
        """What scores client ``client.cid``'s test samples once ``client.model`` holds its personalised model
        (after ``local_update`` for personal_model "local", after :meth:`assemble_personal_model` for
        "assembled"): a module whose outputs' argmax is the prediction. By default the model itself (its head); a
        prototype method returns a nearest-prototype classifier on the model's features (spec/fedproto.md P5)."""
        return client.model

    def assemble_personal_model(self, client: ClientContext, msg: Message) -> None:
        """Load client ``client.cid``'s personalised model into ``client.model`` from ``msg`` (from
        :meth:`personal_message`) and ``client.state``, which it must not change (personal_model "assembled").
        By default the broadcast weights themselves: the global model, as a client would evaluate it."""
        if "weights" not in msg:
            raise NotImplementedError(f"{self.name} sends no weights and does not assemble a personalised model")
        set_flat(client.model, msg["weights"])
