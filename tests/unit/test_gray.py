"""Gray failures and overload, on the real loop with test_loop's in-process fakes.

A hung replica is a fake whose calls sleep (a SIGSTOPped process answers
nothing); a slow one answers late. Covered: learned deadlines (estimates,
floor, peers, cold start), a hung draft costing rounds and not the stream (and
used again once its probe answers), a hung target moving the session (same
text) or, with no other, being waited on up to the bound and then
UNAVAILABLE, outlier ejection of a far slower replica and its readmission
only when its probes are no longer slow, and admission by capacity
(refusal naming the limit, bounded in count and time, a slot freed by a
finished stream).
"""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from orchestrator.policy.capacity import CapacityPolicy, TargetAdmission
from orchestrator.policy.costs import CostBook
from orchestrator.fleet.deadlines import DeadlinePolicy, LatencyBook
from orchestrator.fleet.outliers import OutlierPolicy, ReplicaHealth
from orchestrator.fleet.remote import Call
from orchestrator.fleet.routing import Router
from orchestrator.common.kinds import COMBINED, DRAFT
from specdec.runtime.errors import ResourceExhausted, Unavailable
from tests.unit.test_loop import PROMPTS, Stack, make_models, plain_greedy

FAST = DeadlinePolicy(factor=4.0, floor_ms=60.0, cold_s=0.2)


def fast_health(stack: Stack, **outliers) -> ReplicaHealth:
    """Deadlines of tens of milliseconds and ejections of a tenth of a second, on the stack's router."""
    router = stack.config.router
    policy = OutlierPolicy(**{"eject_s": 0.1, "max_eject_s": 0.2, "min_samples": 3, **outliers})
    router.health = ReplicaHealth(FAST, policy, probe=router.probe)
    return router.health


class Hang:
    """Make a fake service's calls sleep `seconds` while `on` (a SIGSTOPped process); with
    `after`, `on` turns itself on at its call after that many, unless `first` says another
    replica of the group already hung (only the first one to get there hangs)."""

    def __init__(self, service, seconds: float = 30.0, after: int = 0, first: list | None = None) -> None:
        self.on, self.seconds, self.calls = False, seconds, 0
        for verb in ("score", "propose"):
            inner = getattr(service, verb)

            async def hung(request, inner=inner):
                self.calls += 1
                if after and self.calls > after and (first is None or not first or first[0] is self):
                    if first is not None and not first:
                        first.append(self)
                    self.on = True
                if self.on:
                    await asyncio.sleep(self.seconds)
                return await inner(request)

            setattr(service, verb, hung)


# --------------------------------------------------------------------- the deadline table


def test_deadlines_follow_the_replicas_own_latency_for_the_same_size() -> None:
    book = LatencyBook(DeadlinePolicy(factor=4.0, floor_ms=100.0, cold_s=7.0))
    assert book.deadline_s("target", "a", 5) == 7.0  # nothing measured on the role: cold
    for _ in range(5):
        book.observe("target", "a", 5, 50.0)  # bucket 4-7
        book.observe("target", "a", 64, 400.0)
    assert book.deadline_s("target", "a", 6) == pytest.approx(0.2)  # 4 x 50 ms
    assert book.deadline_s("target", "a", 1) == pytest.approx(0.2)  # less work: the next bucket bounds it
    assert book.deadline_s("target", "a", 20) == pytest.approx(1.6)  # between: the larger bucket's
    assert book.deadline_s("target", "a", 256) == pytest.approx(4 * 400 * 256 / 64 / 1e3)  # linear beyond
    book.observe("target", "a", 2, 1.0)
    assert book.deadline_s("target", "a", 2) == pytest.approx(0.1)  # the floor
    assert book.deadline_s("target", "b", 6) == pytest.approx(0.2)  # a new replica borrows its peers'
    assert book.deadline_s("draft", "b", 6) == 7.0  # another role learns apart
    assert LatencyBook(DeadlinePolicy(factor=0)).deadline_s("target", "a", 5) is None  # off


