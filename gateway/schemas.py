"""The response bodies, as pydantic models: what /openapi.json publishes for each route.

The gateway builds its JSON directly (the stream splices text into precomputed
chunk JSON); tests validate real responses against these models, which forbid
unknown fields, so the published schema cannot drift from what is sent.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Closed):
    message: str
    type: str
    param: str | None = Field(description="The request parameter the error is about, if any")
    code: str | None


class ErrorResponse(_Closed):
    error: ErrorDetail


class SpeculationStats(_Closed):
    """The `usage.speculation` extension: what the speculation did (Stats in the proto)."""

    proposer: str
    fallback_reason: str | None
    target_passes: int = Field(ge=0)
    draft_calls: int = Field(ge=0)
    drafted_tokens: int = Field(ge=0)
    accepted_tokens: int = Field(ge=0)
    acceptance_rate: float = Field(ge=0, le=1)
    acceptance_by_position: list[float]
    tokens_per_target_pass: float = Field(ge=0)
    session_id: str
    seed: int = Field(ge=0)
    choices: list[SpeculationStats] | None = Field(
        None, description="n > 1: each choice's own (the counts above are their sums)")


class PromptTokensDetails(_Closed):
    cached_tokens: int = Field(ge=0, description="Served from a kept session's KV caches")
    audio_tokens: int = 0


class CompletionTokensDetails(_Closed):
    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = Field(
        ge=0, description="Tokens of `prediction` the target accepted")
    rejected_prediction_tokens: int = Field(
        ge=0, description="Tokens of `prediction` proposed and rejected by the target")


class Usage(_Closed):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0, description="Summed over the choices")
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
    speculation: SpeculationStats


class UsageSoFar(_Closed):
    """stream_options.continuous_usage_stats: the counts so far, on every chunk (vLLM's extension)."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


FinishReason = Literal["stop", "length", "passes", "tool_calls"]


class FunctionCall(_Closed):
    name: str
    arguments: str = Field(description="JSON text; under tool_choice required or a named function it "
                                       "always parses and validates against the function's parameters")


class ToolCallOut(_Closed):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessageOut(_Closed):
    role: Literal["assistant"]
    content: str | None = Field(description="None when the message is tool calls only")
    refusal: None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Closed):
    index: int = Field(ge=0)
    message: ChatMessageOut
    logprobs: Any
    finish_reason: FinishReason


class _Completion(_Closed):
    id: str
    created: int
    model: str
    system_fingerprint: None


class ChatCompletion(_Completion):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Closed):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Closed):
    """A streamed tool call: the first delta of a call has its id, type and name; later ones
    append to its arguments."""

    index: int = Field(ge=0)
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Closed):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Closed):
    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: Any
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Completion):
    """One `data:` event of a streamed chat completion (the stream ends with `data: [DONE]`)."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | UsageSoFar | None = None


class TextChoice(_Closed):
    index: int = Field(ge=0)
    text: str
    logprobs: Any
    finish_reason: FinishReason | None


class TextCompletion(_Completion):
    """A completion, or (streamed) one `data:` event of it, `usage` on the last with include_usage."""

    object: Literal["text_completion"]
    choices: list[TextChoice]
    usage: Usage | UsageSoFar | None = None


REF = "#/components/schemas/{model}"  # where /openapi.json keeps each named schema


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """FastAPI `openapi_extra=` for a route whose body gateway.protocol parses: `model`'s schema."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF.format(model=model.__name__)}}}}}


def responses(whole: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for a generation route: the body, the stream's events, errors."""
    error = {"model": ErrorResponse}
    return {
        200: {"model": whole, "description": "The completion; with `stream: true`, server-sent "
              f"events whose data are {chunk.__name__} objects, then `[DONE]`",
              "content": {"text/event-stream": {"schema": {"$ref": REF.format(model=chunk.__name__)}}}},
        400: {**error, "description": "A parameter out of its range or not supported (`param` names it)"},
        404: {**error, "description": "Unknown model or session"},
        429: {**error, "description": "An admission limit (Retry-After says when to retry)"},
        503: {**error, "description": "The orchestrator is unavailable"},
    }


class ResponseUsage(_Closed):
    input_tokens: int = Field(ge=0)
    input_tokens_details: dict[str, int] = Field(
        description="cached_tokens: the prompt tokens served from a kept session's KV caches")
    output_tokens: int = Field(ge=0)
    output_tokens_details: dict[str, int]
    total_tokens: int = Field(ge=0)
    speculation: SpeculationStats


class ResponseObject(_Closed):
    """A Response of POST /v1/responses (and GET /v1/responses/{id}); `output` holds `message`
    items (one output_text part) and `function_call` items."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    background: bool
    error: None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, None]
    service_tier: str
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class ResponseEvent(_Closed):
    """One server-sent event of a streamed response (`event:` is its type): response.created,
    response.in_progress, response.output_item.added, response.content_part.added,
    response.output_text.delta, response.output_text.done, response.content_part.done,
    response.function_call_arguments.delta / .done, response.output_item.done, then
    response.completed or response.incomplete; `error` if the generation fails mid-stream."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int = Field(ge=0)


class ResponseDeleted(_Closed):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class Tokenized(_Closed):
    """POST /tokenize (vLLM's shape)."""

    count: int = Field(ge=0)
    max_model_len: int = Field(ge=0)
    tokens: list[int]
    token_strs: list[str] | None


class Detokenized(_Closed):
    """POST /detokenize (vLLM's shape)."""

    prompt: str
