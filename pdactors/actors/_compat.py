"""An actor's side of the compatibility check: its own description, the fields relaxed, and
which peers it has already warned about (:mod:`pdactors.core.compat` decides; this logs).

A relaxed mismatch is logged once per peer and field as a warning naming the field, and so is
a refusal (later ones at DEBUG): operators see each incompatible peer once, not once a pull.
"""

from __future__ import annotations

import logging
from typing import Literal

from pdactors.core.compat import judge
from pdactors.core.send_table import Effect, Reply, SendTable
from pdactors.wire import Compat, PullFailed

__all__ = ["PeerCompat", "refuse_pull"]

_MAX_WARNED = 4096  # (peer, field) pairs remembered; beyond, the memory starts again


class PeerCompat:
    """Checks peers' descriptions against ``mine`` (None: nothing is checked)."""

    def __init__(
        self,
        mine: Compat | None,
        relax: tuple[str, ...],
        me: Literal["P", "D"],
        log: logging.Logger,
    ) -> None:
        self.mine, self.relax, self._me, self._log = mine, relax, me, log
        self._warned: set[tuple[str, str]] = set()

    def refusal(self, peer: str, theirs: Compat | None) -> str | None:
        """Why ``peer``, describing itself as ``theirs``, is refused (None: accepted)."""
        verdict = judge(self.mine, theirs, self.relax)
        for m in verdict.relaxed:
            if self._first(peer, m.field):
                self._log.warning("peer %s: %s; accepted: compat_relax names %r",
                                  peer, m.reason(self._me), m.field)  # fmt: skip
        if verdict.refused is None:
            return None
        reason = verdict.refused.reason(self._me)
        level = logging.WARNING if self._first(peer, verdict.refused.field) else logging.DEBUG
        self._log.log(level, "peer %s refused: %s", peer, reason)
        return reason

    def _first(self, peer: str, field: str) -> bool:
        if (peer, field) in self._warned:
            return False
        if len(self._warned) >= _MAX_WARNED:
            self._warned.clear()
        self._warned.add((peer, field))
        return True


def refuse_pull(
    table: SendTable, identity: bytes, transfer_id: str, now: float, reason: str
) -> list[Effect]:
    """P refuses the pull of ``transfer_id`` from ``identity`` for ``reason``: the transfer
    ends as D's cancel would (P's blocks are released now, or as soon as they are ready; the
    table's record becomes a tombstone that answers later pulls with ``reason``), and the
    pulling D is told ``reason`` rather than "cancelled"."""
    effects = table.pull_cancelled(transfer_id, identity, now, reason)
    return [
        Reply(identity, PullFailed(transfer_id, reason))
        if isinstance(e, Reply) and e.identity == identity and isinstance(e.msg, PullFailed)
        else e
        for e in effects
    ]
