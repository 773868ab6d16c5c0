"""OpenAI request bodies -> Generate options, and Stats -> OpenAI response parts.

Every OpenAI parameter is declared here with its type and range, so /openapi.json
publishes the whole request (and gateway/schemas.py the responses), and a value
outside its range is a 400 naming it before anything reaches the orchestrator.
Parameters fall into four groups (the README's OpenAI table lists each one):
- supported: model, messages / prompt, max_tokens, max_completion_tokens,
  temperature, top_p, seed, stop, n (<= specdec.runtime.limits.MAX_CHOICES), best_of
  (= n only), stream, stream_options (include_usage, continuous_usage_stats), prediction,
  response_format (text, json_object, json_schema), logprobs, top_logprobs, tools and
  tool_choice (gateway.tools), tool messages;
- self-hosted servers' extensions (vLLM's and TGI's names): `ignore_eos`, `min_tokens`,
  `stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`, `top_k` (-1 = off),
  `min_p`: each exact under speculation (orchestrator.proto GenerateRequest);
- specdec's extensions: `speculation` {proposer, k, guess}, `constraint` {regex | lark}
  (structured output beyond JSON), `keep_session` (keep this turn's
  session for later turns; its id comes back in `usage.speculation.session_id`),
  `session_id` (continue a kept session: the shared prefix is served from the
  services' KV caches);
- accepted and ignored: user, metadata, store, service_tier, parallel_tool_calls (one call
  per choice), prompt_cache_key, safety_identifier;
- declared but not supported: accepted only at their neutral value (frequency_penalty 0,
  repetition_penalty 1, logit_bias {}, echo false, ...), otherwise
  400 `unsupported_parameter`, since honouring them would change the output
  distribution the verifier guarantees (or is not built yet). The penalties make p a
  function of the tokens so far, which the services' sampling does not apply; a
  gateway-side approximation would not be the distribution the verifier keeps exact.
Anything else is 400 `unknown_parameter`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import invalid
from specdec.runtime.limits import MAX_CHOICES

INT32 = 2**31 - 1  # the proto's int32 fields (sampling.top_k)
UINT32 = 2**32 - 1  # the proto's uint32 fields (max_new_tokens, k)
MAX_SESSION_ID = 256  # the orchestrator's bound on session ids

# Accepted and not used (reserved: `user` for accounting once tenants exist).
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
           "safety_identifier")
# Declared, not supported: allowed only at the values that mean "off" (the last one is
# what the error message offers).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
}

_PENALTY = ("it makes the target's p a function of the tokens so far, which the services' sampling "
            "does not apply, so the output could not stay exactly the target's under speculation")
_WHY = {"frequency_penalty": _PENALTY, "presence_penalty": _PENALTY, "repetition_penalty": _PENALTY}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Speculation(_Strict):
    """The extension field: `extra_body={"speculation": {"proposer": "draft", "k": 4}}`."""

    # "default" or a kind the orchestrator serves (ServedModel.proposers); it refuses others.
    proposer: str = Field("default", min_length=1, max_length=64)
    # 0 = the orchestrator's default (fixed or adaptive); above the services' limit: 400.
    k: int = Field(0, ge=0, le=UINT32)
    guess: str = ""  # proposer "guess": the expected continuation


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class PredictedOutput(_Strict):
    """Predicted Outputs: text most of the answer is expected to be (e.g. the file being edited)."""

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class GrammarConstraint(_Strict):
    """The extension field for grammars beyond JSON: exactly one of a regex or a Lark grammar."""

    regex: str | None = Field(None, min_length=1)
    lark: str | None = Field(None, min_length=1)


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJSONObject(_Strict):
    type: Literal["json_object"]


class JSONSchemaFormat(_Strict):
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatJSONSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    Union[ResponseFormatText, ResponseFormatJSONObject, ResponseFormatJSONSchema],
    Field(discriminator="type"),
]


class FunctionDefinition(_Strict):
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class _Common(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1, le=UINT32)
    # OpenAI's range; the orchestrator also needs a temperature > 0 to be >= 1e-6.
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[int, Field(ge=-100, le=100)]] | None = None
    user: str | None = None
    # Predicted Outputs (an OpenAI chat parameter; on /v1/completions an extension).
    prediction: PredictedOutput | None = None
    # Extensions.
    speculation: Speculation | None = None
    constraint: GrammarConstraint | None = None
    session_id: str = Field("", max_length=MAX_SESSION_ID)
    keep_session: bool = False
    top_k: int = Field(0, ge=-1, le=INT32)  # vLLM's -1 = no truncation, as 0
    min_p: float = Field(0.0, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    # vLLM's and TGI's extensions.
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=UINT32)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32)]] | None = Field(None, max_length=64)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class ContentPart(BaseModel):
    """A message content part; only "text" parts are supported (others: 400)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str = ""


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    """An assistant's tool call in the history (what an earlier response's `tool_calls` held)."""

    id: str = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(_Strict):
    """A chat message: system, developer, user, assistant (with its `tool_calls`) or a tool's
    result (`role: "tool"`, with the `tool_call_id` it answers). A response's message sent back
    as is may carry `refusal` and `annotations` (ignored)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}


M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], body: Any, neutral: dict[str, tuple[Any, ...]] = NEUTRAL) -> M:
    """A request body as `model`, its `neutral` parameters at a value that means "off"; every
    failure is an APIError naming the parameter."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        if err["type"] == "extra_forbidden" and len(loc) == 1:
            raise invalid(f"Unrecognized request argument supplied: {loc[0]}", param=loc[0],
                          code="unknown_parameter") from None
        # The extension's fields are named as the orchestrator's errors name them ("speculation.k").
        param = ".".join(loc[:2]) if loc[:1] == ["speculation"] and len(loc) > 1 else (
            loc[0] if loc else None)
        raise invalid(f"{'.'.join(loc)}: {err['msg']}", param=param) from None
    for name, allowed in neutral.items():
        value = getattr(request, name, None)
        if isinstance(value, BaseModel):
            value = value.model_dump(exclude_none=True)
        if value not in allowed:
            why = _WHY.get(name, "")
            raise invalid(f"{name}: not supported by this server (only {allowed[-1]!r} is accepted)"
                          + (f": {why}" if why else ""), param=name, code="unsupported_parameter")
    return request


