"""The server half of a round (:class:`ServerRuntime`): sampling, broadcast, aggregation, evaluation,
metrics and checkpoints, plus the per-run helpers it shares with the Flower server app (seeded model
building, round hyperparameters, process settings, numerics)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..config import Config, resolved_config
from ..data.dataset import Dataset
from ..data.pipeline import TensorPipeline
from ..errors import ConfigError, TrainingDiverged
from ..models.flat import get_flat, num_flat, set_flat
from ..protocol import EVAL_PREFIX, Algorithm, Message, RoundInfo, ServerContext, exchange_of, reported_train_loss
from .architectures import check_architectures, check_client_models
from .checkpoint import (
    CHECKPOINT_NAME,
    check_compatible,
    load_checkpoint,
    save_checkpoint,
)
from .cuda_graphs import graphed_evaluate
from .evaluation import evaluate
from .executors import state_to
from . import pauses
from .federation import check_partition
from .perf import deterministic_kernels
from .run_setup import apply_process_settings, build_model_for, build_shared_model, round_info, run_numerics  # noqa: F401  (re-exported)
from .seeding import INIT, SERVER, make_generator, sample_clients
from .state_store import DiskStateStore, MemoryStateStore, make_state_store
from .summary import personal_metrics, personal_metrics_from_counts, personal_metrics_of_ranges


@dataclass
class RunState:
    """What a checkpoint holds besides the models.

    ``client_states`` is used by the in-process simulation, which keeps every client's persistent state on
    the clients' behalf (in memory or on disk, :mod:`.state_store`); in a real deployment each client keeps
    its own.
    """

    round: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    client_states: MemoryStateStore | DiskStateStore = field(default_factory=MemoryStateStore)


def kl_from_uniform(counts: torch.Tensor) -> float:
    """``KL(p || uniform) = log C + Σ p log p`` of a histogram (0 = perfectly balanced; FedLMD §6.1 metric)."""
    p = counts.double() / counts.sum().clamp_min(1)
    nonzero = p[p > 0]
    return float(np.log(p.numel()) + (nonzero * nonzero.log()).sum())


# {client id: personal_message} -> {client id: evaluation reply} (ServerRuntime.evaluate_assembled)
ClientEvaluator = Callable[[RoundInfo, dict[int, Message]], dict[int, Message]]


def non_finite_uploads(replies: Mapping[int, Any]) -> dict[int, list[str]]:
    """{client id: the entries of its upload that hold NaN/inf} (empty when every upload is finite)."""
    bad: dict[int, list[str]] = {}
    for cid, reply in replies.items():
        for key, value in reply.items():  # a Message is flat: tensors and scalars
            if torch.is_tensor(value) and value.is_floating_point():
                finite = bool(torch.isfinite(value).all())
            else:
                finite = not isinstance(value, float) or math.isfinite(value)
            if not finite:
                bad.setdefault(cid, []).append(key)
    return bad


def non_finite_step(replies: Mapping[int, Any]) -> str:
    """Which step made a round's global model non-finite, read off the uploads (only once it has happened): the
    clients whose uploads hold NaN/inf and in which entries (a client's local update diverged; for a method that
    uploads more than weights, the entry says which of its steps: DaFKD's ``generator`` is its generator step,
    ``weights`` and ``discriminator`` its joint classifier-and-discriminator step), or, when every upload is
    finite, the server's own step (aggregation, a server optimiser or a refiner)."""
    bad = non_finite_uploads(replies)
    if not bad:
        return "in the server's step (every upload was finite: aggregation, the server optimiser or a refiner)"
    shown = [f"client {cid} ({', '.join(keys)})" for cid, keys in list(bad.items())[:4]]
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    return f"in the clients' local updates: non-finite uploads from {', '.join(shown)}{more}"


