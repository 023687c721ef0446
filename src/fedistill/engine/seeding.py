"""Independent random streams per (seed, purpose, round, client).

Every consumer of randomness gets its own ``torch.Generator`` derived from the run seed and its
coordinates, never a shared global stream. That is what makes sequential, parallel and resumed runs give
the same numbers: client 7's batches in round 12 do not depend on who trained before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

# Purpose tags keep the streams of different components apart.
INIT, SAMPLING, CLIENT, SERVER = 0, 1, 2, 3
# Server refiners: each has its own tag; its round-t stream is make_generator(seed, TAG, t) and its
# initial weights come from derive_seed(seed, TAG, 0) (rounds are 1-based, so 0 never clashes).
FEDFTG = 4
FEDDF = 5  # FedDF's data-free generator, its proxy order and proxy subset
FEDGEN = 6  # FedGen's server-side feature generator
DAFKD = 7  # DaFKD's global generator (initial weights) and the round's distillation noise
ASSIGNMENT = 8  # the seeded random draw of each client's architecture (model.client_mix)
FD_SERVER = 9  # the federated-distillation server's batch order in round t (FedGKT, FedDKC, FedICT)
FEDGH = 10  # FedGH's global header (initial weights) and the round's order of the uploaded rows
FEDTGP = 11  # FedTGP's prototype generator (initial weights) and the round's order of the uploaded rows
LG_FEDAVG = 12  # LG-FedAvg's initial global head
SHARED_MODEL = 13  # the initial weights of the shared model beside the clients' own (Exchange.shared_model: FML's meme)
FEDMRL = 14  # FedMRL's per-client initial projector P_k^0 (round coordinate 0)
FEDKD = 15  # FedKD's per-client initial hidden map W_h (round coordinate 0)
FEDGEN_HEAD = 16  # the initial global head of FedGen's heterogeneous form (variant htfllib)


def derive_seed(seed: int, *coords: int) -> int:
    """A 63-bit seed from the run seed and integer coordinates (NumPy's SeedSequence hashing)."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *(int(c) for c in coords)]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


@contextlib.contextmanager
def cpu_seeded(seed: int) -> Iterator[None]:
    """Run the block with PyTorch's global CPU generator seeded to ``seed``, and put its state back afterwards.

    For code that draws from the global generator and cannot be handed one (``nn.Module`` initialisation).
    The CPU generator only: ``torch.manual_seed`` would also reseed CUDA's, which ``fork_rng(devices=[])``
    does not restore, so a model built on a GPU machine would change the run's CUDA stream.
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def make_generator(seed: int, *coords: int, device: str | torch.device = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, *coords))
    return gen


def sample_clients(num_clients: int, per_round: int, seed: int, rnd: int) -> list[int]:
    """Uniform sample without replacement for round ``rnd``, sorted by client id (fedavg.md ambiguity 5).

    The stream depends only on (seed, round), so every method sees the same clients in the same round.
    """
    gen = make_generator(seed, SAMPLING, rnd)
    chosen = torch.randperm(num_clients, generator=gen)[:per_round]
    return sorted(int(c) for c in chosen)
