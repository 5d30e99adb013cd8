"""Tensor-parallel process groups and collectives."""
