"""Every wire type of pdactors, in one module.

Three families live here:

* **Side-channel messages** (D ⇄ P over ZMQ ROUTER/DEALER), msgpack-encoded tagged Structs.
  A frame on the side channel is a two-part ZMQ message ``[HEADER, payload]``; the header
  carries the protocol version and is checked before the payload is decoded
  (:func:`decode_frames`).
* **Bootstrap bodies** (JSON over HTTP), in the same shapes as upstream vLLM's Mooncake
  bootstrap server, so upstream proxies and tools can talk to ours.
* **kv_transfer_params keys**, the dictionary vLLM carries per request between the proxy, P
  and D.

Hot-path structs are ``array_like`` (smaller, faster to decode): they are append-only; new
fields go at the end with a default.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, Final, TypeAlias

import msgspec
from msgspec import Meta

from pdactors.errors import BadBlockIds, BadMessage, BadTransferParams

__all__ = [
    "HEADER",
    "LIMITS",
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "BlockIds",
    "BlockIdsLike",
    "BlockLayout",
    "BootstrapEntry",
    "CancelPull",
    "ErrorReply",
    "FrameError",
    "KVTransferParams",
    "Layout",
    "LayoutUnknown",
    "Msg",
    "PullDone",
    "PullFailed",
    "PullRequest",
    "RegisterWorker",
    "block_groups",
    "decode_frames",
    "encode_frames",
    "is_curve_key",
    "layout_id",
    "region_groups",
]

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


# --------------------------------------------------------------------------- limits
# Every number a peer puts on the side channel is bounded here, once, and checked while the
# frame is decoded (msgspec ``Meta``), before any work: a message beyond them is a FrameError.
# Generous: far beyond any deployment vLLM runs (docs/security.md, "Limits on the side channel").
MAX_TP_SIZE: Final = 1024  #: tensor-parallel ranks (``tp_size``; ranks below it)
MAX_PP_SIZE: Final = 256  #: pipeline-parallel stages
MAX_KV_HEADS: Final = 4096  #: the model's KV heads in all
MAX_GROUPS: Final = 32  #: KV-cache groups (vLLM's hybrid cache); group ids are below it
MAX_REGIONS: Final = 16384  #: regions (layers, or K and V apart) in one layout
MAX_NAME: Final = 128  #: characters in a region name
MAX_ID: Final = 512  #: characters in a transfer id, a data-plane session or a layout id
MAX_REASON: Final = 2048  #: characters in a reason (longer ones are cut when sent)
MAX_BLOCK_IDS: Final = 1 << 20  #: block ids in one pull, all groups together
#: Every limit by name, for docs and tests.
LIMITS: Final = {
    "MAX_TP_SIZE": MAX_TP_SIZE, "MAX_PP_SIZE": MAX_PP_SIZE, "MAX_KV_HEADS": MAX_KV_HEADS,
    "MAX_GROUPS": MAX_GROUPS, "MAX_REGIONS": MAX_REGIONS, "MAX_NAME": MAX_NAME,
    "MAX_ID": MAX_ID, "MAX_REASON": MAX_REASON, "MAX_BLOCK_IDS": MAX_BLOCK_IDS,
}  # fmt: skip
#: The longest frame a peer may send (ZMQ's ``MAXMSGSIZE``: a longer one drops its connection),
#: derived from the limits: a pull with every limit reached, 9 bytes per integer, 4 per character
#: (about 19 MB).
MAX_FRAME_BYTES: Final = (1024 + 3 * (4 * MAX_ID + 5) + MAX_GROUPS * 5 + MAX_BLOCK_IDS * 9
                           + MAX_REGIONS * (1 + 4 * 9 + 9 + 4 * MAX_NAME + 5))  # fmt: skip

_Id = Annotated[str, Meta(max_length=MAX_ID)]
_Reason = Annotated[str, Meta(max_length=MAX_REASON)]
_U64 = Annotated[int, Meta(ge=0)]  # msgpack integers stop at 2**64
_PerRegion = Meta(max_length=MAX_REGIONS)
_BlockId = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]


# --------------------------------------------------------------------------- memory layout


class BlockLayout(msgspec.Struct, frozen=True, array_like=True):
    """One registered KV region: ``num_blocks`` blocks, block ``i`` at ``base + i*stride``.

    ``block_bytes`` bytes of each block are transferred (``block_bytes <= stride``). A vLLM
    engine has one region per layer (or two, for layouts that keep K and V apart).
    """

    base: _U64
    num_blocks: _U64
    block_bytes: _U64
    stride: _U64


class Layout(msgspec.Struct, frozen=True, array_like=True):
    """An engine rank's KV memory: its regions in a fixed order shared by P and D.

    ``names``: one per region (vLLM's layer name, with the part for K and V kept apart), or
    none. With names on both sides, P writes each of its regions into D's region of the same
    name: how a pipeline stage of P, which holds some layers, fills a D that holds them all.
    Without, regions pair by position.

    ``groups``: each region's KV-cache group (vLLM's hybrid KV cache: the layers of one kind
    of attention share block ids, e.g. the sliding-window layers and the full ones), or none:
    every region in group 0. A transfer names its blocks per group (:data:`BlockIds`).
    """

    regions: Annotated[tuple[BlockLayout, ...], _PerRegion]
    names: Annotated[tuple[Annotated[str, Meta(max_length=MAX_NAME)], ...], _PerRegion] = ()
    groups: Annotated[tuple[Annotated[int, Meta(ge=0, lt=MAX_GROUPS)], ...], _PerRegion] = ()

    @property
    def bytes_per_block(self) -> int:
        """Bytes moved per block id, summed over all regions."""
        return sum(r.block_bytes for r in self.regions)


def region_groups(layout: Layout) -> tuple[int, ...]:
    """The KV-cache group of each of ``layout``'s regions (all 0 when it names none)."""
    return layout.groups or (0,) * len(layout.regions)