def test_a_noisy_replica_gets_a_wider_deadline_than_a_steady_one() -> None:
    steady, noisy = (LatencyBook(DeadlinePolicy(factor=4.0, floor_ms=10.0, cold_s=7.0)) for _ in range(2))
    for i in range(40):
        steady.observe("draft", "d", 8, 60.0)
        noisy.observe("draft", "d", 8, 20.0 if i % 2 else 100.0)  # about the same mean, noisy
    assert steady.deadline_s("draft", "d", 8) == pytest.approx(0.24)  # 4 x 60 ms: no deviation
    assert steady.usual_ms("draft", "d", 8) == pytest.approx(60.0)
    usual = noisy.usual_ms("draft", "d", 8)
    assert 40.0 < usual < 80.0
    assert noisy.deadline_s("draft", "d", 8) > 4 * (usual + 60.0) / 1e3  # + 2 x a deviation of ~40 ms


def test_a_deadline_counts_the_work_in_flight_to_the_replica() -> None:
    """Eight sessions' feeds sent at once are served together or one after another: each is
    given the time of the whole load, not of one feed alone (a busy replica is not a hung one)."""
    book = LatencyBook(DeadlinePolicy(factor=4.0, floor_ms=100.0, cold_s=7.0))
    book.observe("draft", "d", 64, 100.0)  # one 64-token feed, alone: 100 ms
    sizes = [book.begin("draft", "d", 64) for _ in range(8)]
    assert sizes == [64 * i for i in range(1, 9)]
    assert book.deadline_s("draft", "d", sizes[0]) == pytest.approx(0.4)  # the first: 4 x 100 ms
    assert book.deadline_s("draft", "d", sizes[-1]) == pytest.approx(4 * 100 * 8 / 1e3)  # behind seven more
    for _ in range(8):
        book.end("draft", "d", 64)
    assert book.begin("draft", "d", 64) == 64  # all answered: one feed's load again
    book.end("draft", "d", 64)
    assert book.in_flight == {}


def test_a_replica_far_slower_than_its_peers_is_ejected_and_not_routed_to() -> None:
    router = Router(None, {"target": ["t0", "t1"]}, connect=lambda a, r: type("C", (), {"address": a})())
    health = router.health = ReplicaHealth(FAST, OutlierPolicy(min_samples=5, slow_ratio=3.0))
    for _ in range(4):
        health.answered("target", "t0", 2, 10.0)
        health.answered("target", "t1", 2, 50.0)
    assert not health.ejected("target", "t1")  # 4 answers: not judged yet
    health = router.health = ReplicaHealth(FAST, OutlierPolicy(min_samples=5, slow_ratio=3.0))
    for _ in range(6):
        health.answered("target", "t0", 2, 10.0)
        health.answered("target", "t1", 2, 25.0)  # 2.5x: within the ratio
    assert not health.ejected("target", "t1")
    health.answered("target", "t1", 2, 80.0)  # 8x, once: the median of its last 5 answers is 2.5x
    health.answered("target", "t1", 2, 80.0)
    assert not health.ejected("target", "t1")
    health.answered("target", "t1", 2, 80.0)  # 3 of its last 5 answers at 8x: the median is 8x
    assert health.ejected("target", "t1") and health.ejection_reason("target", "t1") == "slow"
    assert not health.ejected("target", "t0")

    async def picks():
        chosen = {(await router.pick("target")).address for _ in range(20)}
        health.missed("target", "t0", 2, 0.05)  # now both are ejected: routing uses them anyway
        anyway = await router.pick("target")
        none = await router.pick("target", healthy=True)
        return chosen, anyway, none

    chosen, anyway, none = asyncio.run(picks())
    assert chosen == {"t0"} and anyway is not None and none is None


