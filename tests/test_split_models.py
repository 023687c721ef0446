"""FedICT's split client/server models (fedistill.models.split; spec/experiments-fedict.md §4): parameter
counts of the card's "ours" column, the extractor/predictor split, feature shapes, servers on features."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fedistill.models  # noqa: F401  (registers the models)
from fedistill.errors import ConfigError
from fedistill.models import ClassifierModel, build_model, model_options
from fedistill.models.mlp import MLP
from fedistill.models.split import (
    IMAGE_CLIENT_MODELS,
    MLP_CLIENT_MODELS,
    FDResNetServer,
    SplitClassifier,
    TorchvisionBottleneck,
)
from fedistill.registry import MODELS

SERVERS = ("fd_server_resnet56", "fd_server_mlp")
ALL = IMAGE_CLIENT_MODELS + MLP_CLIENT_MODELS + SERVERS
IMAGE_COUNTS = {
    "fd_resnet2": 634, "fd_resnet4": 5_306, "fd_resnet8": 10_586, "fd_resnet10": 9_978, "fd_resnet12": 9_978
}
MLP_HIDDEN = {"fd_mlp16": 16, "fd_mlp32": 32, "fd_mlp64": 64}
MLP_OFFSET_C5 = {"fd_mlp16": 322, "fd_mlp32": 626, "fd_mlp64": 1_234}  # card: 13d + offset for C = 5
IMAGE_SHAPES = [(1, 28, 28), (3, 32, 32)]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny inputs on one thread: the tests must not compete with other work on the machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make(name: str, shape, num_classes: int = 10, **kwargs) -> ClassifierModel:
    torch.manual_seed(0)
    return build_model(name, shape, num_classes, **kwargs)


def batch(shape, n: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, *shape, generator=g)


def count(params) -> int:
    return sum(p.numel() for p in params)


# -- registration --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_every_name_is_registered_and_builds_through_build_model(name):
    assert name in MODELS and MODELS.describe(name)
    shape = {"fd_server_resnet56": (16, 8, 8), "fd_server_mlp": (13, 1, 1)}.get(name, (3, 8, 8))
    model = build_model(name, shape, 4, **({"blocks_per_stage": 1} if name == "fd_server_resnet56" else {}))
    assert isinstance(model, ClassifierModel)
    assert isinstance(model, SplitClassifier) == (name not in SERVERS)
    assert model.input_shape == shape


def test_options_are_only_blocks_per_stage():
    assert model_options("fd_server_resnet56") == {"blocks_per_stage": 6, "projection_dim": None}
    for name in IMAGE_CLIENT_MODELS + MLP_CLIENT_MODELS + ("fd_server_mlp",):
        assert model_options(name) == {"projection_dim": None}
    with pytest.raises(ConfigError, match="no option 'blocks_per_stage'"):
        build_model("fd_resnet8", (3, 32, 32), 10, blocks_per_stage=2)


# -- parameter counts (card's "ours" column) --------------------------------------------------------------


@pytest.mark.parametrize("name", IMAGE_CLIENT_MODELS)
def test_image_client_parameter_counts(name):
    model = make(name, (3, 32, 32), 10)
    assert model.num_parameters() == IMAGE_COUNTS[name]


def test_server_resnet56_parameter_count():
    model = make("fd_server_resnet56", (16, 32, 32), 10)
    assert model.num_parameters() == 590_858
    assert model.feature_dim == 256 and model.classifier.in_features == 256
    # No stem: the first convolution reads the 16 feature channels.
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert first.in_channels == 16 and first.kernel_size == (1, 1)
    assert sum(isinstance(m, TorchvisionBottleneck) for m in model.modules()) == 18


@pytest.mark.parametrize("d", [7, 28, 784])
@pytest.mark.parametrize("name", MLP_CLIENT_MODELS)
def test_mlp_client_parameter_counts(name, d):
    h = MLP_HIDDEN[name]
    model = make(name, (d, 1, 1), 5)
    assert model.num_parameters() == 13 * d + MLP_OFFSET_C5[name]
    assert model.num_parameters() == 13 * d + 13 + 13 * h + h + h * 5 + 5
    # Any (C, H, W) input is flattened: d = C*H*W.
    assert make(name, (1, 28, 28), 5).num_parameters() == 13 * 784 + MLP_OFFSET_C5[name]
    assert make(name, (3, 4, 4), 7).num_parameters() == 13 * 48 + 13 + 13 * h + h + h * 7 + 7


def test_server_mlp_parameter_count():
    assert make("fd_server_mlp", (13, 1, 1), 5).num_parameters() == 2_053
    assert make("fd_server_mlp", (13,), 5).num_parameters() == 2_053


@pytest.mark.parametrize("in_ch", [1, 3])
@pytest.mark.parametrize("name", IMAGE_CLIENT_MODELS)
def test_image_extractor_parameter_count_and_partition(name, in_ch):
    model = make(name, (in_ch, 28, 28), 10)
    assert count(model.extractor_parameters()) == 16 * in_ch * 9 + 32
    assert count(model.extractor.parameters()) == 16 * in_ch * 9 + 32
    ext = {id(p) for p in model.extractor_parameters()}
    pred = {id(p) for p in model.predictor_parameters()}
    assert not ext & pred
    assert ext | pred == {id(p) for p in model.parameters()}
    assert count(model.predictor_parameters()) == model.num_parameters() - (16 * in_ch * 9 + 32)
    conv = model.extractor[0]
    assert isinstance(conv, nn.Conv2d) and conv.bias is None and conv.stride == (1, 1) and conv.padding == (1, 1)


@pytest.mark.parametrize("name", MLP_CLIENT_MODELS)
def test_mlp_extractor_partition(name):
    model = make(name, (10, 1, 1), 5)
    assert count(model.extractor_parameters()) == 13 * 10 + 13
    assert count(model.extractor_parameters()) + count(model.predictor_parameters()) == model.num_parameters()
    assert model.predictor_modules()[-1] is model.classifier


def test_a4_and_a5_share_the_layout_without_unused_modules():
    a4, a5 = make("fd_resnet10", (3, 32, 32)), make("fd_resnet12", (3, 32, 32))
    assert list(a4.state_dict()) == list(a5.state_dict())
    assert all(p.grad is None for p in a4.parameters())
    a4(batch((3, 32, 32))).sum().backward()
    assert all(p.grad is not None for p in a4.parameters())  # every built parameter is used


def test_resnet8_bottleneck_projection_only_on_the_first_block():
    model = make("fd_resnet8", (3, 32, 32))
    blocks = [m for m in model.modules() if isinstance(m, TorchvisionBottleneck)]
    assert len(blocks) == 2
    assert isinstance(blocks[0].shortcut, nn.Sequential) and isinstance(blocks[1].shortcut, nn.Identity)
    assert [blocks[0].conv1.kernel_size, blocks[0].conv2.kernel_size, blocks[0].conv3.kernel_size] == [
        (1, 1),
        (3, 3),
        (1, 1),
    ]
    assert model.feature_dim == 64


def test_initialisation():
    model = make("fd_server_resnet56", (16, 8, 8), 10, blocks_per_stage=1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.equal(m.weight, torch.ones_like(m.weight)) and torch.equal(m.bias, torch.zeros_like(m.bias))
    assert count(model.buffers()) > 0  # running statistics are buffers, not parameters
    assert model.num_parameters() == count(model.parameters())


# -- the split -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", IMAGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", IMAGE_CLIENT_MODELS)
def test_image_split_is_exact_and_shapes(name, shape):
    model = make(name, shape, num_classes=7).eval()
    x = batch(shape, 2)
    with torch.no_grad():
        logits = model(x)
        h = model.split_features(x)
        h_before = h.clone()
        again = model.split_predict(h)
        feats = model.extract(x)
    assert model.feature_shape == (16, shape[1], shape[2])
    assert h.shape == (2, *model.feature_shape)
    assert (h >= 0).all()  # after the ReLU
    assert torch.equal(h, h_before)  # the predictor does not modify the uploaded features in place
    assert logits.shape == (2, 7)
    assert torch.equal(again, logits)
    assert feats.shape == (2, model.feature_dim)
    assert torch.equal(model.embed(h), feats)
    assert torch.equal(model.classify(feats), logits)
    assert model.classifier.in_features == model.feature_dim and model.classifier.out_features == 7


@pytest.mark.parametrize("name", MLP_CLIENT_MODELS)
def test_mlp_split_is_exact_and_shapes(name):
    model = make(name, (10, 1, 1), num_classes=5).eval()
    with torch.no_grad():
        for x in (batch((10, 1, 1), 3), batch((10,), 3)):  # tabular rows as (B, d, 1, 1) or (B, d)
            logits = model(x)
            h = model.split_features(x)
            assert model.feature_shape == (13,)
            assert h.shape == (3, 13)
            assert torch.equal(model.split_predict(h), logits)
            assert torch.equal(model.split_predict(h.view(3, 13, 1, 1)), logits)
            assert model.extract(x).shape == (3, MLP_HIDDEN[name])
            assert logits.shape == (3, 5)
    image = make(name, (1, 28, 28), 5).eval()
    assert image.split_features(batch((1, 28, 28))).shape == (2, 13)


@pytest.mark.parametrize("shape", IMAGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_server_resnet_takes_client_features(shape):
    client = make("fd_resnet4", shape, 10).eval()
    server = make("fd_server_resnet56", client.feature_shape, 10, blocks_per_stage=1).eval()
    assert server.input_shape == (16, shape[1], shape[2])
    with torch.no_grad():
        h = client.split_features(batch(shape, 2))
        out = server(h)
        assert out.shape == (2, 10)
        assert torch.equal(server.classify(server.extract(h)), out)
        assert server.extract(h).shape == (2, 256)
        assert server.feature_map(h).shape == (2, 256, -(-shape[1] // 4), -(-shape[2] // 4))
    assert torch.isfinite(out).all()


def test_full_size_server_forward():
    server = make("fd_server_resnet56", (16, 28, 28), 10).eval()
    with torch.no_grad():
        assert server(batch((16, 28, 28), 2)).shape == (2, 10)


def test_blocks_per_stage_builds_a_smaller_server():
    full = make("fd_server_resnet56", (16, 8, 8), 10)
    small = make("fd_server_resnet56", (16, 8, 8), 10, blocks_per_stage=1)
    two = make("fd_server_resnet56", (16, 8, 8), 10, blocks_per_stage=2)
    assert small.num_parameters() < two.num_parameters() < full.num_parameters()
    assert isinstance(small, FDResNetServer) and small.blocks_per_stage == 1
    assert sum(isinstance(m, TorchvisionBottleneck) for m in small.modules()) == 3
    assert small.feature_dim == 256
    small.train()
    out = small(batch((16, 8, 8), 3))
    out.sum().backward()
    assert out.shape == (3, 10)
    for bad in (0, -1, 1.5, True, "6"):
        with pytest.raises(ConfigError, match="blocks_per_stage"):
            build_model("fd_server_resnet56", (16, 8, 8), 10, blocks_per_stage=bad)


def test_server_mlp_takes_flat_or_3d_features():
    client = make("fd_mlp32", (20, 1, 1), 5).eval()
    server = make("fd_server_mlp", client.feature_shape, 5).eval()
    assert isinstance(server, MLP)
    assert server.input_shape == (13, 1, 1)
    assert server.feature_dim == 38
    with torch.no_grad():
        h = client.split_features(batch((20, 1, 1), 4))
        flat = server(h)
        assert flat.shape == (4, 5)
        assert torch.equal(server(h.view(4, 13, 1, 1)), flat)


def test_training_mode_split_matches_forward_and_backpropagates():
    model = make("fd_resnet8", (1, 28, 28), 10).train()
    x = batch((1, 28, 28), 3)
    torch.manual_seed(0)
    a = model(x)
    b = model.split_predict(model.split_features(x))
    torch.testing.assert_close(a, b)
    # FD: the predictor trained on detached features leaves the extractor without gradients.
    model.zero_grad(set_to_none=True)
    model.split_predict(model.split_features(x).detach()).sum().backward()
    assert all(p.grad is None for p in model.extractor_parameters())
    assert all(p.grad is not None for p in model.predictor_parameters())


def test_bad_input_shapes_are_config_errors():
    with pytest.raises(ConfigError, match="input_shape"):
        build_model("fd_resnet2", (32, 32), 10)
    with pytest.raises(ConfigError, match="input_shape"):
        build_model("fd_server_mlp", (0,), 5)
