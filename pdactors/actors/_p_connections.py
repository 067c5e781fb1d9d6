"""D's side-channel connections to P workers: one DEALER per P worker, opened on first use and
kept while P is alive.

ZMQ heartbeats and the socket's monitor tell when P's side channel is lost; so does an answer
D cannot use (another protocol version, garbage), after which nothing more on that connection
is trusted. Either way the connection is closed, its owner (the receiver) ends the pulls sent
there, and the next pull dials P afresh. A lost connection's pulls get a parting cancel on a
fresh connection, in case only the link broke and P still holds their KV, and so do the
cancels sent on it that P had not answered (sent into a link that then broke, a cancel is
lost with the connection, and P never heard of it): tried again, with
pauses doubling up to :data:`PARTING_PAUSES`' longest, until P answers or
:data:`PARTING_MEMORY` seconds have passed since one was last owed (a partition that heals
within them costs P's KV nothing more; a dead P never answers, and a longer partition leaves
P its ``unclaimed_ttl``). They do not wait for the next try where the link is plainly back: a
new connection to that P worker (a pull sent there again) carries them at once, and one newly
owed is tried at once, its pauses starting again from the shortest. A dead P is tried as a
cut one is (a refused connection does not tell them apart): a few connection attempts over
:data:`PARTING_MEMORY`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import trio

from pdactors._once import Every
from pdactors.config import ReceiverConfig
from pdactors.errors import PdError
from pdactors.transport import Dealer, Transport
from pdactors.wire import (
    PROTOCOL_VERSION,
    CancelPull,
    FrameError,
    Msg,
    PullDone,
    PullFailed,
    decode_frames,
    encode_frames,
)

__all__ = ["DOWN_MEMORY", "PARTING_MEMORY", "PARTING_PAUSES", "PConnections", "Peer"]

log = logging.getLogger("pdactors.receiver")

#: Seconds a lost P worker is remembered as down: a loss again within them logs at INFO.
DOWN_MEMORY = 60.0
#: How long D keeps trying to tell a P worker it lost the connection to which transfers D gave
#: up on: a little longer than P's default ``unclaimed_ttl`` (120 s), after which P has freed
#: their KV itself.
PARTING_MEMORY: Final = 150.0
#: The first and the longest pause between two tries of the parting cancels (each try takes
#: at most twice the liveness ``connect_timeout``).
PARTING_PAUSES: Final = (1.0, 16.0)


@dataclass(slots=True)
class Peer:
    """The connection to one P worker."""

    address: str
    dealer: Dealer
    curve_key: str  # the CURVE key the P worker registered ("": none)
    knows_layout: bool = False  # D's layout went with a pull on this connection
    lost: bool = False
    gone: trio.Event = field(default_factory=trio.Event)  # lost, or P broke the protocol
    gone_reason: str = ""
    broken: bool = False  # P broke the protocol: it cannot read a parting cancel either
    #: transfers D told P it gave up on and P has not answered yet: lost with this connection
    #: (sent into a link that then broke), they are told again as parting cancels
    cancels: set[str] = field(default_factory=set)

    def end(self, reason: str, *, broken: bool = False) -> None:
        """Close this connection for ``reason`` (the first reason stands); ``broken``: P
        broke the protocol."""
        if not self.gone.is_set():
            self.gone_reason, self.broken = reason, broken
            self.gone.set()


@dataclass(slots=True)
class _Owed:
    """The transfers one P worker was not told D gave up on, and its task's wake-up."""

    transfer_ids: set[str]
    give_up: float  # when its task stops trying: PARTING_MEMORY after the last one owed
    wake: trio.Event = field(default_factory=trio.Event)  # try now, pauses from the shortest


@dataclass(slots=True)
class _Connecting:
    """The tasks that want a connection to one P worker: one of them makes it."""

    lock: trio.Lock = field(default_factory=trio.Lock)
    tasks: int = 0


#: What the owner does with each message a P worker sends.
OnAnswer = Callable[[Peer, Msg], None]
#: What the owner does when a connection is gone (with why): ends the pulls sent there and
#: returns the transfer ids of those that ended (a pull fenced against a write still in
#: flight gets its cancel from the fence, :mod:`pdactors.actors._write_fences`).
OnLost = Callable[[Peer, str], list[str]]


