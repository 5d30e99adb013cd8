"""LoRA adapters: PEFT folders read and checked, the batched product, and greedy parity with transformers + PEFT for
several adapters and the base model mixed in one batch (chunked prefill, preemption, prefix caching, TP=2)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from engine import LoRARequest, SamplingParams
from engine.testing.models import hf_greedy, random_prompts
from tests.helpers import assert_all_blocks_free

peft = pytest.importorskip("peft")

MAX_TOKENS = 10
# (folder name, rank, alpha, target modules, rsLoRA)
ADAPTERS = [
    ("qv", 4, 8, ["q_proj", "v_proj"], False),
    ("all", 16, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    ("mlp", 8, 32, ["gate_proj", "up_proj", "down_proj"], True),
    ("ko", 8, 4, ["k_proj", "o_proj"], False),
]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """Four adapters made by peft itself on the tiny model (B not zero: each changes the outputs)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    folders = {}
    for index, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        torch.manual_seed(100 + index)
        config = peft.LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, use_rslora=rslora
        )
        model = peft.get_peft_model(base, config)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "lora_" in pname:
                    param.normal_(0, 0.3)
        model.save_pretrained(root / name)
        folders[name] = str(root / name)
    return folders


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(5, (24, 90), seed=11)


@pytest.fixture(scope="module")
def references(tiny_llama, adapters, prompts) -> dict:
    """transformers + PEFT greedy tokens of every prompt under each adapter (None: the base model)."""
    from transformers import AutoModelForCausalLM

    refs = {
        None: hf_greedy(
            AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval(), prompts, MAX_TOKENS
        )
    }
    for name, folder in adapters.items():
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(base, folder).eval()
        refs[name] = hf_greedy(model, prompts, MAX_TOKENS)
    return refs


def lora_requests(adapters: dict[str, str]) -> dict:
    return {None: None, **{name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}}


def mixed_batch(prompts, names):
    """Every prompt under every adapter and the base model, interleaved: (prompt index, adapter name) pairs."""
    return [(p, name) for p in range(len(prompts)) for name in names]


def run(llm, prompts, pairs, requests):
    outputs = llm.generate(
        [{"prompt_token_ids": prompts[p]} for p, _ in pairs],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        lora_request=[requests[name] for _, name in pairs],
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outputs]


def assert_matches(pairs, tokens, references):
    mismatches = [
        (p, name, got, references[name][p]) for (p, name), got in zip(pairs, tokens) if got != references[name][p]
    ]
    assert not mismatches, mismatches


def test_adapters_change_the_outputs(references, prompts):
    """The references differ: a test that ran every request on the base model would fail."""
    for name, _, _, _, _ in ADAPTERS:
        assert references[name] != references[None], name


