"""Reasoning output: the think-tag parsers (unit), the thinking budget, and `engine serve --reasoning-parser` driven
by the official openai client (reasoning_content apart from content, streamed as separate deltas)."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from engine.reasoning.think_tags import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from engine.sample.builtin_logits_processors import ThinkingBudgetLogitsProcessor
from tests.helpers import assert_all_blocks_free, tiny_server


def stream_through(parser_cls, text: str, seed: int) -> tuple[str, str]:
    """Feed ``text`` in random pieces; the reasoning and the answer that come out."""
    parser, rng = parser_cls(None), random.Random(seed)
    reasoning, answer, position = "", "", 0
    while position < len(text):
        position = min(len(text), position + rng.randint(1, 5))
        delta = parser.extract_reasoning_streaming(text[:position], position == len(text))
        reasoning += delta.reasoning_content or ""
        answer += delta.content or ""
    return reasoning, answer


CASES = [
    # (text, deepseek_r1's (reasoning, answer), qwen3's)
    ("<think>let me see</think>\n\nIt is 4.", ("let me see", "It is 4."), ("let me see", "It is 4.")),
    ("let me see</think>It is 4.", ("let me see", "It is 4."), (None, "let me see</think>It is 4.")),
    ("It is 4.", ("It is 4.", None), (None, "It is 4.")),
    ("<think>cut by max_tok", ("cut by max_tok", None), ("cut by max_tok", None)),
    ("<thin", ("<thin", None), (None, "<thin")),
    ("<think></think>answer < think", (None, "answer < think"), (None, "answer < think")),
]


@pytest.mark.parametrize("text, r1, qwen3", CASES)
def test_think_tag_parsers_split_reasoning_from_the_answer(text, r1, qwen3):
    for parser_cls, expected in ((DeepSeekR1ReasoningParser, r1), (Qwen3ReasoningParser, qwen3)):
        assert parser_cls(None).extract_reasoning(text) == expected, parser_cls.name
        for seed in range(20):  # streamed in any pieces: the same split
            reasoning, answer = stream_through(parser_cls, text, seed)
            assert (reasoning or None, answer or None) == expected, (parser_cls.name, seed)


def test_thinking_budget_forces_the_end_tokens_once_spent():
    params = SamplingParams(thinking_token_budget=3, reasoning_end_token_ids=[7, 8])
    forced = ThinkingBudgetLogitsProcessor.forced_token
    assert forced([1, 2], params) is None
    assert forced([1, 2, 3], params) == 7
    assert forced([1, 2, 3, 7], params) == 8
    assert forced([1, 2, 3, 7, 8], params) is None  # closed: the answer is free
    assert forced([1, 7, 8, 4, 5, 6], params) is None  # closed by the model itself within the budget
    opened = SamplingParams(thinking_token_budget=2, reasoning_start_token_ids=[5], reasoning_end_token_ids=[7])
    assert forced([1, 2, 3], opened) is None  # no reasoning block: nothing to close
    assert forced([5, 1, 2], opened) == 7


def test_thinking_budget_in_the_engine(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, reasoning_parser="deepseek_r1")
    end = llm.get_tokenizer().encode("</think>", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, thinking_token_budget=4)
    out = llm.generate("The answer is", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[4 : 4 + len(end)] == end
    free = llm.generate("The answer is", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert free[0].outputs[0].token_ids[:4] == out.token_ids[:4]  # the budget only acts once spent
    assert_all_blocks_free(llm)
    llm.shutdown()
    plain = LLM(tiny_llama, dtype="float32", max_model_len=256)
    with pytest.raises(ValueError, match="thinking_token_budget needs a reasoning parser"):
        plain.generate("hi", params, use_tqdm=False)
    plain.shutdown()


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = tiny_server(tiny_llama, "--reasoning-parser", "deepseek_r1")
    yield srv
    srv.stop()


THINK_THEN_ANSWER = {"regex": "<think>[a-z]{2,8}( [a-z]{2,8}){1,3}</think>\n[a-z]{2,8}( [a-z]{2,8}){1,3}"}


def test_chat_answers_carry_reasoning_content_apart_from_content(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "think first"}],
        temperature=0,
        max_tokens=80,
        extra_body={"structured_outputs": THINK_THEN_ANSWER},
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message
    reasoning, content = whole.model_extra["reasoning_content"], whole.content
    assert reasoning and content and "<think>" not in reasoning + content and "</think>" not in reasoning + content
    streamed_reasoning, streamed_content, kinds = "", "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        part = (delta.model_extra or {}).get("reasoning_content")
        streamed_reasoning += part or ""
        streamed_content += delta.content or ""
        kinds += ["reasoning"] * bool(part) + ["content"] * bool(delta.content)
    assert (streamed_reasoning, streamed_content) == (reasoning, content)
    assert kinds == sorted(kinds, key=lambda k: k == "content") and "reasoning" in kinds  # reasoning, then answer
    hidden = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            **{k: v for k, v in kwargs.items() if k != "extra_body"},
            **kwargs["extra_body"],
            "include_reasoning": False,
        },
        timeout=60,
    ).json()["choices"][0]["message"]
    assert "reasoning_content" not in hidden and hidden["content"] == content


def test_chat_template_kwargs_reach_the_template(server):
    template = "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}"

    def prompt_tokens(**kwargs) -> int:
        response = httpx.post(
            server.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "chat_template": template,
                **kwargs,
            },
            timeout=60,
        )
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) > prompt_tokens()
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": []}},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_thinking_token_budget_over_http(server):
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "think"}],
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "thinking_token_budget": 3,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] is not None  # the budget closed the reasoning
