"""Garbage at the side channel: a bad frame is answered with an error when its sender has sent
the bytes the answer takes (never more, never twice), and the actors keep serving a normal
transfer afterwards.

The cluster runs in a :class:`~pdactors.host.TrioHost` thread for the whole module, so
hypothesis can drive it from plain synchronous test code through a raw ZMQ socket.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import msgspec
import pytest
import trio
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pdactors.host import TrioHost
from pdactors.testing import Cluster, open_cluster, run_transfer
from pdactors.wire import (
    HEADER,
    CancelPull,
    ErrorReply,
    FrameError,
    PullFailed,
    decode_frames,
    encode_frames,
)


class Running:
    def __init__(self, host: TrioHost, cluster: Cluster) -> None:
        self.host = host
        self.cluster = cluster


@pytest.fixture(scope="module")
def running() -> Iterator[Running]:
    host = TrioHost()
    box: list[Cluster] = []
    ready = trio.Event()
    release = trio.Event()

    async def hold_cluster() -> None:
        async with open_cluster(layers=2, num_blocks=32, block_bytes=1024) as cluster:
            box.append(cluster)
            ready.set()
            await release.wait()

    async def start() -> None:
        host.nursery.start_soon(hold_cluster)
        with trio.fail_after(30):
            await ready.wait()

    try:
        host.run(start)
        yield Running(host, box[0])
    finally:
        host.run_sync(release.set)
        host.close(timeout=30)


@pytest.fixture(scope="module")
def dealer(running: Running) -> Iterator[zmq.Socket[bytes]]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(running.cluster.prefill[0].sender.address)
    yield sock
    sock.close()


def valid_payloads() -> st.SearchStrategy[bytes]:
    """msgpack arrays that look like our messages but are wrong in type or shape."""
    tags = st.sampled_from(["pull", "cancel", "done", "failed", "layout?", "error", "nope"])
    values = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda inner: st.lists(inner, max_size=4),
        max_leaves=12,
    )
    return st.builds(
        lambda t, rest: msgspec.msgpack.encode([t, *rest]), tags, st.lists(values, max_size=10)
    )


frames_strategy = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=4),  # anything at all
    st.tuples(st.just(HEADER), st.binary(max_size=64)).map(list),  # right header, junk payload
    st.tuples(st.just(HEADER), valid_payloads()).map(list),  # right header, near-miss payloads
    st.tuples(st.just(b"PDA\x07"), st.binary(max_size=16)).map(list),  # a future version
)


_probes = itertools.count()
#: Bytes of garbage sent and of answers received, over the whole test (the credit carries over).
_balance = {"sent": 0, "answered": 0}


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frames=frames_strategy)
def test_garbage_frames_are_answered_with_errors_within_their_bytes(
    dealer: zmq.Socket[bytes], frames: list[bytes]
) -> None:
    # Well-formed messages are the other tests' business (a valid pull would wait for P).
    assume(not _decodes(frames))
    dealer.send_multipart(frames)
    _balance["sent"] += sum(map(len, frames))
    # A cancel is always answered, after whatever the garbage got (one queue per peer).
    probe = f"probe-{next(_probes)}"
    dealer.send_multipart(encode_frames(CancelPull(probe)))
    answers = []
    while True:
        raw = dealer.recv_multipart()
        answer = decode_frames(raw)
        if isinstance(answer, PullFailed) and answer.transfer_id == probe:
            break
        assert isinstance(answer, ErrorReply | PullFailed), answer
        _balance["answered"] += sum(map(len, raw))
        answers.append(answer)
    assert len(answers) <= 1  # at most one answer per bad frame
    assert _balance["answered"] <= _balance["sent"]  # never more bytes than it sent


def _decodes(frames: list[bytes]) -> bool:
    try:
        decode_frames(frames)
    except FrameError:
        return False
    return True


def test_version_mismatch_is_named(dealer: zmq.Socket[bytes]) -> None:
    dealer.send_multipart([b"PDA\x09", b"x" * 200])  # pays for an answer
    answer = decode_frames(dealer.recv_multipart())
    assert isinstance(answer, ErrorReply) and "protocol version 9" in answer.reason


def test_actors_still_serve_after_garbage(running: Running) -> None:
    # Runs after the hypothesis test in file order.
    async def transfer() -> None:
        with trio.fail_after(10):
            outcome = await run_transfer(running.cluster, "after-garbage", 4)
            assert outcome.ok and outcome.verified
            await running.cluster.wait_settled()

    running.host.run(transfer)
