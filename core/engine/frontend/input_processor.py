"""Validate and tokenize a prompt into an EngineCoreRequest."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Union

import msgspec

from engine.config import VllmConfig
from engine.errors import InvalidParameterError
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.reasoning_tags import reasoning_tag_token_ids
from engine.lora.adapter import LoRAAdapterError
from engine.lora.checker import LoRAAdapterChecker
from engine.lora_request import LoRARequest
from engine.messages import EngineCoreRequest
from engine.model.model_info import TOKEN_TYPE_SHIFT, ModelInfo, resolve_model
from engine.model.tokenizer import get_tokenizer
from engine.plugins import configured_class
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.structured_output.validation import StructuredOutputsValidator

PromptType = Union[str, list[int], dict[str, Any]]


@dataclass(frozen=True)
class PreparedRequest:
    """A prompt validated and tokenized once by the front end, ready for the engine core: the user request's id,
    its prompt text (when it had one) and its engine-core requests (one per sequence when n > 1). The OpenAI
    server prepares every prompt of a call before starting any, then hands these to ``AsyncLLM.generate``."""

    request_id: str
    prompt_text: Optional[str]
    requests: list[EngineCoreRequest]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.requests[0].prompt_token_ids)


class InputProcessor:
    def __init__(
        self,
        model_info: ModelInfo,
        tokenizer,
        max_logprobs: int = 20,
        structured_outputs_validator=None,
        lora_checker: Optional[LoRAAdapterChecker] = None,
        scheduling_policy: str = "fcfs",
        reasoning_parser_cls: Optional[type] = None,
    ):
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        self.structured_outputs_validator = structured_outputs_validator
        self.lora_checker = lora_checker
        self.scheduling_policy = scheduling_policy
        self.reasoning_parser_cls = reasoning_parser_cls  # server.reasoning_parser (None: none)

    def eos_token_id(self) -> Optional[int]:
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        return eos if eos is not None else self.model_info.eos_token_id

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences of each bad word, as written and with a leading space (as vLLM does)."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def check_context_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """The prompt and ``max_tokens`` must fit the context (the server answers 400 as vLLM does; offline
        generation stops at the context length instead)."""
        max_len = self.model_info.max_model_len
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > max_len:
            raise InvalidParameterError(
                f"SamplingParams.max_tokens too large: this model's maximum context length is {max_len} tokens, "
                f"and {num_prompt_tokens + params.max_tokens} were requested ({num_prompt_tokens} in the prompt, "
                f"{params.max_tokens} in the completion); reduce the prompt or max_tokens",
                "max_tokens",
            )

    def check_priority(self, priority: int) -> None:
        """A non-zero priority needs the priority policy (InvalidParameterError naming ``priority``), as vLLM."""
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidParameterError(
                f"got priority {priority}, but priority scheduling is not enabled: start the engine with "
                "--scheduling-policy priority (scheduler.policy)",
                "priority",
            )

    def with_reasoning_tags(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the reasoning parser's tags as token ids, which a thinking budget needs."""
        if self.reasoning_parser_cls is None:
            raise InvalidParameterError(
                "thinking_token_budget needs a reasoning parser to know where the reasoning ends: start the engine "
                "with --reasoning-parser (server.reasoning_parser), e.g. deepseek_r1 or qwen3",
                "thinking_token_budget",
            )
        start, end = reasoning_tag_token_ids(self.reasoning_parser_cls, self.tokenizer)
        return msgspec.structs.replace(params, reasoning_start_token_ids=start, reasoning_end_token_ids=end)

    def check_generates(self) -> None:
        """InvalidParameterError (param ``model``) when the model is a pooling model: it generates no text."""
        pooling = self.model_info.pooling
        if pooling is not None:
            raise InvalidParameterError(
                f"{self.model_info.architecture} is a pooling model (tasks {list(pooling.tasks)}): it does not "
                "generate text; use /v1/embeddings, /v1/score, /rerank, /classify or /pooling (offline: LLM.embed, "
                "LLM.score, LLM.classify, LLM.encode)",
                "model",
            )

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(the prompt's text when it has one, its token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def pair_token_ids(self, query: str, document: str) -> list[int]:
        """A cross-encoder's input for a (query, document) pair, as its tokenizer joins them; an encoder's second
        segment carries token type 1 (packed above ``TOKEN_TYPE_SHIFT``)."""
        encoded = self.tokenizer(query, document, return_token_type_ids=True)
        token_ids = list(encoded["input_ids"])
        types = encoded.get("token_type_ids")
        if types is not None and self.model_info.is_encoder_only:
            token_ids = [t | (int(kind) << TOKEN_TYPE_SHIFT) for t, kind in zip(token_ids, types)]
        return token_ids

    def prepare_pooling(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> PreparedRequest:
        """Validate and tokenize one prompt of a pooling request (InvalidParameterError naming what is wrong).
        ``truncate_prompt_tokens``: keep the first k tokens (-1: the model's context length)."""
        pooling = self.model_info.pooling
        if pooling is None:
            raise InvalidParameterError(
                f"{self.model_info.architecture} is a generative model: it serves completions and chat, not "
                f"{params.task} (serve a pooling model, or set model.runner=pooling)",
                "model",
            )
        params.validate_for_model(pooling.tasks, pooling.embedding_size, pooling.matryoshka)
        text, token_ids = self.tokenize(prompt)
        if truncate_prompt_tokens is not None:
            limit = self.model_info.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            if limit < 1:
                raise InvalidParameterError(
                    f"truncate_prompt_tokens must be -1 or a positive integer, got {truncate_prompt_tokens}",
                    "truncate_prompt_tokens",
                )
            token_ids = token_ids[:limit]
        try:
            self.model_info.check_prompt_token_ids(token_ids)
        except ValueError as exc:
            raise InvalidParameterError(str(exc), "input") from None
        # max_tokens 1 holds the request to its prompt: the scheduler never plans a step past it
        sampling = SamplingParams(max_tokens=1, detokenize=False)
        request = EngineCoreRequest(request_id, token_ids, sampling, None, time.monotonic(), pooling_params=params)
        return PreparedRequest(request_id, text, [request])

    def prepare(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        cache_salt: Optional[str] = None,
        check_context_length: bool = False,
        lora_request: Optional[LoRARequest] = None,
        priority: int = 0,
    ) -> PreparedRequest:
        """Validate and tokenize one prompt. Bad input raises ValueError naming what is wrong;
        ``check_context_length``: also refuse a prompt whose ``max_tokens`` would overrun the context (the server
        answers 400, as vLLM does; offline generation stops at the context length instead); ``priority``: lower
        goes first (only with ``scheduler.policy`` priority)."""
        self.check_generates()
        self.check_priority(priority)
        text, token_ids = self.tokenize(prompt)
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt", cache_salt)
        self.model_info.check_prompt_token_ids(token_ids)
        params.validate_for_model(self.model_info.vocab_size, self.max_logprobs)
        if params.structured_outputs is not None:
            if self.structured_outputs_validator is None:
                raise InvalidParameterError("structured outputs are not available here", "structured_outputs")
            self.structured_outputs_validator.validate(params.structured_outputs)
        if check_context_length:
            self.check_context_length(len(token_ids), params)
        if lora_request is not None:
            if self.lora_checker is None:
                raise InvalidParameterError("LoRA adapters are not served here", "model")
            try:
                self.lora_checker.check(lora_request)
            except LoRAAdapterError as exc:
                raise InvalidParameterError(str(exc), "model") from None
        if params.bad_words:
            params = msgspec.structs.replace(params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        if params.thinking_token_budget is not None and not params.reasoning_end_token_ids:
            params = self.with_reasoning_tags(params)
        now, eos = time.monotonic(), self.eos_token_id()
        if params.n == 1:
            return PreparedRequest(
                request_id,
                text,
                [
                    EngineCoreRequest(
                        request_id,
                        token_ids,
                        params,
                        eos,
                        now,
                        cache_salt,
                        lora_request=lora_request,
                        priority=priority,
                    )
                ],
            )
        # n sequences share the prompt's KV blocks through the prefix cache (ref counts, no copies)
        sequences = [
            EngineCoreRequest(
                f"{index}_{request_id}",
                token_ids,
                params.for_child(index),
                eos,
                now,
                cache_salt,
                lora_request=lora_request,
                priority=priority,
            )
            for index in range(params.n)
        ]
        return PreparedRequest(request_id, text, sequences)


def build_front_end(vllm_config: VllmConfig) -> tuple[ModelInfo, Any, InputProcessor, OutputProcessor]:
    """(model info, tokenizer, InputProcessor, OutputProcessor) for LLMEngine and AsyncLLM alike."""
    model_info = resolve_model(vllm_config.model, vllm_config.pooler)
    tokenizer = get_tokenizer(model_info)
    validator = StructuredOutputsValidator(vllm_config, model_info)
    return (
        model_info,
        tokenizer,
        InputProcessor(
            model_info,
            tokenizer,
            vllm_config.model.max_logprobs,
            validator,
            LoRAAdapterChecker(vllm_config.lora, model_info.hf_config),
            vllm_config.scheduler.policy,
            configured_class("reasoning_parser", vllm_config),
        ),
        OutputProcessor(tokenizer),
    )
