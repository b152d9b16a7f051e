"""Layers shared by the model families; linear layers are written for tensor parallelism."""