def test_a_replica_slowed_on_one_size_of_work_is_ejected_though_its_other_sizes_were_fast() -> None:
    # Both replicas served prefills and 4-token verifies at the same pace moments ago; then t1 turns
    # 5x slower and gets only 1-token calls. Its answers are judged, not its table's stale sizes.
    health = ReplicaHealth(FAST, OutlierPolicy(min_samples=5, slow_ratio=3.0))
    for address in ("t0", "t1"):
        for size, ms in ((12, 30.0), (4, 12.0), (5, 13.0), (1, 10.0)):
            for _ in range(3):
                health.answered("target", address, size, ms)
    for n in range(1, 4):
        health.answered("target", "t1", 1, 50.0)
        assert health.ejected("target", "t1") == (n == 3), n  # 3 of its last 5 answers are slow
    assert health.ejection_reason("target", "t1") == "slow"


def test_a_replica_that_runs_in_bursts_is_ejected_on_its_total_time_though_its_median_answer_is_fast() -> None:
    # A CPU quota or a duty cycle (running 20 ms of every 100): five answers at the peers' pace, then
    # one that waits out the stall. Its median answer is fast; its streams run ~7x slower.
    health = ReplicaHealth(FAST, OutlierPolicy(min_samples=5, slow_ratio=3.0))
    answers = [2.0, 2.0, 2.0, 2.0, 2.0, 80.0] * 4
    for n, ms in enumerate(answers, start=1):
        health.answered("target", "t0", 1, 2.0)
        health.answered("target", "t1", 1, ms)
        if health.ejected("target", "t1"):
            break
    assert health.ejected("target", "t1") and health.ejection_reason("target", "t1") == "slow"
    assert n == 20  # judged once it has 4 x min_samples answers: 3 stalls among them
    assert sorted(answers[n - 5:n])[2] == 2.0  # the median of its last 5 answers is its peers' pace


def test_one_freak_answer_never_ejects_however_slow() -> None:
    health = ReplicaHealth(FAST, OutlierPolicy(min_samples=5, slow_ratio=3.0))
    for ms in [2.0] * 10 + [500.0] + [2.0] * 12:  # one 250x answer: a pause, a page fault
        health.answered("target", "t0", 1, 2.0)
        health.answered("target", "t1", 1, ms)
    assert not health.ejected("target", "t1")  # its last 20 answers took 13x its peers' time
    for ms in [500.0] + [2.0] * 3:  # a second one within its last 20 answers: it stalls, and it is out
        health.answered("target", "t0", 1, 2.0)
        health.answered("target", "t1", 1, ms)
    assert health.ejected("target", "t1")


def test_an_ejected_replica_comes_back_only_when_its_probes_answer_in_time_and_not_slow() -> None:
    answers = {"t0": 5.0, "t1": 5.0}
    down = {"t1"}
    probed: list[str] = []

    async def probe(role: str, address: str, timeout_s: float) -> float:
        probed.append(address)
        if address in down:
            await asyncio.sleep(timeout_s)
            raise asyncio.TimeoutError
        return answers[address]

    async def body():
        health = ReplicaHealth(FAST, OutlierPolicy(eject_s=0.05, max_eject_s=0.1, slow_ratio=3.0), probe)
        health.answered("target", "t0", 1, 5.0)  # a healthy peer with recent answers
        health.missed("target", "t1", 1, 0.06)
        await asyncio.sleep(0.4)
        still_down = health.ejected("target", "t1") and probed.count("t1") >= 2
        down.clear()
        answers["t1"] = 40.0  # answers now, but 8x the peer on the same probes: stays out
        while probed.count("t0") < 10:  # two whole checks against the peer
            await asyncio.sleep(0.02)
        still_slow = health.ejected("target", "t1")
        answers["t1"] = 6.0
        for _ in range(150):
            if not health.ejected("target", "t1"):
                break
            await asyncio.sleep(0.02)
        back = not health.ejected("target", "t1")
        await health.close()
        return still_down, still_slow, back

    assert asyncio.run(body()) == (True, True, True)