class PConnections:
    """The receiver's connections to P workers; their tasks run in ``nursery``."""

    def __init__(
        self,
        config: ReceiverConfig,
        transport: Transport,
        nursery: trio.Nursery,
        on_answer: OnAnswer,
        on_lost: OnLost,
    ) -> None:
        self._config = config
        self._transport = transport
        self._nursery = nursery
        self._on_answer = on_answer
        self._on_lost = on_lost
        self._peers: dict[str, Peer] = {}
        self._connecting: dict[str, _Connecting] = {}  # address -> tasks dialling it now
        # P workers lost and not heard from since, and when (a repeat loss logs at INFO); kept
        # DOWN_MEMORY seconds, about as long as a dead P's registration lingers.
        self._down: dict[str, float] = {}
        #: P worker address -> the transfers it was not yet told D gave up on (its connection
        #: was lost with their pulls); one task per address tells it (:meth:`_parting_cancels`)
        self._owed: dict[str, _Owed] = {}
        self.protocol_errors = 0  #: ErrorReplies and bad frames from P (logged once a minute)
        self._every = Every(60.0)

    def live(self, address: str) -> Peer | None:
        """The open connection to ``address``, if there is one."""
        return self._peers.get(address)

    async def connect(self, address: str, curve_key: str) -> Peer:
        """The connection to the P worker at ``address`` (made if there is none), which
        registered ``curve_key``. A live connection is reused even if the key it demanded is
        not ``curve_key`` (it is one D trusts; if P restarted there with another key, that
        connection's handshake fails, it is lost, and P is looked up afresh). Checkpoint.

        Raises :class:`~pdactors.transport.TransportError` for a malformed address or a key
        D does not trust."""
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        connecting = self._connecting.setdefault(address, _Connecting())
        connecting.tasks += 1
        try:
            async with connecting.lock:  # one connection per P worker
                peer = self._peers.get(address)
                if peer is None:
                    peer = await self._nursery.start(self._serve, address, curve_key)
                    self._hand_over(peer)
                return peer
        finally:
            connecting.tasks -= 1
            if not connecting.tasks:
                del self._connecting[address]

    def protocol_error(self, peer: Peer, reason: str) -> None:
        """Count (and log, once a minute per P worker) what P said or sent that D cannot use."""
        self.protocol_errors += 1
        if (n := self._every.due(peer.address, trio.current_time())) is not None:
            log.warning("P worker %s: %r (%d such in 60 s)", peer.address, reason, n)

    def cancel(self, peer: Peer, transfer_id: str, reason: str) -> None:
        """Tell ``peer`` that D gave up on ``transfer_id``, so that P frees its KV now. Owed
        until P answers it: a cancel lost with its connection is told again on a fresh one."""
        if peer.lost:
            self._owe(peer, [transfer_id])
        else:
            peer.cancels.add(transfer_id)
            self.send_soon(peer, encode_frames(CancelPull(transfer_id, reason)))

    def cancel_all(self, peers: list[Peer], transfer_id: str, reason: str) -> None:
        """:meth:`cancel` ``transfer_id`` on each of ``peers`` (every P worker it was for)."""
        for peer in peers:
            self.cancel(peer, transfer_id, reason)

    def send_soon(self, peer: Peer, frames: list[bytes]) -> None:
        """Send ``frames`` to ``peer`` in a task of its own; dropped if P is lost meanwhile."""
        self._nursery.start_soon(self._send_quietly, peer, frames)

    async def _send_quietly(self, peer: Peer, frames: list[bytes]) -> None:
        try:
            await peer.dealer.send(frames)
        except trio.ClosedResourceError:
            pass  # P was lost: its pulls end through on_lost

    async def _serve(
        self,
        address: str,
        curve_key: str,
        *,
        task_status: trio.TaskStatus[Peer] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """One P worker's connection: read its answers until it is lost, then end its pulls."""
        liveness = self._config.liveness
        # A malformed address or an untrusted key raises TransportError here, before started:
        # nursery.start re-raises it to the pull that asked, which ends as unreachable.
        dealing = self._transport.open_dealer(address, liveness=liveness, server_key=curve_key)
        async with dealing as dealer:
            peer = self._peers[address] = Peer(address, dealer, curve_key)
            task_status.started(peer)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read_answers, peer)
                    nursery.start_soon(_watch_lost, peer, liveness.connect_timeout)
                    await peer.gone.wait()
                    nursery.cancel_scope.cancel()
                # Before the socket closes: a send still in flight on it then fails for a pull
                # that has already ended here (and gets its parting cancel).
                peer.lost = True
                self._lost(peer)
            finally:
                peer.lost = True
                del self._peers[address]

    def _lost(self, peer: Peer) -> None:
        address, reason = peer.address, peer.gone_reason
        pulls = self._on_lost(peer, f"P gone: {reason}")
        now = trio.current_time()
        for old in [a for a, since in self._down.items() if now - since >= DOWN_MEMORY]:
            del self._down[old]
        level = logging.INFO if address in self._down or not pulls else logging.WARNING
        log.log(level, "P worker %s gone (%r): %d pulls end", address, reason, len(pulls))
        self._down.setdefault(address, now)
        self._owe(peer, [*pulls, *peer.cancels])

    def _owe(self, peer: Peer, transfer_ids: list[str]) -> None:
        """P at ``peer`` was not told (or did not answer) that D gave up on ``transfer_ids``:
        tell it on a fresh connection (:meth:`_parting_cancels`)."""
        if not transfer_ids or peer.broken:
            return
        give_up = trio.current_time() + PARTING_MEMORY
        owed = self._owed.get(peer.address)
        if owed is None:
            self._owed[peer.address] = _Owed(set(transfer_ids), give_up)
            self._nursery.start_soon(self._parting_cancels, peer.address, peer.curve_key)
        else:  # its task, trying already, tells these too: now, and for longer
            owed.transfer_ids.update(transfer_ids)
            owed.give_up = give_up
            owed.wake.set()

    def _hand_over(self, peer: Peer) -> None:
        """A new connection to a P worker owed cancels carries them now (its task, perhaps
        pausing, ends): should it be lost too before P answers them, they are owed again."""
        owed = self._owed.get(peer.address)
        if owed is None or not owed.transfer_ids:
            return
        for transfer_id in sorted(owed.transfer_ids):
            self.cancel(peer, transfer_id, "D lost its connection to P")
        owed.transfer_ids.clear()
        owed.wake.set()

    @property
    def owed_cancels(self) -> int:
        """Transfers whose P worker D lost before it could tell it D gave up on them."""
        return sum(len(owed.transfer_ids) for owed in self._owed.values())

    async def _parting_cancels(self, address: str, key: str) -> None:
        """After a lost connection: if P is in fact alive (only the link broke), tell it on a
        fresh connection that D gave up on the transfers :attr:`_owed` to ``address``, so that
        it frees their KV now rather than at its expiry; tried again after a pause (doubling,
        :data:`PARTING_PAUSES`) until P answered or :data:`PARTING_MEMORY` seconds passed
        since one was last owed; at once when one is newly owed (:meth:`_owe`); ended when a
        new connection took them over (:meth:`_hand_over`)."""
        first, longest = PARTING_PAUSES
        pause, state = first, self._owed[address]
        try:
            while owed := sorted(state.transfer_ids):
                if await self._tell(address, key, owed):
                    state.transfer_ids.difference_update(owed)
                    continue  # others may have been lost to it meanwhile
                if trio.current_time() + pause >= state.give_up and not state.wake.is_set():
                    log.info("P worker %s not reached for %.0f s: %d cancels not delivered",
                             address, PARTING_MEMORY, len(owed))  # fmt: skip
                    return
                with trio.move_on_after(pause):
                    await state.wake.wait()
                pause = first if state.wake.is_set() else min(2 * pause, longest)
                state.wake = trio.Event()
        finally:
            del self._owed[address]

    async def _tell(self, address: str, key: str, transfer_ids: list[str]) -> bool:
        """One try of the parting cancels on a fresh connection; True once P answered one (the
        connection works, and messages on it arrive in order: P read them all) or its key is
        refused (nothing this D may tell it). A P that gives no handshake within
        ``connect_timeout`` is not reached: False. So is one whose address refuses the
        connection at once, which is not taken for a dead P here: a link whose carrier is
        down (this host's own cable) refuses at once too, and a P behind it still holds KV."""
        liveness = self._config.liveness
        cancels = [encode_frames(CancelPull(t, "D lost its connection to P")) for t in transfer_ids]
        heard = False
        with trio.move_on_after(2 * liveness.connect_timeout):
            try:
                async with (
                    self._transport.open_dealer(
                        address, liveness=liveness, server_key=key
                    ) as dealer,
                    trio.open_nursery() as nursery,
                ):

                    async def answers() -> None:
                        nonlocal heard
                        for _ in cancels:  # P answers each cancel (PullFailed "cancelled")
                            await dealer.receive()
                            heard = True
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(answers)
                    for frames in cancels:
                        await dealer.send(frames)
                    await dealer.wait_lost(liveness.connect_timeout)
                    nursery.cancel_scope.cancel()
            except (PdError, trio.ClosedResourceError):
                return True  # P is gone after all: there is nothing left to free
        return heard

    async def _read_answers(self, peer: Peer) -> None:
        while True:
            frames = await peer.dealer.receive()
            try:
                msg = decode_frames(frames)
            except FrameError as exc:
                # Nothing more on this connection can be trusted: its pulls end now.
                self.protocol_error(peer, str(exc))
                why = f"sent an undecodable frame: {exc}"
                if exc.version is not None:
                    why = (f"speaks side-channel protocol version {exc.version}, this D "
                           f"speaks {PROTOCOL_VERSION}")  # fmt: skip
                peer.end(f"P worker {peer.address} {why}", broken=True)
                return
            self._down.pop(peer.address, None)  # heard from: a loss again is news
            if isinstance(msg, PullDone | PullFailed):  # a cancel of it is answered
                peer.cancels.discard(msg.transfer_id)
            self._on_answer(peer, msg)


async def _watch_lost(peer: Peer, connect_timeout: float) -> None:
    peer.end(await peer.dealer.wait_lost(connect_timeout))
