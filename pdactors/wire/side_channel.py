"""The side channel's messages (D ⇄ P over ZMQ ROUTER/DEALER): msgpack-encoded tagged Structs.

A frame on the side channel is a two-part ZMQ message ``[HEADER, payload]``; the header carries
the protocol version and is checked before the payload is decoded (:func:`decode_frames`).
Hot-path structs are ``array_like`` (smaller, faster to decode): they are append-only; new
fields go at the end with a default.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
from msgspec import Meta

from pdactors.errors import BadMessage
from pdactors.wire.compat import Compat
from pdactors.wire.layout import Layout, WireBlockIds
from pdactors.wire.limits import (
    MAX_BLOCK_IDS,
    MAX_ID,
    MAX_KV_HEADS,
    MAX_PP_SIZE,
    MAX_REASON,
    MAX_SUM_BYTES,
    MAX_TP_SIZE,
    U64,
    Epoch,
    Id,
    Reason,
)  # fmt: skip

__all__ = [
    "HEADER", "PROTOCOL_VERSION", "CancelPull", "ErrorReply", "FrameError", "LayoutUnknown",
    "Msg", "PullDone", "PullFailed", "PullRequest", "Writing", "decode_frames", "encode_frames",
]  # fmt: skip

#: 2: block ids per KV-cache group (``PullRequest.block_ids``), regions know their group.
PROTOCOL_VERSION: Final = 2
#: First frame of every side-channel message: a magic and the protocol version.
HEADER: Final = b"PDA" + bytes([PROTOCOL_VERSION])


class FrameError(BadMessage):
    """A side-channel frame could not be decoded (wrong version, malformed, unknown type, or
    beyond :data:`LIMITS`); its ``tag`` and ``transfer_id`` if still readable (else ""), and
    the peer's protocol ``version`` if that is what differs (else None)."""

    def __init__(self, reason: str, *, tag: str = "", transfer_id: str = "",
                 version: int | None = None) -> None:  # fmt: skip
        super().__init__(reason)
        self.tag, self.transfer_id, self.version = tag, transfer_id, version


class _Msg(msgspec.Struct, frozen=True, array_like=True, tag_field="t"):
    """Base of side-channel messages (the tag names the type)."""


class PullRequest(_Msg, frozen=True, tag="pull"):
    """D → P: write the KV of ``transfer_id`` into these blocks of mine.

    ``layout`` is sent the first time D talks to this P worker; afterwards only ``layout_id``
    (P answers :class:`LayoutUnknown` when it has forgotten it, and D resends with the layout).
    ``block_ids``: D's blocks per KV-cache group. ``tp_rank``/``tp_size`` are D's;
    ``kv_heads`` is the model's KV head count (0: D did not say; needed when P's and D's TP
    sizes differ); ``p_tp_size`` / ``p_pp_size`` the TP and PP sizes D took P to have from the
    bootstrap (0: not said). P refuses a pull planned for
    another shape, with ``lookup_again`` set. ``compat``: D's description of what must match
    (None: D did not say; accepted, as before there was one); P refuses a pull whose
    description differs from its own (:mod:`pdactors.core.compat`).
    ``p_epoch``: the epoch of the P worker D looked up (0: unknown); P refuses a pull meant
    for another life of itself. ``d_epoch``: this D receiver's own (0: not said); P fences the
    pulls of an earlier life of the same D session (:mod:`pdactors.core.epochs`).
    ``fence``: D fences its blocks against a write that may land after it lost P; P says
    :class:`Writing` before it writes them (False: an older D, which is sent no such notice).
    ``done_to`` / ``done_token``: D's fast completion path (issue 28): once the whole pull has
    landed, P's write thread itself sends the 8 bytes of ``done_token`` (little-endian) as
    one UDP datagram to ``done_to`` (``"udp://ip:port"``: a numeric IPv4 address, or an IPv6
    one in brackets, ``"udp://[::1]:7"``; P looks no name up and sends nothing to any other
    form), with no Trio loop on either side; the datagram may be lost, and the
    :class:`PullDone` on the side channel still follows and stays the authority for every
    failure path (``""``: D asks for no such notice; an older P ignores both fields).
    """

    transfer_id: Id
    session: Id
    tp_rank: Annotated[int, Meta(ge=0, lt=MAX_TP_SIZE)]
    tp_size: Annotated[int, Meta(ge=1, le=MAX_TP_SIZE)]
    pp_rank: Annotated[int, Meta(ge=0, lt=MAX_PP_SIZE)]
    pp_size: Annotated[int, Meta(ge=1, le=MAX_PP_SIZE)]
    block_ids: WireBlockIds
    layout_id: Id
    layout: Layout | None = None
    kv_heads: Annotated[int, Meta(ge=0, le=MAX_KV_HEADS)] = 0
    p_tp_size: Annotated[int, Meta(ge=0, le=MAX_TP_SIZE)] = 0
    p_pp_size: Annotated[int, Meta(ge=0, le=MAX_PP_SIZE)] = 0
    compat: Compat | None = None
    p_epoch: Epoch = 0
    d_epoch: Epoch = 0
    fence: bool = False
    done_to: Annotated[str, Meta(max_length=MAX_ID)] = ""
    done_token: U64 = 0


