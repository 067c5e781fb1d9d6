"""Fuzzing P's side channel while a real D keeps pulling (issue 23): random frames and
structured ones (our messages with extreme numbers, huge and malformed fields) from a raw
DEALER against a real sender, bounded in examples. The actor must live, a real D's pulls
(verified bytes through real Mooncake engines) must never wait more than about a second
behind the attacker, and P's memory must stay bounded.

The cluster runs in a :class:`~pdactors.host.TrioHost` thread, so hypothesis drives the
attacker from plain synchronous code; the test that fuzzes checks, once the fuzz is over, what
it claims.
"""

from __future__ import annotations

import resource
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import pytest
import trio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdactors.host import TrioHost
from pdactors.testing import Cluster, TransferOutcome, open_cluster, run_transfer
from pdactors.wire import HEADER, MAX_BLOCK_IDS, MAX_REGIONS, decode_frames

#: How long a real D's pull may take while P is under attack (about a second: a loaded CI box).
BEHIND = 1.5
#: What P (this whole process) may grow by under the fuzz.
MEMORY_BOUND = 200 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@dataclass
class Running:
    host: TrioHost
    cluster: Cluster
    outcomes: list[TransferOutcome] = field(default_factory=list)
    stop: trio.Event = field(default_factory=trio.Event)
    rss_before: int = 0


@pytest.fixture
def running() -> Iterator[Running]:
    host = TrioHost()
    box: list[Running] = []
    ready = trio.Event()
    release = trio.Event()

    async def hold_cluster() -> None:
        async with open_cluster(layers=2, num_blocks=256, block_bytes=1024) as cluster:
            run = Running(host, cluster)
            box.append(run)
            ready.set()
            i = 0
            while not run.stop.is_set():  # a real D, pulling verified KV all along
                run.outcomes.append(await run_transfer(cluster, f"real-{i}", 1 + i % 4))
                i += 1
            await release.wait()

    async def start() -> None:
        host.nursery.start_soon(hold_cluster)
        with trio.fail_after(30):
            await ready.wait()

    try:
        host.run(start)
        box[0].rss_before = _rss()
        yield box[0]
    finally:
        if box:
            host.run_sync(box[0].stop.set)
        host.run_sync(release.set)
        host.close(timeout=30)


