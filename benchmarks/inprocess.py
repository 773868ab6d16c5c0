"""The in-process peer: the same models, decoded by transformers' own `generate`.

Three ways, each greedy or sampled: target-only, assisted generation with the
draft as `assistant_model` (a constant k, no confidence early stop, so it
drafts exactly like the draft service), and prompt lookup
(`prompt_lookup_num_tokens`). Target and draft passes are counted with
forward hooks; TTFT is the first streamer call after the prompt.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PeerConfig:
    """One in-process configuration: kind is "target", "assisted" or "lookup"."""

    kind: str
    k: int = 0

    @property
    def name(self) -> str:
        return "hf-target" if self.kind == "target" else f"hf-{self.kind}-k{self.k}"


@dataclass(frozen=True)
class PeerResult:
    token_ids: list[int]   # new tokens only
    wall_s: float
    ttft_s: float
    target_passes: int     # forward calls of the target, prefill included
    draft_passes: int      # forward calls of the assistant (0 for target / lookup)
    prompt_tokens: int


@dataclass
class _Counter:
    calls: int = 0
    handle: object = field(default=None, repr=False)

    def attach(self, model: torch.nn.Module) -> "_Counter":
        def hook(_module, _args, _output) -> None:
            self.calls += 1

        self.handle = model.register_forward_hook(hook)
        return self

    def detach(self) -> None:
        if self.handle is not None:
            self.handle.remove()


class _FirstTokenClock:
    """A streamer that notes when the first generated tokens arrive."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_at: float | None = None

    def put(self, _value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first_at is None:  # the first put is the prompt
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


def generate(
    target,
    draft,
    input_ids: torch.Tensor,  # [1, prompt_len]
    config: PeerConfig,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_ids: list[int] | None = None,
) -> PeerResult:
    """Run one `model.generate` call and time it."""
    kwargs: dict = dict(
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        attention_mask=torch.ones_like(input_ids),
        use_cache=True,
    )
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if eos_token_ids:
        kwargs.update(eos_token_id=eos_token_ids, pad_token_id=eos_token_ids[0])
    if config.kind == "assisted":
        gc = draft.generation_config
        # Draft exactly k tokens every round, like the draft service does.
        gc.num_assistant_tokens = config.k
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = draft
    elif config.kind == "lookup":
        kwargs["prompt_lookup_num_tokens"] = config.k
    elif config.kind != "target":
        raise ValueError(f"unknown in-process config kind {config.kind!r}")

    target_count = _Counter().attach(target)
    draft_count = _Counter().attach(draft) if config.kind == "assisted" else None
    clock = _FirstTokenClock()
    torch.manual_seed(seed)
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            out = target.generate(input_ids, streamer=clock, **kwargs)
            if out.device.type == "cuda":
                torch.cuda.synchronize(out.device)
            wall = time.perf_counter() - start
    finally:
        target_count.detach()
        if draft_count is not None:
            draft_count.detach()
    new = out[0, input_ids.shape[1]:].tolist()
    # generate pads finished sequences only in batches; strip a trailing EOS run
    # beyond the first EOS just in case.
    if eos_token_ids:
        for i, tok in enumerate(new):
            if tok in eos_token_ids:
                new = new[: i + 1]
                break
    ttft = (clock.first_at - start) if clock.first_at is not None else wall
    return PeerResult(
        token_ids=new,
        wall_s=wall,
        ttft_s=ttft,
        target_passes=target_count.calls,
        draft_passes=draft_count.calls if draft_count is not None else 0,
        prompt_tokens=int(input_ids.shape[1]),
    )
