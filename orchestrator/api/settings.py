"""The orchestrator's settings (python -m orchestrator), defined once; no torch, no model hosting."""
from __future__ import annotations

from orchestrator.policy.capacity import CapacityPolicy
from orchestrator.fleet.deadlines import DeadlinePolicy
from orchestrator.proposers.registry import names, plugin_names
from orchestrator.fleet.outliers import OutlierPolicy
from specdec.runtime.settings import (
    APPEND, SERVICE_CLIENT, SWITCH, TENANT_SECURITY, Flag, Group, Settings, limits_group, server_group,
)
from specdec.runtime.limits import RequestLimits
from specdec.runtime.store import SESSION_TTL_S

DEFAULT_PORT = 50050

ORCHESTRATOR = Group("orchestrator", (
    Flag("target", "static target address(es), comma-separated or repeated; the fallback when the "
         "Redis registry lists none", [], kind=APPEND),
    Flag("draft", "static draft address(es), comma-separated or repeated", [], kind=APPEND),
    Flag("tokenizer", "the target's model folder, .gguf or Hugging Face id ORG/NAME (for its tokenizer "
         "and chat template; an id is read from the hub cache as the services' --model is); empty = the "
         "embedded default target", None),
    Flag("tokenizer-revision", "branch, tag or commit of a --tokenizer given as a Hugging Face id", "main"),
    Flag("chat-template", "a Jinja file that renders chat messages in place of the tokenizer's own "
         "template (the orchestrator applies it: the services see token ids only); omitted = the "
         "target's own", None),
    Flag("draft-tokenizer", "the draft's model folder or .gguf, for a draft whose tokenizer differs from "
         "the target's: its drafted text is re-encoded in the target's vocabulary and verified there, "
         "exactly (orchestrator.proposers.translated); empty = the draft must share the target's", None),
    Flag("record-ttl", "seconds a session's record is kept in Redis after its last turn (the model "
         "services free an idle KV cache after their own --kv-idle-ttl)", SESSION_TTL_S, int,
         aliases=("session-ttl",), env_aliases=("SPECDEC_SESSION_TTL",)),
    Flag("redis-outage-s", "a Redis outage up to this many seconds is invisible to streams (writes are "
         "retried, reads at session start too); past it a stream ends with UNAVAILABLE and its committed "
         "tokens are saved once Redis answers", 5.0, float),
    Flag("record-interval-ms", "write a session's record after a round only if the last write began at "
         "least this long ago (a turn's last state, and a failed turn's, are always written; a record "
         "behind by a few rounds only costs a resumed turn some KV reuse)", 200.0, float),
    Flag("default-proposer", "proposer when a request leaves it unspecified (the built-in kinds and "
         "installed plugins', orchestrator.proposers.registry)", "combined",
         choices=names(plugins=False, default_ok=True) + plugin_names()),
    Flag("suffix-cache-tokens", "suffix decoding's memory: tokens of earlier turns it keeps to match, per "
         "orchestrator process, across tenants (each tenant matches only its own; the oldest go first); "
         "about 0.6 KB of memory a token (200,000: about 125 MB)", 200_000, int),
    Flag("default-k", "drafted tokens per round when a request sends k = 0, or 'auto': pick k each round "
         "from the observed acceptance and draft/target costs", "5"),
    Flag("parallel", "parallel speculation by default: the draft drafts the next round while the target "
         "verifies this one (requests may choose either; orchestrator.proposers.parallel)", False, kind=SWITCH),
    Flag("speculation-gate", "for requests that give no k: measure each target replica's tokens/s with "
         "and without drafting, in alternating epochs per load level, and draft only where it measured "
         "faster (orchestrator.policy.gate)", True, kind=SWITCH),
    Flag("sampler", "how sampled requests are verified: 'auto' = the coupled sampler for requests with a "
         "seed (one seed, one text at any k, proposer, load or replica) and rejection sampling for those "
         "without (it accepts more drafts); 'coupled' or 'rejection' for every request (docs/api.md)",
         "auto", choices=["auto", "coupled", "rejection"]),
    Flag("tree-nodes", "draft token trees of at most this many tokens (k deep) where a turn may branch: "
         "the draft model, greedy or the coupled sampler, no grammar or log-probabilities; each round is "
         "verified in one target forward (0 = chains only)", 0, int),
    Flag("tree-width", "candidates per expanded token of a tree, and tokens expanded per depth", 3, int),
    Flag("max-new-tokens-limit", "largest max_new_tokens a request may ask for", 4096, int),
    Flag("rpc-timeout", "seconds before a model-service call counts as down", 60.0, float),
    Flag("startup-timeout", "seconds to wait for a target replica at start-up", 60.0, float),
    Flag("threads", "torch CPU threads (verification is light)", 1, int),
    Flag("text-threads", "threads tokenising, templating and decoding off the event loop", 2, int),
    Flag("stream-interval", "tokens gathered into one chunk message of a Generate stream (the first chunk "
         "and the end go at once; requests with round_tokens get every round): fewer messages for the "
         "orchestrator to write and the client to read where rounds take milliseconds; 1 = every round",
         1, int),
))

