"""LLM: offline batched generation, as in vLLM."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union, cast

from tqdm.auto import tqdm

from engine.beam_search import BeamSearchInstance, BeamSearchOutput, BeamSearchParams
from engine.config import VllmConfig
from engine.frontend.input_processor import PromptType
from engine.frontend.llm_engine import LLMEngine
from engine.lora_request import LoRARequest
from engine.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.pooling.scoring import TextOrTexts, cosine_similarity, score_pairs, scores_jointly
from engine.pooling_params import PoolingParams
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
        priority: Optional[Sequence[int]] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. ``lora_request``: the adapter every
        prompt runs with, or one per prompt (None: the base model), as vLLM (needs ``enable_lora=True``);
        ``priority``: one per prompt, lower first (needs ``scheduling_policy="priority"``)."""
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
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        request_ids = []
        try:
            for prompt, param, adapter, rank in zip(prompts, params, adapters, priorities):
                request_ids.append(self.llm_engine.add_request(prompt, param, lora_request=adapter, priority=rank))
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
        chat_template_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (``chat_template_kwargs``: extra template
        variables, e.g. ``{"enable_thinking": False}``), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = [
            {
                "prompt_token_ids": tokenizer.encode(
                    tokenizer.apply_chat_template(
                        conv,
                        tokenize=False,
                        add_generation_prompt=add_generation_prompt,
                        chat_template=chat_template,
                        **(chat_template_kwargs or {}),
                    ),
                    add_special_tokens=False,
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: Optional[LoRARequest] = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over every prompt (``engine.beam_search``): each step runs all live beams of all prompts as
        one batch of one-token requests, sharing their prefixes through the prefix cache; the best
        ``params.beam_width`` beams of each prompt come back, best first."""
        processor = self.llm_engine.input_processor
        instances = [
            BeamSearchInstance(processor.tokenize(prompt)[1], params, processor.eos_token_id())
            for prompt in self._prompt_list(prompts)
        ]
        max_len = self.llm_engine.model_info.max_model_len
        step_params = params.step_params()
        for _ in tqdm(range(params.max_tokens), desc="Beam search", unit="token", disable=not use_tqdm):
            live = [beam for instance in instances for beam in instance.beams if len(beam.tokens) < max_len]
            if not any(instance.beams for instance in instances):
                break
            outputs = (
                self.generate([{"prompt_token_ids": beam.tokens} for beam in live], step_params, False, lora_request)
                if live
                else []
            )
            step = {id(beam): output.outputs[0].logprobs[0] for beam, output in zip(live, outputs)}  # type: ignore[index]
            for instance in instances:
                if instance.beams:  # a beam at the context length gets None: it ends there
                    instance.advance([step.get(id(beam)) for beam in instance.beams])
        return [instance.result(self.get_tokenizer()) for instance in instances]

    # ---- pooling models -----------------------------------------------------------------------
    def encode(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Optional[Union[PoolingParams, Sequence[PoolingParams]]] = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> list[PoolingRequestOutput]:
        """Run a pooling model on every prompt (``pooling_params.task``: embed, classify, score or encode);
        outputs in prompt order."""
        prompts = self._prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams(task="encode")
        params = [pooling_params] * len(prompts) if isinstance(pooling_params, PoolingParams) else list(pooling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} PoolingParams for {len(prompts)} prompts")
        request_ids: list[str] = []
        try:
            for prompt, param in zip(prompts, params):
                request_ids.append(self.llm_engine.add_pooling_request(prompt, param, None, truncate_prompt_tokens))
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        outputs = self._run_engine(request_ids, use_tqdm)
        failed = [o for o in outputs if o.error is not None]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed in the engine: {failed[0].error}")
        return [PoolingRequestOutput.from_request_output(o) for o in outputs]

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Optional[PoolingParams] = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (an embedding model: ``model.runner`` pooling, ``embed`` task)."""
        params = pooling_params or PoolingParams(task="embed")
        if params.task != "embed":
            raise ValueError(f"LLM.embed takes PoolingParams with task 'embed', got {params.task!r}")
        outputs = self.encode(prompts, params, use_tqdm, truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def classify(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Optional[PoolingParams] = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (a classifier: ``*ForSequenceClassification`` or ``convert=classify``)."""
        params = pooling_params or PoolingParams(task="classify")
        if params.task != "classify":
            raise ValueError(f"LLM.classify takes PoolingParams with task 'classify', got {params.task!r}")
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(prompts, params, use_tqdm)]

    def score(
        self,
        data_1: TextOrTexts,
        data_2: TextOrTexts,
        use_tqdm: bool = True,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance of each (data_1, data_2) pair (one data_1 against every data_2, or pairwise): a cross-encoder
        reads each pair jointly; an embedding model scores the cosine similarity of the two embeddings."""
        pairs = score_pairs(data_1, data_2)
        if scores_jointly(self.llm_engine.model_info):
            processor = self.llm_engine.input_processor
            prompts: list[PromptType] = [
                {"prompt_token_ids": processor.pair_token_ids(query, document)} for query, document in pairs
            ]
            outputs = self.encode(prompts, PoolingParams(task="score"), use_tqdm, truncate_prompt_tokens)
            return [
                ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(o.outputs.data[0]), o.finished)
                for o in outputs
            ]
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        embedded = dict(zip(texts, self.embed(texts, use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)))
        return [
            ScoringRequestOutput(
                f"score-{index}",
                embedded[query].prompt_token_ids + embedded[document].prompt_token_ids,
                ScoringOutput(
                    cosine_similarity(embedded[query].outputs.embedding, embedded[document].outputs.embedding)
                ),
            )
            for index, (query, document) in enumerate(pairs)
        ]

    @staticmethod
    def _prompt_list(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

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
