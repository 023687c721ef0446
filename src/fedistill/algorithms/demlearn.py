"""DemLearn (Nguyen et al., "Self-organizing democratized learning: toward large-scale federated learning
systems", IEEE TNNLS 2022). Card: spec/fmtl-baselines.md §5, with the common protocol of §0.

Every round the server organises the round's clients into a hierarchy by agglomerative clustering of their
weights (Euclidean distance, average linkage), builds "generalised" group models bottom-up by averaging and
pushes them top-down by convex mixing; each client then trains proximally to its parent group's model::

    round 1 (the card's round 0): plain local SGD from the server's initial model
    round t ≥ 2:  w ← (1−α)·w_k + α·g_par(k), then E epochs of SGD on  f_k(w) + (μ/2)‖w − g_par(k)‖²
    server:       cluster → tree → g_node = Σ_child n_child·g_child / n_node  (bottom-up, n = clients below)
                  → g_child ← (1−α)·g_child + α·g_node  (top-down from the root)
                  → client k's parent model g_par(k); its personalised (UA) model is (1−α)·w_k + α·g_par(k)

The pure pieces are functions of this module (:func:`average_linkage_dendrogram`, :func:`build_tree`,
:func:`group_models`, :func:`mix_top_down`, :func:`mix`), tested on hand-made client sets; :class:`DemLearn`
wires them into the round.

Our resolutions where the card leaves room (each also noted where it is implemented):

* The dendrogram is scipy's ``linkage(…, method="average")`` on the float64 Euclidean distances (clients are
  ``0..n−1`` in client-id order, the m-th merge creates cluster ``n + m``), and ties in the linkage follow
  scipy (card ambiguity c). scipy grows a nearest-neighbour chain over the live clusters, each known by the
  largest client index among its members: an empty chain starts at the cluster with the smallest index, the
  chain steps from its last cluster to the nearest other one (of equally near ones the chain's previous
  cluster, else the smallest index), and two clusters that are each other's step are merged; the merges are
  then listed by increasing distance, equal distances in the order they were made. Until issue 62 a
  hand-written O(n³) loop merged, of the tied pairs, the lexicographically first in creation ids: the two
  give the same merges except on exact ties (e.g. identical clients: scipy chains them one by one, the loop
  paired them).
* Tree: the root (level L+1) is the last merge. Expanding a node at level ℓ ≥ 2, each of its two dendrogram
  children becomes a node at level ℓ−1, except a single client, which is attached to the level-ℓ node
  directly, whatever ℓ ≥ 2 is (the card's "a client met above level 1 is attached directly", as the reference
  code's ``create_nodes`` does it; an earlier reading wrapped a client under a level-2 node in a level-1
  group of one, so its model was mixed twice, (1−α²)·w_k + α²·g, and it kept 51 % instead of 30 % of its
  own weights at α = 0.7). A level-1 node owns every client below it as direct children.
* Clustering uses the trainable-parameter entries of the flat vectors only; group models average the full
  vectors, so BatchNorm running statistics of a group are averaged (and mixed) exactly like its parameters.
* A client's first round (no stored w_k) is plain SGD (μ = 0) from the server's current model: in round 1
  the initial model, for a client first sampled later the root model of the last tree (the uniform mean of
  that round's clients, which is also what the engine evaluates as the global model).
* The "Amplify ×1.15" trick of the reference code is dropped (card ambiguity a).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, Literal, Mapping, NamedTuple, Sequence

import torch
from pydantic import Field

from ..losses import proximal_term
from ..models.flat import get_flat, num_flat, set_flat, split_like, trainable_mask, trainable_parameters
from ..registry import ALGORITHMS
from .base import ClientContext, Message, RoundInfo, ServerContext
from .fedavg import FedAvg, FedAvgParams
from .local import ExtraLoss

# Client state: w_k, the client's own weights after its last local training (before any mixing).
WEIGHTS_KEY = "demlearn_weights"
# Server state (tensors only, so checkpoints load with weights_only=True):
GROUPS_KEY = "demlearn_groups"  # float32 [G, |W|]: the mixed models of the groups that are some client's parent
PARENT_KEY = "demlearn_parent"  # int64 [K]: row of GROUPS_KEY holding client k's parent model, −1 = none yet
TREE_NODES_KEY = "demlearn_tree_nodes"  # int64 [nodes, 3]: last round's tree, row = node id: (parent, level, size)
TREE_CLIENTS_KEY = "demlearn_tree_clients"  # int64 [n, 2]: last round's clients: (client id, parent node id)

# Pairwise distances are computed this many float64 entries at a time per block (bounds the temporary memory).
_DISTANCE_BLOCK_ENTRIES = 1 << 24


# -- clustering ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Merge:
    """One step of the dendrogram: clusters ``left < right`` (creation ids) merged at ``distance``.

    Ids follow scipy's convention: the n inputs are clusters ``0..n−1`` and the m-th merge (0-based) creates
    cluster ``n + m`` of ``size`` inputs.
    """

    left: int
    right: int
    distance: float
    size: int


def pairwise_distances(vectors: torch.Tensor) -> torch.Tensor:
    """Euclidean distances between the rows of ``vectors`` in float64, exactly symmetric, zero diagonal.

    Each distance is computed from the coordinate differences (no ``‖x‖² + ‖y‖² − 2x·y`` shortcut, whose
    cancellation would make near-equal distances, and ties, depend on rounding); rows are converted to
    float64 a block at a time so that a big model never needs a second full float64 copy of all clients.
    """
    if vectors.dim() != 2:
        raise ValueError(f"pairwise_distances: expected an [n, d] tensor, got shape {tuple(vectors.shape)}")
    n, d = vectors.shape
    block = max(1, _DISTANCE_BLOCK_ENTRIES // max(1, d))
    out = torch.zeros(n, n, dtype=torch.float64)
    starts = range(0, n, block)
    for i in starts:
        xi = vectors[i : i + block].double()
        for j in starts:
            if j < i:
                continue
            xj = xi if j == i else vectors[j : j + block].double()
            out[i : i + block, j : j + block] = torch.cdist(xi, xj, compute_mode="donot_use_mm_for_euclid_dist")
    # Mirror the upper triangle: d(i, j) and d(j, i) are then the same number, so ties stay ties.
    upper = torch.triu(out, diagonal=1)
    return upper + upper.T


def average_linkage_dendrogram(vectors: torch.Tensor) -> list[Merge]:
    """The full average-linkage (UPGMA) dendrogram of the rows of ``vectors`` (card §5 step 1).

    The distance of two clusters is the mean of the Euclidean distances between their members. The merges are
    scipy's ``linkage(…, method="average")`` on :func:`pairwise_distances` (float64), read off its linkage
    matrix: row m ``[left, right, distance, size]`` is merge m, which creates cluster ``n + m``; scipy lists
    the merges by increasing distance and puts the smaller id first. Ties (equal cluster distances) are broken
    the way scipy breaks them (module docstring). One vector: no merge.
    """
    n = int(vectors.shape[0])
    if n == 0:
        raise ValueError("average_linkage_dendrogram: no vectors")
    if n == 1:
        return []
    import numpy as np
    from scipy.cluster.hierarchy import linkage
    from scipy.spatial.distance import squareform

    condensed = squareform(pairwise_distances(vectors).numpy(), checks=False)  # the upper triangle, row by row
    finite = np.isfinite(condensed)
    if not finite.all():
        # A client whose update diverged (NaN/inf weights) still gets a place in the tree: the engine flags the
        # round as diverged once the aggregate is non-finite, which it is whatever the tree. scipy refuses
        # non-finite distances, so they become one common distance beyond every finite one.
        far = 2.0 * float(condensed[finite].max()) + 1.0 if finite.any() else 1.0
        condensed = np.where(finite, condensed, far)
    table = linkage(condensed, method="average")
    return [Merge(int(left), int(right), float(distance), int(size)) for left, right, distance, size in table]


# -- the hierarchy ---------------------------------------------------------------------------------------------
@dataclass
class Node:
    """A group of the hierarchy: ``children`` are sub-groups and client indices (ints, attached directly).

    ``id`` numbers the groups of one tree in pre-order from the root (0), first dendrogram child first;
    ``size`` is the number of clients below (the weight n_node of the bottom-up average).
    """

    id: int
    level: int
    size: int
    children: list["Node | int"] = field(default_factory=list)

    def groups(self) -> Iterator["Node"]:
        """This node and every group below it, in pre-order (ascending ids)."""
        yield self
        for child in self.children:
            if isinstance(child, Node):
                yield from child.groups()

    def clients(self) -> list[int]:
        """Every client below this node, each once, in tree order."""
        out: list[int] = []
        for child in self.children:
            out.extend(child.clients() if isinstance(child, Node) else [child])
        return out


def build_tree(merges: Sequence[Merge], n: int, levels: int) -> Node:
    """The DemLearn hierarchy of ``n`` clients from their dendrogram (card §5 step 1; module docstring).

    The root is at level ``levels + 1`` and stands for the last merge. A node at level ℓ ≥ 2 has its two
    dendrogram children as nodes at level ℓ−1, except that a single client met while ℓ−1 ≥ 2 is attached
    directly; a node at level 1 owns every client below it (in ascending index order). One client: the root
    with that client attached.
    """
    if n < 1:
        raise ValueError("build_tree: no clients")
    if levels < 1:
        raise ValueError("build_tree: levels must be >= 1")
    if len(merges) != n - 1:
        raise ValueError(f"build_tree: {n} clients need {n - 1} merges, got {len(merges)}")
    children = {n + m: (merge.left, merge.right) for m, merge in enumerate(merges)}
    sizes = {n + m: merge.size for m, merge in enumerate(merges)}
    ids = itertools.count()

    def members(cluster: int) -> list[int]:
        out, stack = [], [cluster]
        while stack:
            c = stack.pop()
            if c < n:
                out.append(c)
            else:
                stack.extend(children[c])
        return sorted(out)

    def group(cluster: int, level: int) -> Node:
        node = Node(id=next(ids), level=level, size=1 if cluster < n else sizes[cluster])
        if level == 1 or cluster < n:
            node.children = members(cluster)  # a level-1 group owns its clients (or the root of one client)
            return node
        for child in children[cluster]:
            if child < n:
                node.children.append(child)  # a client met above level 1: attached directly (card §5)
            else:
                node.children.append(group(child, level - 1))
        return node

    return group(2 * n - 2, levels + 1)


def group_models(tree: Node, vectors: torch.Tensor | Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Bottom-up generalised models (card §5 step 2, γ = 1): ``g = Σ_child n_child·g_child / n_node``.

    A client leaf counts as ``n = 1`` with ``g = w_k = vectors[k]``: every group is the plain mean of its
    clients' vectors (uniform per client, not weighted by sample counts). float64, keyed by node id.
    """
    out: dict[int, torch.Tensor] = {}

    def visit(node: Node) -> None:
        total: torch.Tensor | None = None
        for child in node.children:
            if isinstance(child, Node):
                visit(child)
                term = out[child.id] * child.size
            else:
                term = vectors[child].double()
            total = term.clone() if total is None else total.add_(term)
        if total is None:
            raise ValueError(f"group_models: node {node.id} has no children")
        out[node.id] = total / node.size

    visit(tree)
    return out


