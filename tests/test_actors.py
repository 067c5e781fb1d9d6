"""Sender and receiver actors over real ZMQ sockets and real Mooncake TCP engines on loopback.

Every test ends by checking that no KV block is left allocated on P or D.
"""

from __future__ import annotations

import logging
import threading

import pytest
import trio
import trio.testing

from pdactors import (
    PullFailedError,
    ReceiverConfig,
    SenderConfig,
    open_bootstrap_client,
)
from pdactors.core.send_table import SendState
from pdactors.testing import Cluster, FaultyDataPlane, open_cluster, run_transfer
from pdactors.transport import open_dealer, open_router
from pdactors.wire import (
    CancelPull,
    LayoutUnknown,
    PullRequest,
    RegisterWorker,
    decode_frames,
    encode_frames,
)
from tests.conftest import PATIENT, settled, wait_until

SMALL = {"layers": 4, "num_blocks": 64, "block_bytes": 4096}


def prepare(cluster: Cluster, tid: str, n: int) -> tuple[list[int], list[int]]:
    """P's prefilled blocks (filled, owned) and D's allocated blocks for ``tid``."""
    p, d = cluster.prefill[0], cluster.decode[0]
    src = p.pool.allocate(n)
    p.owned[tid] = src
    p.kv.fill(tid, src)
    return src, d.pool.allocate(n)


async def test_ready_then_pull_moves_every_byte() -> None:
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster:
            outcome = await run_transfer(cluster, "t1", 8)
            assert outcome.ok and outcome.verified, outcome
            assert outcome.nbytes == 8 * 4 * 4096
            await settled(cluster)
            assert cluster.prefill[0].sender.transfer_state("t1") is SendState.DONE


async def test_pull_before_prefill_waits_for_ready() -> None:
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster:
            p, d = cluster.prefill[0], cluster.decode[0]
            src, dst = prepare(cluster, "t2", 5)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: d.receiver.pull(
                        "t2",
                        bootstrap_url=cluster.bootstrap_url,
                        engine_id=p.engine_id,
                        block_ids=dst,
                    )
                )
                await wait_until(lambda: p.sender.transfer_state("t2") is SendState.PENDING)
                p.sender.transfer_pending("t2")
                p.sender.transfer_ready("t2", src)
            assert d.kv.verify("t2", dst, 5)
            d.pool.free(dst)
            await settled(cluster)


async def test_ready_kv_still_being_computed_is_written_once_complete() -> None:
    """``complete``: P hands over blocks a GPU is still computing; the write's thread waits for
    it and only then writes, so D gets the bytes as they are after ``complete`` returned."""
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster:
            p, d = cluster.prefill[0], cluster.decode[0]
            src = p.pool.allocate(4)
            p.owned["t3"] = src
            dst = d.pool.allocate(4)
            computed, waited = threading.Event(), threading.Event()

            def complete() -> None:  # the write's thread waits for the "forward" here
                waited.set()
                computed.wait(10)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: d.receiver.pull(
                        "t3",
                        bootstrap_url=cluster.bootstrap_url,
                        engine_id=p.engine_id,
                        block_ids=dst,
                    )
                )
                await wait_until(lambda: p.sender.transfer_state("t3") is SendState.PENDING)
                p.sender.transfer_ready("t3", src, complete=complete)
                await wait_until(waited.is_set)
                assert p.sender.transfer_state("t3") is SendState.SENDING  # waits for the KV
                p.kv.fill("t3", src)  # the "forward" finishes writing the KV
                computed.set()
            assert d.kv.verify("t3", dst, 4)
            d.pool.free(dst)
            await settled(cluster)


async def test_kv_that_never_completes_fails_the_transfer_and_frees_blocks() -> None:
    def broken() -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")

    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster:
            p, d = cluster.prefill[0], cluster.decode[0]
            src, dst = prepare(cluster, "t4", 3)
            p.sender.transfer_ready("t4", src, complete=broken)
            with pytest.raises(PullFailedError, match="KV was not complete: RuntimeError: CUDA"):
                await d.receiver.pull(
                    "t4", bootstrap_url=cluster.bootstrap_url, engine_id=p.engine_id, block_ids=dst
                )
            d.pool.free(dst)
            await settled(cluster)
            assert p.sender.transfer_state("t4") is SendState.FAILED


