"""The data plane's batching of writes to one peer (pdactors.dataplane._batching): a write
whose ``before`` may wait for KV gets an engine call of its own; one whose ``before`` only
prepares (the KV checksums' hashing) joins a batch like a write without one."""

from __future__ import annotations

import numpy as np

from pdactors.dataplane._batching import PeerQueue, Piece, Write, may_wait


class _Prepare:
    may_wait = False

    def __call__(self) -> None:
        pass


def _piece(before: object = None) -> Piece:
    runs = np.zeros(1, np.uint64)
    return Piece(Write(8, 1, before=before), runs, runs, runs)  # type: ignore[arg-type]


def test_a_preparation_joins_the_batch_and_a_wait_starts_its_own() -> None:
    queue = PeerQueue(calls=1)
    plain, hashed, waits, after = _piece(), _piece(_Prepare()), _piece(lambda: None), _piece()
    queue.pieces.extend([plain, hashed, waits, after])
    assert queue.take(limit=1024) == [plain, hashed]  # the wait would hold the call
    assert queue.take(limit=1024) == [waits, after]
    assert may_wait(lambda: None) and not may_wait(None) and not may_wait(_Prepare())
