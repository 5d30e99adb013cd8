"""Structured outputs: constraints compiled by the backend plugins (xgrammar, guidance), enforced with a token
bitmask. Sampled outputs (temperature 1.0, SmolLM2) must satisfy their constraint every time; an unconstrained
request in the same batch must not change; a compile must never stall the other requests."""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import types

import jsonschema
import numpy as np
import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams, hookimpl
from engine.errors import InvalidParameterError
from engine.testing import inspect
from tests.helpers import assert_all_blocks_free, oracle_spec_config, random_prompts

BACKENDS = [
    pytest.param("xgrammar"),
    pytest.param(
        "guidance",
        marks=pytest.mark.skipif(importlib.util.find_spec("llguidance") is None, reason="llguidance is not installed"),
    ),
]

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
            "mood": {"type": "string", "enum": ["happy", "sad"]},
        },
        "required": ["colors", "mood"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "score", "ok"],
    },
    "list_of_objects": {
        "type": "array",
        "minItems": 1,
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 1000},
                "tag": {"type": "string", "maxLength": 10},
            },
            "required": ["id", "tag"],
        },
    },
}
PROMPTS = ["Describe a person as JSON.", "Give me some data.", "Write JSON about your day.", "Output:"]
GRAMMARS = {  # sums of small numbers, in each backend's grammar language
    "xgrammar": 'root ::= num (" + " num)*\nnum ::= [1-9] [0-9]?',
    "guidance": 'start: num (" + " num)*\nnum: /[1-9][0-9]?/',
}


@pytest.fixture(scope="module", params=BACKENDS)
def smollm2_llm(request, smollm2_gguf):
    llm = LLM(
        smollm2_gguf,
        kv_cache_memory="96MiB",
        max_model_len=1024,
        max_num_seqs=32,
        structured_outputs_backend=request.param,
    )
    llm.backend = request.param
    yield llm
    llm.shutdown()


def generate(llm, prompts, constraint, n=1, max_tokens=200, **kwargs):
    params = SamplingParams(
        temperature=1.0, n=n, seed=7, max_tokens=max_tokens, structured_outputs=constraint, **kwargs
    )
    return [c for out in llm.generate(prompts, params, use_tqdm=False) for c in out.outputs]


# ---- request side ---------------------------------------------------------------------------------------
def test_params_need_exactly_one_constraint():
    with pytest.raises(InvalidParameterError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidParameterError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidParameterError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(InvalidParameterError, match="choice"):
        StructuredOutputsParams(choice=[])
    assert (
        StructuredOutputsParams(json='{"type": "object"}').spec()
        == StructuredOutputsParams(json={"type": "object"}).spec()
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "constraint, problem",
    [
        (StructuredOutputsParams(regex="(unclosed"), "regex"),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "json"),
        (StructuredOutputsParams(grammar="root ::= ( unbalanced"), "grammar"),
    ],
)
def test_invalid_constraints_are_refused_naming_the_backend(backend, constraint, problem):
    from engine.config import VllmConfig
    from engine.structured_output.validation import StructuredOutputsValidator

    validator = StructuredOutputsValidator(VllmConfig.load(structured_outputs_backend=backend))
    with pytest.raises(InvalidParameterError, match=f"{backend} structured-output backend.*{problem}") as info:
        validator.validate(constraint)
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_ebnf_grammar_is_accepted_by_every_backend(backend):
    """xgrammar takes EBNF as it is; guidance converts it to Lark (found broken by mypy: the converter was
    imported as a module and every EBNF grammar was refused)."""
    from engine.config import VllmConfig
    from engine.structured_output.validation import StructuredOutputsValidator

    validator = StructuredOutputsValidator(VllmConfig.load(structured_outputs_backend=backend))
    validator.validate(StructuredOutputsParams(grammar=GRAMMARS["xgrammar"]))
    with pytest.raises(InvalidParameterError, match=f"{backend} structured-output backend.*grammar"):
        validator.validate(StructuredOutputsParams(grammar="root ::= ( unbalanced"))


