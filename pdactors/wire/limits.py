"""The wire's limits: every number a peer puts on the side channel is bounded here, once, and
checked while the frame is decoded (msgspec ``Meta``), before any work; a message beyond them is a
:class:`~pdactors.wire.FrameError`. Also the constrained types the wire's Structs are made of."""

from __future__ import annotations

from typing import Annotated, Final

from msgspec import Meta

__all__ = [
    "LIMITS",
    "MAX_BLOCK_IDS",
    "MAX_BLOCK_SIZE",
    "MAX_COMPAT_FIELD",
    "MAX_FRAME_BYTES",
    "MAX_GROUPS",
    "MAX_ID",
    "MAX_KV_HEADS",
    "MAX_NAME",
    "MAX_PP_SIZE",
    "MAX_REASON",
    "MAX_REGIONS",
    "MAX_SUM_BYTES",
    "MAX_SUM_RUNS",
    "MAX_TP_SIZE",
    "U64",
    "BlockId",
    "Epoch",
    "Id",
    "PerRegion",
    "Reason",
]  # fmt: skip

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
MAX_COMPAT_FIELD: Final = 256  #: characters in a field of a compatibility description
MAX_BLOCK_SIZE: Final = 1 << 20  #: tokens per KV block, as a compatibility description says
#: checksummed runs in one ``PullDone`` (24 bytes each: 3 MiB at most); a transfer of more runs
#: goes without checksums (docs/architecture.md, "KV checksums")
MAX_SUM_RUNS: Final = 1 << 17
#: Every limit by name, for docs and tests.
LIMITS: Final = {
    "MAX_TP_SIZE": MAX_TP_SIZE, "MAX_PP_SIZE": MAX_PP_SIZE, "MAX_KV_HEADS": MAX_KV_HEADS,
    "MAX_GROUPS": MAX_GROUPS, "MAX_REGIONS": MAX_REGIONS, "MAX_NAME": MAX_NAME,
    "MAX_ID": MAX_ID, "MAX_REASON": MAX_REASON, "MAX_BLOCK_IDS": MAX_BLOCK_IDS,
    "MAX_COMPAT_FIELD": MAX_COMPAT_FIELD, "MAX_BLOCK_SIZE": MAX_BLOCK_SIZE,
    "MAX_SUM_RUNS": MAX_SUM_RUNS,
}  # fmt: skip
#: The longest frame a peer may send (ZMQ's ``MAXMSGSIZE``: a longer one drops its connection),
#: derived from the limits: a pull with every limit reached, 9 bytes per integer, 4 per character
#: (about 19 MB), its compatibility description included (7 named fields); a ``PullDone`` with
#: every checksum is about 3 MB.
MAX_FRAME_BYTES: Final = (1024 + 3 * (4 * MAX_ID + 5) + MAX_GROUPS * 5 + MAX_BLOCK_IDS * 9
                           + MAX_REGIONS * (1 + 4 * 9 + 9 + 4 * MAX_NAME + 5)
                           + 7 * (16 + 4 * MAX_COMPAT_FIELD + 5))  # fmt: skip
#: The longest ``PullDone.sums``: a header and ``MAX_SUM_RUNS`` triples.
MAX_SUM_BYTES: Final = 8 + 24 * MAX_SUM_RUNS

Id = Annotated[str, Meta(max_length=MAX_ID)]
Reason = Annotated[str, Meta(max_length=MAX_REASON)]
U64 = Annotated[int, Meta(ge=0)]  # msgpack integers stop at 2**64
PerRegion = Meta(max_length=MAX_REGIONS)
BlockId = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
#: An engine incarnation's epoch: a random 63-bit number, compared for equality only (0: not said).
Epoch = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
