"""n > 1: the choices of one request, their seeds, their merged stream and their shared prefill.

Each choice is its own single-turn session with its own counter-based seed
(choice 0 keeps the request's, so it is the n = 1 answer). The prompt is
prefilled once: choices 1..n-1 wait for choice 0's first round, then start
from a copy of its prefilled prompt (model.proto Fork, on the target and on
the draft replica), through a session record that says those replicas hold
it, exactly as a multi-turn session's next turn starts from its held prefix.
Where a fork cannot be made (an older replica: UNIMPLEMENTED; nothing drafted
yet; a replica gone), that choice prefills its own session; its text is the
same either way, since a fork only changes where the KV comes from.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from orchestrator.common.events import ChunkEvent
from orchestrator.round.sessions import forget_session
from orchestrator.config import LoopConfig
from orchestrator.common.request import TurnRequest
from specdec.core.fingerprint import fingerprint
from specdec.core.rng import choice_seed
from specdec.runtime.store import SessionRecord

log = logging.getLogger(__name__)


def choice_requests(req: TurnRequest, n: int) -> list[TurnRequest]:
    """The n choices of one request: the same prompt, each its own counter-based seed
    (choice 0 keeps the request's, so it is the n = 1 answer). A random seed (0) is
    drawn once here so that every choice derives from the one reported."""
    if n <= 1:
        return [req]
    seed = req.seed or secrets.randbits(63) + 1
    return [dataclasses.replace(req, seed=choice_seed(seed, i), index=i) for i in range(n)]


def resumed_choices(reqs: list[TurnRequest], delivered) -> list[TurnRequest]:
    """A resume of n > 1 (GenerateRequest.delivered): the choices not finished, each continuing
    from its own delivered tokens (with its own seed, as before; each prefills on its own)."""
    by_index = {int(e.index): e for e in delivered}
    out = []
    for req in reqs:
        entry = by_index.get(req.index)
        if entry is not None and entry.finished:
            continue
        tokens = tuple(entry.token_ids) if entry is not None else ()
        out.append(dataclasses.replace(req, delivered=tokens,
                                       resume_from=len(req.prompt_ids) + len(tokens) if tokens else 0))
    return out


async def merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """The responses of concurrent choices on one stream, as each commits. The first
    failure ends the stream (the other choices are cancelled and free their KV)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(streams))
    done = object()

    async def pump(stream) -> None:  # an async generator: closed here, wherever it stopped
        try:
            async for response in stream:
                await queue.put(response)
            await queue.put(done)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put(exc)
        finally:
            # Cancelled while waiting to hand a response over: the choice's own clean-up
            # (its session, both services' KV) runs now, not when the generator is collected.
            await stream.aclose()

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SharedPrefill:
    """Choices 1..n-1 start from choice 0's prefilled prompt (see the module docstring)."""

    def __init__(self, config: LoopConfig, reqs: list[TurnRequest]):
        self.config, self.reqs = config, reqs
        self.ready = asyncio.Event()
        self.forked: dict[int, str] = {}  # choice index -> the session forked for it
        self.reused = 0  # prompt tokens each forked choice starts with

    async def offer(self, event: ChunkEvent) -> None:
        """Choice 0's first chunk: fork its prompt for the others (once; never raises)."""
        if self.ready.is_set():
            return
        try:
            await self._fork(event)
        except Exception as exc:  # noqa: BLE001 - the choices then prefill on their own
            log.info("n = %d: the choices prefill on their own (%s)", len(self.reqs), exc)
        finally:
            self.ready.set()

    def give_up(self) -> None:
        """Choice 0 ended before its first chunk: the others go on their own."""
        self.ready.set()

    async def spec_for(self, req: TurnRequest) -> TurnRequest:
        """Choice i's req once choice 0 has prefilled: its forked session, if one was made."""
        await self.ready.wait()
        session = self.forked.get(req.index)
        return dataclasses.replace(req, session_id=session) if session else req

    async def discard(self, index: int) -> None:
        """A choice cancelled before it started: its forked KV and record go."""
        session = self.forked.pop(index, None)
        if session:
            router = self.config.router
            record = await self.config.store.load(session)
            clients = [router.client(a, r) for a, r in ((record.target, "target"), (record.draft, "draft"))
                       if record is not None and a]
            await forget_session(session, self.config.store, clients)

    async def _fork(self, event: ChunkEvent) -> None:
        prompt = self.reqs[0].prompt_ids
        length = len(prompt) - 1  # every choice's first round feeds the prompt's last token itself
        target, draft = event.replicas
        if length < 1 or not target or not event.session_id:
            return
        prefix = fingerprint(list(prompt[:length]))
        router = self.config.router

        async def fork(req: TurnRequest) -> None:
            new = uuid.uuid4().hex
            await router.client(target, "target").fork(event.session_id, new, length, prefix, tenant=req.tenant)
            draft_len = 0
            if draft:
                try:
                    draft_len = await router.client(draft, "draft").fork(event.session_id, new, length, prefix,
                                                                          tenant=req.tenant)
                except Exception as exc:  # noqa: BLE001 - the choice's draft prefills itself
                    log.info("draft fork for choice %d: %s", req.index, exc)
            await self.config.store.save(SessionRecord(
                session_id=new, tokens=tuple(prompt[:length]), target=target, target_len=length,
                draft=draft if draft_len else "", draft_len=draft_len, created=time.time(),
                tenant=req.tenant))
            self.forked[req.index] = new

        results = await asyncio.gather(*(fork(s) for s in self.reqs[1:]), return_exceptions=True)
        for req, result in zip(self.reqs[1:], results):
            if isinstance(result, BaseException):
                log.info("fork for choice %d: %s (it prefills on its own)", req.index, result)
        self.reused = length