# --------------------------------------------------------------------- hung replicas in the loop


@pytest.mark.parametrize("kind, parallel", [(DRAFT, False), (COMBINED, False), (DRAFT, True)],
                         ids=["draft", "combined", "parallel"])
def test_a_hung_draft_costs_a_round_not_the_stream_and_is_used_again_once_back(kind, parallel) -> None:
    target, draft = make_models(1)
    stack = Stack(target, draft)
    health = fast_health(stack)
    hang = Hang(stack.services["d0"], seconds=30.0)
    reference = plain_greedy(target, PROMPTS[1])

    async def body():
        await stack.arun(PROMPTS[0], k=3, proposer=DRAFT, sampling=stack_greedy(), seed=1, max_new=8)
        hang.on = True
        started = time.monotonic()
        frozen = await stack.arun(PROMPTS[1], k=3, proposer=kind, sampling=stack_greedy(), seed=1,
                                  max_new=48, parallel=parallel)
        frozen_s = time.monotonic() - started
        ejected = health.ejected("draft", "d0")
        hang.on = False
        for _ in range(500):  # its probe answers: back in rotation (waited for, at most 10 s)
            if not health.ejected("draft", "d0"):
                break
            await asyncio.sleep(0.02)
        # Another tenant: the combined proposer's suffix source has this tenant's frozen turn and
        # would propose all of it, with no draft call.
        back = await stack.arun(PROMPTS[1], k=3, proposer=kind, sampling=stack_greedy(), seed=1,
                                max_new=48, parallel=parallel, tenant="another")
        await health.close()
        return frozen, frozen_s, ejected, back

    (out, _, tally), frozen_s, ejected, (out2, _, tally2) = asyncio.run(body())
    assert out == reference == out2
    assert frozen_s < 2.0  # one missed deadline (60 ms floor), not the 30 s hang
    assert tally.deadline_misses == 1 and ejected and not tally.fallback_reason
    assert sum(r.deadline_misses for r in tally.rounds) == 1
    assert tally2.deadline_misses == 0 and tally2.draft_calls > 0 and any(
        r.source == "draft" for r in tally2.rounds)


def test_a_strict_request_waits_on_a_late_draft_and_fails_only_on_a_silent_one(monkeypatch) -> None:
    """Strict means never without the draft: a call past its deadline that still answers is waited
    on (a busy draft), and one silent for STRICT_WAIT_S fails the request with UNAVAILABLE."""
    import orchestrator.proposers.draft as proposers

    monkeypatch.setattr(proposers, "STRICT_WAIT_S", 1.0)
    target, draft = make_models(1)
    stack = Stack(target, draft)
    fast_health(stack)
    reference = plain_greedy(target, PROMPTS[1])

    async def body(seconds: float):
        hang = Hang(stack.services["d0"], seconds=seconds)
        await stack.arun(PROMPTS[0], k=3, proposer=DRAFT, sampling=stack_greedy(), seed=1, max_new=8)
        hang.on = True
        try:
            return await stack.arun(PROMPTS[1], k=3, proposer=DRAFT, sampling=stack_greedy(), seed=1,
                                    max_new=8, strict=True)
        finally:
            hang.on = False

    out, _, tally = asyncio.run(body(0.3))  # 5x the 60 ms floor, within the strict wait
    assert out == reference[:len(out)] and len(out) == 8
    assert tally.deadline_misses >= 1 and tally.draft_calls > 0 and not tally.fallback_reason
    assert all(r.source in ("draft", "") for r in tally.rounds) and tally.drafted_tokens > 0
    started = time.monotonic()
    with pytest.raises(Unavailable, match="strict"):
        asyncio.run(body(30.0))
    assert time.monotonic() - started < 5.0  # the strict wait (1 s), not the 30 s hang


def stack_greedy():
    from tests.unit.test_loop import GREEDY

    return GREEDY


