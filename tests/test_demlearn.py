"""DemLearn (spec/fmtl-baselines.md §5): the clustering, the hierarchy, the bottom-up/top-down passes and the
card's invariants, on hand-made clients and in the engine."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_resume_is_exact, small_config

from fedistill.algorithms.base import ServerContext
from fedistill.algorithms.demlearn import (
    GROUPS_KEY,
    PARENT_KEY,
    TREE_CLIENTS_KEY,
    TREE_NODES_KEY,
    WEIGHTS_KEY,
    DemLearn,
    DemLearnParams,
    Merge,
    Node,
    average_linkage_dendrogram,
    build_tree,
    group_models,
    mix,
    mix_top_down,
    tree_tensors,
)
from fedistill.algorithms.local import local_sgd
from fedistill.errors import ConfigError
from fedistill.simulation import Simulation
from fedistill.models.flat import get_flat, set_flat

# -- hand-made clients ------------------------------------------------------------------------------------------
# Two tight pairs, a point near the second pair and a far outlier:
#   p0 (0,0) p1 (0,2) | p2 (20,0) p3 (20,3) p4 (26,0) | p5 (100,0)
POINTS = torch.tensor([[0.0, 0.0], [0.0, 2.0], [20.0, 0.0], [20.0, 3.0], [26.0, 0.0], [100.0, 0.0]], dtype=torch.float64)


def test_hand_made_average_linkage_dendrogram():
    # Worked by hand (clusters 0..5 are the clients, the m-th merge creates cluster 6 + m):
    #   d(p0,p1) = 2 is the smallest distance                                  -> 6 = {0,1}
    #   d(p2,p3) = 3 next (every other pair is ≥ 6)                            -> 7 = {2,3}
    #   p4 to 7: mean(d(p4,p2), d(p4,p3)) = (6 + √45)/2 ≈ 6.354; 6 to 7 ≈ 20   -> 8 = {2,3,4}
    #   6 to 8: mean of the six cross distances ≈ 22.07; p5 to 8 ≈ 78          -> 9 = {0,..,4}
    #   p5 to 9: mean of its five distances                                    -> 10 = all
    cross = [20.0, math.sqrt(409), 26.0, math.sqrt(404), math.sqrt(401), math.sqrt(680)]
    outlier = [100.0, math.sqrt(10004), 80.0, math.sqrt(6409), 74.0]
    expected = [
        Merge(0, 1, 2.0, 2),
        Merge(2, 3, 3.0, 2),
        Merge(4, 7, (6.0 + math.sqrt(45)) / 2, 3),
        Merge(6, 8, sum(cross) / 6, 5),
        Merge(5, 9, sum(outlier) / 5, 6),
    ]
    merges = average_linkage_dendrogram(POINTS)
    assert [(m.left, m.right, m.size) for m in merges] == [(m.left, m.right, m.size) for m in expected]
    for got, want in zip(merges, expected):
        assert got.distance == pytest.approx(want.distance, rel=1e-12)
    # float32 input (the flat weight vectors) gives the same dendrogram.
    assert [(m.left, m.right) for m in average_linkage_dendrogram(POINTS.float())] == [(m.left, m.right) for m in expected]


def test_hand_made_tree_with_two_levels():
    # Root (level 3) = the last merge {5} + {0..4}; p5 is a client met at level 2 (> 1): attached to the root.
    # {0..4} (level 2) has the dendrogram children {0,1} and {2,3,4}, both at level 1, owning their clients.
    tree = build_tree(average_linkage_dendrogram(POINTS), 6, levels=2)
    assert tree == Node(0, 3, 6, [5, Node(1, 2, 5, [Node(2, 1, 2, [0, 1]), Node(3, 1, 3, [2, 3, 4])])])
    assert sorted(tree.clients()) == list(range(6))


def test_hand_made_tree_with_three_levels():
    # Root at level 4; {0..4} at level 3; {0,1} and {2,3,4} at level 2. A single client among their dendrogram
    # children is attached to the level-2 node directly (card: "a client met above level 1 is attached
    # directly"; the reference code's create_nodes): 0 and 1 under {0,1}, 4 under {2,3,4}; {2,3} is a level-1 group.
    tree = build_tree(average_linkage_dendrogram(POINTS), 6, levels=3)
    assert tree == Node(0, 4, 6, [5, Node(1, 3, 5, [Node(2, 2, 2, [0, 1]), Node(3, 2, 3, [4, Node(4, 1, 2, [2, 3])])])])
    nodes, clients = tree_tensors(tree, [10, 11, 12, 13, 14, 15])
    # (parent id, level, clients below) per node id, and (client id, node it is attached to).
    assert nodes.tolist() == [[-1, 4, 6], [0, 3, 5], [1, 2, 2], [1, 2, 3], [3, 1, 2]]
    assert clients.tolist() == [[10, 2], [11, 2], [12, 4], [13, 4], [14, 3], [15, 0]]


def test_a_client_under_a_level_two_node_is_mixed_once_with_that_group():
    """Card §5 step 3 on the tree above, written out: client 4 hangs from the level-2 group {2,3,4}, so its
    model is (1−α)·w_4 + α·g_{2,3,4} once (wrapped in a group of one it was mixed twice: (1−α²)·w_4 + α²·g)."""
    tree = build_tree(average_linkage_dendrogram(POINTS), 6, levels=3)
    vectors = torch.tensor([[1.0], [2.0], [4.0], [8.0], [16.0], [32.0]])
    alpha = 0.7
    root = vectors.double().mean(0)
    g5 = vectors[:5].double().mean(0)  # level 3
    g234 = vectors[2:5].double().mean(0)  # level 2
    g5 = (1 - alpha) * g5 + alpha * root
    g234 = (1 - alpha) * g234 + alpha * g5
    expected = (1 - alpha) * 16.0 + alpha * g234
    top_down = mix_top_down(tree, group_models(tree, vectors), alpha)
    assert top_down.parent[4] == 3  # the level-2 node {2,3,4}
    assert torch.allclose(mix(vectors[4], top_down.parent_model(4), alpha).double(), expected, atol=1e-6)


def test_hand_made_group_models_and_top_down_mixing():
    tree = build_tree(average_linkage_dendrogram(POINTS), 6, levels=2)
    groups = group_models(tree, POINTS)
    # Bottom-up by hand: {0,1} -> (0,1); {2,3,4} -> (66/3, 3/3) = (22,1); {0..4} -> (2·(0,1) + 3·(22,1))/5
    # = (13.2, 1); root -> (5·(13.2,1) + (100,0))/6 = (166/6, 5/6), the plain mean of the six points.
    want = {2: [0.0, 1.0], 3: [22.0, 1.0], 1: [13.2, 1.0], 0: [166 / 6, 5 / 6]}
    for node, value in want.items():
        assert torch.allclose(groups[node], torch.tensor(value, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(groups[0], POINTS.mean(0), rtol=0, atol=1e-12)
    # Top-down with α = 1/2: the root stays, each group moves halfway to its (already mixed) parent.
    top = mix_top_down(tree, groups, 0.5)
    g0 = torch.tensor([166 / 6, 5 / 6], dtype=torch.float64)
    g1 = (torch.tensor([13.2, 1.0], dtype=torch.float64) + g0) / 2  # (20.4333…, 0.91666…)
    g2 = (torch.tensor([0.0, 1.0], dtype=torch.float64) + g1) / 2
    g3 = (torch.tensor([22.0, 1.0], dtype=torch.float64) + g1) / 2
    for node, value in {0: g0, 1: g1, 2: g2, 3: g3}.items():
        assert torch.allclose(top.groups[node], value, rtol=0, atol=1e-12)
    # Parents: p5 hangs from the root, p0/p1 from {0,1}, p2/p3/p4 from {2,3,4}.
    assert top.parent == {5: 0, 0: 2, 1: 2, 2: 3, 3: 3, 4: 3}
    assert torch.equal(top.parent_model(4), top.groups[3])
    # The client's personalised model: (1 − α)·w_k + α·g_par(k).
    assert torch.allclose(mix(POINTS[0], top.parent_model(0), 0.5), (POINTS[0] + g2) / 2, rtol=0, atol=1e-12)
    # The bottom-up models handed in are left as they were.
    assert torch.allclose(groups[1], torch.tensor([13.2, 1.0], dtype=torch.float64), rtol=0, atol=1e-12)


def test_ties_merge_the_first_pair_in_creation_order():
    # x = 0, 2, 3, 5: {1,2} at 1 -> cluster 4; then d(0,4) = (2+3)/2 = d(3,4) = (3+2)/2 = 2.5 exactly: the
    # pair (0, 4) comes before (3, 4) -> cluster 5 = {0,1,2}; last (3, 5) at (5+3+2)/3.
    line = lambda xs: torch.tensor([[float(x), 0.0] for x in xs])  # noqa: E731
    merges = average_linkage_dendrogram(line([0, 2, 3, 5]))
    assert merges == [Merge(1, 2, 1.0, 2), Merge(0, 4, 2.5, 3), Merge(3, 5, 10 / 3, 4)]
    # x = 0, 1, 10, 11: (0,1) and (2,3) tie at 1; (0,1) first.
    merges = average_linkage_dendrogram(line([0, 1, 10, 11]))
    assert merges == [Merge(0, 1, 1.0, 2), Merge(2, 3, 1.0, 2), Merge(4, 5, 10.0, 4)]


def test_dendrogram_agrees_with_scipy_average_linkage():
    hierarchy = pytest.importorskip("scipy.cluster.hierarchy")
    g = torch.Generator().manual_seed(3)
    for n, d in [(2, 3), (7, 4), (25, 40)]:
        x = torch.randn(n, d, generator=g, dtype=torch.float64)
        x[: n // 2] += 3.0  # some structure
        ours = average_linkage_dendrogram(x)
        theirs = hierarchy.linkage(x.numpy(), method="average", metric="euclidean")
        assert [(m.left, m.right, m.size) for m in ours] == [(int(a), int(b), int(s)) for a, b, _, s in theirs]
        assert [m.distance for m in ours] == pytest.approx([float(r[2]) for r in theirs], rel=1e-10)


def test_one_client_is_its_own_root():
    tree = build_tree(average_linkage_dendrogram(torch.ones(1, 5)), 1, levels=3)
    assert tree == Node(0, 4, 1, [0])
    top = mix_top_down(tree, group_models(tree, torch.ones(1, 5)), 0.7)
    assert torch.equal(top.parent_model(0), torch.ones(5, dtype=torch.float64))


@pytest.mark.parametrize("levels", [1, 2, 3, 4])
def test_tree_holds_every_client_once_and_groups_are_count_weighted_means(levels):
    g = torch.Generator().manual_seed(levels)
    for n in range(1, 14):
        vectors = torch.randn(n, 6, generator=g) * torch.rand(n, 1, generator=g) * 4
        tree = build_tree(average_linkage_dendrogram(vectors), n, levels)
        assert sorted(tree.clients()) == list(range(n))
        assert tree.level == levels + 1 and tree.size == n
        nodes = list(tree.groups())
        assert [node.id for node in nodes] == list(range(len(nodes)))
        groups = group_models(tree, vectors)
        for node in nodes:
            members = node.clients()
            assert node.size == len(members)
            for child in node.children:
                if isinstance(child, Node):
                    assert child.level == node.level - 1
                else:
                    # A client hangs from any node that met it: a level-1 group owning it, or a node at level
                    # ≥ 2 whose dendrogram child it is (never wrapped in a level-1 group of one).
                    assert node.level == 1 or not any(isinstance(c, Node) and c.level == 1 and c.size == 1 for c in node.children)
            if node.level == 1:
                assert all(isinstance(c, int) for c in node.children)
            # Card invariant: a group model is the client-count-weighted (i.e. plain per-client) mean.
            mean = vectors[members].double().mean(0)
            assert torch.allclose(groups[node.id], mean, rtol=0, atol=1e-12)
        parents = mix_top_down(tree, groups, 0.3).parent
        assert sorted(parents) == list(range(n))


def test_alpha_one_copies_the_root_and_alpha_zero_changes_nothing():
    g = torch.Generator().manual_seed(0)
    vectors = torch.randn(9, 5, generator=g)
    tree = build_tree(average_linkage_dendrogram(vectors), 9, 3)
    groups = group_models(tree, vectors)
    root = groups[tree.id]
    assert torch.allclose(root, vectors.double().mean(0), rtol=0, atol=1e-12)
    one = mix_top_down(tree, groups, 1.0)
    for k in range(9):
        assert torch.equal(one.parent_model(k), root)  # exactly the root: the uniform mean of all clients
        assert torch.equal(mix(vectors[k], one.parent_model(k).float(), 1.0), root.float())
    zero = mix_top_down(tree, groups, 0.0)
    for node, model in groups.items():
        assert torch.equal(zero.groups[node], model)
    for k in range(9):
        assert torch.equal(mix(vectors[k], zero.parent_model(k).float(), 0.0), vectors[k])


# -- the algorithm on a hand-made server ----------------------------------------------------------------------
class TinyBNNet(torch.nn.Module):
    """One weight and a BatchNorm's running statistics: flat vector = (weight, running_mean, running_var)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1, 1, bias=False)
        self.bn = torch.nn.BatchNorm1d(1, affine=False)

    def forward(self, x):
        return self.bn(self.lin(x))


