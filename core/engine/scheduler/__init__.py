"""Scheduler: continuous batching over a token budget, chunked prefill, preemption."""
