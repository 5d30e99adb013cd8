"""LoRA adapters (vLLM's multi-LoRA serving): the request that names one, reading and checking a PEFT folder, the
per-step slot mapping, the layers' stacked adapter weights and the worker's adapter manager."""
