"""Pooling models (issue 42): decoder embedders, BERT / XLM-RoBERTa encoders and cross-encoders, a causal LM as a
yes/no reranker, each held to transformers' pooled output on the same weights (float32, 1e-5), through batches of
mixed lengths, chunked prefill and tensor parallelism; the pooling endpoints and the pooler plugin kind."""

from __future__ import annotations

import base64
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from engine import LLM, PoolingParams
from engine.errors import InvalidParameterError
from engine.testing.pooling_models import make_tiny_decoder_embedder, make_tiny_encoder
from tests.helpers import Server, assert_all_blocks_free, install_fixture_plugins

TEXTS = [
    "the cat",
    "a search engine ranks every passage of the corpus by its answer to the question",
    "dog",
    "the river runs from the mountain to the city, and the fish swim in it all the time " * 3,
    "question: which bird? answer: the one in the tree",
]
ATOL = 1e-5


@pytest.fixture(scope="module")
def decoder_embedder(tmp_path_factory, tokenizer_dir) -> str:
    return make_tiny_decoder_embedder(tmp_path_factory.mktemp("qwen3-embedding"), tokenizer_dir)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("encoders")
    return {
        "bert_mean": make_tiny_encoder(folder / "bert", "BertConfig", "BertModel", sentence_transformers="mean"),
        "xlmr_cls": make_tiny_encoder(
            folder / "xlmr", "XLMRobertaConfig", "XLMRobertaModel", sentence_transformers="cls", seed=1
        ),
        "bert_ce": make_tiny_encoder(folder / "bert-ce", "BertConfig", "BertForSequenceClassification", num_labels=1),
        "xlmr_ce": make_tiny_encoder(
            folder / "xlmr-ce", "XLMRobertaConfig", "XLMRobertaForSequenceClassification", num_labels=1, seed=2
        ),
        "bert_3": make_tiny_encoder(
            folder / "bert-3", "BertConfig", "BertForSequenceClassification", num_labels=3, seed=3
        ),
    }


def hf_hidden_states(path: str, texts: list[str]) -> list[torch.Tensor]:
    from transformers import AutoModel, AutoTokenizer

    model, tokenizer = AutoModel.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
    states = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")
            if model.config.type_vocab_size == 1 if hasattr(model.config, "type_vocab_size") else False:
                ids["token_type_ids"] = torch.zeros_like(ids["input_ids"])
            states.append(model(**ids).last_hidden_state[0])
    return states


def pooled(states: torch.Tensor, how: str) -> torch.Tensor:
    return {"last": states[-1], "mean": states.mean(dim=0), "cls": states[0], "max": states.max(dim=0).values}[how]


