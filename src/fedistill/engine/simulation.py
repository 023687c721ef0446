"""The in-process simulation: the round loop of DESIGN.md.

``broadcast -> local_update -> aggregate -> evaluate`` for the clients sampled each round, in client-id
order, with bytes counted from the Messages, a checkpoint every N rounds and exact resume.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..algorithms.base import EVAL_PREFIX, Algorithm, ClientContext, Message, RoundInfo, ServerContext
from ..algorithms.local import evaluate
from ..algorithms.build import make_algorithm  # noqa: F401  (re-exported: tests and tools use it from here)
from ..config import Config, resolved_config
from ..data.dataset import Dataset
from ..data.pipeline import AugmentSpec, TensorPipeline
from ..errors import ConfigError, TrainingDiverged
from ..models.flat import get_flat, num_flat
from .architectures import check_architectures, client_architectures
from .executors import ProcessPoolExecutor, SequentialExecutor, client_threads, make_executor
from .checkpoint import CHECKPOINT_NAME, check_compatible, load_checkpoint, save_checkpoint
from .perf import deterministic_kernels, keep_freed_memory_in_heap
from .state_store import DiskStateStore, MemoryStateStore, make_state_store
from .seeding import CLIENT, INIT, SERVER, derive_seed, make_generator, sample_clients


@dataclass
class Federation:
    """The dataset tensors plus every client's index sets (train, and test for personalised runs).

    The index sets are a list of tensors, or, for a dataset that generates its clients (synthetic), a
    sequence that makes client k's indices when asked (:class:`~fedistill.data.synthetic.ClientRanges`):
    nothing here may walk every client per round.
    """

    dataset: Dataset
    train_indices: Sequence[torch.Tensor]
    test_indices: Sequence[torch.Tensor] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.train_indices)

    def client_sizes(self) -> np.ndarray:
        """n_k of every client (int64)."""
        sizes = getattr(self.train_indices, "sizes", None)
        if sizes is not None:
            return np.asarray(sizes(), dtype=np.int64)
        return np.array([int(ix.numel()) for ix in self.train_indices], dtype=np.int64)

    def partition_digest(self) -> str:
        """A fingerprint of the partition (every client's sizes and, where they are stored, its indices): a
        checkpoint keeps it so that a resume refuses to continue on a different partition (e.g. one made by an
        older version of a partition scheme from the same seed)."""
        import hashlib

        digest = hashlib.sha256(np.ascontiguousarray(self.client_sizes()).tobytes())
        if isinstance(self.train_indices, list) and self.train_indices:
            digest.update(torch.cat([ix.to(torch.int64) for ix in self.train_indices]).numpy().tobytes())
        return digest.hexdigest()[:16]

    def train_map(self) -> Mapping[int, torch.Tensor]:
        """Client id -> train indices, as ClientRuntime takes them."""
        return _IndexMap(self.train_indices)

    def test_map(self) -> Mapping[int, torch.Tensor] | None:
        return _IndexMap(self.test_indices) if self.test_indices is not None else None

    def class_counts_of(self, cids: Sequence[int]) -> np.ndarray:
        """len(cids) x C label counts of the clients ``cids`` (a round's clients: cheap at any K)."""
        out = np.zeros((len(cids), self.dataset.num_classes), dtype=np.int64)
        for row, cid in enumerate(cids):
            labels = self.dataset.train_y[self.train_indices[cid]]
            out[row] = np.bincount(np.asarray(labels), minlength=self.dataset.num_classes)
        return out

    def report_counts(self, limit: int = 1_000) -> tuple[np.ndarray, bool]:
        """The label counts a run directory records (partition_counts.csv, partition.png), and whether they
        stop short of the population: a generated federation makes every client's samples to count them
        (0.65 ms per synthetic client: 6.5 s for 10,000, 65 s for 100,000), so past ``limit`` clients only the
        first ``limit`` are counted. Stored partitions are counted whole (one pass over the labels)."""
        if isinstance(self.train_indices, list) or self.num_clients <= limit:
            return self.class_counts(), False
        return self.class_counts_of(range(limit)), True

    def class_counts(self) -> np.ndarray:
        """K x C label counts of every client (O(N); a generated federation generates every client)."""
        if isinstance(self.train_indices, list):  # one pass over the labels
            labels = self.dataset.train_y.numpy()
            num_classes = self.dataset.num_classes
            sizes = self.client_sizes()
            owner = np.repeat(np.arange(self.num_clients), sizes)
            rows = np.concatenate([ix.numpy() for ix in self.train_indices]) if self.num_clients else np.empty(0, np.int64)
            flat = np.bincount(owner * num_classes + labels[rows], minlength=self.num_clients * num_classes)
            return flat.reshape(self.num_clients, num_classes)
        return self.class_counts_of(range(self.num_clients))


class _IndexMap(Mapping[int, torch.Tensor]):
    """A read-only {client id: indices} view of an index sequence (no copy, no K tensors made)."""

    def __init__(self, indices: Sequence[torch.Tensor]) -> None:
        self._indices = indices

    def __getitem__(self, cid: int) -> torch.Tensor:
        if not 0 <= cid < len(self._indices):
            raise KeyError(cid)
        return self._indices[cid]

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._indices)))

    def __len__(self) -> int:
        return len(self._indices)