def test_mixed_batch_chunked_prefill_and_prefix_cache_equal_transformers_peft(
    tiny_llama, adapters, prompts, references
):
    from engine import LLM

    names = [None, *adapters]
    llm = LLM(
        tiny_llama,
        dtype="float32",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        max_num_batched_tokens=64,  # every prompt prefills in several chunks
        block_size=16,
    )
    requests = lora_requests(adapters)
    pairs = mixed_batch(prompts, names)
    assert_matches(pairs, run(llm, prompts, pairs, requests), references)
    hits = llm.get_stats().prefix_cache_hits
    assert_matches(pairs, run(llm, prompts, pairs, requests), references)  # now from the prefix cache
    assert llm.get_stats().prefix_cache_hits > hits
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_batch_invariant_adapters_give_the_same_bits_alone_and_in_any_batch(tiny_llama, adapters, prompts, references):
    """With ``batch_invariant``, a request on an adapter gets the same tokens and logprob bits alone as among the
    other adapters and the base model under chunked prefill (the cpu LoRA kernel sums each row in one order); its
    tokens still equal transformers + PEFT."""
    from engine import LLM

    requests = lora_requests(adapters)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3)

    def bits(llm, pairs):
        outputs = llm.generate(
            [{"prompt_token_ids": prompts[p]} for p, _ in pairs],
            params,
            lora_request=[requests[name] for _, name in pairs],
            use_tqdm=False,
        )
        return [
            (o.outputs[0].token_ids, [{k: v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs])
            for o in outputs
        ]

    config = dict(dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, batch_invariant=True)
    alone_llm = LLM(tiny_llama, enable_prefix_caching=False, **config)
    targets = [(0, "all"), (3, "mlp")]
    alone = [bits(alone_llm, [pair])[0] for pair in targets]
    alone_llm.shutdown()
    assert [tokens for tokens, _ in alone] == [references[name][p] for p, name in targets]
    llm = LLM(tiny_llama, max_num_batched_tokens=48, **config)
    pairs = mixed_batch(prompts, [None, *adapters])
    batched = dict(zip(pairs, bits(llm, pairs)))
    assert [batched[pair] for pair in targets] == alone
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_the_captured_decode_step_replays_adapter_steps_with_the_eager_bits(tiny_llama, adapters, prompts, references):
    """Decode steps whose tokens run adapters replay in the cpu plugin's C++ graph (the LoRA kernel after each
    product) and give the eager steps' tokens and logprob bits, which equal transformers + PEFT's tokens."""
    pytest.importorskip("engine_attention_cpu._graph", reason="the cpu plugin's decode graph is not built")
    from engine import LLM
    from engine.testing import inspect

    requests = lora_requests(adapters)
    pairs = mixed_batch(prompts[:3], [None, *adapters])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3)
    results, captured = {}, {}
    for enforce_eager in (True, False):
        llm = LLM(
            tiny_llama,
            dtype="float32",
            layer_kernels="cpu",
            enable_lora=True,
            max_loras=4,
            max_lora_rank=16,
            enforce_eager=enforce_eager,
        )
        outputs = llm.generate(
            [{"prompt_token_ids": prompts[p]} for p, _ in pairs],
            params,
            lora_request=[requests[name] for _, name in pairs],
            use_tqdm=False,
        )
        results[enforce_eager] = [
            (o.outputs[0].token_ids, [{k: v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs])
            for o in outputs
        ]
        captured[enforce_eager] = inspect(llm).model_runner.num_captured_steps
        assert_all_blocks_free(llm)
        llm.shutdown()
    assert captured[True] == 0 and captured[False] >= MAX_TOKENS - 2  # every pure decode step, adapters and all
    assert results[False] == results[True]
    assert_matches(pairs, [tokens for tokens, _ in results[False]], references)


def test_prefix_cache_keeps_adapters_apart(tiny_llama, adapters, prompts, references):
    from engine import LLM

    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=2, block_size=16)
    requests = lora_requests(adapters)
    prompt = prompts[4]

    def hits_of(name) -> int:
        before = llm.get_stats().prefix_cache_hits
        assert run(llm, [prompt], [(0, name)], requests) == [references[name][4]]
        return llm.get_stats().prefix_cache_hits - before

    assert hits_of("ko") == 0
    assert hits_of("all") == 0  # the same tokens under another adapter: not a hit
    assert hits_of(None) == 0  # nor for the base model
    assert hits_of("ko") > 0  # the same adapter again: a hit
    llm.shutdown()


def test_preemption_and_max_loras_one_slot(tiny_llama, adapters, prompts, references):
    """One slot for four adapters and a KV cache too small for the batch: requests wait for their adapter's turn,
    are preempted and recomputed, and still give transformers + PEFT's tokens."""
    from engine import LLM

    llm = LLM(
        tiny_llama,
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_lora_rank=16,
        block_size=16,
        num_gpu_blocks_override=14,
        max_model_len=128,
        max_num_batched_tokens=128,
    )
    names = [None, *adapters]
    pairs = mixed_batch(prompts, names)
    assert_matches(pairs, run(llm, prompts, pairs, lora_requests(adapters)), references)
    assert llm.get_stats().num_preemptions > 0
    assert_all_blocks_free(llm)
    llm.shutdown()