def test_server_clusters_on_parameters_and_averages_batchnorm_statistics_alike():
    from fedistill.algorithms.base import Message, RoundInfo

    algo = DemLearn(DemLearnParams(levels=1, alpha=0.5), small_config().local)
    server = ServerContext(model=TinyBNNet(), state={}, generator=torch.Generator(), num_classes=2, num_clients=5)
    algo.init_server(server)
    # Parameters say {0,1} | {2,3}; the running means would say {0,2} | {1,3}: clustering must follow the
    # parameters (card ambiguity b), while the group models average the statistics too.
    def reply(values):
        return Message(weights=torch.tensor(values), num_samples=5, train_loss=0.0)

    def sent(rnd, cid):
        return algo.broadcast(server, RoundInfo(rnd, 0.1), cid)["weights"]

    flat = {0: [0.0, 0.0, 1.0], 1: [0.1, 100.0, 1.0], 2: [10.0, 0.0, 3.0], 3: [10.1, 100.0, 3.0]}
    metrics = algo.aggregate(server, RoundInfo(1, 0.1), {cid: reply(v) for cid, v in flat.items()})
    assert metrics["demlearn_level1_groups"] == 2.0
    assert server.state[TREE_CLIENTS_KEY].tolist() == [[0, 1], [1, 1], [2, 2], [3, 2]]
    assert server.state[TREE_NODES_KEY].tolist() == [[-1, 2, 4], [0, 1, 2], [0, 1, 2]]
    root = torch.tensor([20.2 / 4, 50.0, 2.0])
    assert torch.allclose(get_flat(server.model), root)
    # Parent of {0,1}: (1/2)·(0.05, 50, 1) + (1/2)·root; of {2,3}: (1/2)·(10.05, 50, 3) + (1/2)·root.
    low, high = (torch.tensor([0.05, 50.0, 1.0]) + root) / 2, (torch.tensor([10.05, 50.0, 3.0]) + root) / 2
    assert torch.allclose(sent(2, 1), low) and torch.allclose(sent(2, 2), high)
    # Client 4 has never been aggregated: it gets the server model; two group models are stored, no more.
    assert torch.equal(sent(2, 4), get_flat(server.model))
    assert server.state[GROUPS_KEY].shape == (2, 3)
    assert server.state[PARENT_KEY].tolist() == [0, 0, 1, 1, -1]
    # Next round only client 0 comes: it gets a new parent (the root of a one-client tree); the {2,3}
    # group stays for clients 2 and 3, and the old {0,1} group stays for client 1.
    algo.aggregate(server, RoundInfo(2, 0.1), {0: reply([7.0, 7.0, 7.0])})
    assert server.state[GROUPS_KEY].shape == (3, 3)
    assert torch.equal(sent(3, 0), torch.tensor([7.0, 7.0, 7.0]))
    assert torch.allclose(sent(3, 1), low) and torch.allclose(sent(3, 3), high)
    # Client 1 comes back alone: the old {0,1} group is no longer anyone's parent and is dropped.
    algo.aggregate(server, RoundInfo(3, 0.1), {1: reply([1.0, 1.0, 1.0])})
    assert server.state[GROUPS_KEY].shape == (3, 3)
    assert torch.equal(sent(4, 0), torch.tensor([7.0, 7.0, 7.0])) and torch.equal(sent(4, 1), torch.tensor([1.0, 1.0, 1.0]))
    assert torch.allclose(sent(4, 2), high)