def build_federation(cfg: Config, dataset: Dataset) -> Federation:
    from ..data.partition import make_partition

    p = cfg.partition
    client_ranges = getattr(dataset, "client_ranges", None)
    if p.scheme == "natural" or client_ranges is not None:
        if client_ranges is None:
            raise ConfigError(f"partition.scheme: natural needs a dataset that makes its own clients; {dataset.name} does not")
        if p.scheme != "natural":
            raise ConfigError(f"partition.scheme: dataset {dataset.name} makes its own clients; use natural, not {p.scheme}")
        ranges = client_ranges()
        if len(ranges) != p.num_clients:
            raise ConfigError(f"partition.num_clients: {p.num_clients}, but dataset {dataset.name} was made with {len(ranges)} clients")
        return Federation(dataset, ranges, None)
    params: dict[str, Any] = {}
    if p.scheme in ("lda", "client_dirichlet"):
        params["alpha"] = p.alpha
    for key in ("min_size", "max_retries"):
        if getattr(p, key) is not None:  # the config allows them only for lda
            params[key] = getattr(p, key)
    if p.scheme == "shards":
        params["shards_per_client"] = p.shards_per_client
    part = make_partition(
        p.scheme,
        dataset.train_y.numpy(),
        p.num_clients,
        cfg.partition_seed(),
        test_labels=dataset.test_y.numpy(),
        per_client_test=p.per_client_test,
        **params,
    )
    train = [torch.as_tensor(np.asarray(ix), dtype=torch.int64) for ix in part.train]
    test = [torch.as_tensor(np.asarray(ix), dtype=torch.int64) for ix in part.test] if part.test is not None else None
    return Federation(dataset, train, test)


def build_model_for(
    cfg: Config,
    dataset: Dataset,
    seed_coords: tuple[int, ...],
    name: str | None = None,
    input_shape: tuple[int, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """The configured model (or the architecture ``name``), initialised from its own seeded stream
    (global RNG left untouched). ``model.kwargs`` belong to ``model.name`` only."""
    from ..models import build_model

    name = name or cfg.model_name()
    if kwargs is None:
        kwargs = cfg.model.kwargs if name == cfg.model_name() else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, *seed_coords))
        model = build_model(name, tuple(input_shape or dataset.input_shape), dataset.num_classes, **kwargs)
    model = model.to(cfg.run.device)
    if cfg.run.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


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