#: The blocks of one transfer: one tuple of block ids per KV-cache group, in the groups' order
#: (a model with one kind of attention has one group). A group left out, or empty, moves
#: nothing.
BlockIds: TypeAlias = tuple[tuple[int, ...], ...]
#: :data:`BlockIds` as the wire bounds it (the total is checked after decoding).
_Group = Annotated[tuple[_BlockId, ...], Meta(max_length=MAX_BLOCK_IDS)]
_WireBlockIds = Annotated[tuple[_Group, ...], Meta(max_length=MAX_GROUPS)]
#: What the actors' block-taking calls accept: a flat sequence of ids (one group), or one
#: sequence per group.
BlockIdsLike: TypeAlias = Sequence[int] | Sequence[Sequence[int]]


def block_groups(ids: BlockIdsLike) -> BlockIds:
    """``ids`` as :data:`BlockIds`: a flat sequence of ids is the one group's; a sequence of
    sequences is one per group. Raises :class:`~pdactors.errors.BadBlockIds` (a ``TypeError``)
    for anything else."""
    if not ids:
        return ()
    first = ids[0]
    if isinstance(first, int):
        if not all(isinstance(i, int) for i in ids):
            raise BadBlockIds("block ids mix integers and lists")
        return (tuple(ids),)  # type: ignore[arg-type]
    if isinstance(first, str | bytes) or not isinstance(first, Sequence):
        raise BadBlockIds(f"block ids must be integers or lists of them, not {type(first)!r}")
    return tuple(tuple(group) for group in ids)  # type: ignore[arg-type]


def layout_id(session: str, layout: Layout) -> str:
    """A short, stable id for ``layout`` at data-plane ``session`` (sent instead of the layout)."""
    digest = hashlib.blake2b(session.encode() + msgspec.msgpack.encode(layout), digest_size=12)
    return digest.hexdigest()


# --------------------------------------------------------------------------- side channel


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
    another shape, with ``lookup_again`` set.
    """

    transfer_id: _Id
    session: _Id
    tp_rank: Annotated[int, Meta(ge=0, lt=MAX_TP_SIZE)]
    tp_size: Annotated[int, Meta(ge=1, le=MAX_TP_SIZE)]
    pp_rank: Annotated[int, Meta(ge=0, lt=MAX_PP_SIZE)]
    pp_size: Annotated[int, Meta(ge=1, le=MAX_PP_SIZE)]
    block_ids: _WireBlockIds
    layout_id: _Id
    layout: Layout | None = None
    kv_heads: Annotated[int, Meta(ge=0, le=MAX_KV_HEADS)] = 0
    p_tp_size: Annotated[int, Meta(ge=0, le=MAX_TP_SIZE)] = 0
    p_pp_size: Annotated[int, Meta(ge=0, le=MAX_PP_SIZE)] = 0


class CancelPull(_Msg, frozen=True, tag="cancel"):
    """D → P: D gave up on ``transfer_id`` (aborted or timed out); P may free its blocks."""

    transfer_id: _Id
    reason: _Reason = ""


class PullDone(_Msg, frozen=True, tag="done"):
    """P → D: every block of ``transfer_id`` has landed in D's memory."""

    transfer_id: _Id
    nbytes: _U64 = 0
    descriptors: _U64 = 0


class PullFailed(_Msg, frozen=True, tag="failed"):
    """P → D: ``transfer_id`` will not be delivered; ``reason`` says why. ``lookup_again``: D's
    view of P (from the bootstrap) is stale or partial; D should look P up again."""

    transfer_id: _Id
    reason: _Reason
    lookup_again: bool = False