def test_a_hung_target_moves_the_session_to_another_with_the_same_text() -> None:
    target, draft = make_models(0)
    stack = Stack(target, draft, targets=2)
    health = fast_health(stack)
    first: list = []
    hangs = {name: Hang(stack.services[name], seconds=30.0, after=3, first=first) for name in ("t0", "t1")}
    reference = plain_greedy(target, PROMPTS[1])

    async def body():
        started = time.monotonic()
        result = await stack.arun(PROMPTS[1], k=2, proposer=DRAFT, sampling=stack_greedy(), seed=1,
                                  max_new=48)
        elapsed = time.monotonic() - started
        await health.close()
        return result, elapsed

    (out, _, tally), elapsed = asyncio.run(body())
    hung = [n for n, h in hangs.items() if h.on]
    assert out == reference and elapsed < 2.0
    assert tally.deadline_misses == 1 and len(hung) == 1
    assert tally.target_replica != hung[0]  # it finished on the other replica
    position, sent, _ = stack.services[tally.target_replica].requests[0]
    assert position == 0 and sent > len(PROMPTS[1])  # the committed tokens, resent from position 0


def test_with_no_other_target_a_late_call_is_waited_on_up_to_the_bound_then_unavailable() -> None:
    target, draft = make_models(0)
    stack = Stack(target, draft, target_wait_s=0.6)
    health = fast_health(stack)
    hang = Hang(stack.services["t0"], seconds=0.3, after=3)  # late, but within the bound
    reference = plain_greedy(target, PROMPTS[0], 16)

    async def body():
        late = await stack.arun(PROMPTS[0], k=2, proposer=DRAFT, sampling=stack_greedy(), seed=1,
                                max_new=16)
        sent_again = [r for r in stack.services["t0"].requests[1:] if r[0] == 0]
        hang.seconds = 30.0
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await stack.arun(PROMPTS[1], k=2, proposer=DRAFT, sampling=stack_greedy(), seed=1, max_new=16)
        failed_s = time.monotonic() - started
        await health.close()
        return late, sent_again, failed_s

    (out, _, tally), sent_again, failed_s = asyncio.run(body())
    assert out == reference and tally.deadline_misses >= 1
    assert not sent_again  # waited on, never resent: the only replica kept its cache
    assert 0.5 < failed_s < 2.0  # the bound (0.6 s), not the hang


# --------------------------------------------------------------------- admission by capacity


