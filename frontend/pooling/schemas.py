"""Request bodies of the pooling doors (pydantic), as OpenAI's embeddings API and vLLM's pooling, score,
rerank and classify APIs define them. The same rule as every door: a field declared here is implemented,
one those APIs define that we do not implement is a 400 naming it (check_fields), others are ignored."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from frontend.openai.schemas import check_fields, check_one_of, check_truncation_and_salt, unsupported
from frontend.server.errors import OpenAIError

# the most inputs one request may carry (OpenAI's limit for embeddings)
MAX_INPUTS = 2048
# fields vLLM's pooling requests define that we do not implement
UNSUPPORTED_FIELDS = {
    "mm_processor_kwargs": "multimodal inputs",
    "messages": "chat messages as the input (embed text or token ids)",
    "chat_template": "chat messages as the input",
    "chat_template_kwargs": "chat messages as the input",
    "add_generation_prompt": "chat messages as the input",
    "continue_final_message": "chat messages as the input",
    "media_io_kwargs": "multimodal inputs",
    "max_tokens_per_query": "the query's own cut (rerank)",
}

Input = str | list[str] | list[int] | list[list[int]]


class PoolingFields(BaseModel):
    """What every pooling request shares."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    user: str | None = None  # metadata: changes no output
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None

    def check_supported(self) -> None:
        check_fields(self, UNSUPPORTED_FIELDS)
        check_truncation_and_salt(self.truncate_prompt_tokens, self.cache_salt)


class ActivationFields(BaseModel):
    """classify, score, rerank: softmax over the labels (sigmoid for one). vLLM's names: use_activation
    (its current one), activation and softmax (older)."""

    activation: bool | None = None
    use_activation: bool | None = None
    softmax: bool | None = None

    def activation_of(self) -> bool | None:
        """The one that is set (None: the model's default); 400 when two disagree."""
        given = {
            name: value
            for name, value in (
                ("use_activation", self.use_activation),
                ("activation", self.activation),
                ("softmax", self.softmax),
            )
            if value is not None
        }
        if len(set(given.values())) > 1:
            raise OpenAIError(f"{' and '.join(given)} disagree: give one.", param=next(iter(given)))
        return next(iter(given.values()), None)


class EmbeddingRequest(PoolingFields):
    """POST /v1/embeddings (and /pooling, which answers with `data` instead of `embedding`)."""

    input: Input
    encoding_format: str = "float"  # or base64: float32 little-endian bytes, as the openai SDK reads them
    dimensions: int | None = None  # a Matryoshka model's output size
    normalize: bool | None = None  # vLLM's: None for the model's default
    embed_dtype: str = "float32"  # vLLM's; only float32 here
    endianness: str = "native"  # vLLM's, for base64; float32 little-endian here (x86's native)

    def check_supported(self) -> None:
        super().check_supported()
        check_one_of("encoding_format", self.encoding_format, ("float", "base64"))
        check_one_of("embed_dtype", self.embed_dtype, ("float32",))
        check_one_of("endianness", self.endianness, ("native", "little"))
        if self.dimensions is not None and self.dimensions < 1:
            raise OpenAIError("dimensions must be at least 1.", param="dimensions")


class PoolingRequest(EmbeddingRequest, ActivationFields):
    """POST /pooling: the model's pooled output as it is (vLLM's `task` picks embed, token_embed,
    classify or score); `dimensions` and `normalize` are for the embedding tasks, the activation for the
    others."""

    task: str | None = None


class ClassifyRequest(PoolingFields, ActivationFields):
    """POST /classify."""

    input: Input


class ScoreRequest(PoolingFields, ActivationFields):
    """POST /score and /v1/score: queries against documents (1 to 1, 1 to N, or N to N). text_1 and
    text_2 are the older names."""

    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None

    def pairs(self) -> tuple[list[str], list[str]]:
        """(queries, documents), one query per document."""
        first = self.queries if self.queries is not None else self.text_1
        second = self.documents if self.documents is not None else self.text_2
        if self.queries is not None and self.text_1 is not None:
            raise OpenAIError("Give queries or text_1, not both.", param="text_1")
        if self.documents is not None and self.text_2 is not None:
            raise OpenAIError("Give documents or text_2, not both.", param="text_2")
        if first is None:
            raise OpenAIError("queries (or text_1) is required.", param="queries")
        if second is None:
            raise OpenAIError("documents (or text_2) is required.", param="documents")
        queries = [first] if isinstance(first, str) else list(first)
        documents = [second] if isinstance(second, str) else list(second)
        if not queries or not documents:
            param = "queries" if not queries else "documents"
            raise OpenAIError(f"{param} must not be empty.", param=param)
        if len(queries) == 1:
            queries = queries * len(documents)
        elif len(queries) != len(documents):
            raise OpenAIError(
                f"{len(queries)} queries and {len(documents)} documents: give one query, or one per document.",
                param="documents",
            )
        return queries, documents


class RerankRequest(PoolingFields, ActivationFields):
    """POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape)."""

    query: str
    documents: list[str] | list[dict[str, Any]]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True
    max_tokens_per_doc: int | None = None  # Cohere v2's: truncation of each document
    rank_fields: list[str] | None = Field(default=None)  # Cohere v1's structured documents

    def check_supported(self) -> None:
        super().check_supported()
        if self.rank_fields is not None:
            raise unsupported("rank_fields", "structured documents' rank fields")
        if self.top_n is not None and self.top_n < 0:
            raise OpenAIError("top_n must be 0 or more.", param="top_n")
        if self.max_tokens_per_doc is not None and self.max_tokens_per_doc < 1:
            raise OpenAIError("max_tokens_per_doc must be at least 1.", param="max_tokens_per_doc")

    def texts(self) -> list[str]:
        """The documents' texts: strings, or objects with a `text` (Cohere's and Jina's)."""
        texts = []
        documents: list[str | dict[str, Any]] = list(self.documents)
        for i, document in enumerate(documents):
            if isinstance(document, str):
                texts.append(document)
            elif isinstance(document.get("text"), str):
                texts.append(document["text"])
            else:
                raise OpenAIError(f"documents[{i}] has no text.", param="documents")
        return texts