async def test_prefix_hit_pulls_only_the_missing_tail() -> None:
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster:
            outcome = await run_transfer(cluster, "t3", 10, d_blocks=3)
            assert outcome.ok and outcome.verified
            await settled(cluster)


async def test_concurrent_transfers_all_verified() -> None:
    with trio.fail_after(60):
        async with open_cluster(layers=4, num_blocks=256, block_bytes=2048) as cluster:
            outcomes = []

            async def one(i: int) -> None:
                outcomes.append(await run_transfer(cluster, f"c{i}", 1 + i % 7))

            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(one, i)
            assert all(o.ok and o.verified for o in outcomes), [o for o in outcomes if not o.ok]
            await settled(cluster)


async def test_dropped_prefill_fails_waiting_pull_at_once() -> None:
    # ready_timeout is long: the failure must come from the drop, not the timeout.
    sender = SenderConfig(engine_id="p", ready_timeout=300)
    with trio.fail_after(10):
        async with open_cluster(sender=sender, **SMALL) as cluster:
            p, d = cluster.prefill[0], cluster.decode[0]
            dst = d.pool.allocate(4)
            p.sender.transfer_pending("t4")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(p_drops_when_pulled, cluster, "t4")
                with pytest.raises(PullFailedError, match="dropped"):
                    await d.receiver.pull(
                        "t4",
                        bootstrap_url=cluster.bootstrap_url,
                        engine_id=p.engine_id,
                        block_ids=dst,
                    )
            d.pool.free(dst)
            await settled(cluster)


async def p_drops_when_pulled(cluster: Cluster, tid: str) -> None:
    sender = cluster.prefill[0].sender
    await wait_until(lambda: sender.pulls_waiting(tid) == 1)  # D's pull is attached
    sender.transfer_dropped(tid, "aborted on P")


async def test_prefill_never_ready_times_out_at_ready_timeout(
    mock_clock: trio.testing.MockClock,
) -> None:
    sender = SenderConfig(engine_id="p", ready_timeout=5, tick_interval=0.5, register_timeout=1e6)
    receiver = ReceiverConfig(pull_timeout=1000, lookup_timeout=1e6, liveness=PATIENT)
    async with open_cluster(sender=sender, receiver=receiver, **SMALL) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        dst = d.pool.allocate(2)
        start = trio.current_time()
        with pytest.raises(PullFailedError, match="not ready within 5 s"):
            await d.receiver.pull(
                "t5", bootstrap_url=cluster.bootstrap_url, engine_id=p.engine_id, block_ids=dst
            )
        assert 5 <= trio.current_time() - start < 7
        d.pool.free(dst)
        # P finishes late: D is gone, the blocks are released at once.
        src = p.pool.allocate(2)
        p.owned["t5"] = src
        p.sender.transfer_ready("t5", src)
        await settled(cluster)


