"""The OpenAI-compatible HTTP API's request and response bodies, as pydantic models.

Requests are validated strictly (no string-to-number or number-to-bool coercion) and refuse unknown fields, so a
typo is a 400 naming it rather than a silent ignore; OpenAI fields this server does not implement are listed in
UNSUPPORTED_FIELDS and refused with a message saying so before the model sees them. Ranges of the sampling fields
are not repeated here: they are checked by api/validation.py, which every API shares.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# OpenAI (and vLLM) request fields this server does not implement: refused with 400 when set to anything but null.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "tools": "tool calling", "tool_choice": "tool calling", "functions": "function calling",
    "function_call": "function calling", "parallel_tool_calls": "tool calling",
    "response_format": "structured output (only {\"type\": \"text\"})", "guided_json": "guided decoding",
    "guided_regex": "guided decoding", "guided_choice": "guided decoding", "guided_grammar": "guided decoding",
    "logit_bias": "logit bias", "audio": "audio output", "modalities": "output modalities other than text",
    "prediction": "predicted outputs", "web_search_options": "web search", "reasoning_effort": "reasoning models",
    "store": "stored completions", "metadata": "stored completions", "service_tier": "service tiers",
    "suffix": "insertion (suffix)", "best_of": "best_of other than n", "prompt_logprobs": "prompt log-probabilities",
    "chat_template": "per-request chat templates", "chat_template_kwargs": "per-request chat templates",
    "continue_final_message": "continuing the final message", "documents": "RAG documents",
}  # fmt: skip
# Message fields of the same kind: a tool or function conversation cannot be rendered faithfully.
UNSUPPORTED_MESSAGE_FIELDS: dict[str, str] = {
    "tool_calls": "tool calling", "tool_call_id": "tool calling", "function_call": "function calling",
    "audio": "audio", "refusal": "refusals", "name": "participant names",
}  # fmt: skip


class _Request(BaseModel):
    """Every field is optional (null = its default, as some clients send every field) except the input."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = None


class SamplingFields(_Request):
    """The fields chat and text completions share: OpenAI's, then the extra sampling fields vLLM accepts."""

    model: str | None = None  # None or "" = the server's default model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Any = None  # a string or a list of strings (checked by the translation, which names the field)
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted as OpenAI does; it has no effect on generation
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None
    cache_salt: str | None = None
    add_special_tokens: bool | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None


class CompletionRequest(SamplingFields):
    prompt: Any  # a string, a list of strings, a list of token ids or a list of such lists
    logprobs: int | None = None
    echo: bool | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- responses ------------------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str = ""


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _present_only(self, handler: Any) -> dict[str, Any]:  # a delta carries only what changed
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # present (null until the last chunk) only with stream_options.include_usage


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A text completion, and also each chunk of a streamed one (OpenAI uses one shape for both)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "ringserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