@pytest.mark.slow
def test_tensor_parallel_two_ranks_equal_transformers_peft(tiny_llama, adapters, prompts, references):
    """TP=2: A replicated and B split by output for q/k/v and gate/up, A split by input for o and down."""
    from engine import LLM

    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=4, tensor_parallel_size=2)
    pairs = mixed_batch(prompts[:3], [None, *adapters])
    assert_matches(pairs, run(llm, prompts, pairs, lora_requests(adapters)), references)
    llm.shutdown()


# ---- bad adapters ---------------------------------------------------------------------------------------------


def _copy_adapter(src: str, dst: Path, edit_config=None, edit_tensors=None) -> str:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    config = json.loads((Path(src) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(src) / "adapter_model.safetensors"))
    if edit_config:
        edit_config(config)
    if edit_tensors:
        tensors = edit_tensors(tensors)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return str(dst)


def _with_lm_head(tensors):
    return {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}


def _transposed(tensors):
    return {name: t.t().contiguous() if "k_proj.lora_B" in name else t for name, t in tensors.items()}


@pytest.mark.parametrize(
    "source, make, words",
    [
        ("ko", lambda src, dst: str(dst / "missing"), "is not a folder"),
        ("all", lambda src, dst: _copy_adapter(src, dst / "a"), "above lora.max_lora_rank (8)"),  # rank 16
        (
            "ko",
            lambda src, dst: _copy_adapter(src, dst / "b", edit_tensors=_with_lm_head),
            "target module 'lm_head' is not supported",
        ),
        (
            "ko",
            lambda src, dst: _copy_adapter(src, dst / "c", edit_tensors=_transposed),
            "do not fit this model's k_proj",
        ),
        (
            "ko",
            lambda src, dst: _copy_adapter(src, dst / "d", edit_config=lambda c: c.update(use_dora=True)),
            "DoRA adapters are not supported",
        ),
    ],
)
def test_a_bad_adapter_is_refused_with_the_reason_and_the_engine_keeps_serving(
    tiny_lora_llm, adapters, tmp_path, prompts, references, source, make, words
):
    bad = make(adapters[source], tmp_path)
    with pytest.raises(ValueError, match=re.escape(words)):
        tiny_lora_llm.generate("hello", SamplingParams(max_tokens=2), lora_request=LoRARequest("bad", 99, bad))
    good = LoRARequest("qv", 1, adapters["qv"])
    assert run(tiny_lora_llm, prompts, [(0, "qv")], {"qv": good}) == [references["qv"][0]]
    assert_all_blocks_free(tiny_lora_llm)


@pytest.fixture(scope="module")
def tiny_lora_llm(tiny_llama):
    from engine import LLM

    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=8)
    yield llm
    llm.shutdown()


def test_lora_off_refuses_an_adapter_request(tiny_llama, adapters):
    from engine import LLM

    llm = LLM(tiny_llama, dtype="float32")
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate("hello", SamplingParams(max_tokens=2), lora_request=LoRARequest("qv", 1, adapters["qv"]))
    llm.shutdown()


# ---- serving ---------------------------------------------------------------------------------------------------

API_KEY = "lora-test-key"


@pytest.fixture(scope="module")
def lora_dir(adapters, tmp_path_factory) -> Path:
    """The operator's adapter folder: 'fsad' (found by the filesystem resolver), 'runtime' (loaded over HTTP),
    'toohigh' (rank 16 > the server's 8), and a symlink out of it."""
    import shutil

    root = tmp_path_factory.mktemp("lora_dir")
    shutil.copytree(adapters["mlp"], root / "fsad")
    shutil.copytree(adapters["ko"], root / "runtime")
    shutil.copytree(adapters["all"], root / "toohigh")
    (root / "escape").symlink_to(Path(adapters["ko"]).resolve())
    return root


