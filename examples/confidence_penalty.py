"""Example (b): a method of your own in one file, run from the command line.

FedAvg whose clients add a confidence penalty to their loss (Pereyra et al., 2017): beta * sum_c p_c log p_c,
the negative entropy of the prediction, which discourages over-confident local models on label-skewed
clients. Everything else (sampling, local SGD, aggregation, evaluation) is FedAvg's. The same penalty on Local's
clients, ``local_cp``, trains any model group (clients of different architectures) and ranks on fd-hetero-mnist.

    fedistill run --plugin examples/confidence_penalty.py --algorithm fedavg_cp --set algorithm.beta=0.2
    fedistill bench fd-hetero-mnist --plugin examples/confidence_penalty.py --methods local_cp

or from Python: ``import confidence_penalty; fedistill.run(algorithm={"name": "fedavg_cp", "beta": 0.2})``.
A package can ship it as an entry point instead: ``[project.entry-points."fedistill.plugins"]
fedavg_cp = "my_package.confidence_penalty"``.
"""

from __future__ import annotations

import torch
from pydantic import Field

import fedistill
from fedistill.algorithms.fedavg import FedAvg, FedAvgParams
from fedistill.algorithms.hetero import load_own_model, train_own_model
from fedistill.algorithms.local_only import LocalOnly, LocalOnlyParams
from fedistill.protocol import Message, metric_items


class ConfidencePenaltyParams(FedAvgParams):
    beta: float = Field(0.1, ge=0.0, description="weight of the confidence penalty (0: FedAvg)")


def confidence_penalty(logits: torch.Tensor, beta: float) -> torch.Tensor:
    """beta * mean over the batch of sum_c p_c log p_c (minus beta times the entropy)."""
    log_p = torch.log_softmax(logits.float(), dim=1)
    return beta * (log_p.exp() * log_p).sum(dim=1).mean()


@fedistill.register_algorithm("fedavg_cp", help="FedAvg + a confidence penalty on the clients (examples/confidence_penalty.py)")
class FedAvgConfidencePenalty(FedAvg):
    Params = ConfidencePenaltyParams

    def extra_loss(self, client, msg):
        """Added to each local batch's cross-entropy; gets the model, the batch and its logits and features."""
        beta = self.params.beta
        return lambda model, x, y, logits, features: confidence_penalty(logits, beta)


class LocalConfidencePenaltyParams(LocalOnlyParams):
    beta: float = Field(0.1, ge=0.0, description="weight of the confidence penalty (0: Local)")


@fedistill.register_algorithm("local_cp", help="Local + a confidence penalty on the clients (examples/confidence_penalty.py)")
class LocalConfidencePenalty(LocalOnly):
    """Every client trains its own model (its own architecture) alone, with the penalty added to its loss."""

    Params = LocalConfidencePenaltyParams

    def local_update(self, client, info, msg):
        beta = self.params.beta
        load_own_model(client)
        result = train_own_model(client, info.lr, self.local, extra_loss=lambda model, x, y, logits, features: confidence_penalty(logits, beta))
        return Message(metric_items(result.mean_loss, client.num_samples))