BATCH_CALLS = Group("batch calls (orchestrator.fleet.batching): many sessions' calls to one replica in one RPC", (
    Flag("batch-calls", "gather this orchestrator's Score/Propose calls to a replica into ScoreBatch/"
         "ProposeBatch RPCs; off (or with tracing on) every call is its own RPC", True, kind=SWITCH),
    Flag("batch-max-wait-ms", "longest a gathered call waits for this orchestrator's other live sessions "
         "on the same replica (never when they are all there; at most half a batch RPC's measured time)",
         20.0, float),
    Flag("batch-max-items", "calls in one batch RPC", 64, int),
    Flag("batch-stream", "send the batches as messages of one long-lived ScoreStream/ProposeStream per "
         "replica instead of a ScoreBatch/ProposeBatch call each (no call set-up per batch; a replica "
         "without the stream gets batch calls)", True, kind=SWITCH),
    Flag("batch-overlap", "let a replica's live sessions split into two cohorts, one computing while the "
         "orchestrator works on the other, where that carries more tokens a second (tried and measured "
         "against one cohort from time to time)", True, kind=SWITCH),
))


def _gray() -> Group:
    """Deadlines, outlier routing and overload shedding (orchestrator.fleet.deadlines, .outliers, .capacity)."""
    d, o, c = DeadlinePolicy(), OutlierPolicy(), CapacityPolicy()
    return Group("gray failures and overload", (
        Flag("deadline-factor", "a model-service call's deadline, x that replica's usual wall time for the "
             "same size of work (0 = no learned deadlines: --rpc-timeout only)", d.factor, float),
        Flag("deadline-floor-ms", "shortest learned deadline", d.floor_ms, float),
        Flag("deadline-cold-s", "deadline before any call of a role has answered", d.cold_s, float),
        Flag("outlier-ratio", "eject a replica whose wall time for the same work is this x its peers' "
             "median (0 = off)", o.slow_ratio, float),
        Flag("eject-s", "an ejected replica is probed after this long, doubling while its probes fail",
             o.eject_s, float),
        Flag("max-eject-s", "longest time between probes of an ejected replica", o.max_eject_s, float),
        Flag("target-wait-s", "how long a round (or a new session) waits for some target replica to answer "
             "when none other is usable; then UNAVAILABLE", 10.0, float),
        Flag("target-capacity", "streams per target replica (0 = measured from its batches and queues: "
             "orchestrator.policy.capacity)", c.sessions, int),
        Flag("capacity-pace", "measured capacity also caps a replica at the sessions whose shared forward "
             "costs at most this x a lone session's, fed back from the admitted streams' measured pace "
             "(0 = off: the batch size and queue saturation only)", c.pace, float),
        Flag("admission-queue", "streams that may wait for a target slot at once (more: RESOURCE_EXHAUSTED "
             "admission_queue)", c.queue_depth, int),
        Flag("admission-wait-s", "longest wait for a target slot (then RESOURCE_EXHAUSTED target_capacity, "
             "with retry-after)", c.wait_s, float),
        Flag("tenant-share", "with more than one tenant (--auth-tokens): the most of all target replicas' "
             "slots one tenant's streams hold at once (more: RESOURCE_EXHAUSTED target_share, at once), so "
             "one tenant cannot take the fleet from the others; 1 = no limit", c.tenant_share, float),
    ))


def _bounds() -> Group:
    """The work one request may ask for (specdec.runtime.limits.RequestLimits, orchestrator.api.bounds)."""
    d = RequestLimits()
    return Group("bounded work per request (INVALID_ARGUMENT naming the limit; 0 = off)", (
        Flag("max-stop-strings", "stop strings in one request (each committed token is checked "
             "against every one)", d.max_stop_strings, int),
        Flag("max-stop-bytes", "UTF-8 bytes of a request's stop strings in all", d.max_stop_bytes, int),
        Flag("max-prediction-bytes", "UTF-8 bytes of a Predicted Outputs prediction",
             d.max_prediction_bytes, int),
        Flag("max-grammar-bytes", "UTF-8 bytes of a constraint (JSON schema, regex or Lark grammar); "
             "also counted in --max-request-bytes", d.max_grammar_bytes, int),
        Flag("grammar-compile-s", "longest wait for a constraint's grammar to compile (off the event "
             "loop; a slower one is refused, and kept once compiled)", d.grammar_compile_s, float),
        Flag("max-top-logprobs", "top_logprobs: alternatives per token (the services serve at most 20)",
             d.max_top_logprobs, int),
    ))


def orchestrator_settings(description: str) -> Settings:
    return Settings(
        prog="python -m orchestrator", description=description,
        groups=(server_group(DEFAULT_PORT), TENANT_SECURITY, SERVICE_CLIENT, limits_group(), ORCHESTRATOR,
                _bounds(), BATCH_CALLS, _gray()),
    )
