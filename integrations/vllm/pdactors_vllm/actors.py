"""The worker's actors in its Trio thread: they start there, take each step's work, and put
their results into the :class:`~pdactors_vllm.mailbox.Mailbox` for vLLM's thread.

Everything here runs in the Trio thread (``release_all`` once it has died), but a pull's
``on_landed`` (:meth:`WorkerActors._landed_early`), which the receiver's notices thread calls
when P says the KV landed before its ``PullDone`` reached the Trio thread (issue 28).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import torch
import trio

from pdactors import (
    Layout,
    Receiver,
    RunHasher,
    Sender,
    open_mooncake,
    serve_bootstrap,
    serve_receiver,
    serve_sender,
    timeline,
)
from pdactors.errors import PdError
from pdactors_vllm.actor_configs import ActorConfigs, WorkerPlace
from pdactors_vllm.counters import ReceiverReadings, SenderReadings, TransferCounters
from pdactors_vllm.mailbox import Mailbox, StepWork
from pdactors_vllm.scheduler_side import PullSpec, SendSpec
from pdactors_vllm.settings import ConnectorSettings

if TYPE_CHECKING:
    from pdactors_vllm.tracing import TransferTracer

__all__ = ["WorkerActors"]

log = logging.getLogger("pdactors.vllm")

#: Seconds between two readings of the actors' counters besides those at transfers' ends.
COUNT_EVERY: Final = 5.0


class WorkerActors:
    """The data plane, bootstrap, sender and receiver of one worker, and the requests their
    transfers belong to."""

    def __init__(
        self,
        settings: ConnectorSettings,
        place: WorkerPlace,
        configs: ActorConfigs,
        layout: Layout,
        memory: list[tuple[int, int]],
        mailbox: Mailbox,
        hasher: RunHasher | None = None,
        tracer: TransferTracer | None = None,
    ) -> None:
        self._settings = settings
        self._place = place
        self._configs = configs
        self._layout = layout
        self._memory = memory
        self._mailbox = mailbox
        self._hasher = hasher  # the KV checksums' (None: xxh3 of host memory)
        self._tracer = tracer  # the transfers' spans (None: tracing is off)
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None
        self._sender_epoch = 0  # the last sender's (a restart's sender replaces it)
        self._send_req: dict[str, str] = {}  # transfer id -> P request id
        self._recv_req: dict[str, str] = {}  # transfer id -> D request id
        #: pulls vLLM was told of by P's landed notice (the notices thread adds, the Trio
        #: thread removes once the receiver reports them in ``early``): never failed after
        self._told_early: set[str] = set()
        #: pulls of requests aborted on D (their failure is no pull failure: nothing falls back)
        self._aborted: set[str] = set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the data plane and the actors this role needs; run until cancelled. A new
        call (a restart) starts them anew: the new sender names its predecessor's epoch, so
        its registration takes the rank the old one's live lease still holds."""
        c, place = self._configs, self._place
        replaces = self._sender_epoch
        self._sender = self._receiver = None
        async with open_mooncake(c.plane) as plane, trio.open_nursery() as nursery:
            plane.register(self._memory)
            transport = self._settings.side_channel(
                producer=place.is_producer, consumer=place.is_consumer
            )
            if c.bootstrap is not None:
                await nursery.start(serve_bootstrap, c.bootstrap)
            if c.sender is not None:
                self._sender = await nursery.start(
                    partial(
                        serve_sender, transport=transport, replaces=replaces, hasher=self._hasher
                    ),
                    c.sender,
                    plane,
                    self._layout,
                )
                self._sender_epoch = self._sender.epoch
                sent = SenderReadings()
                nursery.start_soon(self._collect_sent, self._sender, sent)
                nursery.start_soon(_count_every, self._mailbox, partial(sent.add_new, self._sender))
            if c.receiver is not None:
                self._receiver = await nursery.start(
                    partial(serve_receiver, transport=transport, hasher=self._hasher),
                    c.receiver,
                    plane,
                    self._layout,
                )
                got = ReceiverReadings()
                nursery.start_soon(self._collect_received, self._receiver, got)
                nursery.start_soon(
                    _count_every, self._mailbox, partial(got.add_new, self._receiver)
                )
            task_status.started()

    def release_all(self) -> tuple[set[str], set[str]]:
        """After the Trio thread died (its receiver's notices thread stopped with it): (P
        requests whose blocks may be freed, D requests whose pull failed), forgotten here. A
        pull vLLM was told had landed (P's notice) did land: it is not among the failed."""
        sends, self._send_req = set(self._send_req.values()), {}
        told = self._told_early
        pulls = {req for tid, req in self._recv_req.items() if tid not in told}
        self._recv_req, self._aborted, self._told_early = {}, set(), set()
        return sends, pulls

    def apply(self, work: StepWork, event: torch.cuda.Event | None = None) -> None:
        """Hand ``work`` to the actors (``event``: the forward's, for ready KV on a GPU)."""
        self._mailbox.applied(work)
        sender, receiver = self._sender, self._receiver
        if sender is not None:
            for tid in work.pending:
                _logged(sender.transfer_pending, tid)
            for req_id, send in work.streams.items():
                self._send_req[send.transfer_id] = req_id  # a death releases it from now on
                if self._tracer is not None:
                    self._tracer.expect(send.transfer_id, send.traceparent)
                _logged(sender.transfer_streaming, send.transfer_id, send.block_ids)
            if work.ready:
                self._ready(sender, work.ready, _waiter(event))
            for tid in work.dropped:
                _logged(sender.transfer_dropped, tid, "the prefill ended without its KV")
        if receiver is not None:
            for req_id, pull in work.pulls.items():
                self._start_pull(receiver, req_id, pull)
            for tid in work.aborts.values():
                if tid in self._recv_req:
                    self._aborted.add(tid)
                _logged(receiver.abort, tid, "the request was aborted on D")

    def layer_done(
        self, tids: list[str], regions: tuple[int, ...], event: torch.cuda.Event | None
    ) -> None:
        """Layer-wise: ``regions`` of the streamed transfers ``tids`` are computed."""
        if (sender := self._sender) is not None:
            complete = _waiter(event)
            for tid in tids:
                sender.layer_ready(tid, regions, complete=complete)

    def _ready(
        self, sender: Sender, sends: dict[str, SendSpec], complete: Callable[[], object] | None
    ) -> None:
        # Each is known here before the sender has it, so that a death of this thread
        # releases it too.
        self._send_req |= {send.transfer_id: r for r, send in sends.items()}
        for req_id, send in sends.items():
            if self._tracer is not None:
                self._tracer.expect(send.transfer_id, send.traceparent)
            ready = _logged(
                sender.transfer_ready, send.transfer_id, send.block_ids, complete=complete
            )
            if not ready:
                del self._send_req[send.transfer_id]  # never sent: P may free the blocks
                self._mailbox.add(sent={req_id})

    def _start_pull(self, receiver: Receiver, req_id: str, pull: PullSpec) -> None:
        tid = pull.transfer_id
        started = _logged(
            receiver.start_pull,
            tid,
            bootstrap_url=pull.bootstrap_url,
            engine_id=pull.engine_id,
            block_ids=pull.block_ids,
            on_landed=None if pull.notify_only else partial(self._landed_early, req_id, tid),
        )
        if pull.notify_only:
            return
        if started:
            self._recv_req[pull.transfer_id] = req_id
            if self._tracer is not None:
                self._tracer.expect(pull.transfer_id, pull.traceparent)
        else:  # e.g. a pull for this transfer id is in flight: it goes on, this one fails
            self._mailbox.add(failed={req_id})

    def _landed_early(self, req_id: str, tid: str) -> None:
        """The receiver's notices thread: P says the KV of ``tid`` landed whole. vLLM hears of
        it now; the receiver reports the pull's end later in ``early`` only (never again as
        received, nor as failed), where :meth:`_collect_received` forgets it."""
        landed = {req_id: tid} if timeline.enabled() else None
        self._told_early.add(tid)  # before vLLM can hear of it: a death now fails it not
        self._mailbox.add(recved={req_id}, landed=landed, count=_one_received)

    async def _collect_sent(self, sender: Sender, readings: SenderReadings) -> None:
        while True:
            released = await sender.wait_finished()
            if self._tracer is not None:
                self._tracer.forget(released)
            reqs = {self._send_req.pop(tid) for tid in released if tid in self._send_req}
            self._mailbox.add(sent=reqs, count=partial(readings.add_new, sender))

    async def _collect_received(self, receiver: Receiver, readings: ReceiverReadings) -> None:
        while True:
            results = await receiver.wait_results()
            if self._tracer is not None:
                self._tracer.forget([*results.finished, *results.failed, *results.early])
            for tid in results.early:  # vLLM was told in _landed_early
                self._recv_req.pop(tid, None)
                self._told_early.discard(tid)
            self._aborted -= results.early
            recompute = self._settings.on_pull_failure == "recompute"
            aborted = self._aborted.intersection(results.failed)
            self._aborted -= aborted
            for tid, reason in results.failed.items():
                if tid in aborted:
                    log.info("KV pull %s ended: %s", tid, reason)
                elif tid in self._recv_req:
                    then = (
                        "D computes the prompt itself (on_pull_failure: recompute)"
                        if recompute
                        else "its request fails (on_pull_failure: fail)"
                    )
                    log.warning("KV pull %s failed: %s; %s", tid, reason, then)
                else:  # a notify-only pull (P just frees its KV): nobody waits for it
                    log.info("KV release notice %s to P failed: %s", tid, reason)
            ok_tids = {t: self._recv_req.pop(t) for t in results.finished if t in self._recv_req}
            failed = {self._recv_req.pop(t) for t in results.failed if t in self._recv_req}
            fell_back = len(failed) - len(aborted) if recompute else 0

            def count(
                c: TransferCounters,
                landed: int = len(ok_tids),
                lost: int = len(failed),
                recomputed: int = fell_back,
            ) -> None:
                c.received += landed
                c.failed += lost
                c.recomputed += recomputed
                readings.add_new(receiver, c)

            landed = {r: t for t, r in ok_tids.items()} if timeline.enabled() else None
            self._mailbox.add(recved=ok_tids.values(), failed=failed, landed=landed, count=count)


