"""fedistill: federated learning on non-IID data through knowledge distillation."""

__version__ = "0.1.0"
