"""P's writes into D's memory: one whole transfer, or a streamed one layer by layer.

The IO half of a :class:`~pdactors.core.send_table.StartSend`: plan the transfer from P's
layout to D's, hand the descriptors to the data plane, count what went out. The streamed write
takes its layers from the send table's record of the transfer
(:meth:`~pdactors.core.send_table.SendTable.take_layers`), which also says when P is done.

The write after which D's pull has all its bytes (the whole write, or a streamed transfer's
last) carries the pull's fast completion notice as the data plane's ``after``
(:mod:`pdactors.actors._done_notices`), when the pull asked for one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import trio

from pdactors.actors._done_notices import DoneNotices
from pdactors.actors._pull_check import pull_heads
from pdactors.config import SenderConfig
from pdactors.core.plan import matching_regions, plan_transfer
from pdactors.core.send_rules import StreamState
from pdactors.core.send_stream import Complete
from pdactors.core.send_table import SendTable, StartSend
from pdactors.dataplane.base import Addrs, DataPlane
from pdactors.dataplane.checksum import RunHasher, Xxh3Hasher, pack_sums, transfer_seed
from pdactors.errors import DataPlaneError, PlanError
from pdactors.wire import MAX_SUM_RUNS, Layout

__all__ = ["PULL_ERRORS", "KvWriter", "Written"]

_NO_ADDRS = np.empty(0, dtype=np.uint64)
#: What one pull's message or write may raise besides our own errors: numbers numpy or the
#: engine cannot take. It fails that pull, never the actor.
PULL_ERRORS = (PlanError, DataPlaneError, ArithmeticError, ValueError)


@dataclass(eq=False)
class Written:
    """What one transfer's writes moved so far, and the checksums of their runs."""

    nbytes: int = 0
    descriptors: int = 0
    sums: list[bytes] = field(default_factory=list)

    def wire_sums(self, header: bytes) -> bytes:
        """``PullDone.sums`` (``header``: the hasher's): every run's, or ``b""`` when none
        were taken or too many."""
        runs = sum(len(s) for s in self.sums) // 24
        if not self.sums or runs > MAX_SUM_RUNS:
            return b""
        return header + b"".join(self.sums)


class _HashedFirst:
    """A write's ``before`` that also hashes its source runs, once, in the data plane's worker
    thread right before the engine call (after the KV is complete): no thread hop of its own.
    The data plane may call it twice at once (two calls carrying pieces of the write)."""

    def __init__(
        self,
        before: Complete | None,
        hasher: RunHasher,
        seed: int,
        src: Addrs,
        dst: Addrs,
        lengths: Addrs,
    ) -> None:
        self._before, self._hasher, self._args = before, hasher, (seed, src, dst, lengths)
        self._lock = threading.Lock()
        self.sums: bytes | None = None

    @property
    def may_wait(self) -> bool:
        """Whether calling it may wait for P's KV (a streamed layer): only then does the data
        plane give its write an engine call of its own; hashing alone joins a batch."""
        return self._before is not None

    def __call__(self) -> None:
        with self._lock:
            if self.sums is not None:
                return
            if self._before is not None:
                self._before()
            seed, src, dst, lengths = self._args
            try:
                digests = self._hasher.digests(seed, src, lengths)
            except Exception as exc:  # the hasher's (a GPU's, say): this write fails, not P
                raise DataPlaneError(f"hashing the KV failed: {type(exc).__name__}: {exc}") from exc
            self.sums = pack_sums(dst, lengths, digests)