def round_info(cfg: Config, rnd: int) -> RoundInfo:
    """Per-round hyperparameters: η_t = η_0 γ^(t-1) (fedavg.md ambiguity 3)."""
    return RoundInfo(round=rnd, lr=cfg.local.lr * cfg.local.lr_decay ** (rnd - 1))


def apply_process_settings(cfg: Config) -> None:
    # With worker processes, run.threads is each worker's count; this process (aggregation, evaluation)
    # keeps all cores, since it is idle while the workers train.
    if cfg.run.workers == 1:
        torch.set_num_threads(client_threads(cfg))  # what the checkpoint records (and the Flower writer embeds)
    if cfg.run.tune_allocator:
        keep_freed_memory_in_heap()


def check_partition(saved: str | None, current: str | None, scheme: str) -> None:
    """Refuse to resume on a partition other than the checkpoint's (same config, different clients' data)."""
    if saved is not None and current is not None and saved != current:
        raise ConfigError(
            "resume: the partition differs from the checkpointed run's (same configuration, other clients' samples: "
            "the data files or fedistill's partition code changed); the rest of the run would not continue it. "
            "Start a new run, or resume with the data and fedistill version that made the checkpoint"
        )
    if saved is None and current is not None and scheme == "client_dirichlet":
        # client_dirichlet's sampler was rewritten after checkpoints began to carry the digest: an older
        # checkpoint of this scheme was made on another partition of the same seed.
        raise ConfigError(
            "resume: this checkpoint predates partition fingerprints, and partition.scheme=client_dirichlet now "
            "draws a different partition from the same seed; start a new run (or resume with the fedistill "
            "version that made the checkpoint)"
        )


def run_numerics(cfg: Config) -> dict[str, Any]:
    """The run settings that change the numbers a run produces (checked on resume, engine/checkpoint.py)."""
    numerics = {
        "precision": cfg.run.precision,
        "channels_last": cfg.run.channels_last,
        "device": cfg.run.device,
        "client_threads": client_threads(cfg),
    }
    # Recorded only when not the default, so that checkpoints written before the setting existed (fp32)
    # still compare equal.
    if cfg.run.client_state_dtype != "fp32":
        numerics["client_state_dtype"] = cfg.run.client_state_dtype
    return numerics


def kl_from_uniform(counts: torch.Tensor) -> float:
    """``KL(p || uniform) = log C + Σ p log p`` of a histogram (0 = perfectly balanced; FedLMD §6.1 metric)."""
    p = counts.double() / counts.sum().clamp_min(1)
    nonzero = p[p > 0]
    return float(np.log(p.numel()) + (nonzero * nonzero.log()).sum())


