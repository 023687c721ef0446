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

Model groups (:mod:`.group`, :data:`fedistill.registry.MODEL_GROUPS`): ``htfe2``, ``htfe3``, ``resnets5``,
``mixed8``, named lists of the members ``ht_fedavgcnn``, ``ht_cnn4``, ``ht_mlp``, ``ht_resnet4/6/8/10/18/34``,
``ht_mobilenet_v2``, which share one feature dimension (``feature_dim``, 512) and a linear head (HtFLlib's HtFE
groups); ``model.group`` assigns client k the member k mod M.
"""

from . import cnn, generators, group, mlp, mobilenet, resnet, split  # noqa: F401  (imported for their registrations)
from .base import ClassifierModel
from .cnn import DigitsCNN, FedAvgNet
from .generators import CGeneratorA, FeatureGenerator, GeneratorA, build_generator
from .group import PooledToDim, group_members
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
    "PooledToDim",
    "ProjectedClassifier",
    "ResNet",
    "build_generator",
    "build_model",
    "group_members",
    "has_projection_head",
    "model_options",
]