@dataclass(eq=False)
class KvWriter:
    """Writes P's blocks (laid out as ``layout``) into D's through ``dataplane``; with
    ``checksum_kv``, hashes what it writes with ``hasher``; sends D's fast completion notices
    through ``notices`` (None: none)."""

    config: SenderConfig
    layout: Layout
    dataplane: DataPlane
    hasher: RunHasher = field(default_factory=Xxh3Hasher)
    notices: DoneNotices | None = None

    async def write(
        self,
        job: StartSend,
        written: Written,
        regions: Sequence[int] | None = None,
        before: Complete | None = None,
        *,
        last: bool = True,
    ) -> None:
        """Write ``regions`` (default all) of the job's blocks into D's, once ``before()``
        (in the engine's worker thread) says they are complete; ``last``: D's pull has all
        its bytes once this write landed (it carries the pull's fast notice). Raises what the
        plan or the data plane raise (:data:`PULL_ERRORS`)."""
        pull = job.pull
        assert pull.layout is not None  # attached when the pull arrived
        d_layout = matching_regions(self.layout, pull.layout)  # P's layers in D's memory
        plans = [
            plan_transfer(self.layout, job.src_blocks, d_layout, pull.block_ids, regions, h)
            for h in pull_heads(self.config, pull)
        ]
        if len(plans) == 1:
            src, dst, lengths = plans[0].src, plans[0].dst, plans[0].lengths
        else:  # several head slices (or none: this worker only frees its blocks)
            src, dst, lengths = (
                np.concatenate([getattr(p, a) for p in plans] or [_NO_ADDRS])
                for a in ("src", "dst", "lengths")
            )
        hashed: _HashedFirst | None = None
        if self.config.checksum_kv and len(lengths):  # P's blocks stay unchanged until the end
            seed = transfer_seed(job.transfer_id)
            hashed = _HashedFirst(before, self.hasher, seed, src, dst, lengths)
        after = self.notices.after(pull) if last and self.notices is not None else None
        await self.dataplane.write(
            pull.session, src, dst, lengths, before=hashed or before, after=after
        )
        if hashed is not None:
            if hashed.sums is None:  # a data plane that skipped ``before``: no sums to vouch
                raise DataPlaneError("the write ended without hashing its KV (before not run)")
            written.sums.append(hashed.sums)
        elif self.config.checksum_kv:  # nothing to hash: D still learns that P checksums
            written.sums.append(b"")
        written.nbytes += sum(p.nbytes for p in plans)
        written.descriptors += sum(p.descriptors for p in plans)

    async def stream(self, job: StartSend, table: SendTable, written: Written) -> str | None:
        """Write each layer as P reports it complete, then the rest; the error, if any.

        Ends only once P said it is done with its blocks (ready or dropped), even after a
        failed write: the blocks are released when this write ends, and P may be computing
        into them until then. ``ready_timeout`` is the last resort for a P whose step never
        ends. The write that completes D's pull (the last layer's when P reported every
        layer, else the rest's) carries its fast notice: a P that drops the transfer after
        every layer was written sends it and then ``PullFailed`` (every byte did land).
        """
        tid = job.transfer_id
        every = set(range(len(self.layout.regions)))
        done: set[int] = set()
        error: str | None = None
        with trio.move_on_after(self.config.ready_timeout):
            while True:
                wake = trio.Event()
                layers, record = table.take_layers(tid, wake)
                for regions, complete in layers:
                    todo = [r for r in regions if r not in done]
                    if error is not None or not todo:
                        continue
                    last = done.union(todo) >= every  # rest will be empty (see the docstring)
                    try:
                        await self.write(job, written, todo, complete, last=last)
                    except PULL_ERRORS as exc:
                        error = str(exc) or type(exc).__name__  # no more writes; wait for P
                    done.update(todo)
                if not layers:
                    if record.state is not StreamState.COMPUTING:
                        break
                    await wake.wait()  # a Wake from the table: P reported more, or is done
        stream = table.stream(tid)
        assert stream is not None  # closed only once this write ended
        if stream.state is StreamState.COMPUTING:
            return f"P's streamed prefill did not finish within {self.config.ready_timeout:g} s"
        if error is not None or stream.state is StreamState.DROPPED:
            return error or stream.failed
        rest = [r for r in range(len(self.layout.regions)) if r not in done]
        if rest:
            await self.write(job, written, rest, stream.rest_complete)
        return None
