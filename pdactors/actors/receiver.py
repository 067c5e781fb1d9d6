"""The D receiver actor: asks P workers to write KV into D's blocks; reports how pulls end.

Embed it with ``receiver = await nursery.start(serve_receiver, config, dataplane, layout)``.
The engine side starts pulls with :meth:`Receiver.start_pull` (synchronous, never blocks),
aborts them with :meth:`Receiver.abort`, and collects ends with :meth:`Receiver.take_results`
(vLLM's ``finished_recving`` and failed loads). Trio callers can ``await receiver.pull(...)``.

A thin trio shell around :class:`~pdactors.core.pull_table.PullTable`, which holds every
pull's record. One DEALER per P worker, kept while P is alive
(:mod:`pdactors.actors._p_connections`): when it is lost, or P answers what D cannot use,
every pull sent there ends at once (``P_GONE``). D's layout goes with the first pull to each P
worker. Bootstrap answers are cached per bootstrap, re-read when an engine is not in them or
P was lost (:mod:`pdactors.actors._lookups`). P's answers go to the pulls' records
(:mod:`pdactors.actors._p_answers`). Each pull names the P epoch D looked up and D's
own (:mod:`pdactors.core.epochs`); an answer from another life of P is ignored. The actor
sleeps until the earliest pull deadline. A P whose registered compatibility description
differs from D's is refused before the pull is sent (:mod:`pdactors.actors._compat`).
A pull started with ``on_landed`` may be reported landed by P's write thread telling a thread
of D's, before its ``PullDone`` (:mod:`pdactors.actors._landed_notices`); its end then comes in
``PullResults.early`` only (:mod:`pdactors.actors._pull_results`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import trio

from pdactors import timeline
from pdactors._pulse import Pulse
from pdactors.actors._compat import PeerCompat
from pdactors.actors._durations import Durations, DurationStatistics
from pdactors.actors._landed import KvCheckStats, LandedCheck
from pdactors.actors._landed_notices import LandedNoticeStats, PullLatches, open_latches
from pdactors.actors._lookups import Lookups
from pdactors.actors._p_answers import PAnswers
from pdactors.actors._p_connections import PConnections, Peer
from pdactors.actors._pull_results import PullReports, PullResults, Waiter, end_span
from pdactors.actors._write_fences import WriteFences
from pdactors.bootstrap_client import BootstrapClient, open_bootstrap_client
from pdactors.config import ReceiverConfig
from pdactors.core.epochs import new_epoch
from pdactors.core.plan import check_layout
from pdactors.core.pull_table import Completed, Fence, PullEffect, PullTable, SendCancel, Verify
from pdactors.dataplane.base import DataPlane
from pdactors.dataplane.checksum import RunHasher
from pdactors.errors import PdError, PullFailedError
from pdactors.transport import ZMQ, Transport
from pdactors.wire import (
    MAX_ID,
    BlockIds,
    BlockIdsLike,
    Layout,
    Msg,
    PullRequest,
    block_groups,
    encode_frames,
    layout_id,
)

__all__ = ["PullResults", "Receiver", "serve_receiver"]

log = logging.getLogger("pdactors.receiver")


class Receiver:
    """Handle of a running receiver actor; call its methods from the actor's trio thread."""

    def __init__(
        self,
        config: ReceiverConfig,
        dataplane: DataPlane,
        layout: Layout,
        client: BootstrapClient,
        nursery: trio.Nursery,
        transport: Transport = ZMQ,
        hasher: RunHasher | None = None,
        latches: PullLatches | None = None,
    ) -> None:
        """``latches``: the pulls' latches on P's landed notices (None: no fast completion
        path); :func:`serve_receiver` opens and closes them."""
        check_layout(layout)
        self.config = config
        self.layout = layout
        self._session = dataplane.session
        #: This receiver's epoch: random, new at every start (:mod:`pdactors.core.epochs`).
        self.epoch = new_epoch()
        self._layout_id = layout_id(dataplane.session, layout)
        self._nursery = nursery
        self._table = PullTable(timeout=config.pull_timeout, fence_timeout=config.fence_timeout)
        self._lookups = Lookups(client, config.lookup_timeout)
        self._compat = PeerCompat(config.compat, config.compat_relax, "D", log)
        self._links = PConnections(config, transport, nursery, self._on_answer, self._lost)
        self._reports = PullReports()
        self._latches = latches or PullLatches(None)
        self._ended = Pulse()  # fired whenever any pull ends
        self._fences = WriteFences(config, self._session, transport, nursery, self._table,
                                   self._apply, self._ended)  # fmt: skip
        self._pull_seconds = Durations()  # each delivered pull, start to P's answer
        self._landed = LandedCheck(config.verify_kv, layout, hasher)
        self._p_answers = PAnswers(
            self._table, self._lookups, self._landed, self._links, layout, self._apply
        )
        # The sleep of _serve_deadlines, until the earliest deadline; a new pull moves it.
        self._sleep = trio.CancelScope()

    # ------------------------------------------------------------------ engine side (sync)

    def start_pull(
        self,
        transfer_id: str,
        *,
        bootstrap_url: str,
        engine_id: str,
        block_ids: BlockIdsLike,
        on_landed: Callable[[], None] | None = None,
    ) -> None:
        """Ask P (``engine_id``, found at ``bootstrap_url``) to write ``transfer_id`` into
        ``block_ids`` (a list of ids, or one per KV-cache group:
        :func:`~pdactors.wire.block_groups`). Never blocks; the end is reported by
        :meth:`take_results`. ``on_landed`` (blocking-free, thread-safe) may report the KV
        landed first, from another thread, when P's notice comes before its ``PullDone``
        (one P worker, ``verify_kv`` off, ``fast_done`` on); the end then comes in ``early``.

        Raises :class:`~pdactors.errors.DuplicateTransfer` when that transfer id is already in
        flight (the pull in flight is not disturbed).
        """
        groups = block_groups(block_ids)
        self._start(transfer_id, bootstrap_url, engine_id, groups, None, on_landed)

    def _start(self, tid: str, url: str, engine_id: str, block_ids: BlockIds, waiter: object,
               on_landed: Callable[[], None] | None = None) -> None:  # fmt: skip
        self._table.start(tid, trio.current_time(), bootstrap_url=url, engine_id=engine_id,
                          block_ids=block_ids, waiter=waiter, on_landed=on_landed)  # fmt: skip
        pull = self._table.get(tid)
        assert pull is not None
        self._sleep.deadline = min(self._sleep.deadline, pull.deadline)
        self._nursery.start_soon(self._run_pull, tid)

    def abort(self, transfer_id: str, reason: str = "aborted by D") -> None:
        """Give up on ``transfer_id``: it ends as failed, and P is told to free its blocks
        (unless P's landed notice came first: it was reported landed, and ends in ``early``)."""
        if (pull := self._table.get(transfer_id)) is not None:
            self._latches.close(pull)
        self._apply(self._table.abort(transfer_id, reason))

    def take_results(self) -> PullResults:
        """The pulls that ended since the last call (vLLM's ``finished_recving`` / failed)."""
        return self._reports.take()

    def pull_statistics(self) -> DurationStatistics:
        """How many pulls were delivered, and how long the recent ones took (start to P's
        answer, P's prefill included)."""
        return self._pull_seconds.statistics()

    def kv_check_statistics(self) -> KvCheckStats:
        """What the checks of landed KV against P's checksums found (``verify_kv``)."""
        return self._landed.statistics()

    def landed_notice_statistics(self) -> LandedNoticeStats | None:
        """What P's landed notices did (None: no fast completion path)."""
        return self._latches.statistics()

    async def wait_results(self) -> PullResults:
        """Wait until some pull started with :meth:`start_pull` ends, then take the results.
        Checkpoint."""
        return await self._reports.wait()

    async def wait_ended(self, transfer_id: str) -> None:
        """Wait until the pull of ``transfer_id`` has ended (at once if none is in flight). An
        aborted pull ends when P confirms it is not writing, or is known gone: only then may
        D reuse its blocks. Checkpoint."""
        while transfer_id in self._table:
            await self._ended.wait()
        await trio.lowlevel.checkpoint()

    @property
    def in_flight(self) -> int:
        """Pulls that have not ended yet."""
        return len(self._table)

    # ------------------------------------------------------------------ trio callers

    async def pull(
        self,
        transfer_id: str,
        *,
        bootstrap_url: str,
        engine_id: str,
        block_ids: BlockIdsLike,
        on_landed: Callable[[], None] | None = None,
    ) -> None:
        """Pull ``transfer_id`` into ``block_ids`` (as for :meth:`start_pull`, ``on_landed``
        too) and wait for its end. Checkpoint.

        Raises :class:`~pdactors.errors.PullFailedError` when it does not land (a pull that
        ``on_landed`` reported landed did land, whatever ended it after), and
        :class:`~pdactors.errors.DuplicateTransfer` at once when that transfer id is already in
        flight. If this task is cancelled, the pull is aborted (and P told).
        """
        waiter = Waiter()
        groups = block_groups(block_ids)
        self._start(transfer_id, bootstrap_url, engine_id, groups, waiter, on_landed)
        try:
            await waiter.done.wait()
        finally:
            if waiter.result is None:
                self.abort(transfer_id, "the waiting task was cancelled")
        assert waiter.result is not None
        if not waiter.result.ok and not (waiter.result.pull and waiter.result.pull.landed_early):
            raise PullFailedError(transfer_id, waiter.result.reason)

    # ------------------------------------------------------------------ the work

    async def _run_pull(self, tid: str) -> None:
        pull = self._table.get(tid)
        if pull is None:
            return
        if len(tid) > MAX_ID:  # P could not even name it in its refusal
            return self._apply(self._table.fail(tid, f"transfer id over {MAX_ID} characters"))
        if not self.config.trusts(pull.bootstrap_url):
            reason = (f"bootstrap {pull.bootstrap_url} is not among this D's trusted_bootstraps "
                      "(its bootstrap token goes to those only)")  # fmt: skip
            self._apply(self._table.fail(tid, reason))
            return
        try:
            p_tp, p_pp, workers = await self._lookups.p_workers(
                pull.bootstrap_url, pull.engine_id, self.config.ranks, self.config.kv_heads
            )
            peers = [await self._links.connect(address, key) for address, key, _, _ in workers]
        except (PdError, OSError) as exc:
            where = f"P {pull.engine_id} via {pull.bootstrap_url}"
            self._apply(self._table.fail(tid, f"cannot reach {where}: {exc}"))
            return
        if self._table.get(tid) is not pull:  # ended while looking P up: P may hold its KV
            return self._links.cancel_all(peers, tid, "D gave up on it before asking P")
        if lost := [p.address for p in peers if p.lost]:
            self._apply(self._table.fail(tid, f"P worker {lost[0]} was just lost"))
            return
        for address, _, compat, _ in workers:  # P's registration: refused before it is asked
            if (refused := self._compat.refusal(f"P {address}", compat)) is not None:
                self._links.cancel_all(peers, tid, refused)  # P frees its KV now, not at expiry
                return self._apply(self._table.fail(tid, refused))
        ranks = self.config.ranks
        done_to, done_token = self._latches.open(pull, len(peers))
        request = PullRequest(
            transfer_id=tid,
            session=self._session,
            tp_rank=ranks.tp_rank,
            tp_size=ranks.tp_size,
            pp_rank=ranks.pp_rank,
            pp_size=ranks.pp_size,
            block_ids=pull.block_ids,
            layout_id=self._layout_id,
            kv_heads=self.config.kv_heads,
            p_tp_size=p_tp,
            p_pp_size=p_pp,
            compat=self.config.compat,
            d_epoch=self.epoch,
            fence=self.config.fence_timeout > 0,
            done_to=done_to,
            done_token=done_token,
        )
        epochs = [epoch for _, _, _, epoch in workers]  # each P worker's, as D looked it up
        # Recorded before the send: P's answer may arrive before this task runs again.
        self._apply(self._table.sent(tid, [p.address for p in peers], request, epochs))
        timeline.mark(tid, "pull_sent")
        for peer, epoch in zip(peers, epochs, strict=True):
            if self._table.get(tid) is not pull or peer.address not in pull.waiting:
                continue  # ended, or this part did, while sending to the others
            frames = msgspec.structs.replace(request, p_epoch=epoch) if epoch else request
            if not peer.knows_layout:
                # Messages on one connection arrive in order: whoever sends first carries it.
                peer.knows_layout = True
                frames = self._with_layout(frames)
            try:
                await peer.dealer.send(encode_frames(frames))
            except trio.ClosedResourceError:  # P was lost meanwhile: that ended its part
                lost_now = f"P worker {peer.address} was lost"
                self._apply(self._table.fail(tid, lost_now, peer=peer.address))

    def _with_layout(self, request: PullRequest) -> PullRequest:
        return msgspec.structs.replace(request, layout=self.layout)

    @property
    def protocol_errors(self) -> int:
        """ErrorReplies and undecodable frames from P workers so far."""
        return self._links.protocol_errors

    def _lost(self, peer: Peer, reason: str) -> list[str]:
        """``peer``'s connection is gone: its pulls end, but those it said it was writing,
        which are fenced (:mod:`pdactors.actors._write_fences`, asked with the CURVE key
        ``peer`` registered); returns the ids of the others."""
        self._lookups.forget_address(peer.address)
        pulls = self._table.on_peer(peer.address)
        for tid in pulls:  # a notice after the loss is not taken: the pull fails
            if (pull := self._table.get(tid)) is not None:
                self._latches.close(pull)
        effects = self._table.peer_lost(peer.address, reason, trio.current_time())
        fenced: set[str] = set()
        for fence in [e for e in effects if isinstance(e, Fence)]:
            fenced.update(fence.transfer_ids)
            self._fences.open(fence, peer.curve_key)
            self._sleep.deadline = min(self._sleep.deadline, fence.until)
        self._apply([e for e in effects if not isinstance(e, Fence)])
        return [t for t in pulls if t not in fenced]

    def _on_answer(self, peer: Peer, msg: Msg) -> None:
        self._p_answers.on_answer(peer, msg)

    async def _serve_deadlines(self) -> None:
        """End pulls at their deadlines: sleep until the earliest one, which :meth:`_start`
        moves earlier when a new pull's comes first (a waiting D does not wake for nothing)."""
        while True:
            # No checkpoint between reading the deadline and sleeping: no pull starts unseen.
            with trio.CancelScope(deadline=self._table.next_deadline()) as self._sleep:
                await trio.sleep_forever()
            self._apply(self._table.tick(trio.current_time()))

    def _send_cancel(self, cancel: SendCancel) -> None:
        peer = self._links.live(cancel.peer)
        if peer is not None:
            self._links.cancel(peer, cancel.transfer_id, cancel.reason)

    def _apply(self, effects: list[PullEffect]) -> None:
        for effect in effects:
            match effect:
                case SendCancel():
                    self._send_cancel(effect)
                case Completed():
                    self._completed(effect)
                case Verify():
                    self._nursery.start_soon(self._verify, effect)
                case Fence():  # only from peer_lost, which _lost carries out
                    raise AssertionError(f"{effect} outside a loss")

    async def _verify(self, job: Verify) -> None:
        error = await self._landed.check(job)
        self._apply(self._table.verified(job.transfer_id, error))

    def _completed(self, done: Completed) -> None:
        tid, pull = done.transfer_id, done.pull
        assert pull is not None
        self._latches.close(pull)
        self._ended.fire()
        end_span(done, trio.current_time())
        if done.ok:
            self._pull_seconds.add(trio.current_time() - pull.started)
        else:
            what = "ended, its KV landed already," if pull.landed_early else "failed"
            log.info("pull %s %s (%s): %r", tid, what, done.end.value, done.reason)  # P's text
            if done.end.p_may_have_moved:
                self._lookups.forget(pull.bootstrap_url)  # look P up again next time
        if isinstance(pull.waiter, Waiter):
            pull.waiter.result = done
            pull.waiter.done.set()
            return
        self._reports.add(done, landed_early=pull.landed_early)


