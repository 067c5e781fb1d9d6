"""The P sender actor: answers D's pulls by writing P's KV blocks into D's memory.

Embed it with ``sender = await nursery.start(serve_sender, config, dataplane, layout)``. The
engine side tells it about transfers with the synchronous methods of :class:`Sender`
(``transfer_pending`` / ``transfer_ready`` / ``transfer_dropped``) and learns which transfers
P may free with ``take_finished`` (vLLM's ``finished_sending``). Layer-wise streaming:
``transfer_streaming`` when P starts computing a prompt's last chunk, ``layer_ready`` as each
layer's KV is complete, then ``transfer_ready``: when D's pull is already here each layer is
written as it comes, and D is answered once, after the last.

The actor is a thin trio shell around :class:`~pdactors.core.send_table.SendTable`: a receive
loop feeds D's messages in, a loss loop feeds in the D workers whose side channel closed or went
silent (ZMQ heartbeats and the ROUTER's monitor), a tick loop feeds the clock in when the
table's next deadline comes, and the effects come out as replies (through one outbox task),
writes (one task per transfer, :mod:`pdactors.actors._kv_writes`) and released ids. Every
transfer's state, a streamed one's included, lives in the table's record of it. A lease loop
renews the worker's bootstrap registration (:mod:`pdactors.actors._sender_lease`).

Nothing a peer sends can stop the actor: a frame is decoded within the wire's limits
(:data:`~pdactors.wire.LIMITS`) before any work, an error from one message or one write
fails that pull only (a typed reply), replies go out through one bounded queue per peer
(:mod:`pdactors.actors._outbox`: a peer that stops reading is cut off and treated as lost),
and garbage is answered with no more bytes than it carried. A pull whose compatibility
description differs from P's is refused by name at once (:mod:`pdactors.actors._compat`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio

from pdactors import timeline
from pdactors._pulse import Pulse
from pdactors.actors._compat import PeerCompat, refuse_pull
from pdactors.actors._done_notices import DoneNotices, open_done_notices
from pdactors.actors._durations import Durations, DurationStatistics
from pdactors.actors._epoch_fence import EpochFence
from pdactors.actors._kv_writes import PULL_ERRORS, KvWriter, Written
from pdactors.actors._layouts import LayoutCache
from pdactors.actors._outbox import Outbox, Refusals, SideChannelStats
from pdactors.actors._pull_check import StaleView, WaitingPulls, expected_pulls, pull_heads
from pdactors.actors._sender_lease import register_sender
from pdactors.actors._ticks import Ticks
from pdactors.bootstrap_client import open_bootstrap_client
from pdactors.config import SenderConfig
from pdactors.core.plan import check_layout
from pdactors.core.send_stream import Complete
from pdactors.core.send_table import (
    Effect,
    Release,
    Reply,
    SendState,
    SendTable,
    SendTableStats,
    StartSend,
    Wake,
)
from pdactors.dataplane.base import DataPlane
from pdactors.dataplane.checksum import RunHasher, Xxh3Hasher
from pdactors.transport import ZMQ, Router, Transport
from pdactors.wire import (
    BlockIdsLike,
    CancelPull,
    ErrorReply,
    FrameError,
    Layout,
    PullFailed,
    PullRequest,
    Writing,
    block_groups,
    decode_frames,
)

__all__ = ["Sender", "SideChannelStats", "serve_sender"]

log = logging.getLogger("pdactors.sender")


class Sender:
    """Handle of a running sender actor. Its methods must be called from the actor's trio thread.

    The synchronous methods never block; they raise
    :class:`~pdactors.errors.IllegalTransition` when the engine reports an impossible sequence.
    """

    def __init__(
        self,
        config: SenderConfig,
        dataplane: DataPlane,
        layout: Layout,
        router: Router,
        nursery: trio.Nursery,
        hasher: RunHasher | None = None,
        notices: DoneNotices | None = None,
    ) -> None:
        check_layout(layout)
        self.config = config
        self.layout = layout
        self._router = router
        self._nursery = nursery
        self._table = SendTable(
            ready_timeout=config.ready_timeout,
            unclaimed_ttl=config.unclaimed_ttl,
            tombstone_ttl=config.tombstone_ttl,
        )
        self._layouts = LayoutCache()
        stall = config.liveness.heartbeat_timeout
        self._outbox = Outbox(router, self._cut_off, stall_timeout=stall)
        self._refusals = Refusals()
        self._waiting = WaitingPulls()
        self._compat = PeerCompat(config.compat, config.compat_relax, "P", log)
        self._fence = EpochFence(log)  # this life's epoch, and the D sessions' latest
        self._finished: set[str] = set()
        self._finished_changed = Pulse()
        self._writer = KvWriter(config, layout, dataplane, hasher or Xxh3Hasher(), notices)
        self._ticks = Ticks(self._table, config.tick_interval, self._apply)
        self.bytes_sent = 0
        self.descriptors_sent = 0
        self.streamed_sent = 0  # transfers written layer by layer while P computed them
        self._write_seconds = Durations()  # each successful write, plan + engine

    @property
    def address(self) -> str:
        """The side-channel address D workers connect to (``tcp://host:port``)."""
        return self._router.address

    @property
    def epoch(self) -> int:
        """This sender's epoch: random, new at every start (:mod:`pdactors.core.epochs`)."""
        return self._fence.epoch

    # ------------------------------------------------------------------ engine side (sync)

    def transfer_pending(self, transfer_id: str) -> None:
        """P's prefill of ``transfer_id`` started (its KV is not ready yet)."""
        self._apply(self._table.prefill_started(transfer_id, trio.current_time()))

    def transfer_ready(
        self,
        transfer_id: str,
        block_ids: BlockIdsLike,
        *,
        complete: Complete | None = None,
    ) -> None:
        """P's prefill finished; its KV sits in ``block_ids`` (a list of ids, or one per
        KV-cache group: :func:`~pdactors.wire.block_groups`) until the id is released.

        ``complete``: the KV may still be being computed (a GPU's forward was enqueued, not
        finished) and this blocking callable returns once it is in memory, e.g.
        ``torch.cuda.Event.synchronize``. The write's worker thread calls it right before the
        engine call, so no hop is spent on the wait; if it raises, the transfer fails.
        """
        timeline.mark(transfer_id, "ready")
        blocks = block_groups(block_ids)
        now = trio.current_time()
        self._apply(self._table.prefill_ready(transfer_id, blocks, now, complete=complete))

    def transfer_streaming(self, transfer_id: str, block_ids: BlockIdsLike) -> None:
        """P begins computing the KV of ``transfer_id`` into ``block_ids``, layer by layer
        (:meth:`layer_ready`), and will call :meth:`transfer_ready` (or
        :meth:`transfer_dropped`) when it is done. If D's pull is here, each layer is written
        as soon as it is complete and D is answered once after the last; otherwise nothing
        happens before :meth:`transfer_ready`, which sends the whole KV as usual."""
        blocks = block_groups(block_ids)
        self._apply(self._table.prefill_streaming(transfer_id, blocks, trio.current_time()))

    def layer_ready(
        self, transfer_id: str, regions: Sequence[int], *, complete: Complete | None = None
    ) -> None:
        """The KV of these layout regions (a layer's) is complete in the streamed blocks (or
        will be once ``complete()`` returns, as in :meth:`transfer_ready`); ignored unless
        ``transfer_id`` is being streamed."""
        self._apply(self._table.layer_ready(transfer_id, regions, complete))

    def transfer_dropped(self, transfer_id: str, reason: str = "") -> None:
        """P will not finish ``transfer_id``; a waiting D is told at once."""
        self._apply(self._table.prefill_dropped(transfer_id, trio.current_time(), reason))

    def take_finished(self) -> set[str]:
        """Transfer ids whose P blocks may now be freed (vLLM's ``finished_sending``)."""
        finished, self._finished = self._finished, set()
        return finished

    async def wait_finished(self) -> set[str]:
        """Wait until some transfer is released, then take them all. Checkpoint."""
        while not self._finished:
            await self._finished_changed.wait()
        await trio.lowlevel.checkpoint()
        return self.take_finished()

    def transfer_state(self, transfer_id: str) -> SendState | None:
        """Where ``transfer_id`` stands (None: unknown or forgotten)."""
        return self._table.state(transfer_id)

    def pulls_waiting(self, transfer_id: str) -> int:
        """How many D workers' pulls of ``transfer_id`` this sender holds, not answered yet."""
        return self._table.pulls_waiting(transfer_id)

    def statistics(self) -> SendTableStats:
        return self._table.statistics()

    def unreachable(self, reason: str) -> int:
        """No D can find this sender now (another registration holds its rank): release every
        READY transfer no D has pulled; returns how many."""
        self._apply(effects := self._table.unreachable(trio.current_time(), reason))
        return len(effects)

    def write_statistics(self) -> DurationStatistics:
        """How many writes succeeded, and how long the recent ones took (plan + engine)."""
        return self._write_seconds.statistics()

    def side_channel_statistics(self) -> SideChannelStats:
        """What the side channel refused: bad frames, unanswered ones, peers cut off; and
        D's fast completion notices the write threads sent and dropped."""
        return self._outbox.statistics(self._refusals, self._writer.notices)

    # ------------------------------------------------------------------ the loops

    async def _receive_loop(self) -> None:
        while True:
            identity, frames = await self._router.receive()
            if self._outbox.is_cut(identity):
                self._outbox.dropped += 1
                continue
            try:
                msg = decode_frames(frames)
            except FrameError as exc:
                self._bad_frame(identity, frames, exc)
                continue
            now = trio.current_time()
            match msg:
                case PullRequest():
                    self._apply(self._on_pull(identity, msg, now))
                case CancelPull(transfer_id=tid, reason=reason, session=session):
                    log.debug("transfer %r cancelled by D: %r", tid, reason)
                    self._apply(self._table.pull_cancelled(tid, identity, now, reason, session))
                case _:
                    what = f"unexpected message {type(msg).__name__}"
                    self._bad_frame(identity, frames, FrameError(what))

    async def _loss_loop(self) -> None:
        async for identity in self._router.lost_peers:
            self._forget_peer(identity)
            self._peer_gone(identity, "")

    def _peer_gone(self, identity: bytes, reason: str) -> None:
        effects = self._table.peer_gone(identity, trio.current_time(), reason)
        if effects:
            log.warning("D worker %s gone%s: %d transfers it pulled end",
                        identity.hex(), f" ({reason})" if reason else "", len(effects))  # fmt: skip
        self._apply(effects)

    def _forget_peer(self, identity: bytes) -> None:
        self._waiting.forget(identity)
        self._outbox.forget(identity)
        self._refusals.forget(identity)
        self._layouts.forget_peer(identity)

    def _cut_off(self, identity: bytes, reason: str) -> None:
        """The outbox cut ``identity`` off: its transfers end as a lost D's do."""
        log.warning("cut off peer %s: %s", identity.hex(), reason)
        self._waiting.forget(identity)
        self._refusals.forget(identity)
        self._layouts.forget_peer(identity)
        self._peer_gone(identity, f"cut off: {reason}")

    def _bad_frame(self, identity: bytes, frames: list[bytes], exc: FrameError) -> None:
        """Answer a frame that did not decode (a pull whose id could be read gets its
        PullFailed), within what the peer sent (:class:`~pdactors.actors._outbox.Refusals`)."""
        reply: ErrorReply | PullFailed = ErrorReply(str(exc), exc.transfer_id)
        if exc.tag == "pull" and exc.transfer_id:
            reply = PullFailed(exc.transfer_id, f"pull refused: {exc}")
        nbytes = sum(map(len, frames))
        if (answer := self._refusals.answer(identity, nbytes, reply, str(exc))) is not None:
            self._outbox.put(identity, answer)

    def _on_pull(self, identity: bytes, pull: PullRequest, now: float) -> list[Effect]:
        timeline.mark(pull.transfer_id, "pull_at_p")
        fenced, go_on = self._fence.check(self._table, identity, pull, now)  # epochs first
        return fenced + self._take_pull(identity, pull, now) if go_on else fenced

    def _take_pull(self, identity: bytes, pull: PullRequest, now: float) -> list[Effect]:
        tid = pull.transfer_id
        if (refused := self._compat.refusal(f"D {identity.hex()}", pull.compat)) is not None:
            return refuse_pull(self._table, identity, tid, now, refused)  # frees P's blocks
        attached = self._layouts.attach(pull, identity)
        if not isinstance(attached, PullRequest):
            return [Reply(identity, attached)]
        pull = attached
        try:
            pull_heads(self.config, pull)
            expected = expected_pulls(self.config, pull)
        except PULL_ERRORS as exc:
            stale = isinstance(exc, StaleView)
            return [Reply(identity, PullFailed(tid, str(exc), lookup_again=stale))]
        if (too_many := self._waiting.refusal(identity, pull)) is not None:
            return [Reply(identity, PullFailed(tid, too_many))]
        effects = self._table.pull_arrived(tid, identity, pull, now, expected=expected)
        if not any(isinstance(e, Reply) and e.identity == identity for e in effects):
            self._waiting.hold(identity, pull)  # until the reply about it
        return effects

    async def _send(self, job: StartSend) -> None:
        pull = job.pull
        error: str | None = None
        start = trio.current_time()
        timeline.mark(job.transfer_id, "write_start")
        written = Written()
        try:
            if job.streamed:
                error = await self._writer.stream(job, self._table, written)
            else:
                await self._writer.write(job, written, before=job.before)
        except PULL_ERRORS as exc:
            error = str(exc) or type(exc).__name__
        if error is not None:
            log.warning("transfer %r to %r failed: %s", job.transfer_id, pull.session, error)
        now = trio.current_time()
        timeline.mark(job.transfer_id, "write_end")
        timeline.span_done(job.transfer_id, "write", now - start, nbytes=written.nbytes,
                           peer=pull.session, outcome=error or "ok")  # fmt: skip
        if error is None:
            self.bytes_sent += written.nbytes
            self.descriptors_sent += written.descriptors
            self.streamed_sent += job.streamed
            self._write_seconds.add(now - start)
        sums = written.wire_sums(self._writer.hasher.header)
        self._apply(self._table.send_finished(
            job.transfer_id, now, identity=job.identity, error=error, nbytes=written.nbytes,
            descriptors=written.descriptors, sums=sums))  # fmt: skip

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            match effect:
                case Reply(identity=identity, msg=msg):
                    self._waiting.release(identity, getattr(msg, "transfer_id", ""))
                    self._outbox.put(identity, self._fence.stamp(msg))
                case StartSend(identity=identity, pull=pull):
                    if pull.fence:  # said before the write: D fences it should it lose P
                        self._outbox.put_now(identity, Writing(pull.transfer_id, self._fence.epoch))
                    self._nursery.start_soon(self._send, effect)
                case Release(transfer_id=tid, state=state):
                    if state is SendState.EXPIRED:  # no D pulled or cancelled it: say which
                        log.info("transfer %s expired: no pull within unclaimed_ttl (%g s); "
                                 "its KV is freed", tid, self._table.unclaimed_ttl)  # fmt: skip
                    else:
                        log.debug("transfer %s released (%s)", tid, state.value)
                    self._finished.add(tid)
                    self._finished_changed.fire()
                case Wake(waiter=waiter):
                    assert isinstance(waiter, trio.Event)  # the streamed write's, _kv_writes
                    waiter.set()
        self._ticks.rearm()  # the operation may have added an earlier deadline


async def serve_sender(
    config: SenderConfig,
    dataplane: DataPlane,
    layout: Layout,
    *,
    transport: Transport = ZMQ,
    replaces: int = 0,
    hasher: RunHasher | None = None,
    task_status: trio.TaskStatus[Sender] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a P sender until cancelled; ``task_status.started`` gets its :class:`Sender`.

    ``transport`` is the side channel (real ZMQ by default; see :mod:`pdactors.transport`).
    ``hasher``: computes the KV checksums of what it writes (``checksum_kv``) where P's KV is
    (default :class:`~pdactors.dataplane.checksum.Xxh3Hasher`, host memory).
    ``replaces``: the epoch of the sender this one follows in the same process (a restart:
    its registration takes the rank although the predecessor's lease is live; 0: none).

    Binds the side channel on ``config.host`` (``config.port``, 0 for any), registers it with
    the bootstrap at ``config.bootstrap_url`` when one is given (retrying with backoff for
    ``config.register_timeout``), then serves. Raises
    :class:`~pdactors.errors.BootstrapError` when registration never succeeds.
    """
    async with (
        open_done_notices() as notices,  # closed once the nursery's writes have ended
        transport.open_router(config.host, config.port, liveness=config.liveness) as router,
        open_bootstrap_client(config.bootstrap_token, config.bootstrap_ca_file) as client,
        trio.open_nursery() as nursery,
    ):
        sender = Sender(config, dataplane, layout, router, nursery, hasher, notices)
        if config.bootstrap_url is not None:
            await register_sender(client, config, router, nursery, epoch=sender.epoch,
                                  replaces=replaces, unreachable=sender.unreachable)  # fmt: skip
        nursery.start_soon(sender._receive_loop)
        nursery.start_soon(sender._loss_loop)
        nursery.start_soon(sender._outbox.serve)
        nursery.start_soon(sender._ticks.serve)
        log.info("sender %s rank %s serving on %s", config.engine_id, config.ranks, router.address)
        task_status.started(sender)
