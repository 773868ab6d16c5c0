"""Tool calling through the gateway with the `openai` SDK: valid calls, identity, target passes.

    python -m benchmarks.features.tools --gateway http://127.0.0.1:8000    # e.g. `specdec up`'s
    python -m benchmarks.features.tools --gateway URL --limit 4 --max-tokens 128

For every schema/prompt pair of benchmarks/prompts/tools-v1.jsonl (20 functions: enums, bounded
numbers, patterns, arrays, a nested object), the SDK asks with `tools=[the function]` and
`tool_choice="required"`, greedy, once target-only (`speculation.proposer` none) and once in the
default configuration, and once more streamed in the default configuration. Per pair it checks
that the answer is a `tool_calls` message naming the function whose arguments parse and validate
against its parameters, that both configurations produced the same arguments (greedy identity),
and that the streamed arguments equal the whole ones. The numbers are printed and written as
JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAIRS = REPO / "benchmarks" / "prompts" / "tools-v1.jsonl"
PROPOSERS = ("none", "default")


def load_pairs(path: Path = PAIRS) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def validates(pair: dict, call) -> bool:
    """Whether a tool call names the pair's function and its arguments validate."""
    import jsonschema

    function = pair["tool"]["function"]
    try:
        jsonschema.validate(json.loads(call.function.arguments), function["parameters"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return call.function.name == function["name"] and call.type == "function"


def _ask(client, model: str, pair: dict, proposer: str, max_tokens: int, **extra):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": pair["prompt"]}], tools=[pair["tool"]],
        tool_choice="required", temperature=0, max_tokens=max_tokens,
        extra_body={"speculation": {"proposer": proposer}}, **extra)


def _streamed_arguments(client, model: str, pair: dict, max_tokens: int) -> tuple[str, str | None]:
    """(the arguments assembled from a streamed answer in the default configuration, finish reason)."""
    arguments, finish = "", None
    for chunk in _ask(client, model, pair, "default", max_tokens, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return arguments, finish


def run_pair(client, model: str, pair: dict, max_tokens: int) -> dict:
    row = {"id": pair["id"], "function": pair["tool"]["function"]["name"]}
    arguments = {}
    for proposer in PROPOSERS:
        done = _ask(client, model, pair, proposer, max_tokens)
        choice = done.choices[0]
        calls = choice.message.tool_calls or []
        row[proposer] = {
            "valid": len(calls) == 1 and validates(pair, calls[0]), "finish_reason": choice.finish_reason,
            "tokens": done.usage.completion_tokens,
            "target_passes": done.usage.model_extra["speculation"]["target_passes"]}
        arguments[proposer] = calls[0].function.arguments if calls else None
    row["arguments"] = arguments["default"]
    row["identical"] = arguments["none"] == arguments["default"] is not None
    streamed, finish = _streamed_arguments(client, model, pair, max_tokens)
    row["stream_identical"] = streamed == arguments["default"] and finish == "tool_calls"
    return row


def run(base_url: str, *, model: str | None = None, limit: int | None = None, max_tokens: int = 256) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = model or client.models.list().data[0].id
    rows = [run_pair(client, model, pair, max_tokens) for pair in load_pairs()[:limit]]
    summary = {"pairs": len(rows), "model": model}
    for proposer in PROPOSERS:
        summary[f"valid_{proposer}"] = sum(r[proposer]["valid"] for r in rows)
        tokens = sum(r[proposer]["tokens"] for r in rows)
        summary[f"passes_per_token_{proposer}"] = sum(r[proposer]["target_passes"] for r in rows) / max(tokens, 1)
    summary["identical"] = sum(r["identical"] for r in rows)
    summary["stream_identical"] = sum(r["stream_identical"] for r in rows)
    return {"summary": summary, "rows": rows}


def report(result: dict) -> str:
    s = result["summary"]
    return (f"tool calls ({s['model']}, {s['pairs']} pairs, tool_choice required, greedy): "
            f"valid target-only {s['valid_none']}/{s['pairs']}, default {s['valid_default']}/{s['pairs']}; "
            f"identical {s['identical']}/{s['pairs']}; streamed = whole {s['stream_identical']}/{s['pairs']}; "
            f"target passes per token {s['passes_per_token_none']:.3f} target-only, "
            f"{s['passes_per_token_default']:.3f} default")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.features.tools", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateway", default="http://127.0.0.1:8000", help="a running gateway's base URL")
    p.add_argument("--model", default=None, help="the model id to name (default: /v1/models' first)")
    p.add_argument("--limit", type=int, default=None, help="only the first N pairs")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "tools.json")
    args = p.parse_args(argv)
    result = run(args.gateway.rstrip("/"), model=args.model, limit=args.limit, max_tokens=args.max_tokens)
    print(report(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    s = result["summary"]
    return 0 if s["valid_none"] == s["valid_default"] == s["identical"] == s["pairs"] else 1


if __name__ == "__main__":
    sys.exit(main())