# {client id: personal_message} -> {client id: evaluation reply} (ServerRuntime.evaluate_assembled)
ClientEvaluator = Callable[[RoundInfo, dict[int, Message]], dict[int, Message]]


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
    ) -> None:
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
        self.algorithm = make_algorithm(cfg)
        self.architectures = check_architectures(cfg, self.algorithm, num_clients)
        # Each client's test split, where the server holds the partition: the global model's personalised
        # accuracy is read off its test-set predictions at these indices (no extra forward pass).
        self.client_test_indices = client_test_indices
        # The server evaluates on the global test split; it never augments.
        self.test_pipeline = TensorPipeline(dataset, device=self.device, channels_last=cfg.run.channels_last)
        self.knowledge_exchange = getattr(self.algorithm, "exchange", "weights") == "knowledge"
        # What one client's weights would cost per round (down + up) for each architecture: the reference
        # of the communication ratio (experiments-fedict.md §6, "FedAvg-type: 8·|W|").
        self.weight_exchange_bytes = {
            name: 2 * 4 * num_flat(build_model_for(cfg, dataset, (INIT,), name)) for name in set(self.architectures)
        }
        self.server = ServerContext(
            model=self._server_model(cfg, dataset),
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
        )
        self.state = RunState()
        self._store_ready = False
        self.algorithm.init_server(self.server)

    def _server_model(self, cfg: Config, dataset: Dataset) -> torch.nn.Module:
        """The global model; for knowledge exchange, ``model.server`` on the clients' feature maps."""
        if not self.knowledge_exchange:
            return build_model_for(cfg, dataset, (INIT,))
        shapes = {}
        for name in dict.fromkeys(self.architectures):
            client_model = build_model_for(cfg, dataset, (INIT,), name)
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
                "server_state": self.server.state,
                "client_store": self.client_store.snapshot(),
                "history": self.state.history,
            },
        )
        self.client_store.committed()

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
        batches = self.test_pipeline.test_batches(self.cfg.eval.batch_size)
        result = evaluate(self.server.model, batches, self.cfg.run.precision, per_sample=per_sample)
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
        raise TrainingDiverged(f"round {rnd}: {what}; {where}. Lower local.lr (now {info.lr:g}) or check the data.")

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
        if not bool(torch.isfinite(get_flat(self.server.model)).all()):
            self._diverged(rnd, info, "the global model became non-finite (NaN/inf)")
        losses = [(float(r["train_loss"]), int(r.get("num_samples", 1))) for r in replies.values() if "train_loss" in r]
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
        if evaluate_now and not self.knowledge_exchange:
            row["test_accuracy"], row["test_loss"], predictions, correct = self.evaluate_global_with_predictions(
                per_sample=True
            )
            if not math.isfinite(row["test_loss"]):
                # Finite weights can still give non-finite logits (e.g. BatchNorm statistics gone wrong).
                self._diverged(rnd, info, f"its test loss is {row['test_loss']} (non-finite logits)")
            row["prediction_counts"] = [int(v) for v in predictions]
            row["prediction_kl_uniform"] = kl_from_uniform(predictions)
            if self.algorithm.personal_model == "global" and self.client_test_indices is not None and not self.personal_on_clients:
                row.update(personal_metrics({k: correct[ix] for k, ix in enumerate(self.client_test_indices)}))
        if self.algorithm.personal_model == "local":
            reports = {cid: r for cid, r in replies.items() if f"{EVAL_PREFIX}count" in r}
            if reports:
                row.update(personal_metrics_from_counts(reports))
        on_clients = self.algorithm.personal_model == "assembled" or (
            self.algorithm.personal_model == "global" and self.personal_on_clients and not self.knowledge_exchange
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
        self.state.round = rnd
        self.state.history.append(row)
        every = self.cfg.run.checkpoint_every
        if (every and rnd % every == 0) or rnd == self.cfg.rounds:
            self.save()
        return row


class ClientRuntime:
    """The client half: local data, one reused worker model, and ``local_update``.

    It holds its own algorithm instance, so nothing reaches a client except the Message (in the
    simulation as on Flower).
    """

    def __init__(
        self,
        cfg: Config,
        dataset: Dataset,
        train_indices: Mapping[int, torch.Tensor],
        test_indices: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.run.device)
        deterministic_kernels(self.device)
        self.train_indices = train_indices
        self.test_indices = test_indices
        self.algorithm = make_algorithm(cfg)
        self.pipeline = TensorPipeline(
            dataset, AugmentSpec.from_names(cfg.augmentations()), device=self.device, channels_last=cfg.run.channels_last
        )
        self.dataset = dataset
        self._architectures = client_architectures(cfg, cfg.partition.num_clients)
        # One reused worker module per architecture (not per client), made on first use; a client's own
        # weights are loaded into it with set_flat, never deepcopied.
        self.workers: dict[str, torch.nn.Module] = {}
        self.initial_weights_of: dict[str, torch.Tensor] = {}
        self.worker = self.worker_for(cfg.model_name()) if self._uses(cfg.model_name()) else None
        self.initial_weights = self.initial_weights_of.get(cfg.model_name())  # = the server's w_g^0

    def _uses(self, name: str) -> bool:
        return any(self.architecture(cid) == name for cid in self.train_indices)

    def architecture(self, cid: int) -> str:
        if cid >= len(self._architectures):  # a Flower client id beyond the configured population
            self._architectures = client_architectures(self.cfg, cid + 1)
        return self._architectures[cid]

    def worker_for(self, name: str) -> torch.nn.Module:
        if name not in self.workers:
            # Every client of one architecture starts from the same seeded weights (for model.name these
            # are the server's w_g^0: same stream).
            self.workers[name] = build_model_for(self.cfg, self.dataset, (INIT,), name)
            self.initial_weights_of[name] = get_flat(self.workers[name])
        return self.workers[name]

    def context(self, cid: int, rnd: int, state: dict[str, Any]) -> ClientContext:
        name = self.architecture(cid)
        model = self.worker_for(name)
        return ClientContext(
            cid=cid,
            train_indices=self.train_indices[cid],
            test_indices=self.test_indices[cid] if self.test_indices is not None else None,
            data=self.pipeline,
            model=model,
            generator=make_generator(self.cfg.seed, CLIENT, rnd, cid),
            state=state,
            device=self.device,
            precision=self.cfg.run.precision,
            initial_weights=self.initial_weights_of[name],
            round=rnd,
            state_dtype=self.cfg.run.client_state_dtype,
        )

    def update(self, cid: int, info: RoundInfo, msg: Message, state: dict[str, Any]) -> Message:
        ctx = self.context(cid, info.round, state)
        reply = self.algorithm.local_update(ctx, info, msg)
        evaluate_now = info.round % self.cfg.eval.every == 0 or info.round == self.cfg.rounds  # as the server does
        if self.algorithm.personal_model == "local" and evaluate_now and ctx.test_indices is not None and ctx.test_indices.numel():
            # The client's own model after its update, on its own test split (experiments-fedict.md §6 UA_k).
            correct = self.personal_correct(ctx)
            reply = Message(reply, **{f"{EVAL_PREFIX}correct": int(correct.sum()), f"{EVAL_PREFIX}count": int(correct.numel())})
        return reply

    def evaluate_assembled(self, cid: int, info: RoundInfo, msg: Message, state: dict[str, Any]) -> Message:
        """Client ``cid``'s personalised model assembled from ``msg`` and its (unchanged) state, on its own test
        split: ``eval.correct`` and ``eval.count`` (ServerRuntime.evaluate_assembled)."""
        ctx = self.context(cid, info.round, state)
        if ctx.test_indices is None or not ctx.test_indices.numel():
            return Message(**{f"{EVAL_PREFIX}correct": 0, f"{EVAL_PREFIX}count": 0})
        self.algorithm.assemble_personal_model(ctx, msg)
        correct = self.personal_correct(ctx)
        return Message(**{f"{EVAL_PREFIX}correct": int(correct.sum()), f"{EVAL_PREFIX}count": int(correct.numel())})

    def personal_correct(self, ctx: ClientContext) -> torch.Tensor:
        """Whether the worker (holding this client's model) classifies each of the client's test samples right."""
        batches = self.pipeline.test_batches_of(ctx.test_indices, self.cfg.eval.batch_size)
        return evaluate(ctx.model, batches, self.cfg.run.precision, per_sample=True).correct


class Simulation:
    """Runs ``cfg.rounds`` rounds in one process: a ServerRuntime whose messages go straight to a ClientRuntime."""

    def __init__(
        self,
        cfg: Config,
        dataset: Dataset,
        run_dir: Path | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        federation: Federation | None = None,
    ) -> None:
        self.cfg = cfg
        self.on_round = on_round
        apply_process_settings(cfg)
        self.federation = federation or build_federation(cfg, dataset)
        fed = self.federation
        sizes = tuple(fed.client_sizes().tolist())  # n_k of the population (FedDyn's α_k)
        self.server_runtime = ServerRuntime(
            cfg,
            dataset,
            fed.num_clients,
            run_dir,
            client_num_samples=sizes,
            client_test_indices=fed.test_indices,
            client_evaluator=self._evaluate_on_clients,
            partition_digest=fed.partition_digest(),
        )
        self.client_runtime = ClientRuntime(
            cfg,
            dataset,
            fed.train_map(),
            fed.test_map(),
        )
        self.dataset = dataset
        self._executor: SequentialExecutor | ProcessPoolExecutor | None = None

    @property
    def executor(self) -> SequentialExecutor | ProcessPoolExecutor:
        if self._executor is None:  # started on first use: worker processes cost a second or two
            self._executor = make_executor(self.cfg, self.dataset, self.federation, self.client_runtime)
        return self._executor

    def close(self) -> None:
        """Stop worker processes (if any). Safe to call more than once."""
        if self._executor is not None:
            self._executor.close()
            self._executor = None

    # The server's pieces, under the names the rest of the code and the tests use.
    @property
    def server(self) -> ServerContext:
        return self.server_runtime.server

    @property
    def algorithm(self) -> Algorithm:
        return self.server_runtime.algorithm

    @property
    def state(self) -> RunState:
        return self.server_runtime.state

    @property
    def pipeline(self) -> TensorPipeline:
        return self.client_runtime.pipeline

    @property
    def run_dir(self) -> Path | None:
        return self.server_runtime.run_dir

    @run_dir.setter
    def run_dir(self, path: Path | None) -> None:
        self.server_runtime.run_dir = path

    @property
    def checkpoint_path(self) -> Path | None:
        return self.server_runtime.checkpoint_path

    def restore(self, path: Path | None = None, **options: Any) -> bool:
        return self.server_runtime.restore(path, **options)

    def round_info(self, rnd: int) -> RoundInfo:
        return round_info(self.cfg, rnd)

    def run_round(self, rnd: int) -> dict[str, Any]:
        started = time.perf_counter()
        info = self.round_info(rnd)
        selected = self.server_runtime.select_clients(rnd)
        store = self.server_runtime.client_store
        tasks = []
        for cid in selected:
            msg = self.server_runtime.broadcast(info, cid)
            tasks.append((cid, info, msg, store.load(cid)))
        results = self.executor.run(tasks)
        replies: dict[int, Message] = {}
        for (cid, _, _, _), (reply, state) in zip(tasks, results):
            replies[cid] = reply
            store.save(cid, state, rnd)
        bytes_down = sum(msg.nbytes() for _, _, msg, _ in tasks)
        bytes_up = sum(reply.nbytes() for reply in replies.values())
        labels = self.federation.class_counts_of(selected).sum(axis=0).tolist()  # the round's clients only: O(1) in K
        return self.server_runtime.complete_round(info, replies, bytes_down, bytes_up, started, train_label_counts=labels)

    def _evaluate_on_clients(self, info: RoundInfo, messages: dict[int, Message]) -> dict[int, Message]:
        store = self.server_runtime.client_store
        tasks = [(cid, info, msg, store.load(cid)) for cid, msg in messages.items()]
        return dict(zip(messages, self.executor.evaluate(tasks)))

    def run(self, resume: bool = False) -> list[dict[str, Any]]:
        """Run (or continue) to ``cfg.rounds``; returns the per-round metric rows."""
        if resume:
            self.restore()
        try:
            for rnd in range(self.state.round + 1, self.cfg.rounds + 1):
                row = self.run_round(rnd)
                if self.on_round:
                    self.on_round(row)
        finally:
            self.close()
        return self.state.history


PERSONAL_QUANTILES = {"min": 0.0, "q1": 0.25, "median": 0.5, "q3": 0.75, "max": 1.0}


def _personal_row(accuracies: dict[int, float]) -> dict[str, Any]:
    cids = sorted(accuracies)
    values = torch.tensor([accuracies[c] for c in cids], dtype=torch.float64)
    row: dict[str, Any] = {"personal_accuracy": float(values.mean())}  # unweighted over clients (avg UA)
    for name, q in PERSONAL_QUANTILES.items():
        row[f"personal_{name}"] = float(torch.quantile(values, q))
    row["personal_clients"] = cids
    row["personal_accuracies"] = [float(v) for v in values]
    return row


def personal_metrics(correct_by_client: Mapping[int, torch.Tensor]) -> dict[str, Any]:
    """avg UA and its spread over clients (experiments-fedict.md §6) from per-sample correctness.

    ``personal_accuracy`` is the unweighted mean of the clients' accuracies (%), as the paper's np.mean;
    the quartiles show how differently the clients fare. Clients with an empty test split are left out.
    """
    accuracies = {cid: 100.0 * float(c.double().mean()) for cid, c in correct_by_client.items() if c.numel()}
    return _personal_row(accuracies) if accuracies else {}


def personal_metrics_from_counts(replies: Mapping[int, Message]) -> dict[str, Any]:
    """The same, from the correct/count reports clients attached to their replies (their own models)."""
    accuracies = {
        cid: 100.0 * int(r[f"{EVAL_PREFIX}correct"]) / int(r[f"{EVAL_PREFIX}count"])
        for cid, r in replies.items()
        if int(r[f"{EVAL_PREFIX}count"]) > 0
    }
    return _personal_row(accuracies) if accuracies else {}


def summarise(history: list[dict[str, Any]], target: float | None, metric: str = "global") -> dict[str, Any]:
    """Final and best accuracy, round of best, rounds to target, totals (DESIGN.md "run directory").

    ``metric`` picks the accuracy: ``global`` (the global model on the test set) or ``personal`` (the
    clients' average accuracy on their own test splits, ``Config.accuracy_metric``).
    """
    key = "personal_accuracy" if metric == "personal" else "test_accuracy"
    evaluated = [r for r in history if r.get(key) is not None]
    best = max(evaluated, key=lambda r: r[key], default=None)
    reached = next((r["round"] for r in evaluated if target is not None and r[key] >= target), None)
    bytes_total = sum(r["bytes_down"] + r["bytes_up"] for r in history)
    weights_total = sum(r.get("bytes_weight_exchange") or 0 for r in history)
    summary = {
        "rounds": len(history),
        "accuracy_metric": metric,
        "final_accuracy": evaluated[-1][key] if evaluated else None,
        "final_loss": evaluated[-1].get("test_loss") if evaluated else None,
        "best_accuracy": best[key] if best else None,
        "best_round": best["round"] if best else None,
        "target_accuracy": target,
        "rounds_to_target": reached,
        "bytes_down": int(sum(r["bytes_down"] for r in history)),
        "bytes_up": int(sum(r["bytes_up"] for r in history)),
        "bytes_per_round": bytes_total / len(history) if history else None,
        # Bytes sent against what exchanging the clients' weights (FedAvg) would have cost in the same
        # rounds with the same clients and architectures: the FD papers' communication claim.
        "bytes_ratio_to_weight_exchange": bytes_total / weights_total if weights_total else None,
        "seconds": float(sum(r["seconds"] for r in history)),
        "mean_train_loss_last": history[-1]["train_loss"] if history else None,
    }
    personal = [r for r in history if r.get("personal_accuracy") is not None]
    if personal:
        last = personal[-1]
        summary["final_personal_accuracy"] = last["personal_accuracy"]
        summary["best_personal_accuracy"] = max(r["personal_accuracy"] for r in personal)
        summary["final_personal_spread"] = {name: last[f"personal_{name}"] for name in PERSONAL_QUANTILES}
        # mean of the last 10 evaluated rounds (experiments-fedict.md §6 asks for it next to the final value)
        tail = personal[-10:]
        summary["last10_personal_accuracy"] = sum(r["personal_accuracy"] for r in tail) / len(tail)
    return summary
