"""Turn EngineCoreOutputs into RequestOutputs: detokenize incrementally, track finishing."""
from __future__ import annotations

from typing import Optional

from engine.outputs import CompletionOutput, RequestOutput
from engine.runtime.detokenizer import IncrementalDetokenizer
from engine.runtime.messages import EngineCoreOutputs, EngineCoreRequest


class RequestState:
    """The front end's record of one request."""

    def __init__(self, request: EngineCoreRequest, prompt: Optional[str], tokenizer):
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = request.sampling_params
        self.output_token_ids: list[int] = []
        self.detokenizer = (IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                   self.params.skip_special_tokens)
                            if tokenizer is not None and self.params.detokenize else None)
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.num_cached_tokens = 0

    def make_output(self) -> RequestOutput:
        text = self.detokenizer.output_text if self.detokenizer else ""
        completion = CompletionOutput(0, text, list(self.output_token_ids), finish_reason=self.finish_reason,
                                      stop_reason=self.stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             self.finish_reason is not None, self.num_cached_tokens)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: Optional[str]) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.requests[request.request_id] = RequestState(request, prompt, self.tokenizer)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                state.finish_reason = "abort"
                outputs.append(state.make_output())
        return outputs

    def process_outputs(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        results = []
        for out in core_outputs.outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            state.output_token_ids.extend(out.new_token_ids)
            state.num_cached_tokens = out.num_cached_tokens
            if state.detokenizer is not None:
                state.detokenizer.update(out.new_token_ids)
            if out.finish_reason is not None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
                del self.requests[out.request_id]
            results.append(state.make_output())
        return results

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)
