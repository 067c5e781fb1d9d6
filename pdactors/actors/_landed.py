"""D checks what landed before it reports a pull delivered: P's checksums
(:mod:`pdactors.dataplane.checksum`) recomputed over D's blocks in a worker thread.

The receiver's table asks for the check (:class:`~pdactors.core.pull_table.Verify`) once every
P worker of a pull has answered that its part landed; the answer goes back to the table
(:meth:`~pdactors.core.pull_table.PullTable.verified`). A P worker that sent no checksums
(an older P, or its ``checksum_kv`` off), or sums of a kind D's hasher cannot compute (P hashes
a GPU's KV, D's is in host memory, or the other way round), is trusted under
``verify_kv = "on"`` (counted, and logged once per P worker, naming the kind) and fails the
pull under ``"require"``. Malformed sums of D's own kind fail the pull either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from pdactors.actors._durations import Durations, DurationStatistics
from pdactors.config import VerifyKv
from pdactors.core.pull_table import Verify
from pdactors.dataplane.checksum import HEADER_BYTES, RunHasher, Xxh3Hasher, check_landed, sums_kind
from pdactors.errors import PdError
from pdactors.wire import Layout, PullDone

__all__ = ["KvCheckStats", "LandedCheck"]

log = logging.getLogger("pdactors.receiver")

_MAX_REMEMBERED = 1024  # P workers logged as sending no checksums (then logged no more)


@dataclass(frozen=True, slots=True)
class KvCheckStats:
    """What D's checks of landed KV found: pulls whose bytes matched P's checksums, pulls that
    did not, parts accepted without checksums, and how long the checks took."""

    verified: int
    corrupt: int
    unverified: int
    seconds: DurationStatistics


class LandedCheck:
    """Checks the KV that landed in ``layout`` (D's) as ``mode`` says, recomputing P's sums
    with ``hasher`` (default :class:`~pdactors.dataplane.checksum.Xxh3Hasher`)."""

    def __init__(self, mode: VerifyKv, layout: Layout, hasher: RunHasher | None = None) -> None:
        self.mode, self.layout = mode, layout
        self.hasher: RunHasher = hasher or Xxh3Hasher()
        self.verified = self.corrupt = self.unverified = 0
        self._quiet: set[str] = set()
        self._seconds = Durations()

    def sums(self, done: PullDone) -> bytes | None:
        """What the table keeps of ``done`` for the check (None: D does not check)."""
        return None if self.mode == "off" else done.sums

    def statistics(self) -> KvCheckStats:
        seconds = self._seconds.statistics()
        return KvCheckStats(self.verified, self.corrupt, self.unverified, seconds)

    async def check(self, job: Verify) -> str | None:
        """None when what landed is what P sent (or P sent no checksums, under ``"on"``);
        else why not, naming the transfer, the P worker and the first bad region and block.
        Checkpoint (the hashing runs in a worker thread)."""
        tid = job.transfer_id
        mine = self.hasher.header
        parts, unchecked = [], []
        for peer, sums in job.parts:
            if not sums:
                unchecked.append((peer, "no KV checksums"))
            elif len(sums) >= HEADER_BYTES and not sums.startswith(mine):
                kind = f"KV checksums of kind {sums_kind(sums)}, which this D cannot compute"
                unchecked.append((peer, kind))
            else:
                parts.append((peer, sums))
        if unchecked and self.mode == "require":
            peer, what = unchecked[0]
            return f"transfer {tid}: P worker {peer} sent {what} (verify_kv 'require')"
        if unchecked:
            self.unverified += len(unchecked)
            for peer, what in unchecked:
                if peer in self._quiet:
                    continue
                log.warning("P worker %s sends %s: its KV is not verified "
                            "(transfer %s; said once per P worker)", peer, what, tid)  # fmt: skip
                if len(self._quiet) < _MAX_REMEMBERED:
                    self._quiet.add(peer)
        if not parts:
            await trio.lowlevel.checkpoint()
            return None
        start = trio.current_time()
        try:
            error = await trio.to_thread.run_sync(
                check_landed, tid, parts, self.layout, job.block_ids, self.hasher
            )
        except (PdError, ArithmeticError, ValueError) as exc:  # D's own plan of its blocks
            error = f"transfer {tid}: the KV check failed: {exc}"
        except Exception as exc:  # the hasher's own failure (a GPU's, say): this pull fails
            error = f"transfer {tid}: the KV check failed: {type(exc).__name__}: {exc}"
        self._seconds.add(trio.current_time() - start)
        if error is None:
            self.verified += 1
        else:
            self.corrupt += 1
            log.warning("%s", error)
        return error