@pytest.fixture
def attacker(running: Running) -> Iterator[zmq.Socket[bytes]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(running.cluster.prefill[0].sender.address)
    yield sock
    sock.close()


EXTREME = st.sampled_from(
    [0, 1, 2, 7, 8, 1023, 1024, 1025, 4096, 4097, 2**20, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
)
INTS = EXTREME | st.integers(0, 2**64 - 1) | st.integers(-(2**63), -1)
SMALL = st.integers(0, 4)  # ranks and sizes that pass, so the other fields get looked at
TEXT = st.text(max_size=40) | st.sampled_from(["\nCRITICAL forged", "x" * 600, "é" * 200])
IDS = st.lists(INTS, max_size=8) | st.builds(lambda n: list(range(n)), st.integers(0, 3000))


@st.composite
def layouts(draw: st.DrawFn) -> object:
    n = draw(st.integers(0, 6) | st.sampled_from([MAX_REGIONS, MAX_REGIONS + 1]))
    region = st.lists(INTS, min_size=4, max_size=4) if n < 10 else st.just([0, 64, 1024, 1024])
    regions = [draw(region)] * n if n >= 10 else draw(st.lists(region, min_size=n, max_size=n))
    names = draw(st.just([]) | st.lists(TEXT, min_size=n, max_size=n) if n < 10 else st.just([]))
    groups = draw(st.just([]) | st.lists(INTS, min_size=n, max_size=n) if n < 10 else st.just([]))
    return [regions, names, groups]


@st.composite
def pulls(draw: st.DrawFn) -> list[object]:
    ids = draw(st.lists(IDS, max_size=3) | st.just([[0] * (MAX_BLOCK_IDS + 1)]))
    body = [
        draw(TEXT),  # transfer id
        draw(TEXT),  # session
        *(draw(SMALL | INTS) for _ in range(4)),  # tp_rank, tp_size, pp_rank, pp_size
        ids,
        draw(TEXT),  # layout id
        draw(st.none() | layouts()),
        *(draw(SMALL | INTS) for _ in range(3)),  # kv_heads, p_tp_size, p_pp_size
    ]
    return ["pull", *body[: draw(st.integers(8, len(body)))]]


#: A pull P accepts (it waits for its transfer), as the list the wire carries.
VALID_PULL: list[object] = ["pull", "t", "127.0.0.1:1", 0, 1, 0, 1, [[1]], "l",
                            [[[1 << 20, 64, 1024, 1024]], [], []], 0, 0, 0]  # fmt: skip


@st.composite
def mutated_pulls(draw: st.DrawFn) -> list[object]:
    """A valid pull with one to three fields replaced: past the checks that the others pass."""
    msg = list(VALID_PULL)
    msg[1] = draw(TEXT)
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.integers(3, len(msg) - 1))
        msg[field] = draw(SMALL | INTS | TEXT | st.none() | layouts() | st.lists(IDS, max_size=3))
    return msg


@st.composite
def shape_pulls(draw: st.DrawFn) -> list[object]:
    """A valid pull whose TP shape and head count are drawn from the sizes that broke P."""
    msg = list(VALID_PULL)
    msg[3] = draw(st.sampled_from([0, 1, 2**63]))  # tp_rank
    msg[4] = draw(st.sampled_from([1, 2, 8, 1024, 2048, 4000, 2**31]))  # tp_size
    msg[10] = draw(st.sampled_from([0, 8, 4096, 2**63, 2**64 - 1]))  # kv_heads
    return msg


structured = st.one_of(
    shape_pulls(),
    mutated_pulls(),
    pulls(),
    st.builds(lambda t, r: ["cancel", t, r], TEXT, TEXT),
    st.builds(
        lambda tag, rest: [tag, *rest],
        st.sampled_from(["done", "failed", "layout?", "error", "?"]),
        st.lists(INTS | TEXT, max_size=4),
    ),
)
frames_strategy = st.one_of(
    st.lists(st.binary(max_size=256), min_size=1, max_size=5),  # anything at all
    st.tuples(st.just(HEADER), st.binary(max_size=256)).map(list),
    st.tuples(st.just(HEADER), structured.map(msgspec.msgpack.encode)).map(list),
    st.tuples(st.just(b"PDA\x03"), structured.map(msgspec.msgpack.encode)).map(list),
)


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
@given(frames=frames_strategy)
def send_fuzzed(attacker: zmq.Socket[bytes], frames: list[bytes]) -> None:
    attacker.send_multipart(frames)
    while attacker.poll(0):  # it reads its answers (one that did not would be cut off)
        decode_frames(attacker.recv_multipart())  # P only ever sends frames that decode


def test_fuzzed_frames_never_stop_p_nor_hold_up_a_real_d(
    running: Running, attacker: zmq.Socket[bytes]
) -> None:
    send_fuzzed(attacker)

    async def last_transfer() -> TransferOutcome:
        with trio.fail_after(BEHIND):
            return await run_transfer(running.cluster, "after-fuzz", 4)

    outcome = running.host.run(last_transfer)  # P still serves
    assert outcome.ok and outcome.verified, outcome
    running.host.run_sync(running.stop.set)
    outcomes = list(running.outcomes)
    assert len(outcomes) > 10
    bad = [o for o in outcomes if not (o.ok and o.verified)]
    assert not bad, bad[:3]
    slowest = max(o.seconds for o in outcomes)
    assert slowest < BEHIND, slowest
    grown = _rss() - running.rss_before
    assert grown < MEMORY_BOUND, f"P grew by {grown >> 20} MB"
    stats = running.cluster.prefill[0].sender.side_channel_statistics()
    assert stats.bad_frames > 0 and stats.peers_cut_off == 0, stats
    print(
        f"{len(outcomes)} real pulls, slowest {slowest * 1000:.0f} ms; +{grown >> 20} MB; {stats}"
    )