class CancelPull(_Msg, frozen=True, tag="cancel"):
    """D → P: D gave up on ``transfer_id`` (aborted or timed out); P may free its blocks.
    P answers it (``PullFailed``) once no write of it on this connection is in flight. With
    ``session`` (D's data-plane session, as in its pull): once no write of it into that D
    worker's memory is in flight, whichever connection the pull came on — D asks so on a new
    connection after it lost the one a write was for (its fence)."""

    transfer_id: Id
    reason: Reason = ""
    session: Id = ""


class PullDone(_Msg, frozen=True, tag="done"):
    """P → D: every block of ``transfer_id`` has landed in D's memory. ``epoch``: the
    answering P worker's (0: not said); D takes it only from the P life it asked.

    ``sums``: a checksum of every run P wrote, an 8-byte header naming the algorithm
    (xxh3-64 for host memory, wmix-64 for a GPU's) then ``(dst, length, digest)``
    (:mod:`pdactors.dataplane.checksum`), which D recomputes over what landed before it
    reports the KV as received; ``b""``: P sent none."""

    transfer_id: Id
    nbytes: U64 = 0
    descriptors: U64 = 0
    epoch: Epoch = 0
    sums: Annotated[bytes, Meta(max_length=MAX_SUM_BYTES)] = b""


class PullFailed(_Msg, frozen=True, tag="failed"):
    """P → D: ``transfer_id`` will not be delivered; ``reason`` says why. ``lookup_again``: D's
    view of P (from the bootstrap) is stale or partial; D should look P up again. ``epoch``:
    the answering P worker's (0: not said), as in :class:`PullDone`."""

    transfer_id: Id
    reason: Reason
    lookup_again: bool = False
    epoch: Epoch = 0


class Writing(_Msg, frozen=True, tag="writing"):
    """P → D (a pull with ``fence`` set): P is about to write ``transfer_id`` into D's blocks.
    Should D lose P before P's answer, a write may still land there: D keeps those blocks
    until P confirms no write is in flight (its answer to a ``CancelPull`` with ``session``),
    or is known dead. ``epoch``: as in :class:`PullDone`."""

    transfer_id: Id
    epoch: Epoch = 0


class LayoutUnknown(_Msg, frozen=True, tag="layout?"):
    """P → D: resend the pull for ``transfer_id`` with the full layout."""

    transfer_id: Id
    layout_id: Id


class ErrorReply(_Msg, frozen=True, tag="error"):
    """Either way: the frame you sent could not be decoded; ``reason`` says why.
    ``transfer_id``: the transfer it was about, when that could be read ("" otherwise)."""

    reason: Reason
    transfer_id: Id = ""


Msg = PullRequest | CancelPull | PullDone | PullFailed | LayoutUnknown | ErrorReply | Writing


class _Head(msgspec.Struct, array_like=True):  # what an undecodable message may still tell
    t: Annotated[str, Meta(max_length=16)]
    transfer_id: Id = ""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Msg)
_head_decoder = msgspec.msgpack.Decoder(_Head)


def encode_frames(msg: Msg) -> list[bytes]:
    """Encode ``msg`` as the two ZMQ frames of the side channel (a reason longer than
    :data:`MAX_REASON` is cut to it: the peer would refuse the frame)."""
    if isinstance(msg, PullFailed | ErrorReply | CancelPull) and len(msg.reason) > MAX_REASON:
        msg = msgspec.structs.replace(msg, reason=msg.reason[: MAX_REASON - 3] + "...")
    return [HEADER, _encoder.encode(msg)]


def decode_frames(frames: list[bytes]) -> Msg:
    """Check the header, then decode the payload within :data:`LIMITS`. Raises
    :class:`FrameError`."""
    if len(frames) != 2:
        raise FrameError(f"expected 2 frames (header, payload), got {len(frames)}")
    header, payload = frames
    if header != HEADER:
        if header[:3] == HEADER[:3] and len(header) == len(HEADER):
            raise FrameError(
                f"protocol version {header[3]} is not supported (this is {PROTOCOL_VERSION})",
                version=header[3],
            )
        raise FrameError(f"bad header {bytes(header[:8])!r}")
    try:
        msg = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        try:
            head = _head_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise FrameError(f"undecodable payload: {exc}") from None
        reason = f"undecodable {head.t!r} message: {exc}"
        raise FrameError(reason, tag=head.t, transfer_id=head.transfer_id) from None
    if isinstance(msg, PullRequest) and sum(map(len, msg.block_ids)) > MAX_BLOCK_IDS:
        raise FrameError(
            f"a pull names more than {MAX_BLOCK_IDS} block ids",
            tag="pull",
            transfer_id=msg.transfer_id,
        )
    return msg
