"""Model groups (models/group.py): every member on 1/3-channel 28x28/32x32 inputs ends in one feature dimension and
a linear head, trains, differs from the others; HtFLlib's reduction to the dimension; the group assignment
(client k gets member k mod M) and its configuration errors; the documented counts."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedistill.algorithms  # noqa: F401  (registers fedavg)
import fedistill.models  # noqa: F401  (registers the models and groups)
from fedistill.config import build_config
from fedistill.engine.architectures import check_architectures, client_architectures
from fedistill.engine.run_setup import build_model_for
from fedistill.errors import ConfigError
from fedistill.models import build_model, group_members
from fedistill.models.group import pool_to_dim
from fedistill.registry import ALGORITHMS, MODEL_GROUPS, MODELS

GROUPS = MODEL_GROUPS.names()
MEMBERS = sorted({name for group in GROUPS for name in group_members(group)})
SHAPES = [(1, 28, 28), (3, 32, 32), (1, 32, 32), (3, 28, 28)]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "guides" / "model-groups.md"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread (small batches; a second thread only waits on a shared machine), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def built(name: str, shape: tuple[int, int, int]) -> nn.Module:
    """Member ``name`` for ``shape`` and 10 classes, seeded; 1x28x28 builds are shared between the tests."""
    return _built_28(name) if shape == (1, 28, 28) else _build(name, shape)


def parameter_count(name: str, shape: tuple[int, int, int]) -> int:
    """Parameters of member ``name`` for ``shape`` and 10 classes, counted on the meta device (no initialisation)."""
    with torch.device("meta"):
        return build_model(name, shape, 10).num_parameters()


def _build(name: str, shape: tuple[int, int, int]) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, shape, 10)


@functools.lru_cache(maxsize=None)
def _built_28(name: str) -> nn.Module:
    return _build(name, (1, 28, 28))


def batch(shape: tuple[int, int, int], n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, *shape, generator=g), torch.arange(n) % 10


def test_the_groups_list_registered_distinct_members_in_htfllibs_order():
    assert set(GROUPS) >= {"htfe2", "htfe3", "resnets5", "mixed8", "mixed4"}
    for group in GROUPS:
        members = group_members(group)
        assert 2 <= len(members) <= 8 and len(set(members)) == len(members)
        assert all(name in MODELS for name in members)
    # HtFLlib's groups as its main.py lists them, in its order (client k gets models[k % M])
    assert group_members("htfe2") == ("ht_fedavgcnn", "ht_resnet18")
    assert group_members("htfe3") == ("ht_resnet10", "ht_resnet18", "ht_resnet34")
    assert len(group_members("mixed8")) == 8 and set(group_members("mixed4")) < set(group_members("mixed8"))


# ResNet-18 and -34 are built with ResNet-10's blocks and stem: one shape each (the suite's time, issue 62 item 9).
MEMBER_SHAPES = [
    (name, shape) for name in MEMBERS for shape in SHAPES
    if shape == (1, 28, 28) or name not in ("ht_resnet18", "ht_resnet34")
]  # fmt: skip


@pytest.mark.parametrize(("name", "shape"), MEMBER_SHAPES, ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_every_member_ends_in_the_common_dimension_and_a_linear_head(name, shape):
    model = built(name, shape).eval()
    x, _ = batch(shape)
    with torch.no_grad():
        features = model.extract(x)
        logits = model(x)
        torch.testing.assert_close(logits, model.classify(features), rtol=0, atol=0)  # forward = classify(extract)
    assert features.shape == (2, 512) and model.feature_dim == 512
    assert isinstance(model.classifier, nn.Linear)
    assert (model.classifier.in_features, model.classifier.out_features) == (512, 10)
    assert logits.shape == (2, 10) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", MEMBERS)
def test_feature_dim_is_an_option_of_every_member(name):
    model = build_model(name, (1, 28, 28), 10, feature_dim=96).eval()
    with torch.no_grad():
        assert model.extract(batch((1, 28, 28))[0]).shape == (2, 96)
    assert model.classifier.in_features == 96
    with pytest.raises(ConfigError, match="feature_dim"):
        build_model(name, (1, 28, 28), 10, feature_dim=0)


@pytest.mark.parametrize("name", MEMBERS)
def test_one_sgd_step_lowers_the_loss_on_a_fixed_batch(name):
    model = copy.deepcopy(built(name, (1, 28, 28))).train()  # a copy: the shared build stays as built
    x, y = batch((1, 28, 28), 4)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.003)

    def loss() -> torch.Tensor:
        torch.manual_seed(5)  # the same dropout mask (ht_mobilenet_v2) in both forwards
        return F.cross_entropy(model(x), y)

    before = loss()
    before.backward()
    assert all(p.grad is not None for p in model.parameters())  # the head and every layer of the extractor
    optimiser.step()
    with torch.no_grad():
        after = loss()
    assert after < before


def test_members_are_different_architectures():
    counts = {name: built(name, (1, 28, 28)).num_parameters() for name in MEMBERS}
    assert len(set(counts.values())) == len(counts), counts


@pytest.mark.parametrize("name", ["ht_fedavgcnn", "ht_resnet8", "ht_mobilenet_v2", "ht_cnn4", "ht_mlp"])
def test_a_member_is_built_identically_from_one_seed(name):
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return build_model(name, (1, 28, 28), 10)

    a, b, c = make(3), make(3), make(4)
    for (key, ta), tb, tc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(ta, tb), key
    assert any(not torch.equal(ta, tc) for ta, tc in zip(a.parameters(), c.parameters()))


# -- HtFLlib's reduction and architectures --------------------------------------------------------------------


@pytest.mark.parametrize("width", [64, 128, 256, 512, 1280])
def test_pool_to_dim_is_htfllibs_adaptive_average_pool(width):
    features = torch.randn(3, width)
    expected = nn.AdaptiveAvgPool1d(512)(features)  # BaseHeadSplit's module, applied to the (batch, width) feature
    torch.testing.assert_close(pool_to_dim(features, 512), expected, rtol=0, atol=0)
    if width == 64:  # fewer entries than the dimension: each one repeated
        torch.testing.assert_close(expected, features.repeat_interleave(8, dim=1), rtol=0, atol=0)


def test_the_htfllib_members_have_its_counts_and_own_widths():
    # torchvision's resnet18(num_classes=10): 11,181,642 parameters; the group's head has the same shape.
    assert parameter_count("ht_resnet18", (3, 32, 32)) == 11_181_642
    # torchvision's mobilenet_v2(num_classes=10) has 2,236,682: its Linear(1280, 10) becomes the pool + Linear(512, 10).
    assert parameter_count("ht_mobilenet_v2", (3, 32, 32)) == 2_236_682 - (1280 * 10 + 10) + (512 * 10 + 10)
    # FedAvgCNN's flatten size is HtFLlib's dim: 1024 for 28x28, 1600 for 32x32 ("for 32x32 img")
    assert built("ht_fedavgcnn", (1, 28, 28)).body.flat_dim == 1024
    assert built("ht_fedavgcnn", (3, 32, 32)).body.flat_dim == 1600
    native = {name: built(name, (1, 28, 28)).native_dim for name in MEMBERS if name.startswith("ht_resnet")}
    assert native == {"ht_resnet4": 64, "ht_resnet6": 128, "ht_resnet8": 256, "ht_resnet10": 512, "ht_resnet18": 512, "ht_resnet34": 512}
    assert built("ht_mobilenet_v2", (1, 28, 28)).native_dim == 1280
    assert isinstance(built("ht_mobilenet_v2", (1, 28, 28)).dropout, nn.Dropout)
    assert isinstance(build_model("ht_mobilenet_v2", (1, 28, 28), 10, dropout=0).dropout, nn.Identity)


# -- assignment and configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("group", GROUPS)
def test_client_k_gets_member_k_mod_m(group):
    members = group_members(group)
    cfg = build_config({"model": {"group": group}, "partition": {"num_clients": 11}})
    assert client_architectures(cfg, 11) == [members[k % len(members)] for k in range(11)]
    assert cfg.model.client_model_names() == list(members)
    # the same cycle as model.clients naming the members
    listed = build_config({"model": {"clients": list(members)}, "partition": {"num_clients": 11}})
    assert client_architectures(listed, 11) == client_architectures(cfg, 11)


def test_group_kwargs_reach_the_members_that_take_them():
    cfg = build_config({"model": {"group": "mixed8", "group_kwargs": {"feature_dim": 64, "dropout": 0.0}}})
    dataset = SimpleNamespace(input_shape=(1, 28, 28), num_classes=10)
    for name in ("ht_resnet4", "ht_mobilenet_v2", "ht_mlp"):
        model = build_model_for(cfg, dataset, (0,), name)
        assert model.feature_dim == 64
    assert isinstance(build_model_for(cfg, dataset, (0,), "ht_mobilenet_v2").dropout, nn.Identity)
    a, b = (build_model_for(cfg, dataset, (0,), "ht_cnn4") for _ in range(2))  # the run's seeded stream
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_bad_group_configurations_are_refused_in_one_line():
    cases = [
        ({"group": "htfe8x"}, "model.group: unknown model group 'htfe8x'; choose one of: " + ", ".join(GROUPS)),
        ({"group": "mixed8", "clients": ["ht_mlp"]}, "model.group and model.clients: set one of them, not both"),
        ({"group": "mixed8", "client_mix": {"ht_mlp": 1.0}}, "model.group and model.client_mix: set one of them, not both"),
        ({"group_kwargs": {"feature_dim": 64}}, "model.group_kwargs: set model.group too"),
        ({"group": "mixed4", "group_kwargs": {"feature_dims": 64}}, "model.group_kwargs.feature_dims: no member of group 'mixed4'"),
    ]
    for model, message in cases:
        with pytest.raises(ConfigError) as err:
            build_config({"model": model})
        assert message in str(err.value) and "\n" not in str(err.value)


def test_a_weight_averaging_method_refuses_a_group_naming_the_key():
    cfg = build_config({"model": {"group": "mixed4"}, "partition": {"num_clients": 8}})
    with pytest.raises(ConfigError, match=r"^model\.group: fedavg averages weights, so every client needs the same"):
        check_architectures(cfg, ALGORITHMS.get("fedavg"), 8)


# -- the documentation ---------------------------------------------------------------------------------------


def test_the_guide_lists_every_member_with_its_counts_and_flops():
    from fedistill.engine.flops import counted_flops

    rows = {}
    for line in DOCS.read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `(ht_\w+)` \|.*\| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \|$", line)
        if match:
            rows[match[1]] = (int(match[2].replace(",", "")), int(match[3].replace(",", "")), float(match[4]))
    assert sorted(rows) == MEMBERS
    for name, (small, large, mflop) in rows.items():
        model = built(name, (1, 28, 28)).eval()
        assert (model.num_parameters(), parameter_count(name, (3, 32, 32))) == (small, large), name
        with torch.no_grad():
            flops = counted_flops(lambda: model(torch.zeros(1, 1, 28, 28)))
        assert round(flops / 1e6, 2) == mflop, name
    for group in GROUPS:  # the groups table names each group with its members in order
        members = ", ".join(f"`{name}`" for name in group_members(group))
        assert f"| `{group}` | {members} |" in DOCS.read_text(encoding="utf-8")
