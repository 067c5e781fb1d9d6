"""What a write's engine call came to, classified once for every way a call is made.

An engine call (:func:`~pdactors.dataplane._batching.run_call` for a batch, in the Trio thread
or a worker thread, or a write made at once) reports raw facts: what
``batch_transfer_sync_write`` returned (the engine's own code, or the exception the binding
raised instead; None when no call was made) and, for each write it carried, what that write's
``before`` raised. :func:`classify` turns those facts into an :class:`Outcome`,
:func:`failure` into the :class:`Failure` a write keeps, and :meth:`Failure.error` into the
error the write raises. No number of ours is ever mixed into the engine's codes: a code on an
error is one the engine returned.

The rows, first match wins (the tests enumerate them against an oracle written by hand):

============================  ==========================  =================================
the write's ``before``        the engine call             outcome → what the write raises
============================  ==========================  =================================
raised                        anything, or none made      NOT_COMPLETE → ``DataPlaneError``
did not raise (or none)       returned 0                  LANDED → nothing
did not raise (or none)       returned another code       REFUSED → ``TransferError(code)``
did not raise (or none)       raised an exception         RAISED → ``TransferError(None)``
did not raise (or none)       none made                   impossible: ``ValueError``
============================  ==========================  =================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdactors.errors import DataPlaneError, TransferError

__all__ = ["Failure", "Outcome", "classify", "failure"]


class Outcome(enum.Enum):
    """How a write's share of one engine call ended."""

    LANDED = "landed"  # the engine returned 0 for the call that carried it
    REFUSED = "refused"  # the engine returned another code: the peer or its memory refused
    RAISED = "raised"  # the binding raised instead of returning a code
    NOT_COMPLETE = "not_complete"  # its ``before`` raised: no call carried it, nothing sent


_LANDED = Outcome.LANDED  # (a module global: an enum member's lookup costs ~0.05 µs here)


def classify(returned: int | Exception | None, wait: Exception | None = None) -> Outcome:
    """The outcome of a write whose ``before`` raised ``wait`` (None: it did not, or it had
    none) and whose call returned ``returned``: the engine's code, the exception the call
    raised, or None when no call was made (every write of the batch failed its wait).

    Raises :class:`ValueError` for a write no call carried that did not fail its wait."""
    if returned == 0 and wait is None:  # first: every write that lands asks
        return _LANDED
    if wait is not None:
        return Outcome.NOT_COMPLETE
    if isinstance(returned, Exception):
        return Outcome.RAISED
    if returned is None:
        raise ValueError("no engine call carried a write whose wait did not fail")
    return Outcome.REFUSED


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a write failed: its outcome, the engine's code where the engine gave one, and the
    detail its error carries."""

    outcome: Outcome
    detail: str
    code: int | None = None

    def error(self, peer: str, nbytes: int) -> DataPlaneError:
        """The error the write of ``nbytes`` bytes to ``peer`` raises: a
        :class:`DataPlaneError` when its KV never became complete (nothing was sent; not the
        peer's doing), else a :class:`TransferError` naming the peer, the bytes and the
        engine's code (None when the call raised instead of returning one)."""
        if self.outcome is Outcome.NOT_COMPLETE:
            return DataPlaneError(f"write of {nbytes} bytes to {peer}: {self.detail}")
        return TransferError(peer, nbytes, self.code, self.detail)


def failure(
    returned: int | Exception | None,
    wait: Exception | None = None,
    *,
    descriptors: int,
    others: int = 0,
) -> Failure | None:
    """The failure of a write (:func:`classify`), None when it landed. ``descriptors``: those
    the call carried; ``others``: the other writes it carried (both for the detail)."""
    outcome = classify(returned, wait)
    if outcome is _LANDED:
        return None
    if outcome is Outcome.NOT_COMPLETE:
        return Failure(outcome, f"the KV was not complete: {type(wait).__name__}: {wait}")
    if outcome is Outcome.RAISED:
        return Failure(outcome, f"the engine call raised {returned!r}")
    assert isinstance(returned, int)  # REFUSED: the engine's own code
    plural = "s" if others > 1 else ""
    carried = f", carrying {others} other write{plural}" if others else ""
    detail = f"engine call of {descriptors} descriptors{carried} failed"
    return Failure(outcome, detail, code=returned)
