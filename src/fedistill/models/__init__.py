"""Model zoo. Importing this package registers every model in :data:`fedistill.registry.MODELS`.

Registered names: ``cnn`` (FedAvg/FedNTD/FedLMD CNN), ``digits_cnn`` (tiny CNN for 8x8 digits), ``mlp``
(2NN), ``resnet8`` (CIFAR-style), ``resnet18`` (cifar or imagenet stem), ``mobilenet_v2``, and FedICT's
extractor/predictor-split client and server models ``fd_resnet2/4/8/10/12``, ``fd_server_resnet56``,
``fd_mlp16/32/64``, ``fd_server_mlp`` (:mod:`.split`). Create one with
:func:`build_model`; every model is a :class:`ClassifierModel` (``extract`` -> features, ``classify`` ->
logits). Any of them takes ``projection_dim`` for MOON's projection head (:class:`ProjectedClassifier`).

Server-side image generators (``cgenerator``, ``generator``) are not classifiers: they are registered in
:data:`fedistill.registry.GENERATORS` and built with :func:`build_generator` (:mod:`.generators`).
FedGen's :class:`FeatureGenerator` makes penultimate features for a model's head and is built by FedGen.
"""

from . import cnn, generators, mlp, mobilenet, resnet, split  # noqa: F401  (imported for their registrations)
from .base import ClassifierModel
from .cnn import DigitsCNN, FedAvgNet
from .generators import CGeneratorA, FeatureGenerator, GeneratorA, build_generator
from .mlp import MLP
from .projection import ProjectedClassifier, has_projection_head
from .registry import build_model, model_options
from .resnet import BasicBlock, ResNet

__all__ = [
    "BasicBlock",
    "CGeneratorA",
    "ClassifierModel",
    "DigitsCNN",
    "FedAvgNet",
    "FeatureGenerator",
    "GeneratorA",
    "MLP",
    "ProjectedClassifier",
    "ResNet",
    "build_generator",
    "build_model",
    "has_projection_head",
    "model_options",
]
