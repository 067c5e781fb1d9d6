"""D's fences against a write that lands after D lost its writer.

A P worker says ``Writing`` before it writes a pull's blocks (when the pull asked it to:
``PullRequest.fence``). If D loses that P worker before its answer — its process stopped, a
frozen VM, heartbeats lost — the write may still land should it resume, so the pull table
fences the pull (:class:`~pdactors.core.pull_table.Fence`): it keeps D's blocks. This module
finds out when D may give them back, and tells the table (:meth:`PullTable.fenced`):

* P confirms it stopped: D opens a new connection to that P worker (demanding the CURVE key it
  registered, as the lost one did) and sends ``CancelPull`` for each fenced pull, naming D's
  data-plane session; P answers each once no write of that transfer into that D memory is in
  flight, whichever connection the write was for
  (:meth:`~pdactors.core.send_table.SendTable.pull_cancelled`). A P that was stopped answers
  when it resumes: ZMQ completes the handshake then. Any answer will do: one from another life
  of P at that address says the life that wrote is gone (a sender closes its socket only once
  its writes ended: they are never abandoned).
* P is found dead: a reconnect is refused at once (nothing listens at its address:
  :meth:`~pdactors.transport.zmq.DealerSocket.wait_dead`). A stopped P's socket still accepts,
  and a host that does not answer at all is not taken for dead.
* Neither: the table ends the pull at ``fence_timeout`` (:meth:`PullTable.tick`), and its end
  names the risk.

The connection closes as soon as none of its pulls is fenced on that P worker any more (they
ended one way or another), or when the receiver stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from pdactors._pulse import Pulse
from pdactors.config import ReceiverConfig
from pdactors.core.pull_table import Fence, PullEffect, PullTable
from pdactors.errors import PdError
from pdactors.transport import Dealer, Transport
from pdactors.wire import CancelPull, FrameError, PullDone, PullFailed, decode_frames, encode_frames

__all__ = ["WriteFences"]

log = logging.getLogger("pdactors.receiver")

_ASK = "D lost its connection to P mid-write: answer once no write of it is in flight"


class WriteFences:
    """The receiver's open fences; their tasks run in ``nursery``. ``apply`` carries out the
    table's effects; ``ended`` fires whenever a pull ends."""

    def __init__(
        self,
        config: ReceiverConfig,
        session: str,
        transport: Transport,
        nursery: trio.Nursery,
        table: PullTable,
        apply: Callable[[list[PullEffect]], None],
        ended: Pulse,
    ) -> None:
        self._config = config
        self._session = session  # D's data-plane session: the memory P is asked about
        self._transport = transport
        self._nursery = nursery
        self._table = table
        self._apply = apply
        self._ended = ended

    def open(self, fence: Fence, curve_key: str) -> None:
        """Find out whether the P worker of ``fence`` (which registered ``curve_key``) still
        writes its pulls. Not a checkpoint."""
        log.warning("P worker %s lost while writing %d pulls: they keep D's blocks until it "
                    "confirms it stopped or is found dead (at most %g s)", fence.peer,
                    len(fence.transfer_ids), self._config.fence_timeout)  # fmt: skip
        self._nursery.start_soon(self._serve, fence, curve_key)

    def _open(self, fence: Fence) -> bool:
        """Whether a pull of ``fence`` is still fenced on its P worker."""
        return not self._table.fencing(fence.peer).isdisjoint(fence.transfer_ids)

    async def _serve(self, fence: Fence, curve_key: str) -> None:
        address = fence.peer
        liveness = self._config.liveness  # on: its monitor tells a refused reconnect
        try:
            async with (
                self._transport.open_dealer(address, liveness=liveness, server_key=curve_key)
                as dealer,
                trio.open_nursery() as nursery,
            ):  # fmt: skip
                nursery.start_soon(self._answers, fence, dealer, nursery.cancel_scope)
                nursery.start_soon(self._death, fence, dealer, nursery.cancel_scope)
                for tid in fence.transfer_ids:
                    await dealer.send(encode_frames(CancelPull(tid, _ASK, self._session)))
                while self._open(fence):  # until they end, whatever ends them
                    await self._ended.wait()
                nursery.cancel_scope.cancel()
        except (PdError, trio.ClosedResourceError) as exc:
            # No way to ask (a malformed address, an untrusted key): the timeout ends them.
            log.warning("cannot ask P worker %s whether it stopped writing: %s", address, exc)

    async def _answers(self, fence: Fence, dealer: Dealer, done: trio.CancelScope) -> None:
        address, tids = fence.peer, fence.transfer_ids
        while self._open(fence):
            try:
                msg = decode_frames(await dealer.receive())
            except FrameError:
                continue  # not an answer D can use: the fence waits on
            if not isinstance(msg, PullDone | PullFailed) or msg.transfer_id not in tids:
                continue
            pull = self._table.get(msg.transfer_id)
            sent_to = pull.p_epochs.get(address, 0) if pull is not None else 0
            if sent_to and msg.epoch and msg.epoch != sent_to:
                why = f"another life of P worker {address} answers: the one that wrote is gone"
            else:
                why = f"P worker {address} confirmed no write is in flight any more"
            self._apply(self._table.fenced(address, msg.transfer_id, why))
        done.cancel()

    async def _death(self, fence: Fence, dealer: Dealer, done: trio.CancelScope) -> None:
        dead = await dealer.wait_dead()
        self._apply(self._table.fenced(fence.peer, None, f"P worker {fence.peer} is dead: {dead}"))
        done.cancel()
