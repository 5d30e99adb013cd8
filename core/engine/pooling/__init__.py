"""Pooling models: the built-in poolers and the heads (normalisation, Matryoshka truncation, classifiers)."""
