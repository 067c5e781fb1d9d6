"""Engine epochs: which life of a peer a message belongs to.

Every start of a sender or a receiver (a new process, or the actors restarted inside one) is a
new *epoch*: a random nonzero 63-bit number (:func:`new_epoch`). Epochs are opaque: compared
for equality, never ordered (clocks of two hosts say nothing about which life came first), so
"an earlier life" is one that was seen and then superseded.

* P's registration carries its epoch; D sends it back in each pull (``p_epoch``), and P
  refuses a pull meant for another life of itself (:func:`p_refusal`), so a D with a stale
  look-up asks the bootstrap again instead of being served by a stranger to its request.
* D's pulls carry D's epoch (``d_epoch``). P remembers the latest epoch of each D session (the
  data-plane address it writes to) in :class:`SessionEpochs`: a pull from a new epoch of a
  known session means that D restarted, and the pulls P still holds from its earlier life name
  blocks of a dead process that must never be written
  (:meth:`~pdactors.core.send_table.SendTable.session_restarted` ends them); a pull from a
  superseded epoch is refused.
* D takes an answer only from the P life it asked (:meth:`~pdactors.core.pull_table.Pull.
  from_other_life`).

Pure: no IO, no clock.
"""

from __future__ import annotations

import enum
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Final

__all__ = ["EPOCH_BITS", "EpochVerdict", "SessionEpochs", "Verdict", "new_epoch", "p_refusal"]

EPOCH_BITS: Final = 63  #: epochs fit a signed 64-bit integer (msgpack, JSON, every language)


def new_epoch() -> int:
    """A fresh epoch: uniformly random in ``[1, 2**63)`` (0 means "not said" on the wire)."""
    while not (epoch := secrets.randbits(EPOCH_BITS)):
        pass
    return epoch


def p_refusal(mine: int, asked: int) -> str | None:
    """Why P (epoch ``mine``) refuses a pull that named P epoch ``asked`` (None: it is for this
    life, or D did not say). The refusal tells D to look P up again."""
    if not asked or not mine or asked == mine:
        return None
    return f"pull meant for another life of this P worker (epoch {asked}; this one is {mine})"


class Verdict(enum.Enum):
    """What a D session's epoch in a pull means to P."""

    CURRENT = "current"  # the life P knows (or the first it hears of, or D did not say)
    RESTARTED = "restarted"  # a new life of a known session: the earlier one's pulls end
    SUPERSEDED = "superseded"  # an earlier life, already replaced: its pull is refused


@dataclass(frozen=True, slots=True)
class EpochVerdict:
    verdict: Verdict
    #: RESTARTED: the life it replaces; SUPERSEDED: the life that replaced it.
    other: int = 0

    def reason(self, session: str, epoch: int) -> str:
        """The words for a pull of ``session`` at ``epoch`` that this verdict ends or refuses."""
        if self.verdict is Verdict.SUPERSEDED:
            return (f"pull from an earlier life of D session {session!r} (epoch {epoch}; "
                    f"it restarted as epoch {self.other})")  # fmt: skip
        return f"D session {session!r} restarted (epoch {epoch}): its earlier life's pulls end"


class SessionEpochs:
    """The latest epoch of each D session P has heard from, and a few superseded ones.

    Bounded: at most ``max_sessions`` sessions (the least recently heard forgotten first) and
    ``max_past`` superseded epochs each; a forgotten one is a first sighting again (accepted),
    never a false refusal of a live D.
    """

    def __init__(self, max_sessions: int = 4096, max_past: int = 8) -> None:
        self._max_sessions = max_sessions
        self._max_past = max_past
        self._latest: OrderedDict[str, int] = OrderedDict()
        self._past: dict[str, deque[int]] = {}

    def __len__(self) -> int:
        return len(self._latest)

    def judge(self, session: str, epoch: int) -> EpochVerdict:
        """What a pull of ``session`` from D epoch ``epoch`` means, remembering it: a new
        epoch becomes the session's latest (RESTARTED, naming the one it replaces)."""
        if not epoch:
            return EpochVerdict(Verdict.CURRENT)  # D did not say (an older pdactors)
        latest = self._latest.get(session)
        if latest is not None:
            self._latest.move_to_end(session)
        if latest == epoch:
            return EpochVerdict(Verdict.CURRENT)
        past = self._past.get(session)
        if latest is not None and past is not None and epoch in past:
            return EpochVerdict(Verdict.SUPERSEDED, latest)
        self._latest[session] = epoch
        if latest is None:
            if len(self._latest) > self._max_sessions:
                old, _ = self._latest.popitem(last=False)
                self._past.pop(old, None)
            return EpochVerdict(Verdict.CURRENT)
        self._past.setdefault(session, deque(maxlen=self._max_past)).append(latest)
        return EpochVerdict(Verdict.RESTARTED, latest)