def _one_received(counters: TransferCounters) -> None:
    counters.received += 1
    counters.landed_early += 1


def _waiter(event: torch.cuda.Event | None) -> Callable[[], object] | None:
    """What the sender's write thread calls to wait for the forward's kernels up to ``event``
    (None on a CPU, where the forward is synchronous). The wait happens in the thread that
    then makes the engine call: no hop between the GPU finishing and the write starting. Its
    ``ready`` (the event's ``query``) lets the data plane make a small call in the Trio thread
    once the kernels are done (``inline_max_bytes``)."""
    return None if event is None else _EventWait(event)


class _EventWait:
    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def __call__(self) -> None:
        self._event.synchronize()

    def ready(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]


def _logged(fn: Callable[..., None], *args: Any, **kwargs: Any) -> bool:
    """Call ``fn``; say whether it worked. Engine-reported events the actors refuse
    (IllegalTransition, a duplicate transfer id) are logged; anything else is logged with its
    traceback. Neither is fatal: the caller fails that one transfer."""
    try:
        fn(*args, **kwargs)
    except PdError as exc:
        log.warning("%s%r refused: %s", fn.__name__, args, exc)
        return False
    except Exception as exc:  # a bug: this transfer fails, the others go on
        log.error("%s%r failed: %s", fn.__name__, args, exc, exc_info=exc)
        return False
    return True


async def _count_every(mailbox: Mailbox, read: Callable[[TransferCounters], None]) -> None:
    """Count what the actor did every :data:`COUNT_EVERY` seconds besides at each transfer's
    end: what a side channel refused shows on ``/metrics`` though no transfer ends (a peer
    sending only garbage)."""
    while True:
        await trio.sleep(COUNT_EVERY)
        mailbox.count(read)
