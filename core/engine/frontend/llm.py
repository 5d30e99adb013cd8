"""LLM: offline batched generation, as in vLLM."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union, cast

from tqdm.auto import tqdm

from engine.config import VllmConfig
from engine.frontend.input_processor import PromptType
from engine.frontend.llm_engine import LLMEngine
from engine.lora_request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """``LLM(model=..., **config).generate(prompts, SamplingParams(...))``.

    Keyword arguments are config keys (flat, dotted or whole sections), e.g.
    ``LLM(dtype="float32", max_num_batched_tokens=512, attention="torch")``.
    """

    def __init__(self, model: Optional[str] = None, *, config_file: Optional[Union[str, Path]] = None, **kwargs: Any):
        self.vllm_config = VllmConfig.load(config_file, model=model, **kwargs)
        self.llm_engine = LLMEngine(self.vllm_config)

    @classmethod
    def from_config(cls, vllm_config: VllmConfig) -> LLM:
        """An LLM over an already built config (the CLI builds one from flags)."""
        llm = cls.__new__(cls)
        llm.vllm_config = vllm_config
        llm.llm_engine = LLMEngine(vllm_config)
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = True,
        lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. ``lora_request``: the adapter every
        prompt runs with, or one per prompt (None: the base model), as vLLM (needs ``enable_lora=True``)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        adapters = (
            list(lora_request)
            if isinstance(lora_request, (list, tuple))
            else [cast(Optional[LoRARequest], lora_request)] * len(prompts)
        )
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(adapters)} LoRA requests for {len(prompts)} prompts")
        request_ids = []
        try:
            for prompt, param, adapter in zip(prompts, params, adapters):
                request_ids.append(self.llm_engine.add_request(prompt, param, lora_request=adapter))
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: Union[Conversation, Sequence[Conversation]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [
            {
                "prompt_token_ids": tokenizer.encode(
                    tokenizer.apply_chat_template(
                        conv, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
                    ),
                    add_special_tokens=False,
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm, dynamic_ncols=True
        )
        start, prompt_tokens, output_tokens = time.perf_counter(), 0, 0
        try:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        prompt_tokens += len(output.prompt_token_ids)
                        output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(
                            f"in {prompt_tokens / elapsed:.0f} tok/s, out {output_tokens / elapsed:.0f} tok/s"
                        )
                        bar.update(1)
        except BaseException:
            self.llm_engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]

    def get_stats(self):
        """Scheduler and KV-cache counters (free blocks, prefix-cache queries and hits...)."""
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()
