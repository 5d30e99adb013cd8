"""Sampling: the default sampler and the built-in logits processors."""