# -- the engine -----------------------------------------------------------------------------------------------
# One intra-op thread: on two cores shared with other processes, two OpenMP threads per round made rounds up to
# ~50x slower (measured: 25 s instead of 0.3 s for two FedAvg rounds); the results are as deterministic.
ONE_THREAD = {"run.threads": 1}


def config(**overrides):
    return small_config(**{**ONE_THREAD, **overrides})


def demlearn_config(**overrides):
    return config(**{"algorithm.name": "demlearn", **overrides})


def assembled(sim, cid):
    """Client ``cid``'s personalised model after the last round, as the engine's evaluation builds it."""
    info = sim.round_info(sim.state.round)
    msg = sim.algorithm.personal_message(sim.server, info, cid)
    ctx = sim.client_runtime.context(cid, info.round, sim.server_runtime.client_store.load(cid))
    sim.client_runtime.algorithm.assemble_personal_model(ctx, msg)
    return get_flat(ctx.model)


def test_alpha_zero_mu_zero_clients_train_in_isolation(digits):
    # Card invariant: with α = 0 and μ = 0 DemLearn is local-only training. Replay every client alone from
    # the initial model (its own seeded batches, nothing from the others) and compare bit for bit.
    isolated = {"partition.num_clients": 4, "algorithm.alpha": 0.0, "algorithm.mu": 0.0}
    cfg = demlearn_config(rounds=2, clients_per_round=4, **isolated)
    sim = Simulation(cfg, digits)
    initial = get_flat(sim.server.model)
    for rnd in (1, 2):
        sim.run_round(rnd)
    replayed = {}
    for cid in range(4):
        weights = initial
        for rnd in (1, 2):
            ctx = sim.client_runtime.context(cid, rnd, {})
            set_flat(ctx.model, weights)
            local_sgd(
                ctx,
                lr=sim.round_info(rnd).lr,
                epochs=cfg.local.epochs,
                batch_size=cfg.local.batch_size,
                momentum=cfg.local.momentum,
                weight_decay=cfg.local.weight_decay,
            )
            weights = get_flat(ctx.model)
        replayed[cid] = weights
        own = sim.server_runtime.client_store.load(cid)[WEIGHTS_KEY]
        assert torch.equal(own, weights), cid
        assert torch.equal(assembled(sim, cid), own)  # α = 0: the personalised model is w_k itself
    # Not vacuous: with the default α the others do reach client 0 in round 2.
    mixed = Simulation(demlearn_config(rounds=2, clients_per_round=4, **{**isolated, "algorithm.alpha": 0.7}), digits)
    for rnd in (1, 2):
        mixed.run_round(rnd)
    assert not torch.allclose(mixed.server_runtime.client_store.load(0)[WEIGHTS_KEY], replayed[0], atol=1e-4)


