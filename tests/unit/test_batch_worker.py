"""The scheduler in-process on the tiny target: cancellation, failures, early leavers, faults.

A cancel lands between steps by construction: the forwards are let through one at a time
(`_Stepped`) and the cancel is sent while the worker waits before a step; a 400-token prompt
takes 7 prefill chunks.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from draft_service.drafting import propose
from specdec.core.fingerprint import fingerprint
from specdec.core.sampling import SamplingParams
from specdec.runtime.errors import ResourceExhausted, Unavailable
from engine.host import HostLimits, ModelHost
from model_service.requests import ModelRequest
from target_service.scoring import score

GREEDY = SamplingParams()
LONG = [(i * 37) % 380 + 3 for i in range(400)]


@pytest.fixture()
def host(tiny_pair):
    from engine.model.loader import load

    torch.set_num_threads(1)
    host = ModelHost(load(str(tiny_pair[0])), HostLimits(max_batch=16))
    yield host
    host.shutdown()


def _slow(host: ModelHost, seconds: float) -> None:
    inner = host.worker.runner.run

    def run(plan):
        time.sleep(seconds)
        return inner(plan)

    host.worker.runner.run = run


class _Stepped:
    """The worker's forwards, let through one at a time: `next_step()` waits (in a thread) until
    the worker is about to run a forward, with every earlier one done and applied; `step()` lets
    it run; `free()` lets this and every later forward run at once."""

    def __init__(self, host: ModelHost) -> None:
        import threading

        self._ready, self._go, self._free = threading.Semaphore(0), threading.Semaphore(0), threading.Event()
        self.forwards = 0
        inner = host.worker.runner.run

        def run(plan):
            self.forwards += 1
            if not self._free.is_set():
                self._ready.release()
                self._go.acquire()
            return inner(plan)

        host.worker.runner.run = run

    async def next_step(self) -> None:
        assert await asyncio.to_thread(self._ready.acquire, timeout=60), "no forward came"

    def step(self) -> None:
        self._go.release()

    def free(self) -> None:
        self._free.set()
        self._go.release()


def _request(session: str, tokens: list[int], k: int = 0, held: int = 0, committed: list[int] | None = None):
    committed = committed if committed is not None else tokens
    return ModelRequest(session, held, fingerprint(committed[:held]), tokens, k, GREEDY, False)


def test_a_cancelled_call_leaves_at_a_step_boundary(host) -> None:
    prompts = [[5 + i, 9, 11 + i, 40, 41 + i] for i in range(4)]

    async def main():
        stepped = _Stepped(host)
        victim = asyncio.create_task(score(host, _request("victim", LONG)))
        others = [asyncio.create_task(propose(host, _request(f"p{i}", p, k=8), 1, 0.0))
                  for i, p in enumerate(prompts)]
        await stepped.next_step()
        stepped.step()  # the first forward: the victim's first chunk beside the proposals
        await stepped.next_step()  # the worker waits before the second: cancel now, between steps
        assert host.caches._sessions["victim"].length == 64
        victim.cancel()
        await asyncio.sleep(0)  # the cancellation reaches the victim's call before the worker goes on
        stepped.free()
        batched = [t.tokens for t in (done.value for done in await asyncio.gather(*others))]
        held = (await host.run(lambda: host.caches._sessions["victim"].length)).value
        # The victim holds a whole number of chunks, with matching fingerprints:
        # continuing from there equals feeding the prompt in one go.
        assert 0 < held < len(LONG) and held % 64 == 0
        cont = await score(host, _request("victim", LONG[held:], held=held, committed=LONG))
        fresh = await score(host, _request("fresh", LONG))
        assert cont.value.argmax_ids == fresh.value.argmax_ids
        alone = [(await propose(host, _request(f"alone{i}", p, k=8), 1, 0.0)).value.tokens
                 for i, p in enumerate(prompts)]
        assert batched == alone
        assert victim.cancelled()

    asyncio.run(main())


def test_a_failed_forward_fails_its_calls_and_forgets_their_sessions(host) -> None:
    async def main():
        await score(host, _request("s", [5, 6, 7]))
        inner = host.worker.runner.run

        def broken(plan):
            host.worker.runner.run = inner  # fail once
            raise RuntimeError("device lost")

        host.worker.runner.run = broken
        with pytest.raises(RuntimeError):
            await score(host, _request("s", [8], held=3, committed=[5, 6, 7, 8]))
        assert "s" not in host.caches  # a half-extended cache is never reused
        again = await score(host, _request("s", [5, 6, 7, 8]))
        assert again.cache_length == 4

    asyncio.run(main())


def test_proposals_with_smaller_k_leave_early(host) -> None:
    async def main():
        _slow(host, 0.01)
        calls = [propose(host, _request(f"k{k}", [5, 6, 7 + k], k=k), 1, 0.0) for k in (1, 3, 8)]
        done = await asyncio.gather(*calls)
        assert [len(d.value.tokens) for d in done] == [1, 3, 8]
        assert [d.forwards for d in done] == [1, 3, 8]  # k - 1 drafted tokens fed back, plus the prompt
        assert done[0].batch_rows == 3  # the first forward had all three
        assert done[0].forward_ms < done[2].forward_ms

    asyncio.run(main())


def _failing(host: ModelHost, errors: list[BaseException]) -> None:
    """The next len(errors) forwards raise these, in order; then the real runner again."""
    inner = host.worker.runner.run

    def run(plan):
        if errors:
            raise errors.pop(0)
        return inner(plan)

    host.worker.runner.run = run


def test_out_of_memory_evicts_idle_sessions_and_retries_once(host) -> None:
    async def main():
        for i in range(3):
            await score(host, _request(f"idle{i}", [5, 6, 7 + i]))
        _failing(host, [torch.OutOfMemoryError("CUDA out of memory (injected)")])
        done = await score(host, _request("s", [5, 6, 7]))  # retried after evicting the idle three
        assert done.cache_length == 3
        assert all(f"idle{i}" not in host.caches for i in range(3))
        _failing(host, [torch.OutOfMemoryError("again"), torch.OutOfMemoryError("and again")])
        with pytest.raises(ResourceExhausted, match="out of memory"):
            await score(host, _request("t", [5, 6, 7]))
        assert (await score(host, _request("t", [5, 6, 7]))).cache_length == 3  # and it serves on

    asyncio.run(main())


def test_a_sticky_device_error_is_fatal(tiny_pair) -> None:
    from engine.model.loader import load

    reasons: list[str] = []
    host = ModelHost(load(str(tiny_pair[0])), HostLimits(max_batch=16), on_fatal=reasons.append)

    async def main():
        _failing(host, [RuntimeError("CUDA error: an illegal memory access was encountered")])
        with pytest.raises(Unavailable, match="model worker stopped"):
            await score(host, _request("s", [5, 6, 7]))
        with pytest.raises(Unavailable, match="model worker stopped"):  # and nothing is served after
            await score(host, _request("s", [5, 6, 7]))

    asyncio.run(main())
    assert len(reasons) == 1 and "illegal memory access" in reasons[0]


def test_a_wedged_forward_is_fatal(tiny_pair) -> None:
    from engine.model.loader import load

    reasons: list[str] = []
    host = ModelHost(load(str(tiny_pair[0])), HostLimits(max_batch=16, stall_timeout_s=0.4),
                     on_fatal=reasons.append)

    async def main():
        _slow(host, 1.5)
        await score(host, _request("s", [5, 6, 7]))

    asyncio.run(main())
    assert reasons and "more than 0.4 s" in reasons[0]
    host.shutdown()


def test_a_forward_wakes_its_event_loop_once_for_all_its_rows(host) -> None:
    """The worker hands a forward's outcomes to the event loop in one call_soon_threadsafe
    (engine.scheduler._deliver), not one per row: each wake-up writes to the loop's self-pipe."""
    async def main():
        loop = asyncio.get_running_loop()
        stepped = _Stepped(host)
        wakes = []
        original = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            wakes.append(callback)
            return original(callback, *args, **kwargs)

        try:
            # Queued in one turn of the loop; the worker's first forward is held until all twelve
            # are queued, so they share forwards (what the first one had, then the rest).
            calls = asyncio.gather(*(score(host, _request(f"w{i}", [5 + i, 9, 11, 40])) for i in range(12)))
            await stepped.next_step()  # (its own hand-over from a thread is not counted)
            loop.call_soon_threadsafe = counted
            stepped.free()
            results = await calls
        finally:
            loop.call_soon_threadsafe = original
        return results, wakes, stepped.forwards

    results, wakes, forwards = asyncio.run(main())
    assert len(results) == 12 and forwards < 12
    assert sum(r.batch_rows for r in results) > 12  # they shared forwards
    assert len(wakes) == forwards, f"{len(wakes)} wake-ups for {forwards} forwards of 12 rows"
