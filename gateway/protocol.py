"""OpenAI request bodies -> Generate options, and Stats -> OpenAI response parts.

Parameters fall into four groups:
- mapped: model, messages / prompt, max_tokens, max_completion_tokens, temperature,
  top_p, seed, stop, n (1 only), stream, stream_options.include_usage;
- extensions: `speculation` {proposer, k, guess}, `keep_session` (keep this turn's
  session for later turns; its id comes back in `usage.speculation.session_id`),
  `session_id` (continue a kept session: the shared prefix is served from the
  services' KV caches), `top_k`, `min_p`;
- accepted and ignored: user, metadata, store, service_tier, parallel_tool_calls;
- known but not supported: accepted only at their neutral value (frequency_penalty 0,
  logit_bias {}, logprobs false, tools [], response_format text, best_of 1, ...),
  otherwise 400 `unsupported_parameter`, since honouring them would change the output
  distribution the verifier guarantees.
Anything else is 400 `unknown_parameter`.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import APIError, invalid

# Accepted and not used (reserved: `user` for accounting once tenants exist).
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# Known, unsupported: allowed only at the value that means "off".
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "audio": (None,),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Speculation(BaseModel):
    """The extension field: `extra_body={"speculation": {"proposer": "draft", "k": 4}}`."""

    model_config = ConfigDict(extra="forbid")
    proposer: Literal["default", "draft", "lookup", "guess", "none", "combined"] = "default"
    k: int = Field(0, ge=0)  # 0 = the orchestrator's default (fixed or adaptive)
    guess: str = ""          # proposer "guess": the expected continuation


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None  # range checked by the orchestrator
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: Speculation | None = None
    session_id: str = ""
    keep_session: bool = False
    top_k: int = 0
    min_p: float = 0.0


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str = ""


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[_ContentPart] | None = None


class ChatRequest(_Common):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def parse(model: type[_Common], body: Any) -> _Common:
    """Validate a request body; every failure is an APIError naming the parameter."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise invalid(f"{loc}: {err['msg']}", param=str(err["loc"][0]) if err["loc"] else None)
    for name, value in (request.model_extra or {}).items():
        if name in IGNORED:
            continue
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise invalid(f"{name}: not supported by this server (only {NEUTRAL[name][-1]!r} "
                              "is accepted)", param=name, code="unsupported_parameter")
            continue
        raise invalid(f"Unrecognized request argument supplied: {name}", param=name,
                      code="unknown_parameter")
    if request.n not in (None, 1):
        raise invalid("n: only n=1 is supported", param="n", code="unsupported_parameter")
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options: only allowed when stream is true", param="stream_options")
    return request


def chat_messages(request: ChatRequest) -> list[dict[str, str]]:
    out = []
    for i, message in enumerate(request.messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise invalid(f"messages[{i}].role: {message.role!r} is not supported (system, "
                          "developer, user, assistant)", param="messages")
        extra = set(message.model_extra or {}) - {"name"}
        if extra and any((message.model_extra or {})[k] for k in extra):
            raise invalid(f"messages[{i}]: {', '.join(sorted(extra))} not supported",
                          param="messages", code="unsupported_parameter")
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text":
                    raise invalid(f"messages[{i}].content: only text parts are supported, "
                                  f"got {part.type!r}", param="messages",
                                  code="unsupported_parameter")
                parts.append(part.text)
            content = "".join(parts)
        out.append({"role": role, "content": content or ""})
    return out


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
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed or 0,
        stop=stop,
        proposer=spec.proposer,
        k=spec.k,
        guess=spec.guess,
        session_id=request.session_id,
        # Continuing a session keeps it too; otherwise a turn is single-turn and
        # leaves nothing behind (see GenerateRequest.keep_session).
        keep_session=request.keep_session or bool(request.session_id),
    )


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(stats) -> dict[str, Any]:
    """OpenAI usage, with the speculation counts as the `speculation` extension."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.reused_prompt_tokens},
        "speculation": {
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
        },
    }
