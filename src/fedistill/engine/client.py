"""The client half of a round (:class:`ClientRuntime`): local data, one reused worker model per
architecture, and the algorithm's ``local_update``; the same object serves the simulation's executors and
Flower's ClientApp."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..config import Config
from ..data.dataset import Dataset
from ..data.pipeline import AugmentSpec, TensorPipeline
from ..models.flat import get_flat
from ..protocol import EVAL_PREFIX, Algorithm, ClientContext, Message, RoundInfo, exchange_of
from .architectures import client_architectures
from .cuda_graphs import fixed_input
from .evaluation import evaluate
from .perf import deterministic_kernels
from .run_setup import build_model_for, build_shared_model
from .seeding import CLIENT, INIT, make_generator

# Builds a method from a config: what the runtimes are handed instead of importing the algorithms.
AlgorithmFactory = Callable[[Config], Algorithm]


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
        *,
        algorithm_factory: AlgorithmFactory,
    ) -> None:
        """``algorithm_factory(cfg)`` builds this client's own instance of the method (a module-level function,
        so that a worker process can be handed it: ``fedistill.algorithms.build.make_algorithm``)."""
        self.cfg = cfg
        self.algorithm_factory = algorithm_factory
        self.device = torch.device(cfg.run.device)
        deterministic_kernels(self.device)
        self.train_indices = train_indices
        self.test_indices = test_indices
        self.algorithm = algorithm_factory(cfg)
        self.pipeline = TensorPipeline(
            dataset, AugmentSpec.from_names(cfg.augmentations()), device=self.device, channels_last=cfg.run.channels_last,
            sequential_batches=cfg.local.batch_order == "sequential",
        )  # fmt: skip
        self.dataset = dataset
        self._architectures = client_architectures(cfg, cfg.partition.num_clients)
        # One reused worker module per architecture (not per client), made on first use; a client's own
        # weights are loaded into it with set_flat, never deepcopied.
        self.workers: dict[str, torch.nn.Module] = {}
        self.initial_weights_of: dict[str, torch.Tensor] = {}
        self.worker = self.worker_for(cfg.model_name()) if self._uses(cfg.model_name()) else None
        self.initial_weights = self.initial_weights_of.get(cfg.model_name())  # = the server's w_g^0
        # The shared model beside each client's own (Exchange.shared_model: FML's meme): one more reused worker,
        # apart from the architecture workers even where its architecture is one of theirs.
        self.shared_worker = None
        if exchange_of(self.algorithm).shared_model:  # what the method asks of it depends on the client models
            models = {name: self.worker_for(name) for name in dict.fromkeys(self._architectures)}
            self.shared_worker = build_shared_model(cfg, dataset, self.algorithm, models)
        self.shared_initial = get_flat(self.shared_worker) if self.shared_worker is not None else None

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
            shared_model=self.shared_worker,
            shared_initial=self.shared_initial,
            seed=self.cfg.seed,
            round=rnd,
            state_dtype=self.cfg.run.client_state_dtype,
            cuda_graphs=self.cfg.run.cuda_graphs,
            graph_inputs=fixed_input if self.cfg.run.cuda_graphs else None,
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
        """Whether the worker (holding this client's model) classifies each of the client's test samples right,
        with the method's predictor on it (the model's head, or e.g. the nearest global prototype)."""
        batches = self.pipeline.test_batches_of(ctx.test_indices, self.cfg.eval.batch_size)
        predictor = getattr(self.algorithm, "personal_predictor", None)  # a plugin that does not subclass Algorithm has none
        model = predictor(ctx) if predictor is not None else ctx.model
        return evaluate(model, batches, self.cfg.run.precision, per_sample=True).correct


