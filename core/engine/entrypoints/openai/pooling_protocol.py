"""Request bodies of the pooling endpoints, as vLLM (and OpenAI, Jina, Cohere) spell them."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from engine.entrypoints.openai.protocol import TokenId

# a string, strings, token ids, or lists of token ids (OpenAI's embeddings `input`)
PoolingInput = Union[str, list[str], list[TokenId], list[list[TokenId]]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)


class EmbeddingRequest(_Body):
    """POST /v1/embeddings (OpenAI's, with vLLM's ``normalize`` and ``truncate_prompt_tokens``)."""

    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    normalize: Optional[bool] = None


class PoolingRequest(_Body):
    """POST /pooling: the pooled output of each input, for any task the model serves (default ``encode``)."""

    input: PoolingInput
    task: Literal["embed", "classify", "encode"] = "encode"
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    normalize: Optional[bool] = None


class ClassificationRequest(_Body):
    """POST /classify: class probabilities of each input."""

    input: PoolingInput
    activation: Optional[bool] = None


class ScoreRequest(_Body):
    """POST /v1/score and /score: relevance of (text_1, text_2) pairs, one text_1 against many or pairwise."""

    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: str


class RerankRequest(_Body):
    """POST /rerank, /v1/rerank, /v2/rerank (Jina / Cohere): documents ordered by relevance to the query."""

    query: str
    documents: list[Union[str, RerankDocument]] = Field(min_length=1)
    top_n: Optional[int] = Field(None, ge=0)
    return_documents: bool = True