def mix(own: torch.Tensor, anchor: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(1 − α)·own + α·anchor`` in float64, returned in ``own``'s dtype.

    α = 0 returns ``own`` and α = 1 returns ``anchor`` exactly (the card's isolation and FedAvg invariants).
    """
    return (own.double() * (1.0 - alpha) + anchor.double() * alpha).to(own.dtype)


class TopDown(NamedTuple):
    """The result of :func:`mix_top_down`: every group's mixed model and each client's parent node id."""

    groups: dict[int, torch.Tensor]
    parent: dict[int, int]

    def parent_model(self, client: int) -> torch.Tensor:
        """g_par(k): the mixed model of the group client ``client`` is attached to."""
        return self.groups[self.parent[client]]


def mix_top_down(tree: Node, groups: Mapping[int, torch.Tensor], alpha: float) -> TopDown:
    """Top-down pass (card §5 step 3): from the root, ``g_child ← (1−α)·g_child + α·g_node`` for every
    sub-group, with ``g_node`` already mixed; the root keeps its model. ``groups`` is not modified.

    A client's own mixing ``w_k ← (1−α)·w_k + α·g_par(k)`` is left to the client (it holds w_k and receives
    g_par(k)); the returned ``parent`` map says which group that is.
    """
    mixed: dict[int, torch.Tensor] = {tree.id: groups[tree.id]}
    parent: dict[int, int] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in node.children:
            if isinstance(child, Node):
                mixed[child.id] = mix(groups[child.id], mixed[node.id], alpha)
                stack.append(child)
            else:
                parent[child] = node.id
    return TopDown(mixed, parent)


def tree_tensors(tree: Node, cids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree as int64 tensors for the server state: ``nodes[id] = (parent id or −1, level, size)`` and
    ``clients[i] = (cids[i], id of the node client i is attached to)``."""
    nodes = list(tree.groups())
    table = torch.zeros(len(nodes), 3, dtype=torch.int64)
    clients = torch.zeros(len(cids), 2, dtype=torch.int64)
    table[tree.id, 0] = -1
    for node in nodes:
        table[node.id, 1], table[node.id, 2] = node.level, node.size
        for child in node.children:
            if isinstance(child, Node):
                table[child.id, 0] = node.id
            else:
                clients[child] = torch.tensor([cids[child], node.id])
    return table, clients


# -- the algorithm ---------------------------------------------------------------------------------------------
class DemLearnParams(FedAvgParams):
    # Group models weigh every client alike (card §5 step 2), whatever its sample count.
    weighting: Literal["uniform"] = Field("uniform", description="group models are plain means over clients (card §5)")
    alpha: float = Field(0.7, ge=0.0, le=1.0, description="top-down mixing factor α (card: 0.7; 0.6 for MNIST)")
    mu: float = Field(0.002, ge=0.0, description="proximal coefficient μ toward the parent group model")
    levels: int = Field(3, ge=1, description="K_levels: the root is at level levels + 1")


@ALGORITHMS.register("demlearn")
class DemLearn(FedAvg):
    """DemLearn: hierarchical clustering of the clients, group models bottom-up, mixing top-down.

    Communication per client and round is FedAvg's: the server sends one flat vector (g_par(k), or the server
    model before the client's first round) and the client returns its own trained weights w_k.
    """

    name = "demlearn"
    Params = DemLearnParams
    adds_proximal_term = True
    # UA_k: (1−α)·w_k + α·g_par(k), built by the client after aggregation (card §5 "UA model").
    personal_model = "assembled"

    # -- server ---------------------------------------------------------------------------------
    def init_server(self, server: ServerContext) -> None:
        server.state[GROUPS_KEY] = torch.zeros(0, num_flat(server.model))
        server.state[PARENT_KEY] = torch.full((server.num_clients,), -1, dtype=torch.int64)
        server.state[TREE_NODES_KEY] = torch.zeros(0, 3, dtype=torch.int64)
        server.state[TREE_CLIENTS_KEY] = torch.zeros(0, 2, dtype=torch.int64)
        self._broadcast_round = None

    @staticmethod
    def _parent_row(server: ServerContext, cid: int) -> int:
        parent = server.state[PARENT_KEY]
        return int(parent[cid]) if cid < parent.numel() else -1

    def broadcast(self, server: ServerContext, info: RoundInfo, cid: int) -> Message:
        row = self._parent_row(server, cid)
        if row >= 0:
            # A copy, not a view: a view would carry (and serialise) the whole [G, |W|] storage.
            return Message(weights=server.state[GROUPS_KEY][row].clone())
        # A client never aggregated yet starts from the server model (flattened once per round, as FedAvg).
        if getattr(self, "_broadcast_round", None) != info.round:
            self._broadcast_round, self._broadcast_vec = info.round, get_flat(server.model)
        return Message(weights=self._broadcast_vec)

    def aggregate(self, server: ServerContext, info: RoundInfo, replies: Mapping[int, Message]) -> dict[str, float]:
        cids = sorted(replies)
        if not cids:
            return {}
        vectors = torch.stack([replies[c]["weights"].float() for c in cids])
        mask = getattr(self, "_trainable", None)
        if mask is None or mask.numel() != vectors.shape[1]:
            mask = self._trainable = trainable_mask(server.model)  # depends on the architecture only
        # Clustering on trainable parameters (card ambiguity b); the groups average the full vectors.
        features = vectors if bool(mask.all()) else vectors[:, mask]
        tree = build_tree(average_linkage_dendrogram(features), len(cids), self.params.levels)
        groups = group_models(tree, vectors)
        top = mix_top_down(tree, groups, self.params.alpha)
        # The root (never mixed) is the uniform mean of the round's clients: the "global" model evaluated.
        set_flat(server.model, groups[tree.id].float())
        self._broadcast_round = None
        self._store_parents(server, cids, top)
        server.state[TREE_NODES_KEY], server.state[TREE_CLIENTS_KEY] = tree_tensors(tree, cids)
        nodes = list(tree.groups())
        direct = sum(not isinstance(child, Node) for node in nodes if node.level > 1 for child in node.children)
        return {
            "demlearn_groups": float(len(nodes)),  # group nodes of the tree, root included
            "demlearn_level1_groups": float(sum(node.level == 1 for node in nodes)),
            "demlearn_direct_clients": float(direct),  # clients attached above level 1
        }

    @staticmethod
    def _store_parents(server: ServerContext, cids: list[int], top: TopDown) -> None:
        """Keep g_par(k) for the next broadcast: this round's parents for its clients, the previous ones for
        the others; group models no client points to any more are dropped."""
        parent = server.state[PARENT_KEY]
        if parent.numel() <= cids[-1]:  # a client id beyond the configured population (Flower)
            parent = torch.cat([parent, torch.full((cids[-1] + 1 - parent.numel(),), -1, dtype=torch.int64)])
        old = server.state[GROUPS_KEY]
        used_nodes = sorted(set(top.parent.values()))
        row_of = {node: old.shape[0] + r for r, node in enumerate(used_nodes)}
        for pos, cid in enumerate(cids):
            parent[cid] = row_of[top.parent[pos]]
        rows = torch.cat([old, torch.stack([top.groups[node].float() for node in used_nodes])])
        kept = torch.unique(parent[parent >= 0])  # sorted: the stored rows keep their relative order
        remap = torch.full((rows.shape[0],), -1, dtype=torch.int64)
        remap[kept] = torch.arange(kept.numel())
        server.state[PARENT_KEY] = torch.where(parent >= 0, remap[parent.clamp_min(0)], parent)
        server.state[GROUPS_KEY] = rows[kept]

    # -- client: FedAvg's local round with three hooks -------------------------------------------
    def load_weights(self, client: ClientContext, received: torch.Tensor) -> None:
        """The client's starting point, and also its personalised (UA) model when the engine assembles it after
        aggregation (card §5): ``(1−α)·w_k + α·g_par(k)``, the client finishing the server's top-down pass
        itself. A client that never trained (no stored w_k) starts from what it received: in round 1 the
        initial model (card: round 0). ``client.state`` is only read."""
        own = client.state.get(WEIGHTS_KEY)
        # On a GPU the executor hands the state over on the device and the message stays on the host (issue 29).
        set_flat(client.model, received if own is None else mix(own.to(received.device), received, self.params.alpha))

    def extra_loss(self, client: ClientContext, msg: Message) -> ExtraLoss | None:
        """``(μ/2)‖w − g_par(k)‖²`` over the trainable parameters, from the client's second round on (its first
        round is plain SGD, μ = 0). The anchor is the received parent model, fixed for the round."""
        if client.state.get(WEIGHTS_KEY) is None or self.params.mu == 0:
            return None
        params = trainable_parameters(client.model)
        anchors = split_like(msg["weights"][trainable_mask(client.model)], params)
        mu = self.params.mu
        return lambda model, x, y, logits, features: proximal_term(params, anchors, mu)

    def upload_weights(self, client: ClientContext) -> torch.Tensor:
        """w_k after training goes up and stays in the client's state for its next round and its UA model."""
        weights = get_flat(client.model)
        client.state[WEIGHTS_KEY] = weights
        return weights
