"""The model services' settings (python -m target_service / draft_service), defined once.

The defaults are the engine's own (engine.host.HostLimits); the role adds its
port and what an omitted --model serves.
"""
from __future__ import annotations

from engine.model.dtypes import AUTO, DTYPES
from engine.host import HostLimits
from model_service.role import Role
from specdec.runtime.settings import SERVICE_SECURITY, SWITCH, Flag, Group, Settings, server_group

_D = HostLimits()


def service_settings(role: Role) -> Settings:
    model = Group("model", (
        Flag("model", "local Hugging Face folder, .gguf file, or Hugging Face id ORG/NAME (an existing "
             "local path wins; an id is read from the hub cache, HF_HOME / HF_HUB_CACHE, and fetched there "
             f"unless HF_HUB_OFFLINE is set; HF_TOKEN for gated models); omitted = {role.model_help}", None),
        Flag("revision", "branch, tag or commit of a --model given as a Hugging Face id", "main"),
        *((Flag("base-model", "the target a --model in EAGLE-3's published layout drafts for (a folder, "
                ".gguf or Hugging Face id): its tokenizer, its layer count and, where the head holds none, "
                "its embedding; other drafts ignore it", None, default_doc="the embedded default target"),)
          if role.name == "draft" else ()),
        Flag("max-model-len", "cap the context length (prompt + generated tokens) this service reports "
             "in GetInfo and accepts; the orchestrator refuses longer requests", None, int,
             default_doc="the model's own (max_position_embeddings)"),
        Flag("device", "cpu, cuda, cuda:N", "cpu"),
        Flag("dtype", "weights and KV dtype; auto = the fastest dtype the device computes exactly: bfloat16 on "
             "GPUs and CPUs with native bf16 (AVX-512 BF16, AMX), else float32 (a distilled draft or EAGLE-3 "
             "head: the dtype its folder names, where the device has it). Every dtype is proven exact at "
             "start-up: a target whose verify shapes are not bitwise invariant does not start, except that "
             "auto then serves float32 (with a warning)",
             AUTO, choices=sorted(DTYPES) + [AUTO]),
        Flag("threads", "torch CPU threads", None, int, default_doc="the CPU count"),
        Flag("num-layers", "keep only the first N decoder layers (early exit; Llama-like models)"
             + role.layers_help, None, int, aliases=("draft-layers",)),
    ))
    sessions = Group("sessions and limits", (
        Flag("max-sessions", "sessions holding a KV cache; the least recently used is evicted",
             _D.max_sessions, int),
        Flag("cache-budget-mb", "memory of the KV pool; least recently used sessions are evicted when it "
             "is full", None, float,
             default_doc="2048 on a CPU, 85% of the GPU memory free after loading on a GPU"),
        Flag("kv-idle-ttl", "seconds before an idle session's KV cache here is freed (the orchestrator's "
             "session record has its own --record-ttl)", _D.session_ttl_s, float,
             aliases=("session-ttl",), env_aliases=("SPECDEC_SESSION_TTL",)),
        Flag("max-k", "largest k (drafted tokens in one Propose or Score) accepted", _D.max_k, int,
             aliases=("max-draft",), env_aliases=("SPECDEC_MAX_DRAFT",)),
        Flag("max-request-tokens", "tokens in one request before RESOURCE_EXHAUSTED",
             _D.max_request_tokens, int),
        Flag("replica-id", "name in GetInfo and the registry; empty = hostname:port", ""),
    ))
    batching = Group("batching (concurrent calls of different sessions share a forward pass)", (
        Flag("max-batch", "requests (sessions) per forward; 1 = batching off, one request per forward",
             _D.max_batch, int),
        Flag("max-batch-tokens", "tokens per forward; longer prompts are fed in chunks of 64",
             _D.max_batch_tokens, int),
        Flag("max-wait-us", "when idle, wait this long for more requests to batch with the first",
             _D.max_wait_us, int),
        Flag("batch-invariant", "keep a session's logits bitwise the same alone and batched: on a CPU "
             "each matrix product pads its rows where its kernel needs it (calibrated at start-up; costs "
             "a lone one-token decode a few percent), on a GPU every forward is padded to a fixed token "
             "bucket", _D.batch_invariant, kind=SWITCH),
        Flag("compile", "torch.compile the engine's norms and activation (CUDA graphs on a GPU); the "
             "start-up checks run on the compiled forward; on a CPU it measured slower",
             _D.compile, kind=SWITCH),
        Flag("stall-timeout", "a forward running longer than this many seconds means a wedged device: "
             "the service turns NOT_SERVING and exits so its sessions move; 0 = never",
             _D.stall_timeout_s, float),
    ))
    return Settings(
        prog=f"python -m {role.name}_service",
        description=f"specdec {role.name} service: one causal LM over gRPC, serving {role.verb}, "
        "Release and GetInfo, with grpc.health.v1, reflection and Prometheus metrics. "
        "Every flag has a SPECDEC_* environment equivalent; flags win.",
        groups=(model, sessions, batching, server_group(role.default_port), SERVICE_SECURITY),
        raw_description=False,
    )
