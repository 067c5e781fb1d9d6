"""The sender's side of engine epochs: its own epoch, the D sessions' latest, and what a pull
from another life gets (:mod:`pdactors.core.epochs` decides; this carries it out and logs).

* A pull that names another P epoch than this sender's is refused at once with
  ``lookup_again`` (D's look-up is stale: P restarted, or another P took its address).
* A pull from a new epoch of a known D session ends every pull P holds from that session's
  earlier life (:meth:`~pdactors.core.send_table.SendTable.session_restarted`), logged once
  per restart; a pull from a superseded life is refused.
* Every answer P sends carries its epoch (:meth:`EpochFence.stamp`), so D takes answers only
  from the life it asked.
"""

from __future__ import annotations

import logging

import msgspec

from pdactors.core.epochs import SessionEpochs, Verdict, new_epoch, p_refusal
from pdactors.core.send_table import Effect, Release, Reply, SendTable
from pdactors.wire import Msg, PullDone, PullFailed, PullRequest

__all__ = ["EpochFence"]


class EpochFence:
    """One sender incarnation's epoch (``epoch``: fresh at every start) and its D sessions'."""

    def __init__(self, log: logging.Logger) -> None:
        self.epoch = new_epoch()
        self._sessions = SessionEpochs()
        self._log = log

    def check(
        self, table: SendTable, identity: bytes, pull: PullRequest, now: float
    ) -> tuple[list[Effect], bool]:
        """What ``pull`` causes before anything else about it is looked at, and whether it
        goes on: a refusal (False), or (True) nothing, or for a D that restarted the ends of
        its earlier life's pulls. Not a checkpoint."""
        tid = pull.transfer_id
        if (other := p_refusal(self.epoch, pull.p_epoch)) is not None:
            self._log.debug("pull %r from D %s refused: %s", tid, identity.hex(), other)
            return [Reply(identity, PullFailed(tid, other, lookup_again=True))], False
        verdict = self._sessions.judge(pull.session, pull.d_epoch)
        if verdict.verdict is Verdict.CURRENT:
            return [], True
        reason = verdict.reason(pull.session, pull.d_epoch)
        if verdict.verdict is Verdict.SUPERSEDED:
            self._log.debug("pull %r refused: %s", tid, reason)
            return [Reply(identity, PullFailed(tid, reason))], False
        ended = table.session_restarted(pull.session, pull.d_epoch, now, reason)
        ends = {e.transfer_id for e in ended if isinstance(e, Release)}
        self._log.warning("%s (it was epoch %d): %d pulls end, %d transfers' blocks released",
                          reason, verdict.other, sum(isinstance(e, Reply) for e in ended),
                          len(ends))  # fmt: skip
        return ended, True

    def stamp(self, msg: Msg) -> Msg:
        """``msg`` as this life sends it: an answer to a pull carries this epoch."""
        if isinstance(msg, PullDone | PullFailed) and not msg.epoch:
            return msgspec.structs.replace(msg, epoch=self.epoch)
        return msg