class LayoutUnknown(_Msg, frozen=True, tag="layout?"):
    """P → D: resend the pull for ``transfer_id`` with the full layout."""

    transfer_id: _Id
    layout_id: _Id


class ErrorReply(_Msg, frozen=True, tag="error"):
    """Either way: the frame you sent could not be decoded; ``reason`` says why.
    ``transfer_id``: the transfer it was about, when that could be read ("" otherwise)."""

    reason: _Reason
    transfer_id: _Id = ""


Msg = PullRequest | CancelPull | PullDone | PullFailed | LayoutUnknown | ErrorReply


class _Head(msgspec.Struct, array_like=True):  # what an undecodable message may still tell
    t: Annotated[str, Meta(max_length=16)]
    transfer_id: _Id = ""


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


# --------------------------------------------------------------------------- bootstrap (JSON)


_Z85 = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)


def is_curve_key(key: str) -> bool:
    """``key`` has the form of a CURVE key in Z85 text (40 characters of its alphabet)."""
    return len(key) == 40 and _Z85.issuperset(key)


class RegisterWorker(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /register`` body: one worker's side-channel address (upstream's shape).

    ``curve_key`` (ours; left out of the JSON when empty, and ignored by upstream's bootstrap)
    is the worker's CURVE public key, which D checks against the keys it trusts.
    """

    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    addr: str
    curve_key: str = ""

    def __post_init__(self) -> None:
        if min(self.dp_rank, self.tp_rank, self.pp_rank) < 0:
            raise BadMessage("ranks must be >= 0")
        if not self.engine_id:
            raise BadMessage("engine_id must not be empty")
        if not self.addr.startswith("tcp://"):
            raise BadMessage("addr must be a tcp:// address")
        if self.curve_key and not is_curve_key(self.curve_key):
            raise BadMessage("curve_key must be a CURVE public key: 40 characters of Z85 text")


class BootstrapEntry(msgspec.Struct, omit_defaults=True):
    """One DP rank of the ``GET /query`` answer: ``{"engine_id", "worker_addr": {tp: {pp: addr}}}``.

    The whole answer is ``dict[int, BootstrapEntry]`` keyed by DP rank (JSON object keys are
    strings on the wire; msgspec converts them). ``curve_keys`` (ours, ``{tp: {pp: key}}``,
    present only when a worker registered a key) are the workers' CURVE public keys.
    """

    engine_id: str
    worker_addr: dict[int, dict[int, str]]
    curve_keys: dict[int, dict[int, str]] = msgspec.field(default_factory=dict)


BootstrapAnswer = dict[int, BootstrapEntry]


# --------------------------------------------------------------------------- kv_transfer_params


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """The per-request ``kv_transfer_params``, as upstream's MooncakeConnector and the routers
    built for it (its example proxy, vllm-router, llm-d) write them: the one definition of
    those keys, for the proxy and for the vLLM adapter's scheduler side.

    P's request carries ``do_remote_decode=True`` and a ``transfer_id``; D's request carries
    ``do_remote_prefill=True``, ``remote_engine_id``, ``remote_bootstrap_addr`` and the same
    ``transfer_id``; P's answer (for routers that call P first) carries all five, with
    ``do_remote_decode=False``. A key left unset (None) is not written; unknown keys are
    ignored on reading, so other tools can add their own.

    ``first_token_from_p`` (ours; `pdactors proxy` sends it): the client's first token is P's
    answer, and D continues after it. On P: the whole prompt is computed (a model with
    recurrent state holds no token back) and a request that stops at that token (EOS, a stop
    string) frees its KV at once, as no D will pull it. On D: the prompt's last token is P's
    token, so D pulls the KV of the tokens before it and computes that one itself.
    """

    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    remote_engine_id: str | None = None
    remote_bootstrap_addr: str | None = None
    transfer_id: str | None = None
    first_token_from_p: bool | None = None

    @classmethod
    def from_dict(cls, params: dict[str, object]) -> KVTransferParams:
        """Read a request's ``kv_transfer_params``. Raises :class:`BadTransferParams` naming
        the key whose value has the wrong type."""
        try:
            return msgspec.convert(params, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise BadTransferParams(f"kv_transfer_params {params!r}: {exc}") from None

    def to_dict(self) -> dict[str, object]:
        """The JSON object the wire carries (keys left unset are not written)."""
        out: dict[str, object] = msgspec.to_builtins(self)
        return out

    @property
    def remote_complete(self) -> bool:
        """Whether D's params name everything a pull needs."""
        return bool(self.remote_engine_id and self.remote_bootstrap_addr and self.transfer_id)