def test_a_schema_keyword_xgrammar_cannot_enforce_is_refused():
    from engine.config import VllmConfig
    from engine.structured_output.validation import StructuredOutputsValidator

    validator = StructuredOutputsValidator(VllmConfig.load(structured_outputs_backend="xgrammar"))
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(InvalidParameterError, match=r"xgrammar.*uniqueItems.*backend=guidance"):
        validator.validate(StructuredOutputsParams(json=schema))


def test_unknown_backend_is_refused_with_the_choices():
    from engine.config import VllmConfig
    from engine.structured_output.validation import StructuredOutputsValidator

    validator = StructuredOutputsValidator(VllmConfig.load(structured_outputs_backend="nope"))
    with pytest.raises(InvalidParameterError, match=r"structured_outputs.backend.*nope.*xgrammar"):
        validator.validate(StructuredOutputsParams(regex="a+"))


# ---- sampled outputs satisfy their constraint (SmolLM2, temperature 1.0) ---------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_json_validates_against_its_schema(smollm2_llm, name):
    schema = SCHEMAS[name]
    outputs = generate(smollm2_llm, PROMPTS, StructuredOutputsParams(json=schema), n=4)
    assert len(outputs) == 16
    for completion in outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
    assert len({c.text for c in outputs}) > 1  # sampled, not one forced answer
    assert_all_blocks_free(smollm2_llm)


@pytest.mark.slow
def test_sampled_regex_choice_grammar_and_json_object(smollm2_llm):
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9])?"
    for completion in generate(smollm2_llm, PROMPTS, StructuredOutputsParams(regex=regex), n=2):
        assert re.fullmatch(regex, completion.text), completion.text
        assert completion.finish_reason == "stop"
    choices = ["positive", "negative", "neutral"]
    for completion in generate(smollm2_llm, PROMPTS, StructuredOutputsParams(choice=choices), n=2):
        assert completion.text in choices and completion.finish_reason == "stop"
    grammar = GRAMMARS[smollm2_llm.backend]
    for completion in generate(smollm2_llm, PROMPTS, StructuredOutputsParams(grammar=grammar), n=2, max_tokens=40):
        if completion.finish_reason == "stop":
            assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)*", completion.text), completion.text
        else:  # a sum may go on to max_tokens: what was written is still a prefix of a sentence
            assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)*( \+ ?| \+)?", completion.text), completion.text
    for completion in generate(
        smollm2_llm, ["Reply in JSON."], StructuredOutputsParams(json_object=True), n=4, max_tokens=400
    ):
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:
            assert completion.text.startswith("{")
    assert_all_blocks_free(smollm2_llm)


# ---- the batch: an unconstrained request pays nothing; compiles never stall -----------------------------
@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory="32MiB", max_model_len=512, max_num_seqs=16)
    yield llm
    llm.shutdown()


