"""GenerateMany end to end: many generations over one stream, their chunks packed per moment.

Real processes (tiny target, draft, orchestrator, Redis). Each generation on the shared stream
must be token-identical to its own Generate stream; a bad request ends that generation only, with
the status Generate gives it; a cancel stops one generation; the client library runs
`AsyncClient(multiplex=True)` over it.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

PROMPTS = ["The cat sat on the", "def add(a, b):\n    return", "mat is", "Once upon a time",
           "Please rewrite: the cat sat.", "1, 2, 3,"]
N_NEW = 24


def _request(prompt: str, **options):
    from client import build_request

    return build_request(prompt, max_new_tokens=N_NEW, **options)


async def _raw(address: str, messages) -> list:
    """Every GenerateManyResponse of one stream carrying `messages`, then half-closed."""
    from specdec.v1 import orchestrator_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        async def requests():
            for message in messages:
                yield message

        return [response async for response in stub.GenerateMany(requests(), timeout=120)]


def _counted(stack, code: str) -> int:
    """GenerateMany's generations the orchestrator finished with `code`, from its /metrics."""
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5).read().decode()
    key = f'specdec_requests_total{{code="{code}",method="/specdec.v1.Orchestrator/GenerateMany"}} '
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in body.splitlines() if line.startswith(key))


