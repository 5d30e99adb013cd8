"""Structured outputs: constraints compiled by a backend plugin, enforced with a token bitmask."""
