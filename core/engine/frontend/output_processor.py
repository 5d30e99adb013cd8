"""Turn EngineCoreOutputs into RequestOutputs: incremental detokenization, stop strings, logprobs,
and the fan-in of an n>1 request's sequences."""

from __future__ import annotations

import functools
from typing import Optional, Union

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.messages import EngineCoreOutputs, EngineCoreRequest, TokenLogprobs
from engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


class SequenceState:
    """One sequence (one engine-core request) of a user request."""

    def __init__(self, request: EngineCoreRequest, index: int, parent: ParentRequest, tokenizer):
        self.request_id = request.request_id
        self.index = index
        self.parent = parent
        self.params = request.sampling_params
        self.output_token_ids: list[int] = []
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, request.prompt_token_ids, self.params.skip_special_tokens)
            if tokenizer is not None and self.params.detokenize
            else None
        )
        self.text = ""
        self.logprobs: Optional[list[PositionLogprobs]] = [] if self.params.logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if self.params.logprobs is not None else None
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it

    def update_text(self, new_token_ids: list[int]) -> bool:
        """Detokenize the new tokens; True when a stop string ended the sequence."""
        if self.detokenizer is None:
            return False
        delta = self.detokenizer.update(new_token_ids)
        previous_len = len(self.text)
        self.text += delta
        for stop in self.params.stop or ():
            found = self.text.find(stop, max(0, previous_len - len(stop) + 1))
            if found != -1:
                self.text = (
                    self.text[: found + len(stop)] if self.params.include_stop_str_in_output else self.text[:found]
                )
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        return False

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.text,
            list(self.output_token_ids),
            self.cumulative_logprob,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
        )


class ParentRequest:
    """A user request: its prompt and its n sequences."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sequences: list[SequenceState] = []
        self.prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
        self.num_cached_tokens = 0
        self.error: Optional[str] = None
        self.pooling_output: Optional[list[float]] = None

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.sequences)

    def make_output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [seq.completion() for seq in self.sequences],
            self.finished,
            self.num_cached_tokens,
            self.prompt_logprobs,
            error=self.error,
            pooling_output=self.pooling_output,
        )


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.sequences: dict[str, SequenceState] = {}
        self.parents: dict[str, ParentRequest] = {}
        # per instance: an lru_cache on the method would be one cache for the class, keeping every processor
        # (and its tokenizer) alive for the life of the process
        self.decode_token = functools.lru_cache(maxsize=65536)(self._decode_token)

    def _decode_token(self, token_id: int) -> Optional[str]:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _position(self, entry: TokenLogprobs) -> PositionLogprobs:
        position = {entry.token_ids[0]: Logprob(entry.logprobs[0], entry.rank, self.decode_token(entry.token_ids[0]))}
        for rank, (token_id, logprob) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:]), start=1):
            position.setdefault(token_id, Logprob(logprob, rank, self.decode_token(token_id)))
        return position

    def add_request(self, parent_id: str, prompt: Optional[str], requests: list[EngineCoreRequest]) -> None:
        """Register a user request and the engine-core requests of its sequences."""
        if parent_id in self.parents:
            raise ValueError(f"request id {parent_id!r} is already running")
        parent = ParentRequest(parent_id, prompt, requests[0].prompt_token_ids)
        for index, request in enumerate(requests):
            sequence = SequenceState(request, index, parent, self.tokenizer)
            parent.sequences.append(sequence)
            self.sequences[request.request_id] = sequence
        self.parents[parent_id] = parent

    def sequence_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return [seq.request_id for seq in parent.sequences] if parent else []

    def abort_requests(self, parent_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for parent_id in parent_ids:
            parent = self.parents.pop(parent_id, None)
            if parent is None:
                continue
            for seq in parent.sequences:
                self.sequences.pop(seq.request_id, None)
                if seq.finish_reason is None:
                    seq.finish_reason = "abort"
            outputs.append(parent.make_output())
        return outputs

    def process_outputs(self, core_outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutputs of the user requests that changed, and the sequences a stop string ended
        (the caller aborts them in the engine core)."""
        changed: dict[str, ParentRequest] = {}
        stopped: list[str] = []
        for out in core_outputs.outputs:
            seq = self.sequences.get(out.request_id)
            if seq is None:
                continue
            parent = seq.parent
            parent.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs:
                if parent.prompt_logprobs is None:
                    parent.prompt_logprobs = [None]
                parent.prompt_logprobs += [self._position(entry) for entry in out.new_prompt_logprobs]
            seq.output_token_ids.extend(out.new_token_ids)
            if seq.logprobs is not None and seq.cumulative_logprob is not None and out.new_logprobs:
                for entry in out.new_logprobs:
                    seq.logprobs.append(self._position(entry))
                    seq.cumulative_logprob += entry.logprobs[0]
            if seq.update_text(out.new_token_ids):
                stopped.append(seq.request_id)
            elif out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            if out.pooling_output is not None:
                parent.pooling_output = out.pooling_output
            if out.error is not None:
                parent.error = parent.error or out.error
            if seq.finish_reason is not None:
                del self.sequences[seq.request_id]
            changed[parent.request_id] = parent
        outputs = []
        for parent_id, parent in changed.items():
            outputs.append(parent.make_output())
            if parent.finished:
                del self.parents[parent_id]
        return outputs, stopped

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)