def assert_close(ours: list[float], reference: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(ours), reference.float(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
@pytest.mark.parametrize("budget", [2048, 16])  # 16: the long prompts are prefilled in chunks
def test_decoder_embedder_matches_transformers(decoder_embedder, pooling_type, budget):
    llm = LLM(
        decoder_embedder, dtype="float32", pooling_type=pooling_type, max_num_batched_tokens=budget, max_num_seqs=4
    )
    try:
        outputs = llm.embed(TEXTS, use_tqdm=False)
        for output, states in zip(outputs, hf_hidden_states(decoder_embedder, TEXTS)):
            assert_close(output.outputs.embedding, F.normalize(pooled(states, pooling_type), dim=-1))
        unnormalized = llm.embed(TEXTS[:2], PoolingParams(normalize=False), use_tqdm=False)
        assert_close(
            unnormalized[1].outputs.embedding, pooled(hf_hidden_states(decoder_embedder, TEXTS[1:2])[0], pooling_type)
        )
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_encoders_match_transformers_and_sentence_transformers(encoders):
    from sentence_transformers import SentenceTransformer

    for key, how in (("bert_mean", "mean"), ("xlmr_cls", "cls")):
        path = encoders[key]
        llm = LLM(path, dtype="float32")
        try:
            outputs = llm.embed(TEXTS, use_tqdm=False)
            assert llm.llm_engine.model_info.is_encoder_only
            for output, states in zip(outputs, hf_hidden_states(path, TEXTS)):
                assert_close(output.outputs.embedding, F.normalize(pooled(states, how), dim=-1))
            reference = SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_tensor=True)
            for output, row in zip(outputs, reference):
                assert_close(output.outputs.embedding, row)
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()


def hf_pair_logits(path: str, pairs: list[tuple[str, str]]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = []
    with torch.no_grad():
        for query, document in pairs:
            ids = tokenizer(query, document, return_tensors="pt")
            if model.config.type_vocab_size == 1:
                ids["token_type_ids"] = torch.zeros_like(ids["input_ids"])
            rows.append(model(**ids).logits[0])
    return torch.stack(rows)


@pytest.mark.parametrize("key", ["bert_ce", "xlmr_ce"])
def test_cross_encoders_score_and_rank_as_transformers(encoders, key):
    path = encoders[key]
    query, documents = TEXTS[0], TEXTS[1:]
    llm = LLM(path, dtype="float32")
    try:
        scores = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
        reference = hf_pair_logits(path, [(query, d) for d in documents])[:, 0].sigmoid()
        assert_close(scores, reference)
        assert np.argsort(scores).tolist() == reference.argsort().tolist()
        pairwise = llm.score(TEXTS[:2], TEXTS[2:4], use_tqdm=False)  # N x N: pair i with i
        assert_close(
            [o.outputs.score for o in pairwise], hf_pair_logits(path, list(zip(TEXTS[:2], TEXTS[2:4])))[:, 0].sigmoid()
        )
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_classifier_probabilities_and_refused_tasks(encoders):
    path = encoders["bert_3"]
    llm = LLM(path, dtype="float32")
    try:
        outputs = llm.classify(TEXTS, use_tqdm=False)
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        with torch.no_grad():
            for output, text in zip(outputs, TEXTS):
                assert_close(output.outputs.probs, model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1))
        with pytest.raises(InvalidParameterError, match="classifier with 3 labels"):
            llm.score("a", ["b"], use_tqdm=False)  # three labels: a classifier, not a cross-encoder
        with pytest.raises(InvalidParameterError, match="task 'embed'"):
            llm.embed("a", use_tqdm=False)
        with pytest.raises(InvalidParameterError, match="pooling model"):
            llm.generate("a", use_tqdm=False)
    finally:
        llm.shutdown()


def test_causal_lm_as_a_yes_no_reranker(make_tiny_model):
    """Qwen3-Reranker's form: the last position's logits of "no" and "yes"; the score is P(yes) of the two."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_model("Qwen3Config", head_dim=16)
    llm = LLM(path, dtype="float32", runner="pooling", classifier_from_token=["no", "yes"])
    try:
        query, documents = "question: which bird?", ["the one in the tree", "fish", "the city"]
        scores = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
        model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
        no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
        with torch.no_grad():
            reference = [
                model(**tokenizer(query, d, return_tensors="pt")).logits[0, -1, [no, yes]].softmax(-1)[1]
                for d in documents
            ]
        assert_close(scores, torch.stack(reference))
    finally:
        llm.shutdown()


def test_requests_must_fit_the_model(tiny_llama, make_tiny_model, tokenizer_dir, tmp_path):
    llm = LLM(tiny_llama, dtype="float32")
    try:
        with pytest.raises(InvalidParameterError, match="generative model"):
            llm.embed("hi", use_tqdm=False)
    finally:
        llm.shutdown()
    matryoshka = make_tiny_decoder_embedder(tmp_path / "matryoshka", tokenizer_dir, is_matryoshka=True)
    llm = LLM(matryoshka, dtype="float32")
    try:
        full = llm.embed(TEXTS[1], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
        cut = llm.embed(TEXTS[1], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
        assert_close(cut, F.normalize(torch.tensor(full[:16]), dim=-1))
        with pytest.raises(InvalidParameterError, match="exceeds"):
            llm.embed("hi", PoolingParams(dimensions=65), use_tqdm=False)
    finally:
        llm.shutdown()


def test_tensor_parallel_decoder_embedder(decoder_embedder):
    llm = LLM(decoder_embedder, dtype="float32", tensor_parallel_size=2, pooling_type="mean", max_num_batched_tokens=32)
    try:
        outputs = llm.embed(TEXTS, use_tqdm=False)
        for output, states in zip(outputs, hf_hidden_states(decoder_embedder, TEXTS)):
            assert_close(output.outputs.embedding, F.normalize(states.mean(dim=0), dim=-1))
    finally:
        llm.shutdown()


def test_third_party_pooler_plugin(tmp_path_factory, encoders):
    env = install_fixture_plugins(tmp_path_factory, "engine_pooler_plugin")
    path = encoders["bert_mean"]
    script = f"""
import json
from engine import LLM
llm = LLM({path!r}, dtype="float32", pooling_type="max")
print(json.dumps([o.outputs.embedding for o in llm.embed({TEXTS!r}, use_tqdm=False)]))
llm.shutdown()
"""
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    import json

    embeddings = json.loads(result.stdout.strip().splitlines()[-1])
    for embedding, states in zip(embeddings, hf_hidden_states(path, TEXTS)):
        assert_close(embedding, F.normalize(states.max(dim=0).values, dim=-1))


@pytest.fixture(scope="module")
def embedding_server(encoders):
    srv = Server("--model", encoders["bert_mean"], "--served-model-name", "tiny-embed", "--dtype", "float32")
    yield srv
    srv.stop()


def test_openai_client_embeddings_and_pooling_endpoints(embedding_server, encoders):
    client = openai.OpenAI(base_url=embedding_server.url + "/v1", api_key="unused", max_retries=0)
    result = client.embeddings.create(model="tiny-embed", input=TEXTS)
    reference = [F.normalize(s.mean(dim=0), dim=-1) for s in hf_hidden_states(encoders["bert_mean"], TEXTS)]
    assert [d.index for d in result.data] == list(range(len(TEXTS)))
    for data, row in zip(result.data, reference):
        assert_close(data.embedding, row)
    assert result.usage.prompt_tokens == result.usage.total_tokens > len(TEXTS)
    raw = httpx.post(
        embedding_server.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}, timeout=30
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert_close(decoded.tolist(), reference[0])
    score = httpx.post(
        embedding_server.url + "/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:3]}, timeout=30
    ).json()
    cosines = [float(reference[0] @ reference[i]) for i in (1, 2)]
    assert [d["score"] for d in score["data"]] == pytest.approx(cosines, abs=1e-5)
    ranked = httpx.post(
        embedding_server.url + "/v1/rerank",
        json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2},
        timeout=30,
    ).json()
    expected = sorted(range(1, len(TEXTS)), key=lambda i: -float(reference[0] @ reference[i]))[:2]
    assert [r["index"] + 1 for r in ranked["results"]] == expected
    assert ranked["results"][0]["document"]["text"] == TEXTS[expected[0]]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": [5] * 300}, "input"),  # past the context length
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
    ],
)
def test_pooling_server_answers_bad_requests_with_400(embedding_server, path, body, param):
    response = httpx.post(embedding_server.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.post(embedding_server.url + "/v1/embeddings", json={"input": "up"}, timeout=30).status_code == 200


def test_pooler_settings_from_flags_and_text():
    from engine.config import ConfigError, VllmConfig

    for text in ('["no", "yes"]', "no,yes"):
        assert VllmConfig.load(classifier_from_token=text).pooler.classifier_from_token == ["no", "yes"]
    assert VllmConfig.load(pooling_type="MEAN").pooler.pooling_type == "mean"
    with pytest.raises(ConfigError, match="classifier_from_token"):
        VllmConfig.load(classifier_from_token="a,b,c")
    with pytest.raises(ConfigError, match="model.runner"):
        VllmConfig.load(runner="embed")
