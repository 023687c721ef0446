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

        Evaluation reports (keys under ``eval.``, added by the engine after a client's update) are not the
        algorithm's payload and are not counted: a deployment would send them only when asked to evaluate.
        """
        total = 0
        for key, value in self._items.items():
            if key.startswith(EVAL_PREFIX):
                continue
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif isinstance(value, str):
                total += len(value.encode())
            else:
                total += SCALAR_BYTES
        return total


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


class Algorithm:
    """Base class; subclasses set ``name`` and ``Params`` and implement the three round functions."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[AlgorithmParams]] = AlgorithmParams
    # What travels between clients and server. "weights": every client trains a copy of one global model
    # (one architecture), which the engine evaluates on the test set. "knowledge" (federated distillation,
    # spec/fedgkt.md): each client keeps its own model, possibly of its own architecture (model.clients);
    # the server's model is ``model.server`` over the clients' uploaded features and is never evaluated on
    # images, so accuracy is personal (each client's own model on its own test split).
    exchange: ClassVar[str] = "weights"
    # The model whose accuracy on client k's test split is client k's personalised accuracy: "global" (the
    # aggregated model, fmtl-baselines.md §1) or "local" (the model the client holds after its update).
    # "assembled": the client builds it after aggregation from what the server sends it next (the new shared
    # weights, its group's model) and its own state (MTFL's private BatchNorm patch, DemLearn's own weights);
    # the engine then asks the client to evaluate it (an evaluation exchange, not counted as communication).
    personal_model: ClassVar[str] = "global"
    # Datasets the method cannot run, with the reason (shown by `fedistill list`): e.g. a method whose
    # generator makes images cannot run the synthetic dataset's feature vectors.
    cannot_run: ClassVar[dict[str, str]] = {}

    @classmethod
    def config_defaults(cls, tree: dict[str, Any]) -> dict[str, Any]:
        """Settings this method needs where the run's defaults do not suit it, as a config tree (``{"local":
        {"momentum": 0.0}}``), given the user's tree: applied under whatever the user set (config file, flags,
        --set), so that ``fedistill run --algorithm NAME`` runs every method and an explicit value still wins."""
        return {}

    def __init__(self, params: AlgorithmParams, local: Any) -> None:
        self.params = params
        self.local = local  # LocalConfig: epochs, batch size, lr, momentum, weight decay

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

    def assemble_personal_model(self, client: ClientContext, msg: Message) -> None:
        """Load client ``client.cid``'s personalised model into ``client.model`` from ``msg`` (from
        :meth:`personal_message`) and ``client.state``, which it must not change (personal_model "assembled").
        By default the broadcast weights themselves: the global model, as a client would evaluate it."""
        if "weights" not in msg:
            raise NotImplementedError(f"{self.name} sends no weights and does not assemble a personalised model")
        set_flat(client.model, msg["weights"])
