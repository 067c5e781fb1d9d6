"""Typed exceptions of pdactors. Every error the library raises on purpose is a :class:`PdError`."""

from __future__ import annotations

__all__ = [
    "BadBlockIds",
    "BadMessage",
    "BadTransferParams",
    "BootstrapError",
    "BootstrapTimeout",
    "ConfigError",
    "DataPlaneError",
    "DuplicateTransfer",
    "IllegalTransition",
    "LayoutMismatch",
    "PdError",
    "PlanError",
    "PullFailedError",
    "RankHeld",
    "TransferError",
    "describe",
]


def describe(exc: BaseException) -> str:
    """``Type: message``, with the first message found down the cause chain when the error
    itself has none (httpx's ConnectError and trio's BrokenResourceError over TLS carry the SSL
    reason in their cause)."""
    cause: BaseException | None = exc
    while cause is not None and not str(cause):
        cause = cause.__cause__ or cause.__context__
    return f"{type(exc).__name__}: {cause}" if cause is not None else type(exc).__name__


class PdError(Exception):
    """Base class of pdactors' errors."""


class IllegalTransition(PdError):
    """An event that a transfer's state does not allow (a bug in the caller)."""


class DuplicateTransfer(IllegalTransition):
    """A transfer id that is already in flight was started again; the first one is untouched."""

    def __init__(self, transfer_id: str) -> None:
        self.transfer_id = transfer_id
        super().__init__(f"transfer {transfer_id} is already in flight; this duplicate is refused")


class ConfigError(PdError, ValueError):
    """A setting out of its range, or settings that do not fit together. A ``ValueError``, so
    msgspec reports it as a ``ValidationError`` when the settings are decoded from a file."""


class BadMessage(PdError, ValueError):
    """A message from a peer that breaks the wire's rules (a bad registration, block ids of
    the wrong shape, an undecodable side-channel frame)."""


class BadBlockIds(PdError, TypeError):
    """Block ids that are neither a sequence of integers nor a sequence of such sequences."""


class BadTransferParams(PdError, ValueError):
    """A request's ``kv_transfer_params`` cannot be read (a key has a wrong type)."""


class PlanError(PdError, ValueError):
    """A transfer cannot be planned: bad block ids, or layouts that do not match."""


class LayoutMismatch(PlanError):
    """P's and D's KV layouts (region count or bytes per block) are not compatible."""


class DataPlaneError(PdError):
    """The data plane could not start, register memory, or do what it was asked."""


class TransferError(DataPlaneError):
    """A batched write failed: names the peer, the bytes asked for and the engine's code
    (None when the engine gave none: its call raised instead of returning one)."""

    def __init__(self, peer: str, nbytes: int, code: int | None, detail: str = "") -> None:
        self.peer = peer
        self.nbytes = nbytes
        self.code = code
        msg = f"write of {nbytes} bytes to {peer} failed"
        if code is not None:
            msg += f" with code {code}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class BootstrapError(PdError):
    """The bootstrap registry could not be reached or did not know the engine asked for."""


class BootstrapTimeout(BootstrapError):
    """The registry gave no answer at all in time: busy or hung, not known to be gone (a
    refused connection or an error answer is a plain :class:`BootstrapError`)."""


class RankHeld(BootstrapError):
    """The registry refused a registration (HTTP 409): its dp/tp/pp rank is held by another
    worker whose lease is live, and the registration would move it elsewhere. Not retried
    within one ``register`` call: the holder's lease must lapse first (or the registration
    must name the holder's epoch in ``replaces``)."""


class PullFailedError(PdError):
    """A pull ended without the KV: P refused, failed, the pull timed out or was aborted."""

    def __init__(self, transfer_id: str, reason: str) -> None:
        self.transfer_id = transfer_id
        self.reason = reason
        super().__init__(f"transfer {transfer_id}: {reason}")