def test_each_generation_on_one_stream_equals_its_own_generate_stream(stack, client):
    from specdec.v1 import orchestrator_pb2 as pb

    references = {p: client.complete(p, max_new_tokens=N_NEW, proposer=kind)
                  for p in PROMPTS for kind in ("none",)}
    messages = [pb.GenerateManyRequest(id=10 + i, request=_request(p, proposer=kind))
                for i, (p, kind) in enumerate((p, kind) for p in PROMPTS for kind in ("none", "draft", "lookup"))]
    responses = asyncio.run(_raw(stack.addresses["orch"], messages))
    tokens: dict[int, list[int]] = {m.id: [] for m in messages}
    stats, ends = {}, set()
    for response in responses:
        for event in response.events:
            assert event.id not in ends, "an event after the generation's end"
            assert event.code == 0, event.message
            if event.end:
                ends.add(event.id)
            elif event.response.HasField("chunk"):
                tokens[event.id].extend(event.response.chunk.token_ids)
            else:
                stats[event.id] = event.response.stats
    assert ends == set(tokens) == set(stats)
    for i, message in enumerate(messages):
        prompt = PROMPTS[i // 3]
        assert tokens[message.id] == list(references[prompt].token_ids), (prompt, message.request.proposer_name)
    # Each generation is counted as a call, by its status.
    assert _counted(stack, "OK") >= len(messages)
    # Packed: fewer messages than a stream per generation would have sent.
    chunk_events = sum(1 for r in responses for e in r.events if e.response.HasField("chunk"))
    assert len(responses) < chunk_events, (len(responses), chunk_events)


def test_a_bad_request_ends_only_its_own_generation_with_generates_status(stack):
    from specdec.v1 import orchestrator_pb2 as pb

    good, bad = _request("The cat sat on the", proposer="none"), _request("x", proposer="none")
    bad.sampling.top_p = 7.0  # out of range
    messages = [pb.GenerateManyRequest(id=1, request=bad), pb.GenerateManyRequest(id=2, request=good),
                pb.GenerateManyRequest(id=3)]  # neither a request nor a cancel
    responses = asyncio.run(_raw(stack.addresses["orch"], messages))
    events = [e for r in responses for e in r.events]
    failed = {e.id: e for e in events if e.code}
    assert set(failed) == {1, 3}
    assert failed[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and failed[1].end
    assert "top_p" in failed[1].message
    assert failed[3].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert sum(len(e.response.chunk.token_ids) for e in events if e.id == 2) == N_NEW
    assert any(e.id == 2 and e.end and not e.code for e in events)
    assert _counted(stack, "INVALID_ARGUMENT") >= 2


def test_a_live_id_cannot_start_twice_and_a_cancel_stops_one_generation(stack):
    from specdec.v1 import orchestrator_pb2 as pb
    from specdec.v1 import orchestrator_pb2_grpc

    async def run():
        async with grpc.aio.insecure_channel(stack.addresses["orch"]) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            out: asyncio.Queue = asyncio.Queue()

            async def requests():
                while (m := await out.get()) is not None:
                    yield m

            long = _request("Once upon a time", proposer="none", ignore_eos=True)
            long.max_new_tokens = 400
            call = stub.GenerateMany(requests(), timeout=120)
            out.put_nowait(pb.GenerateManyRequest(id=7, request=long))
            out.put_nowait(pb.GenerateManyRequest(id=7, request=long))  # id 7 is live
            out.put_nowait(pb.GenerateManyRequest(id=8, request=_request("mat is", proposer="none")))
            seen: list = []
            cancelled = False
            async for response in call:
                seen.extend(response.events)
                got7 = sum(len(e.response.chunk.token_ids) for e in seen if e.id == 7)
                if not cancelled and got7 >= 8:
                    out.put_nowait(pb.GenerateManyRequest(id=7, cancel=True))
                    out.put_nowait(None)  # half-close: the stream ends once nothing is live
                    cancelled = True
            return seen

    seen = asyncio.run(run())
    duplicate = [e for e in seen if e.id == 7 and e.code]
    assert len(duplicate) == 1 and duplicate[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "still live" in duplicate[0].message
    assert sum(len(e.response.chunk.token_ids) for e in seen if e.id == 7) < 400  # stopped early
    assert any(e.id == 8 and e.end and not e.code for e in seen)


def test_the_async_client_multiplexes_and_matches_plain_streams(stack, client):
    from client import AsyncClient

    references = {p: client.complete(p, max_new_tokens=N_NEW, proposer="none") for p in PROMPTS}

    async def run():
        async with AsyncClient(stack.addresses["orch"], timeout=120, multiplex=True) as c:
            done = await asyncio.gather(*(c.complete(p, max_new_tokens=N_NEW, proposer=kind)
                                          for p in PROMPTS for kind in ("none", "combined")))
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await c.complete("x", max_new_tokens=N_NEW, top_p=7.0)
            again = await c.complete(PROMPTS[0], max_new_tokens=N_NEW)  # a new stream after the idle close
            muxes = list(c._muxes.values())
            return done, bad.value, again, muxes

    done, bad, again, muxes = asyncio.run(run())
    for i, out in enumerate(done):
        assert list(out.token_ids) == list(references[PROMPTS[i // 2]].token_ids)
        assert out.stats.new_tokens == N_NEW
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(bad.trailing_metadata()).get("x-request-id")  # as Generate's, for the server's log
    assert list(again.token_ids) == list(references[PROMPTS[0]].token_ids)
    assert len(muxes) == 1 and muxes[0].opened >= 2  # one stream for the 12, another later


def test_a_generation_past_its_timeout_ends_with_deadline_exceeded_and_stops_on_the_server(stack):
    """The client keeps each generation's timeout (one timer, not a timed wait per chunk): past it the
    generation raises DEADLINE_EXCEEDED after the chunks that came in time, the server stops it, and
    the others on the stream go on."""
    from client import build_request
    from client.multiplex import Multiplexed

    async def run():
        async with grpc.aio.insecure_channel(stack.addresses["orch"]) as channel:
            mux = Multiplexed(channel)
            slow = mux.generate(build_request(PROMPTS[0], max_new_tokens=480, ignore_eos=True), timeout=0.3)
            other = mux.generate(_request(PROMPTS[1]), timeout=120)
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as late:
                async for response in slow:
                    got.extend(response.chunk.token_ids)
            tokens = [t async for response in other for t in response.chunk.token_ids]
            return late.value, got, tokens

    late, got, tokens = asyncio.run(run())
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(got) < 480  # what came in time was delivered
    assert len(tokens) == N_NEW
    assert _counted(stack, "CANCELLED") >= 1  # the server stopped the generation