def test_alpha_one_every_client_ends_the_round_with_the_uniform_mean(digits):
    # 6 clients, 3 a round (rounds 1: 0,3,5; 2: 0,2,3): the round's clients assemble the uniform mean of
    # that round's client models, which is the server model; a client absent from round 2 keeps its round-1
    # parent; one never sampled gets the server model.
    sim = Simulation(demlearn_config(rounds=2, **{"algorithm.alpha": 1.0}), digits)
    store = sim.server_runtime.client_store
    sim.run_round(1)
    first_root = get_flat(sim.server.model)
    sim.run_round(2)
    second = sim.server_runtime.select_clients(2)
    only_first = [c for c in sim.server_runtime.select_clients(1) if c not in second]
    assert second == [0, 2, 3] and only_first == [5]
    uniform = torch.stack([store.load(c)[WEIGHTS_KEY] for c in second]).double().mean(0).float()
    assert torch.allclose(get_flat(sim.server.model), uniform, rtol=0, atol=1e-6)
    for cid in second:
        before = {k: v.clone() for k, v in store.load(cid).items()}
        assert torch.equal(assembled(sim, cid), get_flat(sim.server.model))
        after = store.load(cid)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)  # read only
    assert torch.equal(assembled(sim, 5), first_root)
    assert torch.equal(assembled(sim, 1), get_flat(sim.server.model))