def parse(model: type[_Common], body: Any) -> _Common:
    """Validate a chat or completion request body; every failure is an APIError naming the parameter."""
    request = validate(model, body)
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options: only allowed when stream is true", param="stream_options")
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of != (request.n or 1):
        raise invalid(f"best_of: only best_of = n ({request.n or 1}) is supported (ranking "
                      "candidates by log-probability is not)", param="best_of",
                      code="unsupported_parameter")
    spec = request.speculation
    if request.prediction is not None and spec is not None and (
            spec.proposer not in ("default", "guess") or spec.guess):
        raise invalid("prediction: the prediction is the proposal; it cannot be combined with "
                      f"speculation.proposer {spec.proposer!r} or a guess", param="prediction")
    _check_structured(request)
    if (request.n or 1) > 1 and (request.session_id or request.keep_session):
        raise invalid("n: each choice is a single-turn session (no session_id or keep_session "
                      "with n > 1)", param="n")
    return request


def _check_structured(request: _Common) -> None:
    """response_format / constraint / logprobs: the combinations that mean something."""
    fmt = getattr(request, "response_format", None)
    grammar = request.constraint
    if grammar is not None and (grammar.regex is None) == (grammar.lark is None):
        raise invalid("constraint: give exactly one of regex, lark", param="constraint")
    if grammar is not None and fmt is not None and fmt.type != "text":
        raise invalid("constraint: not with a response_format other than text", param="constraint")
    if isinstance(fmt, ResponseFormatJSONSchema) and fmt.json_schema.schema_ is None:
        raise invalid("response_format.json_schema.schema: required", param="response_format")
    if isinstance(request, ChatRequest) and request.top_logprobs and not request.logprobs:
        raise invalid("top_logprobs: requires logprobs: true", param="top_logprobs")


def structured_options(request: _Common) -> dict[str, Any]:
    """The grammar and log-probability keywords of `client.build_request`."""
    out: dict[str, Any] = {}
    fmt = getattr(request, "response_format", None)
    if isinstance(fmt, ResponseFormatJSONObject):
        out["json_object"] = True
    elif isinstance(fmt, ResponseFormatJSONSchema):
        out["json_schema"] = fmt.json_schema.schema_
    if request.constraint is not None:
        out["regex"], out["lark"] = request.constraint.regex, request.constraint.lark
    if isinstance(request, ChatRequest):
        if request.logprobs:
            out["logprobs"], out["top_logprobs"] = True, request.top_logprobs or 0
    elif request.logprobs is not None:  # completions: logprobs = n alternatives (0: the token's own)
        out["logprobs"], out["top_logprobs"] = True, request.logprobs
    return out


