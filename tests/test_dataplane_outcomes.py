"""The data plane's one failure classification (pdactors.dataplane._outcomes): every class of
what the engine returns, and of what a write's ``before`` does, against an oracle written out
by hand; then the same engine behaviours through each way a call is made (at once in the Trio
thread, queued in the Trio thread, queued in a worker thread), which must end alike.

No Mooncake: a stub engine returns the code (or raises the exception) it is given.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import trio

from pdactors.config import DataPlaneConfig
from pdactors.dataplane._outcomes import Outcome, classify, failure
from pdactors.dataplane.mooncake import MooncakeDataPlane
from pdactors.errors import DataPlaneError, TransferError

OC = Outcome
BOOM = RuntimeError("binding exploded")
CUDA = RuntimeError("CUDA error")

#: (what the engine returned, what the write's ``before`` raised) -> outcome, the error type
#: the write raises (None: none), the code on it, and its message. Written by hand: a call of
#: 3 descriptors carrying one other write, a write of 8 bytes to "d:1".
ORACLE: list[tuple[Any, Exception | None, Outcome, type[Exception] | None, Any, str]] = [
    (0, None, OC.LANDED, None, None, ""),
    # the engine's own codes, whatever their sign: the peer refused; the code is kept as is
    (-1, None, OC.REFUSED, TransferError, -1,
     "write of 8 bytes to d:1 failed with code -1: engine call of 3 descriptors, "
     "carrying 1 other write failed"),
    (-800, None, OC.REFUSED, TransferError, -800,
     "write of 8 bytes to d:1 failed with code -800: engine call of 3 descriptors, "
     "carrying 1 other write failed"),
    (1, None, OC.REFUSED, TransferError, 1,
     "write of 8 bytes to d:1 failed with code 1: engine call of 3 descriptors, "
     "carrying 1 other write failed"),
    # the binding raised: no code at all, never a number of ours
    (BOOM, None, OC.RAISED, TransferError, None,
     "write of 8 bytes to d:1 failed: the engine call raised RuntimeError('binding exploded')"),
    # the write's wait raised: whatever its call did, nothing of it was sent
    (0, CUDA, OC.NOT_COMPLETE, DataPlaneError, None,
     "write of 8 bytes to d:1: the KV was not complete: RuntimeError: CUDA error"),
    (-1, CUDA, OC.NOT_COMPLETE, DataPlaneError, None,
     "write of 8 bytes to d:1: the KV was not complete: RuntimeError: CUDA error"),
    (BOOM, CUDA, OC.NOT_COMPLETE, DataPlaneError, None,
     "write of 8 bytes to d:1: the KV was not complete: RuntimeError: CUDA error"),
    (None, CUDA, OC.NOT_COMPLETE, DataPlaneError, None,  # every write of the call failed its wait
     "write of 8 bytes to d:1: the KV was not complete: RuntimeError: CUDA error"),
]  # fmt: skip


@pytest.mark.parametrize(("returned", "wait", "outcome", "kind", "code", "message"), ORACLE)
def test_every_class_of_engine_result_has_one_outcome_and_one_error(
    returned: Any,
    wait: Exception | None,
    outcome: Outcome,
    kind: type[Exception] | None,
    code: Any,
    message: str,
) -> None:
    assert classify(returned, wait) is outcome
    failed = failure(returned, wait, descriptors=3, others=1)
    if kind is None:
        assert failed is None
        return
    assert failed is not None and failed.outcome is outcome and failed.code == code
    error = failed.error("d:1", 8)
    assert type(error) is kind and str(error) == message
    if isinstance(error, TransferError):
        assert (error.peer, error.nbytes, error.code) == ("d:1", 8, code)


def test_the_oracle_covers_every_outcome() -> None:
    assert {row[2] for row in ORACLE} == set(Outcome)


def test_no_call_for_a_write_whose_wait_did_not_fail_is_a_bug() -> None:
    with pytest.raises(ValueError, match="no engine call"):
        classify(None)


def test_the_detail_counts_the_other_writes_of_the_call() -> None:
    def detail(others: int) -> str:
        failed = failure(-1, descriptors=5, others=others)
        assert failed is not None
        return failed.detail

    assert detail(0) == "engine call of 5 descriptors failed"
    assert detail(2) == "engine call of 5 descriptors, carrying 2 other writes failed"


# ------------------------------------------------------ every way a call is made ends alike


class StubEngine:
    """Returns ``returned`` from every call, or raises it; records the calls' threads."""

    def __init__(self, returned: int | Exception) -> None:
        self.returned = returned
        self.threads: list[int] = []

    def register_memory(self, addr: int, length: int) -> int:
        return 0

    def unregister_memory(self, addr: int) -> int:
        return 0

    def batch_transfer_sync_write(
        self, target: str, src: list[int], dst: list[int], lengths: list[int]
    ) -> int:
        self.threads.append(threading.get_ident())
        if isinstance(self.returned, Exception):
            raise self.returned
        return self.returned


