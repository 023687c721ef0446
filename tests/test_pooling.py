"""The global average pooling with a layout-keeping gradient and the in-place residual ReLU (models/pooling.py,
models/resnet.relu_of_sum): the same numbers as the plain expressions, only the memory layout and the buffers
change (issue 41, item 2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fedistill.models.pooling import global_average_pool
from fedistill.models.registry import build_model
from fedistill.models.resnet import relu_of_sum

LAYOUTS = [torch.channels_last, torch.contiguous_format]
DTYPES = [torch.float32, torch.bfloat16]


def _native(x: torch.Tensor) -> torch.Tensor:
    return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 64, 28, 28), (3, 256, 7, 7), (2, 16, 5, 3)])
def test_forward_and_gradient_equal_the_native_pooling_and_the_formula(layout, dtype, shape):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(shape, generator=gen).to(dtype).contiguous(memory_format=layout)
    # gradients over many magnitudes, so that a second rounding (dividing by H, then by W) would show
    upstream = (torch.randn(shape[:2], generator=gen) * torch.exp(3 * torch.randn(shape[:2], generator=gen))).to(dtype)

    x_new, x_old = base.clone().requires_grad_(), base.clone().requires_grad_()
    out_new, out_old = global_average_pool(x_new), _native(x_old)
    assert torch.equal(out_new, out_old)
    (g_new,) = torch.autograd.grad(out_new, x_new, upstream)
    (g_old,) = torch.autograd.grad(out_old, x_old, upstream)
    assert torch.equal(g_new, g_old)
    # the formula written out: dL/dx[n, c, h, w] = g[n, c] / (H W), one rounding
    height, width = shape[2:]
    by_hand = (upstream.float() / (height * width)).to(dtype)
    assert torch.equal(g_new, by_hand[:, :, None, None].expand(shape))
    # and the point of it: the gradient comes back in the input's layout
    assert g_new.stride() == x_new.stride()


def test_the_native_pooling_returns_an_nchw_gradient_for_a_channels_last_input():
    """The cause this module works around: if PyTorch changes it, the custom function is no longer needed."""
    x = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
    (g,) = torch.autograd.grad(_native(x).sum(), x)
    assert g.is_contiguous() and not g.is_contiguous(memory_format=torch.channels_last)


def test_without_gradients_it_is_the_plain_expression():
    x = torch.randn(2, 8, 4, 4)
    with torch.inference_mode():
        assert torch.equal(global_average_pool(x), _native(x))


def test_per_sample_gradients_through_vmap():
    """FedCurv takes per-sample gradients with vmap(grad(functional_call)); the pooling must batch under it."""
    torch.manual_seed(0)
    model = build_model("resnet8", (1, 8, 8), 3, width=4).eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v for k, v in model.named_buffers()}
    x, y = torch.randn(5, 1, 8, 8), torch.randint(0, 3, (5,))

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(5):
        one = grad(loss)(params, x[i], y[i])
        for name in params:
            torch.testing.assert_close(per_sample[name][i], one[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_of_sum_equals_the_out_of_place_expression_with_its_gradients(dtype):
    gen = torch.Generator().manual_seed(1)
    a0, b0 = (torch.randn(3, 4, 5, 5, generator=gen).to(dtype) for _ in range(2))
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    a_ref, b_ref = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    # relu_of_sum writes into its first argument, as a block does into its own BatchNorm output
    out = relu_of_sum(a * 1, b)
    ref = F.relu(a_ref + b_ref)
    assert torch.equal(out, ref)
    upstream = torch.randn(ref.shape, generator=gen).to(dtype)
    assert torch.equal(torch.autograd.grad(out, (a, b), upstream)[0], torch.autograd.grad(ref, (a_ref, b_ref), upstream)[0])
    # the gradient is the ReLU's mask times the upstream gradient, for both addends
    mask = (a0 + b0 > 0).to(dtype)
    a2, b2 = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    ga, gb = torch.autograd.grad(relu_of_sum(a2 * 1, b2), (a2, b2), upstream)
    assert torch.equal(ga, upstream * mask) and torch.equal(gb, upstream * mask)


def test_relu_of_sum_promotes_mixed_dtypes_as_before():
    """A bf16 branch beside an fp32 identity shortcut: the sum is fp32, as ``relu(out + x)`` gives, not bf16."""
    out, shortcut = torch.randn(2, 3).to(torch.bfloat16), torch.randn(2, 3)
    result = relu_of_sum(out.clone(), shortcut)
    assert result.dtype == torch.float32
    assert torch.equal(result, F.relu(out + shortcut))


@pytest.mark.parametrize("name,shape,kwargs", [
    ("fd_resnet8", (1, 12, 12), {}),
    ("fd_resnet10", (1, 12, 12), {}),
    ("fd_server_resnet56", (16, 12, 12), {"blocks_per_stage": 1}),
    ("resnet8", (3, 12, 12), {"width": 8}),
    ("resnet11", (1, 12, 12), {"width": 4}),
])
def test_a_training_step_equals_one_with_the_plain_expressions(name, shape, kwargs, monkeypatch):
    """Three bf16 steps on channels-last models: every weight and BatchNorm statistic equals, bit for bit, the
    same steps with the native pooling and out-of-place residual ReLUs (the previous code)."""
    import fedistill.models.resnet as resnet
    import fedistill.models.split as split

    def train(plain: bool) -> torch.Tensor:
        with monkeypatch.context() as patch:
            if plain:
                patch.setattr(resnet, "global_average_pool", _native)
                patch.setattr(split.GlobalAveragePool, "forward", lambda self, x: _native(x))
                patch.setattr(resnet, "relu_of_sum", lambda out, sc: F.relu(out + sc))
                patch.setattr(split, "relu_of_sum", lambda out, sc: F.relu(out + sc))
                patch.setattr(F, "relu", _out_of_place_relu)
            torch.manual_seed(0)
            model = build_model(name, shape, 5, **kwargs).to(memory_format=torch.channels_last)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            gen = torch.Generator().manual_seed(2)
            for _ in range(3):
                x = torch.randn(8, *shape, generator=gen).contiguous(memory_format=torch.channels_last)
                y = torch.randint(0, 5, (8,), generator=gen)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x).float(), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            return torch.cat([t.detach().float().flatten() for t in model.state_dict().values() if t.is_floating_point()])

    assert torch.equal(train(plain=False), train(plain=True))


_relu = F.relu


def _out_of_place_relu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return _relu(x)