def test_unconstrained_greedy_tokens_unchanged_next_to_constrained_requests(tiny_llm):
    prompt = "Once upon a time, in a land far away, there lived a curious fox who"
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = tiny_llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    constrained = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,30}")
        )
        for i in range(3)
    ]
    outputs = tiny_llm.generate([prompt] * 4, [greedy, *constrained], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == alone
    for out in outputs[1:]:
        assert re.fullmatch(r"[a-z]{3,30}", out.outputs[0].text) or (
            out.outputs[0].finish_reason == "length" and re.fullmatch(r"[a-z]{0,30}", out.outputs[0].text)
        )
    assert_all_blocks_free(tiny_llm)


class GatedBackend:
    """A backend plugin whose compiles wait for the test (and fail for the regex 'fail')."""

    gate = threading.Event()

    @classmethod
    def make(cls):
        from engine_structured_output_xgrammar.plugin import XgrammarBackend

        class Gated(XgrammarBackend):
            name = "gated-test"
            priority = -1

            def compile_grammar(self, params):
                assert cls.gate.wait(60)
                if params.regex == "fail":
                    raise RuntimeError("compile failed on purpose")
                return super().compile_grammar(params)

        module = types.ModuleType("gated_backend_plugin")
        module.engine_structured_output_backends = hookimpl(lambda: [Gated])
        return module


@pytest.fixture
def gated_llm(tiny_llama):
    from engine.plugins import get_plugin_manager

    module = GatedBackend.make()
    manager = get_plugin_manager()
    manager.pm.register(module, name="gated_backend_plugin")
    GatedBackend.gate.clear()
    llm = LLM(
        tiny_llama, dtype="float32", kv_cache_memory="32MiB", max_model_len=512, structured_outputs_backend="gated-test"
    )
    yield llm
    GatedBackend.gate.set()
    llm.shutdown()
    manager.pm.unregister(module)


def run_until(engine, done, max_steps=2000):
    finals = {}
    for _ in range(max_steps):
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        if done(finals):
            return finals
    raise AssertionError(f"not done after {max_steps} steps: {finals}")


def test_a_compile_in_progress_does_not_stall_other_requests(gated_llm):
    engine = gated_llm.llm_engine
    constrained = SamplingParams(
        temperature=1.0, seed=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{4}")
    )
    engine.add_request("The year was", constrained, "constrained")
    engine.add_request(
        {"prompt_token_ids": list(range(200, 220))}, SamplingParams(max_tokens=12, ignore_eos=True), "free"
    )
    finals = run_until(engine, lambda f: "free" in f)
    assert len(finals["free"].outputs[0].token_ids) == 12 and "constrained" not in finals
    assert gated_llm.get_stats().num_waiting_reqs == 1  # still compiling, waiting
    GatedBackend.gate.set()
    finals = run_until(engine, lambda f: "constrained" in f)
    assert re.fullmatch(r"[0-9]{4}", finals["constrained"].outputs[0].text)
    assert finals["constrained"].outputs[0].finish_reason == "stop"
    assert_all_blocks_free(gated_llm)


def test_a_failed_compile_fails_its_request_alone(gated_llm):
    engine = gated_llm.llm_engine
    GatedBackend.gate.set()
    failing = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="fail"))
    engine.add_request("The year was", failing, "failing")
    engine.add_request(
        {"prompt_token_ids": list(range(200, 220))}, SamplingParams(max_tokens=8, ignore_eos=True), "free"
    )
    finals = run_until(engine, lambda f: len(f) == 2)
    assert finals["failing"].outputs[0].finish_reason == "error"
    assert "compile failed on purpose" in finals["failing"].error
    assert len(finals["free"].outputs[0].token_ids) == 8
    assert_all_blocks_free(gated_llm)


def test_compiled_grammars_are_cached_per_constraint(tiny_llm):
    manager = inspect(tiny_llm).structured_output_manager
    params = SamplingParams(
        temperature=1.0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex=r"[ab]{1,5}")
    )
    tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, params, use_tqdm=False)
    compiles = len(manager.compile_seconds)
    tiny_llm.generate([{"prompt_token_ids": [8, 9]}] * 2, params, use_tqdm=False)
    assert len(manager.compile_seconds) == compiles
    tiny_llm.generate(
        [{"prompt_token_ids": [8, 9]}],
        SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=r"[cd]{1,5}")),
        use_tqdm=False,
    )
    assert len(manager.compile_seconds) == compiles + 1


ENGINE_PATHS = {  # the engine paths a constrained request must survive, next to unconstrained ones
    "preemption": dict(num_gpu_blocks_override=8, max_model_len=128, max_num_batched_tokens=32),
    "async_scheduling": dict(async_scheduling=True, kv_cache_memory="32MiB", max_model_len=512),
    # the bitmask crosses process boundaries; PP: only the last stage masks and samples, in-flight steps overlap
    "tp2_pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2, kv_cache_memory="32MiB", max_model_len=512),
    "speculative_ngram": dict(
        speculative_method="ngram", prompt_lookup_min=2, prompt_lookup_max=3, kv_cache_memory="32MiB", max_model_len=512
    ),
}


@pytest.mark.parametrize("path", sorted(ENGINE_PATHS))
def test_constraints_hold_on_every_engine_path(tiny_llama, path):
    llm = LLM(tiny_llama, dtype="float32", **ENGINE_PATHS[path])
    try:
        regex = r"(ab|cd){2,12}x"
        prompt = "one two three one two three one two three one two"  # repeats: ngram drafts exist
        greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        alone = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        constrained = [
            SamplingParams(
                temperature=1.0, seed=i, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)
            )
            for i in range(5)
        ]
        outputs = llm.generate([prompt] * 6, [greedy, *constrained], use_tqdm=False)
        assert outputs[0].outputs[0].token_ids == alone
        for out in outputs[1:]:
            completion = out.outputs[0]
            assert completion.finish_reason == "stop" and re.fullmatch(regex, completion.text), completion
        assert_all_blocks_free(llm)
        if path == "preemption":
            assert llm.get_stats().num_preemptions > 0
    finally:
        llm.shutdown()