class ServerRuntime:
    """The server half of a round: sampling, broadcast, aggregation, evaluation, metrics, checkpoints.

    It knows the clients only by id and talks to them only through Messages, so the same object drives
    the in-process simulation and a Flower deployment.
    """

    def __init__(
        self,
        cfg: Config,
        dataset: Dataset,
        num_clients: int,
        run_dir: Path | None = None,
        client_num_samples: tuple[int, ...] | None = None,
        client_test_indices: list[torch.Tensor] | None = None,
        client_evaluator: ClientEvaluator | None = None,
        partition_digest: str | None = None,
        *,
        algorithm: Algorithm,
    ) -> None:
        """``algorithm`` is the method this server runs, built by the caller (the composition root:
        ``fedistill.simulation``, the Flower server app) from ``cfg``."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.partition_digest = partition_digest  # Federation.partition_digest, kept in checkpoints
        # How the server asks clients to evaluate an "assembled" personalised model (the simulation's executor,
        # or Flower evaluate messages): {cid: personal_message} -> {cid: reply with eval.correct/eval.count}.
        self.client_evaluator = client_evaluator
        # Measure even the global model's personalised accuracy on the clients (Flower sites with their own
        # files, whose test splits the server does not have); the simulation reads it off the server's predictions.
        self.personal_on_clients = False
        self.num_clients = num_clients
        self.device = torch.device(cfg.run.device)
        deterministic_kernels(self.device)
        self.algorithm = algorithm
        self.architectures = check_architectures(cfg, self.algorithm, num_clients)
        # Each client's test split, where the server holds the partition: the global model's personalised
        # accuracy is read off its test-set predictions at these indices (no extra forward pass).
        self.client_test_indices = client_test_indices
        # The server evaluates on the global test split; it never augments.
        self.test_pipeline = TensorPipeline(dataset, device=self.device, channels_last=cfg.run.channels_last)
        # What the method declares it exchanges (protocol.Exchange): whether the server holds a global model to
        # evaluate, trains model.server on the clients' features, or holds no model at all.
        self.exchange = exchange_of(self.algorithm)
        # One built model per architecture, to check what the method needs of them and to size their weights.
        client_models = {name: build_model_for(cfg, dataset, (INIT,), name) for name in dict.fromkeys(self.architectures)}
        check_client_models(cfg, self.algorithm, client_models)
        # What one client's weights would cost per round (down + up) for each architecture: the reference
        # of the communication ratio (experiments-fedict.md §6, "FedAvg-type: 8·|W|").
        self.weight_exchange_bytes = {name: 2 * 4 * num_flat(model) for name, model in client_models.items()}
        shared = self._shared_model(cfg, dataset, client_models)
        self.server = ServerContext(
            model=self._server_model(cfg, dataset, client_models),
            state={},
            generator=make_generator(cfg.seed, SERVER, 0),
            num_classes=dataset.num_classes,
            device=self.device,
            num_clients=num_clients,
            client_num_samples=client_num_samples,
            seed=cfg.seed,
            input_shape=tuple(dataset.input_shape),
            precision=cfg.run.precision,
            data_dir=cfg.dataset.data_dir,
            data_verify=cfg.dataset.verify,
            data_resize=cfg.dataset.resize,
            input_mean=tuple(dataset.mean),
            input_std=tuple(dataset.std),
            feature_dim=common_feature_dim(self.exchange, client_models),
            shared_initial=shared[0],
            shared_model_shapes=shared[1],
        )
        self.state = RunState()
        self._store_ready = False
        # Marks for the next round's metric row, set by whoever runs the round (the FLOP-counted round's
        # ``flops_counted``): recorded with the row itself, so a checkpoint and a resume keep them.
        self.next_row_marks: dict[str, Any] = {}
        pauses.install()  # a round the process is stopped in is marked, and left out of the seconds per round
        self.algorithm.init_server(self.server)

    def _shared_model(self, cfg: Config, dataset: Dataset, client_models: dict) -> tuple[torch.Tensor | None, tuple | None]:
        """The shared model's seeded initial weights (flat) and its parameters' (name, shape), where the method
        trains one beside the clients' own (Exchange.shared_model), from its own stream: the clients' workers of
        it are built from the same."""
        if not self.exchange.shared_model:
            return None, None
        model = build_shared_model(cfg, dataset, self.algorithm, client_models)
        parameters = dict(model.named_parameters())
        entries = [(name, tuple(t.shape), name in parameters) for name, t in model.state_dict().items() if t.is_floating_point()]
        return get_flat(model), tuple(entries)

    def _server_model(self, cfg: Config, dataset: Dataset, client_models: dict[str, torch.nn.Module]) -> torch.nn.Module:
        """The global model; for knowledge exchange, ``model.server`` on the clients' feature maps; for a method
        whose clients keep their own models and the server trains none, an empty module (what the server keeps,
        a table or a header, lives in ``server.state``)."""
        if self.exchange.global_model:
            return build_model_for(cfg, dataset, (INIT,))
        if not self.exchange.server_predictor:
            return torch.nn.Module()
        shapes = {}
        for name, client_model in client_models.items():
            if not hasattr(client_model, "split_features"):
                raise ConfigError(
                    f"model.clients: {name!r} has no extractor/predictor split; {cfg.algorithm.display_name()} needs "
                    "split models (fd_resnet2/4/8/10/12, fd_mlp16/32/64)"
                )
            shapes[name] = tuple(client_model.feature_shape)
        if len(set(shapes.values())) > 1:
            raise ConfigError(
                f"model.clients: the server trains on the clients' features, so they must have one shape; got {shapes}"
            )
        feature_shape = next(iter(shapes.values()))
        return build_model_for(cfg, dataset, (INIT,), cfg.model.server, feature_shape, cfg.model.server_kwargs)

    @property
    def client_store(self) -> MemoryStateStore | DiskStateStore:
        """The clients' state store, made on first use (the run directory may be set after construction)."""
        if not self._store_ready:
            self.state.client_states = make_state_store(self.cfg.run.client_state, self.run_dir, self.cfg.run.client_state_dtype)
            self._store_ready = True
        return self.state.client_states

    @property
    def checkpoint_path(self) -> Path | None:
        return self.run_dir / CHECKPOINT_NAME if self.run_dir else None

    def save(self) -> None:
        if self.checkpoint_path is None:
            return
        save_checkpoint(
            self.checkpoint_path,
            {
                "config": self.cfg.resolved_dict(),
                "numerics": run_numerics(self.cfg),
                "partition_digest": self.partition_digest,
                "round": self.state.round,
                "global_model": self.server.model.state_dict(),
                "server_state": state_to(self.server.state, torch.device("cpu")),  # host tensors (resident weights)
                "client_store": self.client_store.snapshot(),
                "history": self.state.history,
            },
        )
        self.client_store.committed()

    def server_state_to_device(self) -> None:
        """The server state's tensors on the run's device (``run.resident_weights`` after a resume)."""
        self.server.state = state_to(self.server.state, self.device)

    def restore(self, path: Path | None = None, allow_numeric_change: bool = False, hint: str = "") -> bool:
        """Continue from the checkpoint; False (and a clean round-0 state) when the run has none yet.

        A run that died before its first checkpoint then starts again from round 1: the client-state
        files it left are removed. Settings that change results (:data:`NUMERIC_RUN_SETTINGS`) must equal
        the checkpoint's unless ``allow_numeric_change``; the changes made are kept in ``numeric_changes``.
        """
        path = path or self.checkpoint_path
        self.numeric_changes: list[str] = []
        if path is None or not path.is_file():
            store = self.client_store
            store.restore({"kind": store.kind, "states": {}, "index": {}}, self.run_dir)
            self.state = RunState(0, [], store)
            return False
        payload = load_checkpoint(path)
        self.numeric_changes = check_compatible(
            resolved_config(payload["config"]), self.cfg.resolved_dict(), payload.get("numerics"), run_numerics(self.cfg),
            allow_numeric_change, hint,
        )  # fmt: skip
        check_partition(payload.get("partition_digest"), self.partition_digest, self.cfg.partition.scheme)
        self.server.model.load_state_dict(payload["global_model"])
        self.server.state = payload["server_state"]
        store = self.client_store
        # Checkpoints from before the state store held a plain dict under "client_states".
        store.restore(payload.get("client_store") or {"kind": "memory", "states": payload["client_states"]}, self.run_dir)
        self.state = RunState(payload["round"], payload["history"], store)
        return True

    def select_clients(self, rnd: int) -> list[int]:
        return sample_clients(self.num_clients, self.cfg.clients_per_round, self.cfg.seed, rnd)

    def broadcast(self, info: RoundInfo, cid: int) -> Message:
        return self.algorithm.broadcast(self.server, info, cid)

    def evaluate_global(self) -> tuple[float, float]:
        acc, loss, _ = self.evaluate_global_with_predictions()
        return acc, loss

    def evaluate_global_with_predictions(self, per_sample: bool = False) -> tuple[Any, ...]:
        """Accuracy (%), loss and the global model's predicted-class histogram on the test set (and, with
        ``per_sample``, whether each test sample was classified correctly)."""
        pipeline, batch_size, precision = self.test_pipeline, self.cfg.eval.batch_size, self.cfg.run.precision
        if self.cfg.run.cuda_graphs:  # one replay of the whole test loop (engine/cuda_graphs.py): the same bits
            result = graphed_evaluate(
                self.server.model, lambda: pipeline.test_batches(batch_size), precision, per_sample, pipeline.test_tensors, batch_size
            )
        else:
            result = evaluate(self.server.model, pipeline.test_batches(batch_size), precision, per_sample=per_sample)
        head = (100.0 * result.accuracy, result.loss, result.predictions)
        return (*head, result.correct) if per_sample else head

    def evaluate_assembled(self, info: RoundInfo, cids: list[int]) -> dict[str, Any]:
        """Personal metrics of models the clients assemble after aggregation (personal_model "assembled").

        Each client of the round gets the algorithm's ``personal_message`` (what it would receive next: the new
        shared weights, its group's model), builds its personalised model from it and its own state, and
        reports how many of its test samples that model gets right. As a deployment's evaluate phase, these
        messages are not the algorithm's communication: they are not counted in ``bytes_down``.
        """
        if self.client_evaluator is None:
            raise RuntimeError(f"{self.algorithm.name}: personalised models are assembled on the clients, but no client evaluator was given")
        messages = {cid: self.algorithm.personal_message(self.server, info, cid) for cid in cids}
        reports = self.client_evaluator(info, messages)
        reports = {cid: r for cid, r in reports.items() if int(r.get(f"{EVAL_PREFIX}count", 0)) > 0}
        return personal_metrics_from_counts(reports) if reports else {}

    def _diverged(self, rnd: int, info: RoundInfo, what: str) -> None:
        """Stop the run: the round is not recorded and the last good checkpoint stays."""
        last = self.state.round
        where = (
            f"the last good checkpoint (round {last}) is {self.checkpoint_path}"
            if self.checkpoint_path and self.checkpoint_path.exists()
            else "no checkpoint was written"
        )
        own = getattr(self.algorithm, "step_sizes", dict)()  # a plugin that does not subclass Algorithm names none
        knobs = [f"local.lr (now {info.lr:g})"] + [f"{key} (now {value:g})" for key, value in own.items()]
        raise TrainingDiverged(f"round {rnd}: {what}; {where}. Lower {' or '.join(knobs)}, or check the data.")

    def _server_step_metrics(self, aggregate: torch.Tensor | None, accuracy: float) -> dict[str, float]:
        """The aggregate ŵ's test accuracy and loss and what the server's own step changed, for a method whose
        server refines ŵ after aggregation (FedFTG, FedDF, DaFKD): ``server_step_accuracy_change`` = accuracy after
        the step − accuracy of ŵ, so a step that takes points off shows in every round, at chance or not (issue 61).
        Nothing where the round's model is ŵ itself (no refiner, or a refiner that left it unchanged)."""
        model = self.server.model
        if aggregate is None:
            return {}
        refined = get_flat(model)
        if aggregate.shape != refined.shape or torch.equal(aggregate, refined):
            return {}
        set_flat(model, aggregate)
        try:
            aggregate_accuracy, aggregate_loss = self.evaluate_global()
        finally:
            set_flat(model, refined)  # bit for bit the refined model: the run goes on from it
        return {
            "aggregate_accuracy": aggregate_accuracy,
            "aggregate_loss": aggregate_loss,
            "server_step_accuracy_change": accuracy - aggregate_accuracy,
        }

    def _collapse(self, rnd: int, row: dict[str, Any]) -> dict[str, str]:
        """Issue 61's collapse rule: the global model at chance (within a point of 100 / classes) after an earlier
        round at least 20 points above it. Logs one warning naming the round and the step that threw it there:
        the server's step when the aggregate ŵ was still above chance, else the clients' aggregate."""
        chance = 100.0 / self.server.num_classes
        accuracy = row["test_accuracy"]
        if accuracy > chance + 1.0:
            return {}
        earlier = [r["test_accuracy"] for r in self.state.history if r.get("test_accuracy") is not None]
        if not earlier or max(earlier) < chance + 20.0:
            return {}
        before = row.get("aggregate_accuracy")
        if before is not None and before > chance + 1.0:
            step, what = "server_step", f"the server's step (the clients' aggregate had {before:.2f} %)"
        else:
            step, what = "aggregate", "the clients' aggregate"
        logging.getLogger("fedistill.engine").warning(
            "round %d collapsed to chance: %.2f %% test accuracy (chance %.2f %%, best earlier round %.2f %%), thrown "
            "there by %s", rnd, accuracy, chance, max(earlier), what,
        )  # fmt: skip
        return {"collapse": step}

    def complete_round(
        self,
        info: RoundInfo,
        replies: dict[int, Message],
        bytes_down: int,
        bytes_up: int,
        started: float,
        train_label_counts: list[int] | None = None,
    ) -> dict[str, Any]:
        """Aggregate the replies (client-id order), check, evaluate, record and checkpoint the round.

        ``train_label_counts`` (the round's clients' labels, summed) is known where the server holds the
        partition (the simulation); with the predicted-class histogram it is FedLMD Fig. 2's diagnostic.
        """
        train_seconds = time.perf_counter() - started
        replies = {cid: replies[cid] for cid in sorted(replies)}
        aggregate_start = time.perf_counter()
        extra = self.algorithm.aggregate(self.server, info, replies)
        # Aggregation plus any server-side refinement (FedFTG's fine-tune, DaFKD's or FedDF's distillation,
        # FedGen's generator): what the server spends beside the clients' training (issue 15 compares them).
        server_seconds = time.perf_counter() - aggregate_start
        rnd = info.round
        aggregate, self.server.aggregate = self.server.aggregate, None  # ŵ before any server refiner's step
        if num_flat(self.server.model) == 0:  # no server model: the uploads are what the round made
            if non_finite_uploads(replies):
                self._diverged(rnd, info, f"a client's upload became non-finite (NaN/inf) {non_finite_step(replies)}")
        elif not bool(torch.isfinite(get_flat(self.server.model)).all()):
            self._diverged(rnd, info, f"the global model became non-finite (NaN/inf) {non_finite_step(replies)}")
        losses = [loss for loss in map(reported_train_loss, replies.values()) if loss is not None]
        weight = sum(n for _, n in losses)
        row: dict[str, Any] = {
            "round": rnd,
            "lr": info.lr,
            "clients": len(replies),
            "train_loss": sum(l * n for l, n in losses) / weight if weight else None,
            "test_accuracy": None,
            "test_loss": None,
            "bytes_down": bytes_down,
            "bytes_up": bytes_up,
        }
        eval_start = time.perf_counter()
        evaluate_now = rnd % self.cfg.eval.every == 0 or rnd == self.cfg.rounds
        if evaluate_now and self.exchange.global_model:
            row["test_accuracy"], row["test_loss"], predictions, correct = self.evaluate_global_with_predictions(
                per_sample=True
            )
            if not math.isfinite(row["test_loss"]):
                # Finite weights can still give non-finite logits (e.g. BatchNorm statistics gone wrong).
                self._diverged(rnd, info, f"its test loss is {row['test_loss']} (non-finite logits)")
            row["prediction_counts"] = [int(v) for v in predictions]
            row["prediction_kl_uniform"] = kl_from_uniform(predictions)
            row.update(self._server_step_metrics(aggregate, row["test_accuracy"]))
            row.update(self._collapse(rnd, row))
            if self.algorithm.personal_model == "global" and self.client_test_indices is not None and not self.personal_on_clients:
                offsets = getattr(self.client_test_indices, "offsets", None)  # contiguous ranges (synthetic)
                if offsets is not None:
                    row.update(personal_metrics_of_ranges(correct, offsets))
                else:
                    row.update(personal_metrics({k: correct[ix] for k, ix in enumerate(self.client_test_indices)}))
        if self.algorithm.personal_model == "local":
            reports = {cid: r for cid, r in replies.items() if f"{EVAL_PREFIX}count" in r}
            if reports:
                row.update(personal_metrics_from_counts(reports))
        on_clients = self.algorithm.personal_model == "assembled" or (
            self.algorithm.personal_model == "global" and self.personal_on_clients and self.exchange.global_model
        )
        if on_clients and evaluate_now and self.cfg.partition.per_client_test:
            row.update(self.evaluate_assembled(info, list(replies)))
        row["bytes_weight_exchange"] = sum(self.weight_exchange_bytes[self.architectures[cid]] for cid in replies)
        if train_label_counts is not None:
            row["train_label_counts"] = [int(v) for v in train_label_counts]
        row.update(extra)
        row["train_seconds"] = train_seconds  # broadcast + local updates (+ transport) of all clients
        row["server_seconds"] = server_seconds
        row["eval_seconds"] = time.perf_counter() - eval_start
        row["seconds"] = time.perf_counter() - started
        if pauses.stopped_since(started):
            row[pauses.PAUSED_KEY] = True
        row.update(self.next_row_marks)
        self.next_row_marks = {}
        self.state.round = rnd
        self.state.history.append(row)
        every = self.cfg.run.checkpoint_every
        if (every and rnd % every == 0) or rnd == self.cfg.rounds:
            self.save()
        return row


def common_feature_dim(exchange: Any, client_models: dict[str, torch.nn.Module]) -> int:
    """The one ``feature_dim`` of the client models where the method adds features across clients
    (``Exchange.common_feature``, checked by check_client_models), else 0."""
    if not exchange.common_feature:
        return 0
    return int(next(iter(client_models.values())).feature_dim)
