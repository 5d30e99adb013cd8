"""Speculative decoding: built-in proposers (ngram, suffix), the rejection sampler, dynamic speculation."""