async def test_unclaimed_ready_transfer_expires(
    mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    sender = SenderConfig(engine_id="p", unclaimed_ttl=3, tick_interval=0.5, register_timeout=1e6)
    async with open_cluster(sender=sender, **SMALL) as cluster:
        p = cluster.prefill[0]
        src = p.pool.allocate(3)
        p.owned["t6"] = src
        start = trio.current_time()
        with caplog.at_level(logging.INFO, logger="pdactors.sender"):
            p.sender.transfer_ready("t6", src)
            await settled(cluster)
        assert 3 <= trio.current_time() - start < 4
        assert p.sender.transfer_state("t6") is SendState.EXPIRED
        # the operator's line names the transfer (its KV waited the whole TTL)
        (line,) = [r.getMessage() for r in caplog.records if "expired" in r.getMessage()]
        assert line.startswith("transfer t6 expired: no pull within unclaimed_ttl (3 s)"), line


async def test_silent_p_times_out_and_is_told_to_cancel(
    mock_clock: trio.testing.MockClock,
) -> None:
    receiver = ReceiverConfig(
        pull_timeout=2, tick_interval=0.25, lookup_timeout=1e6, liveness=PATIENT
    )
    async with open_cluster(receiver=receiver, **SMALL) as cluster:
        d = cluster.decode[0]
        async with open_router("127.0.0.1") as ghost, open_bootstrap_client() as client:
            worker = RegisterWorker("ghost", 1, 0, 0, ghost.address)  # (dp 0 is P's, leased)
            await client.register(cluster.bootstrap_url, worker, timeout=1e6)
            dst = d.pool.allocate(2)
            start = trio.current_time()
            with pytest.raises(PullFailedError, match=r"pull deadline \(2 s\)"):
                await d.receiver.pull(
                    "t7", bootstrap_url=cluster.bootstrap_url, engine_id="ghost", block_ids=dst
                )
            assert 2 <= trio.current_time() - start < 3
            d.pool.free(dst)
            _, first = await ghost.receive()
            _, second = await ghost.receive()
            assert isinstance(decode_frames(first), PullRequest)
            cancel = decode_frames(second)
            assert isinstance(cancel, CancelPull) and cancel.transfer_id == "t7"


async def test_abort_on_d_frees_p_blocks() -> None:
    sender = SenderConfig(engine_id="p", ready_timeout=300)
    with trio.fail_after(10):
        async with open_cluster(sender=sender, **SMALL) as cluster:
            p, d = cluster.prefill[0], cluster.decode[0]
            dst = d.pool.allocate(4)
            p.sender.transfer_pending("t8")
            d.receiver.start_pull(
                "t8", bootstrap_url=cluster.bootstrap_url, engine_id=p.engine_id, block_ids=dst
            )
            await wait_until(lambda: p.sender.pulls_waiting("t8") == 1)  # the pull reached P
            d.receiver.abort("t8", "client went away")
            # the pull ends when P confirms it is not writing into D's blocks
            assert d.receiver.take_results().failed == {}
            await wait_until(lambda: d.receiver.in_flight == 0)
            assert d.receiver.take_results().failed == {"t8": "client went away"}
            d.pool.free(dst)
            await wait_until(lambda: p.sender.transfer_state("t8") is SendState.CANCELLED)
            src = p.pool.allocate(4)
            p.owned["t8"] = src
            p.sender.transfer_ready("t8", src)  # P finishes after D left: freed at once
            await settled(cluster)


async def test_write_failure_is_reported_and_next_transfer_works() -> None:
    def faulty(plane: object) -> FaultyDataPlane:
        return FaultyDataPlane(plane, fail_writes=1)  # type: ignore[arg-type]

    with trio.fail_after(30):
        async with open_cluster(wrap_prefill=faulty, **SMALL) as cluster:
            bad = await run_transfer(cluster, "t9", 4)
            assert not bad.ok and "injected fault" in bad.reason
            good = await run_transfer(cluster, "t10", 4)
            assert good.ok and good.verified
            await settled(cluster)


async def test_unknown_engine_fails_with_clear_reason() -> None:
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster:
            d = cluster.decode[0]
            with pytest.raises(PullFailedError, match="'nope' is not registered"):
                await d.receiver.pull(
                    "t11", bootstrap_url=cluster.bootstrap_url, engine_id="nope", block_ids=[0]
                )


async def test_out_of_range_block_ids_fail_without_writing() -> None:
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster:
            p, d = cluster.prefill[0], cluster.decode[0]
            src, dst = prepare(cluster, "t12", 2)
            p.sender.transfer_ready("t12", src)
            with pytest.raises(PullFailedError, match=r"out of range|outside"):
                await d.receiver.pull(
                    "t12",
                    bootstrap_url=cluster.bootstrap_url,
                    engine_id=p.engine_id,
                    block_ids=[dst[0], 10_000],
                )
            d.pool.free(dst)
            await settled(cluster)


async def test_pull_without_known_layout_gets_layout_unknown() -> None:
    with trio.fail_after(30):
        async with open_cluster(**SMALL) as cluster:
            p = cluster.prefill[0]
            request = PullRequest("t13", "127.0.0.1:1", 0, 1, 0, 1, ((0,),), "never-sent")
            async with open_dealer(p.sender.address) as dealer:
                await dealer.send(encode_frames(request))
                answer = decode_frames(await dealer.receive())
            assert answer == LayoutUnknown("t13", "never-sent")
