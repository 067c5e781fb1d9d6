"""What D does with each message a P worker sends about D's pulls: ``PullDone`` (its part
landed, with checksums to verify), ``PullFailed`` (it will not deliver; perhaps look P up
again), ``LayoutUnknown`` (P forgot D's layout: the pull is resent with it) and ``ErrorReply``
(P could not read D's message), and ``Writing`` (P writes D's blocks now: a loss of P
before its answer fences the pull).

Each answer goes to the pull's record (:class:`~pdactors.core.pull_table.PullTable`), whose
effects the receiver carries out; a late answer (its pull ended) is dropped, and one from
another life of P than D asked (:mod:`pdactors.core.epochs`) is ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from pdactors import timeline
from pdactors.actors._landed import LandedCheck
from pdactors.actors._lookups import Lookups
from pdactors.actors._p_connections import PConnections, Peer
from pdactors.core.pull_table import PullEffect, PullTable
from pdactors.wire import (
    ErrorReply,
    Layout,
    LayoutUnknown,
    Msg,
    PullDone,
    PullFailed,
    Writing,
    encode_frames,
)

__all__ = ["PAnswers"]

log = logging.getLogger("pdactors.receiver")


class PAnswers:
    """The receiver's handling of P's answers; ``apply`` carries out the table's effects."""

    def __init__(
        self,
        table: PullTable,
        lookups: Lookups,
        landed: LandedCheck,
        links: PConnections,
        layout: Layout,
        apply: Callable[[list[PullEffect]], None],
    ) -> None:
        self._table = table
        self._lookups = lookups
        self._landed = landed
        self._links = links
        self._layout = layout
        self._apply = apply

    def on_answer(self, peer: Peer, msg: Msg) -> None:
        """Take ``msg`` from ``peer``. Not a checkpoint."""
        match msg:
            case PullDone(transfer_id=tid, epoch=epoch) | PullFailed(transfer_id=tid, epoch=epoch):
                failed = msg if isinstance(msg, PullFailed) else None
                again = failed is not None and failed.lookup_again
                if (pull := self._table.get(tid)) is None:
                    return  # a late answer
                if pull.from_other_life(peer.address, epoch, lookup_again=again):
                    log.debug("ignored %r from P %s: another life than it asked", msg, peer.address)
                elif failed is None:
                    timeline.mark(tid, "landed")
                    assert isinstance(msg, PullDone)
                    sums = self._landed.sums(msg)
                    self._apply(self._table.answered(tid, ok=True, peer=peer.address, epoch=epoch,
                                                     sums=sums, nbytes=msg.nbytes))  # fmt: skip
                else:
                    if again:  # P has more workers than we knew, or is another life of it
                        self._lookups.forget(pull.bootstrap_url)
                    self._apply(self._table.answered(tid, ok=False, reason=f"P: {failed.reason}",
                                                     peer=peer.address, epoch=epoch,
                                                     lookup_again=again))  # fmt: skip
            case Writing(transfer_id=tid, epoch=epoch):
                self._apply(self._table.writing(tid, peer.address, epoch))
            case LayoutUnknown(transfer_id=tid):
                pull = self._table.get(tid)
                if pull is not None and pull.request is not None and peer.address in pull.waiting:
                    # P forgot us (restart): resend with the layout
                    request = msgspec.structs.replace(
                        pull.request,
                        p_epoch=pull.p_epochs.get(peer.address, 0),
                        layout=self._layout,
                    )
                    self._links.send_soon(peer, encode_frames(request))
            case ErrorReply(reason=reason, transfer_id=tid):
                # P could not read our message about ``tid``: it is not writing that pull.
                self._links.protocol_error(peer, f"could not read our message: {reason}")
                reason = f"P could not read the pull: {reason}"
                if tid:
                    self._apply(
                        self._table.answered(tid, ok=False, reason=reason, peer=peer.address)
                    )
                else:  # about a message we cannot tell: every pull on this connection
                    peer.end(f"P worker {peer.address}: {reason}", broken=True)
            case _:
                log.warning("unexpected %s from P worker %s", type(msg).__name__, peer.address)