@pytest.fixture(scope="module")
def lora_server(tiny_llama, adapters, lora_dir):
    from tests.helpers import Server

    srv = Server(
        "--model",
        tiny_llama,
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "512",
        "--enable-lora",
        "--lora-modules",
        f"qv={adapters['qv']}",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-dir",
        str(lora_dir),
        "--enable-lora-runtime-updates",
        "--api-key",
        API_KEY,
    )
    yield srv
    srv.stop()


def _post(server, path: str, body: dict, key: str | None = API_KEY):
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def _complete(server, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    response = _post(
        server,
        "/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == model
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == max_tokens or body["choices"][0]["finish_reason"] == "stop"
    return tokens


@pytest.fixture(scope="module")
def token_text(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    return lambda ids: [tokenizer.decode([t]) for t in ids]


def test_served_adapters_are_listed_and_chosen_by_model(lora_server, prompts, references, token_text):
    import httpx

    listed = httpx.get(lora_server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [("tiny", None), ("qv", "tiny")]
    assert _complete(lora_server, "qv", prompts[0]) == token_text(references["qv"][0])
    assert _complete(lora_server, "tiny", prompts[0]) == token_text(references[None][0])
    unknown = _post(lora_server, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_the_filesystem_resolver_finds_an_adapter_by_name(lora_server, prompts, references, token_text):
    import httpx

    assert _complete(lora_server, "fsad", prompts[1]) == token_text(references["mlp"][1])
    listed = httpx.get(lora_server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"]
    assert "fsad" in [m["id"] for m in listed]
    for name in ("../fsad", "escape/..", "toohigh"):  # a walk out of the folder finds nothing; a bad adapter is a 400
        response = _post(lora_server, "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2})
        assert response.status_code == (400 if name == "toohigh" else 404), response.text
        assert response.json()["error"]["message"]


def test_runtime_load_is_an_admin_action_confined_to_the_allowed_folders(
    lora_server, lora_dir, adapters, prompts, references, token_text
):
    load = {"lora_name": "rt", "lora_path": str(lora_dir / "runtime")}
    assert _post(lora_server, "/v1/load_lora_adapter", load, key=None).status_code == 401
    for path, status in (
        (adapters["ko"], 403),  # outside --lora-dir
        (str(lora_dir / "runtime" / ".." / "runtime"), 403),  # '..' is refused even when it lands inside
        (str(lora_dir / "escape"), 403),  # a symlink out of the folder
        (str(lora_dir / "toohigh"), 400),  # inside, but rank 16 > --max-lora-rank 8
        (str(lora_dir / "missing"), 400),
    ):
        response = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": path})
        assert response.status_code == status, (path, response.text)
        assert response.json()["error"]["message"]
    assert "outside the allowed folders" in lora_server.output()  # refusals are logged
    started = time.monotonic()
    assert _post(lora_server, "/v1/load_lora_adapter", load).status_code == 200
    assert _complete(lora_server, "rt", prompts[2]) == token_text(references["ko"][2])
    print(f"first request of a runtime-loaded adapter: {time.monotonic() - started:.2f} s after the load call")
    assert _post(lora_server, "/v1/load_lora_adapter", load).status_code == 400  # the name is taken
    assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "rt"}).status_code == 200
    gone = _post(lora_server, "/v1/completions", {"model": "rt", "prompt": "hi", "max_tokens": 2})
    assert gone.status_code == 404
    assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "rt"}).status_code == 404


def test_unloading_an_adapter_in_use_lets_its_requests_finish(lora_server, lora_dir, prompts, references, token_text):
    import httpx

    assert (
        _post(
            lora_server, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": str(lora_dir / "runtime")}
        ).status_code
        == 200
    )
    body = {
        "model": "busy",
        "prompt": prompts[3],
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
    }
    tokens: list[str] = []
    with httpx.stream(
        "POST",
        lora_server.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    ) as stream:
        unloaded = False
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            tokens += chunk["choices"][0]["logprobs"]["tokens"]
            if tokens and not unloaded:
                assert _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "busy"}).status_code == 200
                unloaded = True
    assert unloaded and len(tokens) == 120
    assert tokens[:MAX_TOKENS] == token_text(references["ko"][3])


def test_adapter_metrics(lora_server, prompts):
    import httpx

    _complete(lora_server, "qv", prompts[4], max_tokens=3)
    text = httpx.get(lora_server.url + "/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("engine_lora_generation_tokens_total{")]
    assert any('lora_name="qv"' in line and float(line.rsplit(" ", 1)[1]) >= 3 for line in lines), lines


# ---- pieces ----------------------------------------------------------------------------------------------------


def test_config_keys_and_their_errors(tmp_path):
    from engine.config import ConfigError, VllmConfig

    config = VllmConfig.load(enable_lora=True, lora_modules="a=/x b=/y", max_loras=2, max_cpu_loras=3)
    assert config.lora.modules() == {"a": "/x", "b": "/y"} and config.lora.cpu_capacity == 3
    yaml_file = tmp_path / "engine.yaml"
    yaml_file.write_text("lora:\n  enable_lora: true\n  lora_modules: {sql: /adapters/sql}\n  max_lora_rank: 64\n")
    assert VllmConfig.load(yaml_file).lora.modules() == {"sql": "/adapters/sql"}
    for bad, words in (
        (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
        (dict(lora_modules=["a=/x"]), "needs lora.enable_lora"),
        (dict(enable_lora=True, lora_modules=["no-path"]), "NAME=PATH"),
    ):
        with pytest.raises(ConfigError, match=words):
            VllmConfig.load(**bad)


def test_path_checks_follow_symlinks_and_refuse_dot_dot(tmp_path):
    from engine.lora.paths import path_within

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert path_within(str(root / "a"), [str(root)])
    assert not path_within(str(root / "a" / ".." / "a"), [str(root)])
    assert not path_within(str(root / "link"), [str(root)])
    assert not path_within(str(tmp_path / "rootless"), [str(root)])  # a shared prefix is not inside
    assert not path_within(str(root / "a"), [])


def test_prefix_hashes_differ_per_adapter_and_id():
    from engine.kv_cache.hashing import extend_block_hashes

    def first(lora=None, salt=None):
        hashes: list[bytes] = []
        extend_block_hashes(hashes, list(range(32)), 16, salt, lora)
        return hashes

    base = first()
    assert base == first(None, None)
    assert len({base[0], first(("a", 1))[0], first(("b", 2))[0], first(("a", 3))[0]}) == 4
    assert first(("a", 1), "salt") != first(("a", 1))


def test_the_scheduler_keeps_a_steps_adapters_within_max_loras():
    """Requests of a third adapter wait while two others run (max_loras=2), and start when one finishes; the base
    model's never wait for a slot, and requests behind a waiting one are not held up by it."""
    from engine.config import VllmConfig
    from engine.kv_cache.coordinators import UnitaryKVCacheCoordinator
    from engine.kv_cache.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from engine.scheduler.output import ModelRunnerOutput
    from engine.scheduler.request import Request
    from engine.scheduler.scheduler import Scheduler

    kv = KVCacheConfig(64, (KVCacheGroupSpec(("l0",), FullAttentionSpec(16, 1, 4, torch.float32)),))
    scheduler = Scheduler(
        VllmConfig.load(enable_lora=True, max_loras=2), kv, UnitaryKVCacheCoordinator, max_model_len=128
    )
    adapters = [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in (1, 2, 3)]
    for index, adapter in enumerate([adapters[0], adapters[1], adapters[2], None, adapters[0]]):
        prompt = list(range(100 * (index + 1), 100 * (index + 1) + 8))
        scheduler.add_request(
            Request(f"r{index}", prompt, SamplingParams(max_tokens=1), None, 16, lora_request=adapter)
        )
    output = scheduler.schedule()
    assert sorted(new.req_id for new in output.scheduled_new_reqs) == ["r0", "r1", "r3", "r4"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    sampled = [[5] for _ in output.num_scheduled_tokens]
    scheduler.update_from_output(output, ModelRunnerOutput(list(output.num_scheduled_tokens), sampled))
    output = scheduler.schedule()  # every request above finished (max_tokens=1): a3 gets a slot
    assert [new.req_id for new in output.scheduled_new_reqs] == ["r2"]
    assert output.scheduled_new_reqs[0].lora_request == adapters[2]


def test_engine_plugins_lists_the_lora_kernels_and_resolvers(tmp_path):
    from engine.config import VllmConfig
    from engine.interfaces.base import SelectionContext
    from engine.plugins import get_plugin_manager

    def rows(**config):
        return get_plugin_manager().table(SelectionContext(VllmConfig.load(**config)))

    kernels = {row["name"]: row["lora"] for row in rows() if row["kind"] == "layer_kernels"}
    assert kernels["native"].startswith("the torch reference")
    if "cpu" in kernels:
        assert kernels["cpu"].startswith("own kernel (CpuLayerKernels.add_lora)")
    (resolver,) = [row for row in rows() if row["kind"] == "lora_resolver"]
    assert resolver["name"] == "filesystem" and resolver["available"] == "no" and "lora" in resolver["reason"]
    (resolver,) = [row for row in rows(enable_lora=True, lora_dir=str(tmp_path)) if row["kind"] == "lora_resolver"]
    assert resolver["available"] == "yes"


def test_speculative_decoding_verifies_drafts_with_each_requests_adapter(
    tiny_llama, oracle, adapters, prompts, references
):
    """Drafts of the oracle proposer (transformers + PEFT's tokens, one in three made wrong) are verified by the target
    model under each request's adapter: accepted where right, rejected where wrong, and the greedy tokens stay
    transformers + PEFT's, for two adapters and the base model in one batch."""
    from engine import LLM
    from tests.helpers import oracle_spec_config

    pairs = [(0, None), (1, "all"), (2, "ko"), (3, "mlp")]
    drafts = {",".join(map(str, prompts[p])): references[name][p] for p, name in pairs}
    llm = LLM(
        tiny_llama,
        dtype="float32",
        enable_lora=True,
        max_loras=3,
        speculative_config=oracle_spec_config(oracle, drafts),
    )
    assert_matches(pairs, run(llm, prompts, pairs, lora_requests(adapters)), references)
    counters = llm.get_stats().spec_decoding
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    llm.shutdown()


def test_adapters_over_int8_quantized_base_weights(tiny_llama, hf_tiny_llama, adapters, prompts):
    """LoRA adds to the product whatever the base weights are: over weight-only int8 (native kernels: products on
    the de-quantized weights) greedy tokens equal transformers + PEFT on the int8-rounded base."""
    from engine import LLM
    from tests.helpers import rounded_copy

    rounded = rounded_copy(hf_tiny_llama)
    want = {
        name: hf_greedy(
            peft.PeftModel.from_pretrained(rounded_copy(hf_tiny_llama), adapters[name]).eval(), prompts[:2], MAX_TOKENS
        )
        for name in ("all", "mlp")
    }
    want[None] = hf_greedy(rounded.eval(), prompts[:2], MAX_TOKENS)
    llm = LLM(tiny_llama, dtype="float32", quantization="int8", layer_kernels="native", enable_lora=True, max_loras=2)
    pairs = [(p, name) for p in range(2) for name in (None, "all", "mlp")]
    requests = {
        None: None,
        "all": LoRARequest("all", 2, adapters["all"]),
        "mlp": LoRARequest("mlp", 3, adapters["mlp"]),
    }
    assert_matches(pairs, run(llm, prompts, pairs, requests), want)
    llm.shutdown()
