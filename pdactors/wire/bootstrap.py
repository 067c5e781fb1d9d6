"""The bootstrap's JSON bodies, in the shapes of upstream vLLM's Mooncake bootstrap server, so
upstream proxies and tools can talk to ours (``POST /register``, ``GET /query``)."""

from __future__ import annotations

import msgspec

from pdactors.errors import BadMessage
from pdactors.wire.compat import Compat
from pdactors.wire.limits import Epoch

__all__ = ["BootstrapAnswer", "BootstrapEntry", "RegisterWorker", "is_curve_key"]


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
    ``compat`` (ours; left out when None) is the worker's description of what a D must match
    (:class:`~pdactors.wire.Compat`), which D checks before it pulls.
    ``epoch`` (ours; left out when 0) is the registering sender's incarnation (a random
    number, new at every start); ``replaces`` (ours; left out when 0) the epoch of the
    registration this one may displace although its lease is live (the same process's
    previous sender). See :class:`~pdactors.core.registry.BootstrapRegistry` for the rules.
    """

    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    addr: str
    curve_key: str = ""
    compat: Compat | None = None
    epoch: Epoch = 0
    replaces: Epoch = 0

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
    present only when a worker registered a key) are the workers' CURVE public keys;
    ``compats`` (ours, ``{tp: {pp: Compat}}``, present only when a worker registered one) their
    compatibility descriptions; ``epochs`` (ours, ``{tp: {pp: epoch}}``, present only when a
    worker registered one) their incarnations, which D sends back with each pull.
    """

    engine_id: str
    worker_addr: dict[int, dict[int, str]]
    curve_keys: dict[int, dict[int, str]] = msgspec.field(default_factory=dict)
    compats: dict[int, dict[int, Compat]] = msgspec.field(default_factory=dict)
    epochs: dict[int, dict[int, Epoch]] = msgspec.field(default_factory=dict)


BootstrapAnswer = dict[int, BootstrapEntry]
