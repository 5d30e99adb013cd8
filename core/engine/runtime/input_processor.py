"""Validate and tokenize a prompt into an EngineCoreRequest."""
from __future__ import annotations

import time
from typing import Any, Optional, Union

from engine.model.model_info import ModelInfo
from engine.runtime.messages import EngineCoreRequest
from engine.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict[str, Any]]


class InputProcessor:
    def __init__(self, model_info: ModelInfo, tokenizer):
        self.model_info = model_info
        self.tokenizer = tokenizer

    def eos_token_id(self) -> Optional[int]:
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        return eos if eos is not None else self.model_info.eos_token_id

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                cache_salt: Optional[str] = None) -> tuple[Optional[str], EngineCoreRequest]:
        """Return (prompt text if any, the request for the engine core). Bad input raises ValueError."""
        text: Optional[str] = None
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt", cache_salt)
            if "prompt_token_ids" in prompt:
                token_ids = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text = prompt["prompt"]
                token_ids = self.tokenizer.encode(text)
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_info.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        max_len = self.model_info.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; the context length is {max_len} "
                             "and at least one token must be generated")
        request = EngineCoreRequest(request_id, token_ids, params, self.eos_token_id(), time.monotonic(), cache_salt)
        return text, request
