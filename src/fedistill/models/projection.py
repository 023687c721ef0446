"""MOON's projection head as a model option: ``model.kwargs.projection_dim`` (spec/moon.md §3, ambiguity 1).

Official MOON (``ModelFedCon`` in QinbinLi/MOON) puts a two-layer head between a network's features and its
classifier, ``Linear(d, d) → ReLU → Linear(d, out_dim)`` with ``out_dim = 256``, and the classifier reads the
projection. Any zoo model can take it: :func:`~fedistill.models.registry.build_model` wraps the built model
in :class:`ProjectedClassifier` when ``projection_dim`` is given.

Why a model option and not a module owned by MOON: the head is trained and averaged like every other
weight, so it must be part of the model that the server and every client build from the configuration
(through ``build_model``, from one seeded stream) and of the flat weight vector they exchange. A head kept
beside the model would need its own vectors, messages and checkpoint entries, and would not exist for the
server's evaluation. MOON's ``projection_head`` switch then only checks that the configured model has one.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ClassifierModel


class ProjectedClassifier(ClassifierModel):
    """A zoo model (``body``) whose features go through a projection head before a new classifier.

    ``extract(x) = projection(body.extract(x))`` of size ``projection_dim`` (so ``feature_dim`` is the
    projection's size and MOON's contrastive term, which uses ``extract``, sees the projection);
    ``classify`` is a new ``Linear(projection_dim, num_classes)``. The body's own classifier is replaced by
    an identity, so no unused weights enter the flat vector. ``backbone_dim`` is the body's feature size d.
    """

    def __init__(self, body: ClassifierModel, projection_dim: int) -> None:
        super().__init__(body.input_shape, body.num_classes)
        d = body.feature_dim
        body.classifier = nn.Identity()  # type: ignore[assignment]  # the classifier now reads the projection
        self.body = body
        self.backbone_dim = d
        self.projection = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, projection_dim))
        self.feature_dim = projection_dim
        self.classifier = nn.Linear(projection_dim, self.num_classes)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.body.extract(x))


def has_projection_head(model: nn.Module) -> bool:
    return isinstance(model, ProjectedClassifier)