def test_aborting_a_request_whose_grammar_compiles_frees_it(gated_llm):
    engine = gated_llm.llm_engine
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}"))
    engine.add_request("Count:", params, "compiling")
    engine.step()
    assert gated_llm.get_stats().num_waiting_reqs == 1
    engine.abort_request(["compiling"])
    GatedBackend.gate.set()
    for _ in range(5):
        engine.step()
    assert_all_blocks_free(gated_llm)


# ---- speculative decoding: drafts checked against the grammar, one bitmask row per position ---------------
def allowed(bitmask: np.ndarray, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matchers_check_drafts_and_give_a_bitmask_row_per_draft(tiny_llama, backend):
    """A request's drafts are cut at the first token its grammar refuses, without moving its matcher; the bitmask
    gives draft position i the tokens allowed after the first i drafts; the matcher ends where it started."""
    from engine.config import VllmConfig
    from engine.model.model_info import resolve_model
    from engine.model.tokenizer import get_tokenizer
    from engine.structured_output.manager import StructuredOutputManager

    config = VllmConfig.load(model=tiny_llama, structured_outputs_backend=backend)
    info = resolve_model(config.model)
    manager = StructuredOutputManager(config, info)
    try:
        first, second = (manager.request(StructuredOutputsParams(regex=r"(ab|cd){1,3}x")) for _ in range(2))
        first.compiled.result(timeout=60)
        assert first.is_ready() and second.is_ready() and first.grammar is not None
        tokenizer = get_tokenizer(info)
        a, b, c, d, x, q = (tokenizer.convert_tokens_to_ids(char) for char in "abcdxq")
        grammar = first.grammar
        assert grammar.validate_tokens([a, b, c, d, x, a]) == [a, b, c, d, x]
        assert grammar.validate_tokens([a, c, d]) == [a]
        assert grammar.validate_tokens([q, a]) == []
        bitmask = manager.grammar_bitmask([(grammar, [a, b, c]), (second.grammar, [])])
        assert bitmask.shape[0] == 5
        expected = [{a, c}, {b}, {a, c, x}, {d}, {a, c}]  # before any draft, after a, ab, abc; the second request
        for row, tokens in enumerate(expected):
            assert {t for t in (a, b, c, d, x, q) if allowed(bitmask, row, t)} == tokens, row
        # the matchers did not move: the same rows again, and the first token still decides
        assert (manager.grammar_bitmask([(grammar, [a, b, c])]) == bitmask[:4]).all()
        assert grammar.accept_tokens([c]) and not grammar.accept_tokens([c])
    finally:
        manager.shutdown()


def test_drafts_are_verified_against_the_grammar(tiny_llama, oracle):
    """Constrained requests speculate too: the oracle proposer drafts each request's constrained greedy output
    (one draft in three made wrong), and greedy decoding with drafts gives the same tokens; the drafts the
    grammar allows are run and most are accepted, which only happens if every draft position is masked with
    its own bitmask row."""
    regex = r"(ab|cd|ef|gh){3,25}x"
    prompts = random_prompts(4, (5, 30), seed=11, vocab=(100, 1000))
    params = [
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ] * 2
    common = dict(dtype="float32", kv_cache_memory="32MiB", max_model_len=256)
    llm = LLM(tiny_llama, **common)
    try:
        reference = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    spec = oracle_spec_config(
        oracle, {",".join(map(str, p)): o.outputs[0].token_ids for p, o in zip(prompts, reference)}
    )
    llm = LLM(tiny_llama, speculative_config=spec, **common)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        counters = llm.get_stats().spec_decoding
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
    for out, ref in zip(outputs, reference):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
    for out in outputs[::2]:
        assert re.fullmatch(regex, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    assert counters.num_draft_tokens > 40
    assert counters.num_accepted_tokens > 0.7 * counters.num_draft_tokens