def test_alpha_one_mu_zero_is_uniform_fedavg(digits):
    # α = 1 copies the root (the uniform mean) to every client, μ = 0 drops the prox term: FedAvg with uniform
    # weights, up to the rounding of the nested group means (two rounds, all clients start from the mean).
    a = Simulation(demlearn_config(rounds=2, **{"algorithm.alpha": 1.0, "algorithm.mu": 0.0}), digits)
    b = Simulation(config(rounds=2, **{"algorithm.name": "fedavg", "algorithm.weighting": "uniform"}), digits)
    for rnd in (1, 2):
        ra, rb = a.run_round(rnd), b.run_round(rnd)
        assert torch.allclose(get_flat(a.server.model), get_flat(b.server.model), rtol=0, atol=1e-5)
        assert (ra["bytes_down"], ra["bytes_up"]) == (rb["bytes_down"], rb["bytes_up"])  # FedAvg's traffic


def test_round_state_prox_and_the_client_start(digits):
    # Default α, μ, levels; all six clients each round.
    sim = Simulation(demlearn_config(rounds=2, clients_per_round=6), digits)
    row = sim.run_round(1)
    assert row["demlearn_groups"] >= 1 and row["demlearn_level1_groups"] >= 1
    store = sim.server_runtime.client_store
    own = {c: store.load(c)[WEIGHTS_KEY] for c in range(6)}
    # The server model is the root: the uniform (not sample-weighted) mean of the clients' models.
    assert torch.allclose(get_flat(sim.server.model), torch.stack(list(own.values())).mean(0), rtol=0, atol=1e-6)
    clients = sim.server.state[TREE_CLIENTS_KEY]
    assert sorted(clients[:, 0].tolist()) == list(range(6))  # every client once in the tree
    # Round 2 by hand for client 0, with lr = 0: the client starts from (1−α)·w_k + α·g_par(k) exactly.
    info = sim.round_info(2)
    msg = sim.server_runtime.broadcast(info, 0)
    alpha = sim.algorithm.params.alpha
    frozen = type(info)(info.round, 0.0)
    reply = sim.client_runtime.update(0, frozen, msg, {WEIGHTS_KEY: own[0]})
    assert torch.equal(reply["weights"], mix(own[0], msg["weights"], alpha))
    # The proximal term pulls toward g_par(k): a large μ keeps the trained weights closer to it.
    drift = {}
    for mu in (0.0, 5.0):
        sim.client_runtime.algorithm.params = sim.client_runtime.algorithm.params.model_copy(update={"mu": mu})
        reply = sim.client_runtime.update(0, info, msg, {WEIGHTS_KEY: own[0]})
        drift[mu] = float((reply["weights"] - msg["weights"]).norm())
    assert drift[5.0] < drift[0.0]


