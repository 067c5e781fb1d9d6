"""Issue 23, as an attacker or a buggy peer would probe the side channel: one test per finding
(each failed before the fix). Real ZMQ on loopback, real Mooncake engines where bytes move:
a real D keeps pulling verified KV through the P under attack, and no pull of it waits more
than about a second behind the attacker."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import trio
import zmq
from msgspec import msgpack

from pdactors import PullFailedError
from pdactors.actors._pull_check import MAX_WAITING_IDS, MAX_WAITING_PULLS
from pdactors.bootstrap_client import open_bootstrap_client
from pdactors.config import Liveness
from pdactors.core.plan import packed_layout
from pdactors.testing import Cluster, open_cluster, run_transfer
from pdactors.transport import open_dealer, open_router
from pdactors.wire import (
    HEADER,
    MAX_BLOCK_IDS,
    MAX_FRAME_BYTES,
    MAX_REGIONS,
    BlockLayout,
    CancelPull,
    Layout,
    Msg,
    PullFailed,
    PullRequest,
    RegisterWorker,
    decode_frames,
    encode_frames,
)
from tests.conftest import wait_until

SMALL = {"layers": 2, "num_blocks": 64, "block_bytes": 1024}
#: How long a real D's pull may take while P is under attack (about a second: a loaded CI box).
BEHIND = 1.5
LAYOUT = packed_layout(1 << 20, 2, 64, 1024)


def pull(tid: str, **fields: object) -> PullRequest:
    """A well-formed pull of one block, with ``fields`` changed."""
    base: dict[str, object] = {
        "transfer_id": tid,
        "session": "127.0.0.1:1",
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "block_ids": ((1,),),
        "layout_id": f"layout-{tid}",
        "layout": LAYOUT,
    }
    return PullRequest(**{**base, **fields})  # type: ignore[arg-type]


async def real_pull(cluster: Cluster, tid: str) -> None:
    """One real transfer, verified, within :data:`BEHIND` seconds."""
    with trio.fail_after(BEHIND):
        outcome = await run_transfer(cluster, tid, 3)
    assert outcome.ok and outcome.verified, outcome


async def answer(dealer: object, tid: str) -> Msg:
    """The next answer on ``dealer`` about ``tid`` (within 5 s)."""
    with trio.fail_after(5):
        while True:
            msg = decode_frames(await dealer.receive())  # type: ignore[attr-defined]
            if getattr(msg, "transfer_id", None) == tid:
                return msg


# --------------------------------------------------------------------------- finding 1


async def test_a_pull_with_a_huge_tp_size_costs_p_no_time() -> None:
    """tp_size 1,000 froze P for 2.8 s, 2,000 for 6.6 s (O(tp_size²) in the receive loop)."""
    async with open_cluster(**SMALL) as cluster:
        p = cluster.prefill[0]
        await real_pull(cluster, "warm")
        async with open_dealer(p.sender.address) as attacker:
            for tp_size, heads in [(1024, 8), (1024, 4096), (2048, 8)]:
                tid = f"tp{tp_size}-{heads}"
                evil = pull(tid, tp_rank=tp_size - 1, tp_size=tp_size, kv_heads=heads)
                await attacker.send(encode_frames(evil))
            await real_pull(cluster, "after-tp")
            refused = await answer(attacker, "tp2048-8")  # beyond the limit: refused at once
            assert isinstance(refused, PullFailed) and "pull refused" in refused.reason
            # within the limits, a valid pull: it waits for its transfer, as any pull does
            assert p.sender.transfer_state("tp1024-8") is not None


# --------------------------------------------------------------------------- finding 2


async def test_no_message_crashes_p() -> None:
    """kv_heads 2**63 with tp_size 2 (OverflowError), and a layout group of 2**63 meeting a
    ready transfer (numpy's intp), each ended P's sender."""
    async with open_cluster(**SMALL) as cluster:
        p = cluster.prefill[0]
        src = p.pool.allocate(1)
        p.owned["ready"] = src
        p.sender.transfer_ready("ready", src)
        huge_group = Layout(LAYOUT.regions, groups=(2**63, 2**63))
        evil = [
            pull("heads", tp_size=2, kv_heads=2**63),
            pull("ready", layout=huge_group, layout_id="huge-group"),
            pull("ids", block_ids=((2**64 - 1,),)),
            pull("region", layout=Layout((BlockLayout(2**64 - 1, 2**64 - 1, 1, 1),))),
        ]
        async with open_dealer(p.sender.address) as attacker:
            for msg in evil:
                await attacker.send(encode_frames(msg))
                failed = await answer(attacker, msg.transfer_id)
                assert isinstance(failed, PullFailed), failed
        await real_pull(cluster, "after-crashers")
        p.sender.transfer_dropped("ready")
        await cluster.wait_settled()


# --------------------------------------------------------------------------- finding 3


async def test_a_peer_that_stops_reading_is_cut_off_and_stalls_no_d() -> None:
    """A DEALER that sends and never reads stalled every D's pulls for 60 s."""
    async with open_cluster(**SMALL) as cluster:
        p = cluster.prefill[0]
        await real_pull(cluster, "warm")
        attacker = zmq.Context.instance().socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.setsockopt(zmq.RCVHWM, 1)
        attacker.setsockopt(zmq.RCVBUF, 4096)
        attacker.connect(p.sender.address)
        try:
            attacker.send_multipart(encode_frames(pull("victim")))  # a pull of its, waiting

            def cut() -> bool:
                return p.sender.side_channel_statistics().peers_cut_off > 0

            async def flood() -> None:
                sent = 0
                while sent < 200_000 and not cut():  # each cancel gets a ~560-byte answer
                    try:
                        cancel = encode_frames(CancelPull(f"{sent:0500}"))
                        attacker.send_multipart(cancel, zmq.NOBLOCK)
                        sent += 1
                    except zmq.Again:
                        await trio.sleep(0.001)
                    if sent % 100 == 0:
                        await trio.lowlevel.checkpoint()

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(flood)
                    i = 0
                    while not cut():
                        await real_pull(cluster, f"during-{i}")
                        i += 1
            assert i > 0
            # its transfers ended as a lost D's do
            assert p.sender.transfer_state("victim").value == "cancelled"  # type: ignore[union-attr]
            await real_pull(cluster, "after-cut")
        finally:
            attacker.close()


async def test_garbage_is_never_answered_with_more_bytes_than_it_carried() -> None:
    """Each garbage frame got a ~60x larger ErrorReply: an amplifier."""
    async with open_cluster(**SMALL) as cluster:
        p = cluster.prefill[0]
        async with open_dealer(p.sender.address) as attacker:
            garbage = [[b"x"], [HEADER, b""], [HEADER, b"\xc1"], [b"PDA\x07", b"y" * 3]] * 50
            garbage += [[HEADER, b"\x93\xa4pull" + b"z" * 60]] * 20
            sent = sum(len(f) for frames in garbage for f in frames)
            for frames in garbage:
                await attacker.send(frames)
            await attacker.send(encode_frames(CancelPull("probe")))  # answered after the rest
            received = 0
            with trio.fail_after(5):
                while True:
                    frames = await attacker.receive()
                    msg = decode_frames(frames)
                    if isinstance(msg, PullFailed) and msg.transfer_id == "probe":
                        break
                    received += sum(map(len, frames))
            assert received <= sent, (received, sent)
        stats = p.sender.side_channel_statistics()
        assert stats.bad_frames == len(garbage) and stats.answers_withheld > 0, stats
        await real_pull(cluster, "after-garbage")


# --------------------------------------------------------------------------- finding 4


@pytest.mark.parametrize(
    ("answer_with", "why"),
    [
        # (as msgpack: the ErrorReply that names its transfer, written out)
        (lambda tid: [HEADER, msgpack.encode(["error", "cannot read it", tid])], "could not read"),
        (lambda tid: [b"PDA\x03", b"\x91\xa4done"], "protocol version 3, this D speaks 2"),
        (lambda tid: [HEADER, b"\xc1"], "undecodable frame"),
    ],
    ids=["error-reply", "other-version", "garbage"],
)
async def test_d_ends_a_pull_at_once_when_p_answers_what_it_cannot_use(
    answer_with: Callable[[str], list[bytes]], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An ErrorReply, a frame of another protocol version or garbage from P left D's pull
    waiting for pull_timeout (540 s)."""
    caplog.set_level(logging.INFO, "pdactors.receiver")
    async with (
        open_cluster(**SMALL) as cluster,
        open_router("127.0.0.1", liveness=Liveness()) as fake_p,
        open_bootstrap_client(None, None) as client,
        trio.open_nursery() as nursery,
    ):
        me = RegisterWorker(engine_id="fake-p", dp_rank=7, tp_rank=0, pp_rank=0,
                            addr=fake_p.address)  # fmt: skip
        await client.register(cluster.bootstrap_url, me, timeout=5)

        async def serve() -> None:
            while True:
                identity, frames = await fake_p.receive()
                msg = decode_frames(frames)
                if isinstance(msg, PullRequest):
                    await fake_p.send(identity, answer_with(msg.transfer_id))

        nursery.start_soon(serve)
        d = cluster.decode[0]
        for i in range(3):
            with trio.fail_after(5), pytest.raises(PullFailedError, match=why):
                await d.receiver.pull(f"skew-{i}", bootstrap_url=cluster.bootstrap_url,
                                      engine_id="fake-p", block_ids=[i])  # fmt: skip
        assert d.receiver.protocol_errors == 3
        await real_pull(cluster, "real-after-skew")  # the real P is still served
        nursery.cancel_scope.cancel()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "fake" not in r.name]
    protocol_lines = [r for r in warnings if "such in" in r.getMessage()]
    assert len(protocol_lines) == 1, [r.getMessage() for r in warnings]  # counted, logged once


# --------------------------------------------------------------------------- finding 5


async def test_a_frame_beyond_the_limit_drops_its_connection_unread() -> None:
    """No MAXMSGSIZE: 5 x 100 MB frames raised P to 566 MB."""
    async with open_cluster(**SMALL) as cluster:
        p = cluster.prefill[0]
        async with open_dealer(p.sender.address, liveness=Liveness()) as attacker:
            await attacker.send([HEADER, bytes(MAX_FRAME_BYTES + 1)])
            with trio.fail_after(10):
                reason = await attacker.wait_lost(5)
            assert "lost" in reason, reason
        assert p.sender.side_channel_statistics().bad_frames == 0  # never reached the actor
        await real_pull(cluster, "after-big-frame")


async def test_layouts_are_bounded_in_bytes_and_forgotten_with_their_peer() -> None:
    """The layout cache kept 1,024 layouts of any size, after their peer left."""
    async with open_cluster(**SMALL) as cluster:
        p = cluster.prefill[0]
        cache = p.sender._layouts
        async with open_dealer(p.sender.address) as attacker:
            for i in range(12):
                big = packed_layout(i << 40, MAX_REGIONS, 64, 1024)
                named = Layout(big.regions, tuple(f"{i}-{r:0120}" for r in range(MAX_REGIONS)))
                msg = pull(f"big-{i}", layout=named, layout_id=f"big-{i}")
                await attacker.send(encode_frames(msg))
            await wait_until(lambda: p.sender.transfer_state("big-11") is not None)
            assert 0 < cache.nbytes <= cache.max_bytes and len(cache) < 12
        await wait_until(lambda: len(cache) == 0)  # its peer is gone: so are its layouts
        await real_pull(cluster, "after-layouts")


async def test_a_pull_beyond_the_block_id_limit_is_refused_at_once() -> None:
    """10 M block ids per pull were kept (+78 MB each) until ready_timeout."""
    async with open_cluster(**SMALL) as cluster:
        p = cluster.prefill[0]
        async with open_dealer(p.sender.address) as attacker:
            ids = (tuple(range(100)) * (MAX_BLOCK_IDS // 100 + 1))[: MAX_BLOCK_IDS + 1]
            await attacker.send(encode_frames(pull("many", block_ids=(ids,))))
            refused = await answer(attacker, "many")
            assert isinstance(refused, PullFailed) and "pull refused" in refused.reason
            assert p.sender.transfer_state("many") is None
        await real_pull(cluster, "after-many")


async def test_what_one_peer_leaves_waiting_is_bounded() -> None:
    """Pulls for transfers P has not heard of wait for ready_timeout (480 s): one peer may
    leave only so many, naming only so many block ids."""
    async with open_cluster(**SMALL) as cluster:
        p = cluster.prefill[0]
        async with open_dealer(p.sender.address) as attacker:
            ids = (tuple(range(100)) * (MAX_BLOCK_IDS // 100 + 1))[:MAX_BLOCK_IDS]
            for i in range(MAX_WAITING_IDS // MAX_BLOCK_IDS):
                await attacker.send(encode_frames(pull(f"big-{i}", block_ids=(ids,))))
            await attacker.send(encode_frames(pull("one-id-too-many")))
            refused = await answer(attacker, "one-id-too-many")
            assert isinstance(refused, PullFailed) and "block ids" in refused.reason
            for i in range(MAX_WAITING_PULLS):  # (the big ones count too)
                await attacker.send(encode_frames(pull(f"w{i}", block_ids=())))
            refused = await answer(attacker, f"w{MAX_WAITING_PULLS - 4}")
            assert isinstance(refused, PullFailed) and "pulls waiting" in refused.reason
            await real_pull(cluster, "beside-the-waiting")
            await attacker.send(encode_frames(CancelPull("big-0")))  # one ends: room again
            assert (await answer(attacker, "big-0")).reason == "cancelled"  # type: ignore[union-attr]
            await attacker.send(encode_frames(pull("room")))
            with trio.move_on_after(0.5):
                raise AssertionError(f"refused: {await answer(attacker, 'room')}")
            assert p.sender.transfer_state("room") is not None


# --------------------------------------------------------------------------- finding 8


async def test_cancels_are_not_logged_per_message_and_peer_text_is_escaped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every CancelPull was logged at INFO with the peer's text: a newline forged a line."""
    caplog.set_level(logging.DEBUG, "pdactors")
    async with open_cluster(**SMALL) as cluster:
        p = cluster.prefill[0]
        async with open_dealer(p.sender.address) as attacker:
            for i in range(100):
                forged = CancelPull(f"c{i}\nCRITICAL x", "bye\nCRITICAL forged line")
                await attacker.send(encode_frames(forged))
            await attacker.send([b"PDA\x07", b"\nCRITICAL " * 10])
            await attacker.send(encode_frames(pull("p\nCRITICAL forged", session="s\nCRITICAL")))
            await attacker.send(encode_frames(CancelPull("last")))
            await answer(attacker, "last")  # everything before it was read
    assert not [r for r in caplog.records if "\n" in r.getMessage()]
    cancels = [r for r in caplog.records if r.levelno >= logging.INFO and "bye" in r.getMessage()]
    assert not cancels
