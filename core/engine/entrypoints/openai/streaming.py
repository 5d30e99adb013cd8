"""Server-sent events shared by the completions and chat endpoints: text deltas per choice, usage, errors."""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable, Iterable

from engine.entrypoints.openai.errors import APIError
from engine.outputs import CompletionOutput, RequestOutput

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def usage(outputs: Iterable[RequestOutput]) -> dict[str, int]:
    outputs = list(outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# (choice index, the completion so far, its new text, how many of its tokens were sent before) -> one choice
ChoiceDelta = Callable[[int, CompletionOutput, str, int], dict]


async def stream_choices(
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    header: dict,
    make_choice: ChoiceDelta,
    include_usage: bool,
    request_id: str,
    preamble: Iterable[dict] = (),
) -> AsyncIterator[str]:
    """One event per choice that has new text, new tokens or a finish reason (choice index: prompt index
    times ``n`` plus the sequence index); then the usage if asked; ``[DONE]`` last. A failure after the 200
    header ends the stream with an OpenAI error event."""
    for chunk in preamble:
        yield sse({**header, **chunk})
    sent: dict[int, tuple[int, int]] = {}  # choice -> (characters, tokens) already sent
    finals: dict[int, RequestOutput] = {}
    try:
        async for prompt_index, output in outputs:
            finals[prompt_index] = output
            for completion in output.outputs:
                key = prompt_index * n + completion.index
                sent_chars, sent_tokens = sent.get(key, (0, 0))
                text = completion.text[sent_chars:]
                if not text and completion.finish_reason is None and len(completion.token_ids) == sent_tokens:
                    continue
                sent[key] = (len(completion.text), len(completion.token_ids))
                yield sse({**header, "choices": [make_choice(key, completion, text, sent_tokens)], "usage": None})
        if include_usage and finals:
            yield sse({**header, "choices": [], "usage": usage(finals.values())})
    except Exception as exc:
        yield sse(APIError.from_exception(exc, request_id).body())
    yield DONE
