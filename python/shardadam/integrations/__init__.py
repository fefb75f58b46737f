"""Adapters for the training frameworks: ``huggingface`` (transformers'
Trainer) and ``lightning`` (PyTorch Lightning). Each imports its framework
when imported itself; shardadam does not depend on either."""