def chat_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The messages as client.build_request takes them (tool calls and results included)."""
    out = []
    for i, message in enumerate(request.messages):
        entry: dict[str, Any] = {"role": _ROLES[message.role],  # the schema allows only these roles
                                 "content": _text(i, message.content)}
        if message.tool_calls:
            entry["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.name and message.role == "tool":
            entry["name"] = message.name
        out.append(entry)
    return out


def _text(i: int, content: str | list[ContentPart] | None) -> str:
    if not isinstance(content, list):
        return content or ""
    for part in content:
        if part.type != "text":
            raise invalid(f"messages[{i}].content: only text parts are supported, "
                          f"got {part.type!r}", param="messages", code="unsupported_parameter")
    return "".join(part.text for part in content)


def completion_prompt(request: CompletionRequest) -> str:
    prompt = request.prompt
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if prompt and all(isinstance(p, str) for p in prompt):
        raise invalid("prompt: one prompt per request (a list of several is not supported)",
                      param="prompt", code="unsupported_parameter")
    raise invalid("prompt: token-id prompts are not supported; send text", param="prompt",
                  code="unsupported_parameter")


def generate_options(request: _Common, default_max_tokens: int) -> dict[str, Any]:
    """Keyword arguments for `AsyncClient.generate` (client.build_request)."""
    max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens
    spec = request.speculation or Speculation()
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or ())
    return dict(
        max_new_tokens=max_tokens or default_max_tokens,
        # The OpenAI default is 1.0 (sampling); send 0 for greedy.
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=request.top_p,
        top_k=max(request.top_k, 0),
        min_p=request.min_p,
        seed=request.seed or 0,
        stop=stop,
        # A prediction is the proposal (GenerateRequest.prediction): the proposer stays unset.
        proposer="default" if request.prediction is not None else spec.proposer,
        k=spec.k,
        guess=spec.guess,
        prediction=request.prediction.text if request.prediction is not None else "",
        n=request.n or 1,
        session_id=request.session_id,
        # Continuing a session keeps it too; otherwise a turn is single-turn and
        # leaves nothing behind (see GenerateRequest.keep_session).
        keep_session=request.keep_session or bool(request.session_id),
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        stop_token_ids=list(request.stop_token_ids or ()),
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        **structured_options(request),
    )


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """stream_options.continuous_usage_stats: the counts on every chunk (vLLM's shape)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _speculation(stats) -> dict[str, Any]:
    return {
        "proposer": stats.proposer,
        "fallback_reason": stats.fallback_reason or None,
        "target_passes": stats.target_passes,
        "draft_calls": stats.draft_calls,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "acceptance_by_position": list(stats.acceptance_by_position),
        "tokens_per_target_pass": stats.new_tokens / max(stats.target_passes, 1),
        "session_id": stats.session_id,
        "seed": stats.seed,
    }


_SUMMED = ("target_passes", "draft_calls", "drafted_tokens", "accepted_tokens")


def usage(choices: Sequence) -> dict[str, Any]:
    """OpenAI usage of a request's choices (their Stats, by index), with the speculation
    counts as the `speculation` extension: choice 0's, with the counts summed over the
    choices and each choice's own under `choices` when n > 1."""
    first = choices[0]
    completion = sum(s.new_tokens for s in choices)
    speculation = _speculation(first)
    if len(choices) > 1:
        for key in _SUMMED:
            speculation[key] = sum(getattr(s, key) for s in choices)
        speculation["acceptance_rate"] = (speculation["accepted_tokens"]
                                          / max(speculation["drafted_tokens"], 1))
        speculation["tokens_per_target_pass"] = completion / max(speculation["target_passes"], 1)
        speculation["choices"] = [_speculation(s) for s in choices]
    return {
        "prompt_tokens": first.prompt_tokens,  # one prompt, whatever n
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.reused_prompt_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0, "audio_tokens": 0,
            "accepted_prediction_tokens": sum(s.accepted_prediction_tokens for s in choices),
            "rejected_prediction_tokens": sum(s.rejected_prediction_tokens for s in choices),
        },
        "speculation": speculation,
    }


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's body): a prompt, or messages (and tools) through the chat template
    with the generation prompt, counted as a generation's prompt is (no special tokens added to a
    prompt unless add_special_tokens)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: Literal[True] = True  # as Generate renders messages
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's body)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32)]] = Field(max_length=1 << 20)
