"""Generators for server-side data-free distillation: images (FedFTG, FedDF, DaFKD) and features (FedGen).

They are not classifiers, so they have their own registry, :data:`fedistill.registry.GENERATORS`
(``fedistill list`` shows it beside the models). Every factory has the signature
``fn(output_shape, num_classes, noise_dim=100, ngf=64) -> nn.Module`` and the module's forward is
``generator(z, y)`` with ``z`` of shape ``(B, noise_dim)`` and ``y`` the class indices ``(B,)`` (ignored by
an unconditional generator), except ``dcgan``, whose forward is ``generator(z)`` (no label input).

``generator`` is DFAD's GeneratorA (Fang et al. 2019; spec/fedftg.md §3 "Unconditional DFAD GeneratorA"):
one linear layer from z to a ``2·ngf × s × s`` map with ``s = side / 4``, BN, nearest upsampling x2 twice with
3x3 convolutions, BN and LeakyReLU(0.2) between them, a last 3x3 convolution to the image channels, Tanh, and a
BatchNorm without affine parameters that standardises every output channel.

``cgenerator`` is FedFTG's CGeneratorA (spec/fedftg.md §3): the same body, but the ``2·ngf`` input channels
come half from ``Linear(z)`` (channels ``0..ngf-1``) and half from ``Linear(onehot(y))`` (``ngf..2ngf-1``).

==========================  ===============  ==========
generator                   output           parameters
==========================  ===============  ==========
cgenerator, d=100, M=10     3x32x32          682,499
cgenerator, d=256, M=100    3x32x32          1,690,115
generator, d=100            3x32x32          1,051,139
generator, d=100            1x28x28          856,065
==========================  ===============  ==========

Any square output whose side is a multiple of 4 is accepted (8x8 digits: s = 2).

``dcgan`` is DaFKD's unconditional DCGAN ``GeneratorCifar`` (spec/dafkd.md "Architectures", n_g = ngf = 64):
four transposed convolutions ``d -> 4ngf -> 2ngf -> ngf -> C`` with BN + ReLU between them and Tanh at the end,
so its images lie in [-1, 1]. Unlike the others its forward takes the noise only, ``generator(z)``.
For 3x32x32 and d = 100 it has 1,068,931 parameters (1,066,881 for one channel) and 896 BatchNorm
running-statistic floats; sides that are a multiple of 8 or of 4 are accepted (see :class:`DCGANGenerator`).

:class:`FeatureGenerator` is FedGen's generator of penultimate features (spec/fedgen.md §2), built by the
FedGen algorithm for its model's head; it makes vectors, not images, so it is not in the registry.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..registry import GENERATORS
from .base import check_input_shape, check_num_classes, check_positive_ints


def _seed_side(name: str, output_shape: Sequence[int]) -> tuple[tuple[int, int, int], int]:
    shape = check_input_shape(output_shape)
    _, h, w = shape
    if h != w or h % 4 != 0:
        raise ConfigError(
            f"generator {name!r} makes square images whose side is a multiple of 4, got {h}x{w} (output_shape={shape})"
        )
    return shape, h // 4


class _Body(nn.Module):
    """DFAD's trunk from a ``(B, 2·ngf, s, s)`` map to a ``(B, nc, 4s, 4s)`` image (card §3)."""

    def __init__(self, ngf: int, channels: int) -> None:
        super().__init__()
        self.bn0 = nn.BatchNorm2d(2 * ngf)
        self.conv1 = nn.Conv2d(2 * ngf, 2 * ngf, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(2 * ngf)
        self.conv2 = nn.Conv2d(2 * ngf, ngf, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(ngf)
        self.conv3 = nn.Conv2d(ngf, channels, 3, padding=1)
        # Standardises each output channel like the mean/std-normalised real inputs (no learnable scale).
        self.out_norm = nn.BatchNorm2d(channels, affine=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(self.bn0(h), scale_factor=2, mode="nearest")
        h = F.leaky_relu(self.bn1(self.conv1(h)), 0.2)
        h = F.interpolate(h, scale_factor=2, mode="nearest")
        h = F.leaky_relu(self.bn2(self.conv2(h)), 0.2)
        return self.out_norm(torch.tanh(self.conv3(h)))


class GeneratorA(nn.Module):
    """DFAD's unconditional GeneratorA: ``Linear(d → 2·ngf·s²)`` then the shared trunk."""

    conditional = False

    def __init__(self, output_shape: Sequence[int], noise_dim: int = 100, ngf: int = 64) -> None:
        super().__init__()
        self.output_shape, self.side = _seed_side("generator", output_shape)
        (self.noise_dim,) = check_positive_ints("generator", "noise_dim", noise_dim, length=1)
        (self.ngf,) = check_positive_ints("generator", "ngf", ngf, length=1)
        self.l1 = nn.Linear(self.noise_dim, 2 * self.ngf * self.side**2)
        self.body = _Body(self.ngf, self.output_shape[0])

    def forward(self, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.l1(z).view(z.shape[0], 2 * self.ngf, self.side, self.side)
        return self.body(h)


class CGeneratorA(nn.Module):
    """FedFTG's conditional CGeneratorA: ``[Linear(z) ; Linear(onehot(y))]`` reshaped, then the trunk."""

    conditional = True

    def __init__(self, output_shape: Sequence[int], num_classes: int, noise_dim: int = 100, ngf: int = 64) -> None:
        super().__init__()
        self.output_shape, self.side = _seed_side("cgenerator", output_shape)
        self.num_classes = check_num_classes(num_classes)
        (self.noise_dim,) = check_positive_ints("cgenerator", "noise_dim", noise_dim, length=1)
        (self.ngf,) = check_positive_ints("cgenerator", "ngf", ngf, length=1)
        width = self.ngf * self.side**2
        self.l1 = nn.Linear(self.noise_dim, width)
        self.l2 = nn.Linear(self.num_classes, width)
        self.body = _Body(self.ngf, self.output_shape[0])

    def forward(self, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if y is None:
            raise ValueError("cgenerator needs the class labels y")
        onehot = F.one_hot(y, self.num_classes).to(z.dtype)
        # z part first: channels 0..ngf-1 come from the noise, ngf..2ngf-1 from the label (card §3).
        h = torch.cat([self.l1(z), self.l2(onehot)], dim=1)
        return self.body(h.view(z.shape[0], 2 * self.ngf, self.side, self.side))


@GENERATORS.register("cgenerator")
def cgenerator(output_shape: Sequence[int], num_classes: int, noise_dim: int = 100, ngf: int = 64) -> CGeneratorA:
    """FedFTG's conditional CGeneratorA (z and one-hot y, DFAD trunk, affine-free output BN)."""
    return CGeneratorA(output_shape, num_classes, noise_dim=noise_dim, ngf=ngf)


@GENERATORS.register("generator")
def generator(output_shape: Sequence[int], num_classes: int, noise_dim: int = 100, ngf: int = 64) -> GeneratorA:
    """DFAD's unconditional GeneratorA (z only; num_classes is ignored)."""
    return GeneratorA(output_shape, noise_dim=noise_dim, ngf=ngf)


class DCGANGenerator(nn.Module):
    """DaFKD's unconditional DCGAN generator (``GeneratorCifar``): noise ``z`` of shape ``(B, noise_dim)`` to
    images ``(B, C, S, S)`` in [-1, 1].

    ``forward(z)`` takes the noise only: unlike ``cgenerator`` (and ``generator``, which accepts and ignores a
    label) there is no label input. The noise is reshaped to ``(B, noise_dim, 1, 1)`` inside.

    Layers for a side ``S`` (card, S = 32): ``ConvT(d -> 4ngf, k=S/8, s1, p0)`` to S/8 px, BN, ReLU;
    ``ConvT(4ngf -> 2ngf, k4, s2, p1)`` to S/4, BN, ReLU; ``ConvT(2ngf -> ngf, k4, s2, p1)`` to S/2, BN, ReLU;
    ``ConvT(ngf -> C, k4, s2, p1, bias)`` to S; Tanh. Only the last layer has a bias. For a side that is a
    multiple of 4 but not of 8 (28x28) the first layer makes S/4 px (kernel S/4), the next two double to S,
    and the last is ``ConvT(ngf -> C, k3, s1, p1, bias)`` keeping S, so the network has the same four layers
    and BN widths. Other sizes, and non-square ones, are a ConfigError.

    Initialisation (DaFKD's code): convolution weights Xavier-normal, BN weights ``N(1, 0.02)`` and biases 0,
    drawn from the global torch RNG; the last layer's bias keeps PyTorch's default.
    """

    conditional = False

    def __init__(self, output_shape: Sequence[int], noise_dim: int = 100, ngf: int = 64) -> None:
        super().__init__()
        shape = check_input_shape(output_shape)
        channels, h, w = shape
        if h != w or h % 4 != 0:
            raise ConfigError(
                "generator 'dcgan' makes square images whose side is a multiple of 8 (e.g. 8x8, 16x16, 32x32) "
                f"or of 4 (e.g. 28x28), got {h}x{w} (output_shape={shape})"
            )
        self.output_shape = shape
        (self.noise_dim,) = check_positive_ints("dcgan", "noise_dim", noise_dim, length=1)
        (self.ngf,) = check_positive_ints("dcgan", "ngf", ngf, length=1)
        ng = self.ngf
        if h % 8 == 0:
            # Card layout: S/8 px, three doublings.
            first_kernel = h // 8
            last = nn.ConvTranspose2d(ng, channels, 4, 2, 1, bias=True)
        else:
            # S/4 px, two doublings, then a size-keeping 3x3 layer.
            first_kernel = h // 4
            last = nn.ConvTranspose2d(ng, channels, 3, 1, 1, bias=True)
        self.net = nn.Sequential(
            nn.ConvTranspose2d(self.noise_dim, 4 * ng, first_kernel, 1, 0, bias=False),
            nn.BatchNorm2d(4 * ng),
            nn.ReLU(inplace=True),
            nn.ConvTranspose2d(4 * ng, 2 * ng, 4, 2, 1, bias=False),
            nn.BatchNorm2d(2 * ng),
            nn.ReLU(inplace=True),
            nn.ConvTranspose2d(2 * ng, ng, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ng),
            nn.ReLU(inplace=True),
            last,
            nn.Tanh(),
        )
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.xavier_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.normal_(m.weight, 1.0, 0.02)
                nn.init.zeros_(m.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z.reshape(z.shape[0], self.noise_dim, 1, 1))


@GENERATORS.register("dcgan")
def dcgan(output_shape: Sequence[int], num_classes: int, noise_dim: int = 100, ngf: int = 64) -> DCGANGenerator:
    """DaFKD's unconditional DCGAN generator (forward takes z only; num_classes is ignored)."""
    return DCGANGenerator(output_shape, noise_dim=noise_dim, ngf=ngf)


def build_generator(name: str, output_shape: Sequence[int], num_classes: int, /, **kwargs: Any) -> nn.Module:
    """Generator ``name`` for images of ``output_shape`` (C, H, W); unknown names are a ConfigError."""
    fn = GENERATORS.get(name, key="generator")
    return fn(output_shape, num_classes, **kwargs)


class FeatureGenerator(nn.Module):
    """FedGen's generator in the classifier's feature space (spec/fedgen.md §2-3).

    ``G(ε, y) = W₂ · ReLU(BN1d(W₁ [ε ; onehot(y)] + b₁)) + b₂`` of shape ``(B, feature_dim)``: noise first,
    then the one-hot label (official ``generator.py``), no output activation (the card's heads read
    un-activated features). Parameters ``(d+M)·H + H + 2H + H·L + L`` plus ``2H`` BatchNorm running-stat
    floats:

    =======================================  ==========
    d, H, L, M                               parameters
    =======================================  ==========
    32, 256, 32, 10 (FedGen MNIST config)    19,744
    32, 256, 32, 26 (EMNIST-letters)         23,840
    64, 512, 32, 10 (FedGen CIFAR config)    55,840
    =======================================  ==========

    It is not registered in :data:`~fedistill.registry.GENERATORS`: those make images of a sample shape,
    this one makes vectors for a model's last linear layer (``model.classifier``).
    """

    conditional = True

    def __init__(self, noise_dim: int, num_classes: int, feature_dim: int, hidden_dim: int = 256) -> None:
        super().__init__()
        (self.noise_dim,) = check_positive_ints("feature_generator", "noise_dim", noise_dim, length=1)
        (self.hidden_dim,) = check_positive_ints("feature_generator", "hidden_dim", hidden_dim, length=1)
        (self.feature_dim,) = check_positive_ints("feature_generator", "feature_dim", feature_dim, length=1)
        self.num_classes = check_num_classes(num_classes)
        self.fc1 = nn.Linear(self.noise_dim + self.num_classes, self.hidden_dim)
        self.bn = nn.BatchNorm1d(self.hidden_dim)
        self.fc2 = nn.Linear(self.hidden_dim, self.feature_dim)

    def forward(self, eps: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(y, self.num_classes).to(eps.dtype)
        h = F.relu(self.bn(self.fc1(torch.cat([eps, onehot], dim=1))))
        return self.fc2(h)


def draw_noise(n: int, dim: int, law: str, generator: torch.Generator) -> torch.Tensor:
    """The noise ε of a :class:`FeatureGenerator`: N(0, I) (``"gaussian"``, FedGen's paper) or U[0,1) (``"uniform"``,
    its official code's and HtFLlib's draw under a "Gaussian" comment; spec/fedgen.md ambiguity 1)."""
    if law == "gaussian":
        return torch.randn(n, dim, generator=generator)
    return torch.rand(n, dim, generator=generator)
