"""DaFKD's models (spec/dafkd.md "Architectures"): the ResNet-11 classifier/discriminator (``resnet11``) and
the unconditional DCGAN generator (``dcgan``): parameter counts from the card, shapes, the extract/classify
split and the generator's size checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fedistill.models  # noqa: F401  (registers the models and generators)
from fedistill.errors import ConfigError
from fedistill.models.generators import DCGANGenerator, build_generator
from fedistill.models.registry import build_model
from fedistill.models.resnet import Bottleneck
from fedistill.registry import GENERATORS, MODELS

SHAPES = [(1, 28, 28), (3, 32, 32), (1, 8, 8)]


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def bn_buffer_floats(module: nn.Module) -> int:
    """BatchNorm running means and variances (num_batches_tracked excluded)."""
    return sum(
        b.numel() for name, b in module.named_buffers() if name.endswith(("running_mean", "running_var"))
    )


def noise_batch(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(3))


def test_registered():
    assert "resnet11" in MODELS and MODELS.describe("resnet11")
    assert "dcgan" in GENERATORS and GENERATORS.describe("dcgan")
    assert "dcgan" not in MODELS


# -- ResNet-11 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels, trunk", [(3, 817_872), (1, 817_584)])
def test_resnet11_parameter_counts(channels, trunk):
    model = build_model("resnet11", (channels, 32, 32), 10)
    head = n_params(model.classifier)
    assert head == 2_570
    assert model.num_parameters() - head == trunk
    assert bn_buffer_floats(model) == 3_616


def test_resnet11_structure():
    model = build_model("resnet11", (3, 32, 32), 10)
    assert model.feature_dim == 256
    assert isinstance(model.classifier, nn.Linear)
    assert (model.classifier.in_features, model.classifier.out_features) == (256, 10)
    assert len(model.stages) == 3
    widths, outs, strides = [], [], []
    for stage in model.stages:
        assert len(stage) == 2
        for blk in stage:
            assert isinstance(blk, Bottleneck)
            for conv in (blk.conv1, blk.conv2, blk.conv3):
                assert conv.kernel_size == (3, 3) and conv.padding == (1, 1) and conv.bias is None
            assert blk.conv1.stride == (1, 1) and blk.conv3.stride == (1, 1)
        first = stage[0]
        widths.append(first.conv1.out_channels)
        outs.append(first.conv3.out_channels)
        strides.append(first.conv2.stride[0])
        # The first block of every stage changes the shape, so it projects with a 1x1 conv + BN.
        assert isinstance(first.shortcut, nn.Sequential)
        assert first.shortcut[0].kernel_size == (1, 1)
        assert isinstance(stage[1].shortcut, nn.Identity)
    assert widths == [16, 32, 64] and outs == [64, 128, 256] and strides == [1, 2, 2]


def test_resnet11_init():
    torch.manual_seed(0)
    model = build_model("resnet11", (3, 32, 32), 10)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.all(m.weight == 1) and torch.all(m.bias == 0)
    # Kaiming-normal, fan_out, ReLU gain: std = sqrt(2 / (out_channels * k * k)).
    conv = model.stages[2][1].conv1  # 256 -> 64, 147,456 weights
    expected = (2.0 / (64 * 9)) ** 0.5
    assert conv.weight.std().item() == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("shape", SHAPES)
def test_resnet11_shapes_and_split(shape):
    torch.manual_seed(0)
    model = build_model("resnet11", shape, 10).eval()
    x = noise_batch((2, *shape))
    with torch.no_grad():
        feats = model.extract(x)
        logits = model(x)
    assert feats.shape == (2, 256)
    assert logits.shape == (2, 10)
    torch.testing.assert_close(logits, model.classify(feats))


def test_resnet11_one_output_discriminator():
    model = build_model("resnet11", (1, 28, 28), 1).eval()
    with torch.no_grad():
        out = model(noise_batch((2, 1, 28, 28)))
    assert out.shape == (2, 1)
    assert n_params(model.classifier) == 257


def test_resnet11_width_option():
    model = build_model("resnet11", (3, 32, 32), 10, width=8)
    assert model.feature_dim == 128
    with pytest.raises(ConfigError):
        build_model("resnet11", (3, 32, 32), 10, width=0)


# -- DCGAN generator --------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels, count", [(3, 1_068_931), (1, 1_066_881)])
def test_dcgan_parameter_counts(channels, count):
    gen = build_generator("dcgan", (channels, 32, 32), 10)
    assert isinstance(gen, DCGANGenerator)
    assert n_params(gen) == count
    assert bn_buffer_floats(gen) == 896
    assert gen.noise_dim == 100


def test_dcgan_card_layers_32():
    gen = build_generator("dcgan", (3, 32, 32), 10)
    convs = [m for m in gen.modules() if isinstance(m, nn.ConvTranspose2d)]
    assert [(c.in_channels, c.out_channels) for c in convs] == [(100, 256), (256, 128), (128, 64), (64, 3)]
    assert [c.kernel_size[0] for c in convs] == [4, 4, 4, 4]
    assert [c.stride[0] for c in convs] == [1, 2, 2, 2]
    assert [c.padding[0] for c in convs] == [0, 1, 1, 1]
    assert [c.bias is not None for c in convs] == [False, False, False, True]


@pytest.mark.parametrize("shape", SHAPES)
def test_dcgan_shapes(shape):
    torch.manual_seed(0)
    gen = build_generator("dcgan", shape, 10, noise_dim=16, ngf=8)
    assert sum(isinstance(m, nn.ConvTranspose2d) for m in gen.modules()) == 4
    z = noise_batch((3, 16))
    out = gen(z)  # train mode (batch statistics), noise only
    assert out.shape == (3, *shape)
    assert out.min() >= -1 and out.max() <= 1
    gen.eval()
    with torch.no_grad():
        assert gen(z).shape == (3, *shape)


@pytest.mark.parametrize("shape", [(3, 30, 30), (1, 10, 10), (3, 32, 28), (1, 6, 6)])
def test_dcgan_rejects_unsupported_sizes(shape):
    with pytest.raises(ConfigError, match="dcgan"):
        build_generator("dcgan", shape, 10)


def test_dcgan_init_is_seeded_and_follows_card():
    torch.manual_seed(5)
    a = build_generator("dcgan", (3, 32, 32), 10)
    torch.manual_seed(5)
    b = build_generator("dcgan", (3, 32, 32), 10)
    for pa, pb in zip(a.state_dict().values(), b.state_dict().values()):
        torch.testing.assert_close(pa, pb)
    bn = [m for m in a.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bn) == 3
    for m in bn:
        assert torch.all(m.bias == 0)
        assert abs(m.weight.mean().item() - 1.0) < 0.01 and 0.01 < m.weight.std().item() < 0.03
    # Xavier-normal on the first ConvTranspose2d (weight (in, out, k, k) = (100, 256, 4, 4)).
    w = next(m for m in a.modules() if isinstance(m, nn.ConvTranspose2d)).weight
    fan_in, fan_out = w.shape[1] * 16, w.shape[0] * 16
    assert w.std().item() == pytest.approx((2.0 / (fan_in + fan_out)) ** 0.5, rel=0.02)