class Wait:
    """A ``before``: raises ``raises`` if given. ``probe``: what its ``ready()`` answers, in
    turn (the last answer repeats; ``probes`` counts the questions); None: it has no
    ``ready()``."""

    def __init__(self, raises: Exception | None, probe: list[bool] | None) -> None:
        self.raises, self.probes = raises, 0
        if probe is not None:
            answers = iter(probe)

            def ready() -> bool:
                self.probes += 1
                return next(answers, probe[-1])

            self.ready = ready

    def __call__(self) -> None:
        if self.raises is not None:
            raise self.raises


#: How each way is reached: the config, and the ``before`` probe that leads there. Queued in
#: the Trio thread: the KV was not complete when the write came (so it queued), and is when
#: its call is made.
WAYS = {
    "at once": (DataPlaneConfig(inline_max_bytes=1 << 20), [True]),
    "queued here": (DataPlaneConfig(inline_max_bytes=1 << 20), [False, True]),
    "worker thread": (DataPlaneConfig(inline_max_bytes=0), None),
}

ENGINE_ROWS = [row for row in ORACLE if row[0] is not None]


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize(("returned", "wait", "outcome", "kind", "code", "message"), ENGINE_ROWS)
async def test_each_way_of_making_a_call_classifies_alike(
    way: str,
    returned: Any,
    wait: Exception | None,
    outcome: Outcome,
    kind: type[Exception] | None,
    code: Any,
    message: str,
) -> None:
    config, probe = WAYS[way]
    engine = StubEngine(returned)
    plane = MooncakeDataPlane(engine, config, "p:1")
    one = np.array([4096], dtype=np.uint64)
    lengths = np.array([8], dtype=np.uint64)
    after: list[int] = []
    before = Wait(wait, probe)
    with trio.fail_after(5):
        if kind is None:
            await plane.write("d:1", one, one, lengths, before=before,
                              after=lambda: after.append(1))  # fmt: skip
        else:
            with pytest.raises(kind) as info:
                await plane.write("d:1", one, one, lengths, before=before,
                                  after=lambda: after.append(1))  # fmt: skip
            assert type(info.value) is kind
            # one descriptor and no other write in the call (the oracle's call had 3 and 1)
            expected = message.replace("3 descriptors, carrying 1 other write", "1 descriptors")
            assert str(info.value) == expected
            assert getattr(info.value, "code", None) == code
    # asked once at once; queued, asked again when its call is made; never without a probe
    assert before.probes == {"at once": 1, "queued here": 2, "worker thread": 0}[way]
    stats = plane.statistics()
    landed = outcome is OC.LANDED
    assert (stats.writes, stats.failures, stats.calls) == (int(landed), int(not landed), 1)
    assert stats.inline_calls == (0 if way == "worker thread" else 1)
    assert after == ([1] if landed else [])
    made = outcome is not OC.NOT_COMPLETE  # a write whose wait raised is left out of its call
    assert len(engine.threads) == int(made)
    if made:
        here = engine.threads[0] == threading.get_ident()
        assert here == (way != "worker thread")