def test_demlearn_cannot_be_combined_and_weights_clients_uniformly():
    with pytest.raises(ConfigError, match="demlearn replaces"):
        small_config(**{"algorithm.name": "demlearn", "algorithm.plus": {"fedprox": {"mu": 0.1}}})
    with pytest.raises(ConfigError, match="demlearn replaces"):
        small_config(**{"algorithm.name": "fedavg", "algorithm.plus": {"demlearn": {}}})
    with pytest.raises(ConfigError, match="weighting"):
        small_config(**{"algorithm.name": "demlearn", "algorithm.weighting": "samples"})


def test_resume_is_exact(digits, tmp_path):
    assert_resume_is_exact(
        digits,
        tmp_path,
        "demlearn",
        server_keys=(GROUPS_KEY, PARENT_KEY, TREE_NODES_KEY, TREE_CLIENTS_KEY),
        client_keys=(WEIGHTS_KEY,),
        **{"partition.per_client_test": True, **ONE_THREAD},
    )


def test_personal_accuracy_beats_fedavg_on_label_skewed_digits(digits):
    # 10 label-skewed clients (LDA 0.3), all every round, 8 rounds. Measured: DemLearn personal_accuracy
    # 80.1 % (global test accuracy 57.9 %), FedAvg personal_accuracy 53.9 % (test 55.6 %).
    def run(algorithm):
        cfg = config(
            rounds=8,
            clients_per_round=10,
            partition={"scheme": "lda", "num_clients": 10, "alpha": 0.3, "per_client_test": True},
            **{"algorithm.name": algorithm},
        )
        return Simulation(cfg, digits).run()[-1]

    demlearn, fedavg = run("demlearn")["personal_accuracy"], run("fedavg")["personal_accuracy"]
    assert demlearn > 70.0, demlearn
    assert demlearn > fedavg + 10.0, (demlearn, fedavg)