def _costs_with(points: list[tuple[int, float]], address: str = "t0", row: int = 1) -> CostBook:
    """Forwards of `tokens` tokens costing `ms`, each batching one-token rows (`row` tokens each)."""
    book = CostBook()
    for tokens, ms in points:
        for _ in range(8):
            book.observe("target", address, Call(rpc_ms=ms + 1, server_ms=ms + 0.1, bytes_sent=0,
                                                 bytes_received=0, forward_ms=ms, batch_rows=max(1, tokens // row),
                                                 batch_tokens=tokens, tokens=row, forwards=1))
    return book


class _OnReplica:
    """A stream's place as TargetAdmission.load counts it: its replica's address."""

    def __init__(self, address: str):
        self.address = address


def test_capacity_is_the_sessions_whose_shared_round_keeps_the_pace() -> None:
    router = Router(None, {"target": ["t0"]}, connect=lambda a, r: type("C", (), {"address": a, "max_batch": 12})())
    book = _costs_with([(1, 10.0), (16, 40.0)])  # v(T) = 10 + 2 (T - 1)
    assert TargetAdmission(CapacityPolicy(pace=1.5), book).capacity(router, "t0") == 3  # v(3) = 14 <= 15
    assert TargetAdmission(CapacityPolicy(pace=3.0), book).capacity(router, "t0") == 11  # v(11) = 30
    assert TargetAdmission(CapacityPolicy(pace=9.0), book).capacity(router, "t0") == 12  # its batch size
    assert TargetAdmission(CapacityPolicy(pace=1.5), CostBook()).capacity(router, "t0") == 12  # unmeasured
    assert TargetAdmission(CapacityPolicy(sessions=5), book).capacity(router, "t0") == 5  # configured
    # Rows of 4 tokens (speculating): the same table holds fewer of them at the pace, v(4n) <= 1.5 v(4).
    assert TargetAdmission(CapacityPolicy(pace=1.5), _costs_with([(1, 10.0), (16, 40.0)], row=4)
                           ).capacity(router, "t0") == 2
    saturated = _costs_with([(1, 10.0)])
    for _ in range(8):  # its calls now wait ~100 ms in its queue for 10 ms forwards (a 11 ms round)
        saturated.observe("target", "t0", Call(rpc_ms=121, server_ms=110, bytes_sent=0, bytes_received=0,
                                                forward_ms=10, batch_rows=1, batch_tokens=1, tokens=1,
                                                forwards=1))
    # Saturated: no room beside this orchestrator's own streams there; with none of them, one (the
    # probe that refreshes a reading only calls can refresh: a burst that has ended must not refuse
    # a lone stream until its reading ages out).
    admission = TargetAdmission(CapacityPolicy(), saturated)
    assert admission.capacity(router, "t0") == 1
    admission.active[_OnReplica("t0")] = 0.0
    assert admission.capacity(router, "t0") == 0


def test_past_capacity_new_streams_are_refused_naming_the_limit_within_the_wait_bound() -> None:
    target, draft = make_models(0)
    admission = TargetAdmission(CapacityPolicy(sessions=2, queue_depth=1, wait_s=0.2))
    stack = Stack(target, draft, targets=1, admission=admission)
    router = stack.config.router

    async def body():
        a = await admission.place(router, "a", "", 0, wait_s=1.0)
        b = await admission.place(router, "b", "", 0, wait_s=1.0)
        started = time.monotonic()
        waiting = asyncio.ensure_future(admission.place(router, "c", "", 0, wait_s=1.0))
        await asyncio.sleep(0.01)
        with pytest.raises(ResourceExhausted, match="admission_queue") as queue_full:
            await admission.place(router, "d", "", 0, wait_s=1.0)  # the one queue place is taken
        queue_s = time.monotonic() - started
        with pytest.raises(ResourceExhausted, match="target_capacity: every target replica") as full:
            await waiting
        full_s = time.monotonic() - started
        # A stream that ends frees its slot for one that waits.
        waiting = asyncio.ensure_future(admission.place(router, "e", "", 0, wait_s=1.0))
        await asyncio.sleep(0.05)
        admission.leave(a)
        e = await waiting
        return queue_s, full_s, full.value, queue_full.value, e, b

    queue_s, full_s, full, queue_full, e, b = asyncio.run(body())
    assert queue_s < 0.1 and 0.15 < full_s < 0.6
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED and full.retry_after_s >= 1
    assert queue_full.retry_after_s >= 1
    assert e.address == "t0" and admission.load("t0") == 2


def test_no_tenant_holds_more_than_its_share_of_the_fleet_while_others_may_call() -> None:
    """--tenant-share 0.5 over 2 replicas of 4 slots: a tenant opening every stream it can holds 4,
    the next is refused at once (target_share), and another tenant still gets a slot at once.
    With one tenant (no token table) it may hold them all."""
    target, draft = make_models(0)
    shared = TargetAdmission(CapacityPolicy(sessions=4, wait_s=5.0, tenant_share=0.5), tenants=2)
    router = Stack(target, draft, targets=2, admission=shared).config.router
    alone = TargetAdmission(CapacityPolicy(sessions=4, wait_s=0.05, tenant_share=0.5), tenants=1)

    async def body():
        mine = [await shared.place(router, f"a{i}", "", 0, wait_s=1.0, tenant="alice") for i in range(4)]
        started = time.monotonic()
        with pytest.raises(ResourceExhausted, match="target_share: this tenant's streams hold 4 of the 8") as over:
            await shared.place(router, "a4", "", 0, wait_s=1.0, tenant="alice")
        refused_s = time.monotonic() - started  # at once, not after the 5 s slot wait
        theirs = await shared.place(router, "b0", "", 0, wait_s=1.0, tenant="bob")
        shared.leave(mine[0])  # one of alice's streams ends: room in her share again
        again = await shared.place(router, "a5", "", 0, wait_s=1.0, tenant="alice")
        lone = [await alone.place(router, f"c{i}", "", 0, wait_s=1.0, tenant="carol") for i in range(8)]
        return refused_s, over.value, theirs, again, lone

    refused_s, over, theirs, again, lone = asyncio.run(body())
    assert refused_s < 0.5 and over.code == grpc.StatusCode.RESOURCE_EXHAUSTED and over.retry_after_s >= 1
    assert theirs is not None and again is not None
    assert shared.held_by("alice") == 4 and shared.held_by("bob") == 1
    assert all(p is not None for p in lone) and alone.held_by("carol") == 8


def test_a_refused_stream_costs_nothing_and_a_finished_one_frees_its_slot() -> None:
    target, draft = make_models(0)
    admission = TargetAdmission(CapacityPolicy(sessions=1, wait_s=0.05))
    stack = Stack(target, draft, admission=admission)

    async def body():
        held = await admission.place(stack.config.router, "held", "", 0, wait_s=1.0)
        with pytest.raises(ResourceExhausted, match="target_capacity"):
            await stack.arun(PROMPTS[0], k=2, proposer=DRAFT, sampling=stack_greedy(), seed=1, max_new=8)
        calls = sum(len(s.requests) for s in stack.services.values())
        admission.leave(held)
        done = await stack.arun(PROMPTS[0], k=2, proposer=DRAFT, sampling=stack_greedy(), seed=1, max_new=8)
        return calls, done, admission.load("t0")

    calls, (out, _, _), load = asyncio.run(body())
    assert calls == 0 and out == plain_greedy(target, PROMPTS[0], 8) and load == 0


def test_the_admitted_streams_pace_feeds_the_limit_back() -> None:
    """On the measured pace: a slow start doubling the limit while rounds keep the pace, then
    rounds slower than pace x the lone ones cut it in proportion, below the load they ran at;
    after that, rounds well within the pace at the limit raise it by one."""
    from orchestrator.policy.capacity import _Pace

    pace = _Pace()

    def rounds(n: int, ms: float, load: int) -> int:
        for _ in range(n):
            pace.observe(ms, load)
        pace.since -= 1
        pace.adjust(1.5, model_cap=10)
        return pace.limit

    assert rounds(5, 100.0, 1) == 2  # alone and in time: a slow start
    assert rounds(10, 100.0, 2) == 4  # at the limit, within the pace: doubled
    assert rounds(10, 110.0, 4) == 8
    assert rounds(15, 200.0, 8) == 8  # 15 rounds at 8 streams: not enough to judge yet
    pace.observe(200.0, 8)
    pace.adjust(1.5, model_cap=10)
    assert pace.limit == 6  # 8 x 150 / 200: the load that would keep the pace
    assert rounds(12, 100.0, 6) == 7  # after a cut: one at a time
    assert rounds(10, 100.0, 2) == 7  # within the pace but well below the limit: no change


def test_a_probe_leaves_the_replica_s_batch_calls() -> None:
    """A probe's throwaway session must not stay counted as coming by the replica's batch calls
    (each batch would wait its bound for it until it went stale)."""
    target, draft = make_models(3)
    stack = Stack(target, draft)
    for role, address in (("target", "t0"), ("draft", "d0")):
        ms = asyncio.run(stack.config.router.probe(role, address, 5.0))
        service = stack.services[address]
        assert ms >= 0 and len(service.left) == 1 and service.left[0].startswith("probe-")
