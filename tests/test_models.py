"""Model zoo: parameter counts from the specs, shapes, the extract/classify split, memory formats,
mixed precision, gradients, and the configuration errors of build_model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fedistill.models  # noqa: F401  (registers the models)
from fedistill.errors import ConfigError
from fedistill.models import ClassifierModel, build_model, model_options
from fedistill.registry import MODELS

ZOO = ["cnn", "digits_cnn", "mlp", "resnet8", "resnet18", "mobilenet_v2"]
SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]


def make(name: str, shape: tuple[int, int, int], num_classes: int = 10, **kwargs) -> ClassifierModel:
    torch.manual_seed(0)
    try:
        return build_model(name, shape, num_classes, **kwargs)
    except ConfigError as err:  # a model that cannot take this input size says so
        pytest.skip(f"{name} does not take {shape}: {err}")


def batch(shape: tuple[int, int, int], n: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, *shape, generator=g)


def test_import_registers_every_model():
    for name in ZOO:
        assert name in MODELS
        assert MODELS.describe(name)


# -- parameter counts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, classes, expected",
    [((1, 28, 28), 10, 1_663_370), ((3, 32, 32), 10, 2_156_490), ((3, 32, 32), 100, 2_202_660)],
)
def test_cnn_parameter_counts_match_fedlmd_spec(shape, classes, expected):
    model = build_model("cnn", shape, classes)
    assert model.num_parameters() == expected
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.feature_dim == 512


def test_cnn_layers_match_spec_table():
    model = build_model("cnn", (3, 32, 32), 10)
    assert model.conv1.weight.numel() + model.conv1.bias.numel() == 2_432
    assert model.conv2.weight.numel() + model.conv2.bias.numel() == 51_264
    assert model.flat_dim == 64 * 8 * 8
    assert build_model("cnn", (1, 28, 28), 10).flat_dim == 64 * 7 * 7
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.Dropout)) for m in model.modules())


@pytest.mark.parametrize("classes, expected", [(10, 11_181_642), (100, 11_227_812)])
def test_resnet18_imagenet_stem_matches_fedftg_counts(classes, expected):
    model = build_model("resnet18", (3, 32, 32), classes, stem="imagenet")
    assert model.num_parameters() == expected
    # 9,600 BN running-stat floats and 20 integer counters (spec/fedftg.md §2).
    floats = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    counters = sum(b.numel() for b in model.buffers() if not b.is_floating_point())
    assert (floats, counters) == (9_600, 20)


def test_other_parameter_counts():
    assert build_model("digits_cnn", (1, 8, 8), 10).num_parameters() == 38_282
    # FedProto's CNNMnist: conv 1->10 5x5 (260), conv 10->20 5x5 (5,020), unpadded so 20 x 4 x 4 = 320 -> fc 50
    # (16,050), head 50 -> 10 (510)
    fedproto = build_model("fedproto_cnn", (1, 28, 28), 10)
    assert fedproto.num_parameters() == 260 + 5_020 + 16_050 + 510 and fedproto.fc1.in_features == 320
    mlp_count = 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10
    assert build_model("mlp", (1, 28, 28), 10).num_parameters() == mlp_count
    assert build_model("resnet8", (3, 32, 32), 10).num_parameters() == 78_042
    # The cifar stem's 3x3 conv (1,728 weights) replaces the 7x7 one (9,408).
    assert build_model("resnet18", (3, 32, 32), 10).num_parameters() == 11_181_642 - 9_408 + 1_728


# -- shapes and the extract/classify split ------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", ZOO)
def test_output_shapes_and_split(name, shape):
    model = make(name, shape, num_classes=7).eval()
    x = batch(shape, 3)
    with torch.no_grad():
        logits = model(x)
        feats = model.extract(x)
        again = model.classify(feats)
    assert logits.shape == (3, 7)
    assert feats.shape == (3, model.feature_dim)
    assert model.classifier.in_features == model.feature_dim
    assert model.classifier.out_features == 7
    torch.testing.assert_close(again, logits)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("shape", [(3, 20, 24), (1, 5, 9), (2, 16, 16)])
def test_cnn_flatten_size_follows_input_shape(shape):
    model = build_model("cnn", shape, 4)
    assert model.flat_dim == 64 * (shape[1] // 4) * (shape[2] // 4)
    assert model(batch(shape)).shape == (2, 4)


def test_cnn_rejects_inputs_too_small_to_pool():
    with pytest.raises(ConfigError, match="at least 4x4"):
        build_model("cnn", (1, 3, 8), 10)


def test_mlp_hidden_option_and_logistic_regression():
    model = build_model("mlp", (3, 32, 32), 10, hidden=[64])
    assert model.feature_dim == 64
    linear = build_model("mlp", (1, 8, 8), 10, hidden=())
    assert linear.feature_dim == 64 and linear.num_parameters() == 650
    assert linear(batch((1, 8, 8))).shape == (2, 10)


def test_resnet18_stems_spatial_behaviour():
    cifar = build_model("resnet18", (3, 32, 32), 10).eval()
    imagenet = build_model("resnet18", (3, 32, 32), 10, stem="imagenet").eval()
    assert not any(isinstance(m, nn.MaxPool2d) for m in cifar.modules())
    assert any(isinstance(m, nn.MaxPool2d) for m in imagenet.modules())
    assert cifar.stem[0].kernel_size == (3, 3) and cifar.stem[0].stride == (1, 1)
    assert imagenet.stem[0].kernel_size == (7, 7) and imagenet.stem[0].stride == (2, 2)
    with torch.no_grad():
        x = batch((3, 32, 32))
        assert cifar.stem(x).shape[-2:] == (32, 32)
        assert imagenet.stem(x).shape[-2:] == (8, 8)  # /2 conv, /2 max-pool
        assert cifar.feature_map(x).shape == (2, 512, 4, 4)
        assert imagenet.feature_map(x).shape == (2, 512, 1, 1)
        y = batch((1, 64, 64))
        assert build_model("resnet18", (1, 64, 64), 10).feature_map(y).shape == (2, 512, 8, 8)
        assert build_model("resnet18", (1, 64, 64), 10, stem="imagenet").feature_map(y).shape == (2, 512, 2, 2)


def test_resnet_init():
    model = build_model("resnet8", (3, 32, 32), 10)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.all(m.weight == 1) and torch.all(m.bias == 0)
    conv = model.stages[2][0].conv2  # 64 -> 64, 3x3: fan_out = 576
    assert conv.bias is None
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2 / 576), rel=0.05)


# -- memory format, mixed precision, gradients --------------------------------------------------------


@pytest.mark.parametrize("name", ZOO)
def test_channels_last(name):
    shape = (3, 32, 32)
    model = make(name, shape).eval()
    x = batch(shape)
    with torch.no_grad():
        expected = model(x)
        model = model.to(memory_format=torch.channels_last)
        out = model(x.contiguous(memory_format=torch.channels_last))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ZOO)
def test_autocast_bfloat16(name):
    # 16x16, two images: where the CPU has no bf16 instructions (AVX2 only) bf16 convolutions are emulated, and
    # ResNet-18 on four 28x28 images took 29 s of the suite there; the dtypes, not the sizes, are under test.
    shape = (1, 16, 16)
    model = make(name, shape)
    x = batch(shape, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        feats = model.extract(x)
    assert out.shape == (2, 10) and feats.shape == (2, model.feature_dim)
    assert torch.isfinite(out.float()).all()
    out.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", ZOO)
def test_backward_reaches_every_parameter(name, shape):
    model = make(name, shape).train()
    x = batch(shape, 4)
    y = torch.tensor([0, 1, 2, 3])
    nn.functional.cross_entropy(model(x), y).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname


def _textbook_extract(model: ClassifierModel, x: torch.Tensor) -> torch.Tensor:
    """The CNNs as the papers write them: conv -> ReLU -> max-pool (the library pools before the ReLU)."""
    F = nn.functional
    if model.__class__.__name__ == "FedAvgNet":
        x = F.max_pool2d(F.relu(model.conv1(x)), 2)
        x = F.max_pool2d(F.relu(model.conv2(x)), 2)
    else:
        x = F.relu(model.conv1(x))
        x = F.max_pool2d(F.relu(model.conv2(x)), 2)
    return F.relu(model.fc1(torch.flatten(x, 1)))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name,shape", [("cnn", (1, 28, 28)), ("digits_cnn", (1, 8, 8))])
def test_relu_after_pooling_is_bitwise_the_textbook_order(name, shape, precision):
    """max(relu(a)) = relu(max(a)), and the gradient reaches the same element either way: the speed-up
    (ReLU on a quarter of the elements) must not change a single bit of outputs or gradients. A negative
    input block checks the case where every element of a pooling window is cut by the ReLU."""
    model = make(name, shape).train().to(memory_format=torch.channels_last)
    x = batch(shape, 8).contiguous(memory_format=torch.channels_last)
    x[0] = -x[0].abs()  # a sample whose windows are largely negative
    y = torch.arange(8) % 10
    grads = {}
    for order, extract in (("library", model.extract), ("textbook", lambda t: _textbook_extract(model, t))):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            features = extract(x)
            logits = model.classify(features)
        nn.functional.cross_entropy(logits.float(), y).backward()
        grads[order] = (features.detach(), logits.detach(), [p.grad.clone() for p in model.parameters()])
    (f1, l1, g1), (f2, l2, g2) = grads["library"], grads["textbook"]
    assert torch.equal(f1, f2) and torch.equal(l1, l2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert (f1 == 0).any() and (f1 > 0).any()  # both sides of the ReLU are exercised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (2, 5, 7, 9), (1, 3, 2, 3), (2, 16, 28, 14), (3, 1, 4, 6), (2, 3, 6, 5)])
def test_inference_pooling_equals_max_pool2d(shape, dtype):
    """Without autograd the CNNs pool with pairwise maxima (two passes over memory-order halves on even sizes,
    strided sub-grids elsewhere): the values of ``F.max_pool2d(x, 2)`` exactly, with odd edges dropped (floor),
    NaN propagated, ties and channels-last kept, and a strided input (neither layout) pooled as well."""
    from fedistill.models.cnn import max_pool_2x2

    x = torch.randn(shape).to(dtype)
    x[0, 0, 0, :2] = 1.5  # a tie inside a window
    x[-1, -1, 1, 1] = float("nan")
    for layout in (torch.contiguous_format, torch.channels_last):
        xl = x.contiguous(memory_format=layout)
        expected = nn.functional.max_pool2d(xl, 2)
        for context in (torch.no_grad, torch.inference_mode):
            with context():
                got = max_pool_2x2(xl)
            assert got.shape == expected.shape and got.dtype == dtype
            assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
            assert got[-1, -1, 0, 0].isnan()
            if layout is torch.channels_last and shape[1] > 1:
                assert got.is_contiguous(memory_format=torch.channels_last)  # the next conv gets its layout
    strided = torch.stack([x, x], dim=-1)[..., 0]  # the same values, in neither memory order
    with torch.no_grad():
        assert torch.equal(max_pool_2x2(strided).nan_to_num(7.0), nn.functional.max_pool2d(x, 2).nan_to_num(7.0))


def test_pooling_with_autograd_keeps_the_native_tie_rule():
    """With autograd the native kernel pools: the gradient of a tied window goes whole to its first maximum
    (``torch.maximum`` would split it), which the bitwise training results rely on."""
    from fedistill.models.cnn import max_pool_2x2

    x = torch.zeros(1, 1, 2, 2, requires_grad=True)
    max_pool_2x2(x).sum().backward()
    assert x.grad.flatten().tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("name,shape", [("cnn", (1, 28, 28)), ("digits_cnn", (1, 8, 8))])
def test_cnn_inference_forward_equals_the_training_forward(name, shape):
    """The evaluation/teacher forward (no autograd) gives the logits of the forward that trains, bit for bit."""
    model = make(name, shape).eval().to(memory_format=torch.channels_last)
    x = batch(shape, 6).contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trained = model(x)
        with torch.inference_mode():
            inferred = model(x)
    assert trained.requires_grad and not inferred.requires_grad
    assert torch.equal(trained.detach(), inferred)


# -- configuration errors -----------------------------------------------------------------------------


def test_unknown_model_name_lists_choices():
    with pytest.raises(ConfigError, match="model.name") as info:
        build_model("resnet1000", (3, 32, 32), 10)
    for name in ZOO:
        assert name in str(info.value)


def test_unknown_kwarg_names_key_and_accepted_options():
    with pytest.raises(ConfigError) as info:
        build_model("resnet18", (3, 32, 32), 10, stme="imagenet")
    message = str(info.value)
    assert "'stme'" in message and "stem" in message and "width" in message
    with pytest.raises(ConfigError, match="no option 'depth'; accepted options: hidden"):
        build_model("mlp", (1, 28, 28), 10, depth=3)
    with pytest.raises(ConfigError, match="num_classes"):
        build_model("cnn", (1, 28, 28), 10, num_classes=5)


@pytest.mark.parametrize(
    "name, shape, classes, kwargs",
    [
        ("resnet18", (3, 32, 32), 10, {"stem": "tiny"}),
        ("cnn", (3, 32), 10, {}),
        ("cnn", (3, 0, 32), 10, {}),
        ("cnn", (3, 32.5, 32), 10, {}),
        ("cnn", (3, 32, 32), 0, {}),
        ("mlp", (1, 8, 8), 10, {"hidden": (200, -1)}),
        ("cnn", (1, 28, 28), 10, {"channels": (32,)}),
        ("resnet8", (3, 32, 32), 10, {"width": 0}),
    ],
)
def test_bad_values_are_config_errors(name, shape, classes, kwargs):
    with pytest.raises(ConfigError):
        build_model(name, shape, classes, **kwargs)


def test_model_options_lists_defaults():
    assert model_options("resnet18") == {"stem": "cifar", "width": 64, "projection_dim": None}
    assert model_options("mlp") == {"hidden": (200, 200), "projection_dim": None}
    assert model_options("cnn") == {"channels": (32, 64), "hidden": 512, "projection_dim": None}


# -- projection_dim: MOON's projection head (spec/moon.md §3, ambiguity 1) ---------------------------------


@pytest.mark.parametrize("name", ZOO)
def test_projection_head_sits_between_features_and_classifier(name):
    shape = (3, 32, 32)
    plain = make(name, shape, num_classes=7)
    model = make(name, shape, num_classes=7, projection_dim=24).train()
    d = plain.feature_dim
    assert model.backbone_dim == d and model.feature_dim == 24
    # The card's head: Linear(d, d) -> ReLU -> Linear(d, out); the classifier reads the projection.
    assert [type(m) for m in model.projection] == [nn.Linear, nn.ReLU, nn.Linear]
    assert (model.projection[0].in_features, model.projection[0].out_features) == (d, d)
    assert (model.projection[2].in_features, model.projection[2].out_features) == (d, 24)
    assert (model.classifier.in_features, model.classifier.out_features) == (24, 7)
    # The body's own classifier is gone: parameters = body without it + head + new classifier.
    expected = plain.num_parameters() - (d * 7 + 7) + (d * d + d) + (d * 24 + 24) + (24 * 7 + 7)
    assert model.num_parameters() == expected
    x = batch(shape, 3)
    feats = model.extract(x)
    l1, l2 = model.projection[0], model.projection[2]
    by_hand = torch.relu(model.body.extract(x) @ l1.weight.T + l1.bias) @ l2.weight.T + l2.bias
    torch.testing.assert_close(feats, by_hand)
    torch.testing.assert_close(model(x), feats @ model.classifier.weight.T + model.classifier.bias)
    nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2])).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname


def test_projection_head_builds_identically_from_one_seed():
    from fedistill.models.flat import get_flat

    a, b = make("digits_cnn", (1, 8, 8), projection_dim=256), make("digits_cnn", (1, 8, 8), projection_dim=256)
    assert torch.equal(get_flat(a), get_flat(b))


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "256", [256]])
def test_projection_dim_must_be_a_positive_int(bad):
    with pytest.raises(ConfigError, match="projection_dim"):
        build_model("digits_cnn", (1, 8, 8), 10, projection_dim=bad)


# -- MobileNetV2 (FedLMD Table 4's "MobileNet") ----------------------------------------------------------
def test_mobilenet_v2_has_the_published_parameter_count():
    # torchvision documents 3,504,872 parameters for MobileNetV2 with 1000 classes; the strides of our
    # CIFAR stem do not change the count, and 10 classes remove 1280·990 + 990 classifier weights.
    assert build_model("mobilenet_v2", (3, 224, 224), 1000, stem="imagenet").num_parameters() == 3_504_872
    assert build_model("mobilenet_v2", (3, 32, 32), 10).num_parameters() == 3_504_872 - 1280 * 990 - 990


def test_mobilenet_v2_cifar_stem_keeps_a_4x4_map_and_residuals_where_shapes_allow():
    from fedistill.models.mobilenet import InvertedResidual

    model = make("mobilenet_v2", (3, 32, 32))
    x = batch((3, 32, 32))
    assert model.head(model.blocks(model.stem(x))).shape == (2, 1280, 4, 4)
    imagenet = make("mobilenet_v2", (3, 32, 32), stem="imagenet")
    assert imagenet.head(imagenet.blocks(imagenet.stem(x))).shape == (2, 1280, 1, 1)
    blocks = [b for b in model.blocks if isinstance(b, InvertedResidual)]
    assert len(blocks) == 17 and sum(b.residual for b in blocks) == 10  # n−1 repeats per stage: 0+1+2+3+2+2+0


@pytest.mark.parametrize("kwargs", [{"width": 0}, {"width": "wide"}, {"stem": "tiny"}])
def test_mobilenet_v2_rejects_bad_options(kwargs):
    with pytest.raises(ConfigError, match="mobilenet_v2"):
        build_model("mobilenet_v2", (3, 32, 32), 10, **kwargs)
