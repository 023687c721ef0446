"""What a run sets up the same way in the simulation and in the Flower apps: models built from their own seeded
stream, the round's hyperparameters, the process settings (threads, allocator) and the numerics a checkpoint
records."""

from __future__ import annotations

from typing import Any

import torch

from ..config import Config
from ..data.dataset import Dataset
from ..errors import ConfigError
from ..protocol import RoundInfo
from .cores import client_threads
from .perf import keep_freed_memory_in_heap
from .seeding import INIT, SHARED_MODEL, cpu_seeded, derive_seed


def build_model_for(
    cfg: Config,
    dataset: Dataset,
    seed_coords: tuple[int, ...],
    name: str | None = None,
    input_shape: tuple[int, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """The configured model (or the architecture ``name``), initialised from its own seeded stream
    (global RNG left untouched). ``model.kwargs`` belong to ``model.name`` only, ``model.group_kwargs`` to the
    members of ``model.group``."""
    from ..models import build_model

    name = name or cfg.model_name()
    if kwargs is None:
        kwargs = cfg.model.kwargs_for(name, cfg.model_name())
    with cpu_seeded(derive_seed(cfg.seed, *seed_coords)):
        model = build_model(name, tuple(input_shape or dataset.input_shape), dataset.num_classes, **kwargs)
    model = model.to(cfg.run.device)
    if cfg.run.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def build_shared_model(cfg: Config, dataset: Dataset, algorithm: Any, client_models: Any) -> torch.nn.Module:
    """The shared model beside the clients' own (``Exchange.shared_model``), from its own seeded stream: the
    architecture ``model.shared`` or the assignment's first member, with the options the method asks of it
    (``Algorithm.shared_model_options``: FedMRL's feature width s; ``client_models``: one built model per client
    architecture) where the model takes them. Refused in one line where it cannot have them."""
    from ..models import model_options
    from .architectures import shared_model_name

    name = shared_model_name(cfg)
    asked = algorithm.shared_model_options(client_models)
    accepted = model_options(name)
    kwargs = {**cfg.model.kwargs_for(name, cfg.model_name()), **{k: v for k, v in asked.items() if k in accepted}}
    model = build_model_for(cfg, dataset, (INIT, SHARED_MODEL), name, kwargs=kwargs)
    wanted = asked.get("feature_dim")
    if wanted is not None and getattr(model, "feature_dim", None) != wanted:
        raise ConfigError(
            f"model.shared: {cfg.algorithm.display_name()} needs a shared model with a {wanted}-wide feature; {name} "
            f"has {getattr(model, 'feature_dim', 'no feature')} and no feature_dim option (name one that has, e.g. ht_fedavgcnn)"
        )
    return model


def round_info(cfg: Config, rnd: int) -> RoundInfo:
    """Per-round hyperparameters: η_t = η_0 γ^(t-1) (fedavg.md ambiguity 3)."""
    return RoundInfo(round=rnd, lr=cfg.local.lr * cfg.local.lr_decay ** (rnd - 1))


def apply_process_settings(cfg: Config) -> None:
    # Every process of the run has the same thread count (1 unless run.threads says otherwise): this one trains
    # the clients when it runs them itself, and its server steps (refiners) then give the same numbers whichever
    # executor ran the clients. What the checkpoint records (and the Flower writer embeds).
    torch.set_num_threads(client_threads(cfg))
    if cfg.run.tune_allocator:
        keep_freed_memory_in_heap()


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
    if isinstance(cfg.run.cohort, int):  # a cohort step sums in another order: the same math, other last bits
        numerics["cohort"] = cfg.run.cohort
    return numerics


def round_training_flops(cfg: Any, dataset: Any, federation: Any) -> float:
    """About how many floating-point operations a round's client training does: forward + backward (3x the
    forward, counted by torch.utils.flop_counter on one sample of the run's model) over a round's samples
    (clients per round x the mean client size x local epochs). Decides whether worker processes pay off."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model_for(cfg, dataset, (0,)).to("cpu").eval()
    counter = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), counter:
            model(torch.zeros(1, *dataset.input_shape))
    except Exception:  # noqa: BLE001  a model the counter cannot follow: a guess, not a failed run
        return float("inf")  # worker processes, as a large model would get
    sizes = federation.client_sizes()
    mean_size = float(sizes.mean()) if len(sizes) else 0.0
    return 3.0 * counter.get_total_flops() * min(cfg.clients_per_round, len(sizes)) * mean_size * max(1, cfg.local.epochs)