async def serve_receiver(
    config: ReceiverConfig,
    dataplane: DataPlane,
    layout: Layout,
    *,
    transport: Transport = ZMQ,
    hasher: RunHasher | None = None,
    task_status: trio.TaskStatus[Receiver] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a D receiver until cancelled; ``task_status.started`` gets its :class:`Receiver`.

    ``layout`` is D's KV memory, already registered with ``dataplane`` (P writes into it);
    ``transport`` is the side channel (real ZMQ by default; see :mod:`pdactors.transport`);
    ``hasher`` recomputes P's KV checksums over what landed (``verify_kv``) where D's KV is
    (default :class:`~pdactors.dataplane.checksum.Xxh3Hasher`, host memory).
    """
    receiver: Receiver | None = None
    try:
        with open_latches(config, dataplane.session) as latches:
            async with (
                open_bootstrap_client(config.bootstrap_token, config.bootstrap_ca_file) as client,
                trio.open_nursery() as nursery,
            ):
                receiver = Receiver(config, dataplane, layout, client, nursery, transport,
                                    hasher, latches)  # fmt: skip
                nursery.start_soon(receiver._serve_deadlines)
                log.info("receiver %s rank %s ready", config.engine_id, config.ranks)
                task_status.started(receiver)
    finally:
        if receiver is not None and (fenced := receiver._table.fenced_pulls()):
            # Their blocks go back with whatever reuses D's memory next: say which.
            log.warning("receiver stops with %d pulls fenced (%s): a P worker lost while "
                        "writing them may still write their blocks", len(fenced),
                        ", ".join(fenced[:8]))  # fmt: skip
