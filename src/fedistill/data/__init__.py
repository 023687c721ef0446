"""Datasets, partitions and the tensor data pipeline."""
