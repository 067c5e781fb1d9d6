"""Which engine continues a request whose decoding engine failed (a migration): another D in
rotation, else a P. Whether a failed leg is asked again or migrated at all is the exchange
record's (:func:`pdactors.core.exchange_next.after_failure`);
:class:`~pdactors.proxy._answer.Answers` asks this module for the engine. Not a checkpoint, no
IO: it reads the pools' rotation.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from pdactors.proxy._health import HealthWatch
from pdactors.proxy._state import Backend

__all__ = ["successor"]


def successor(
    watch: HealthWatch,
    failed: Backend,
    *,
    fall_back_to_p: bool,
    tried: AbstractSet[str] = frozenset(),
) -> Backend | None:
    """The engine that continues a request ``failed`` was decoding: another D in rotation,
    else (``fall_back_to_p``) a P in rotation that answers with the same model; never one of
    ``tried`` (the URLs of engines that failed this request already)."""
    d, _ = watch.decode.route((), lambda b: b is not failed and b.url not in tried)
    if d is not None or not fall_back_to_p:
        return d
    pairs = watch.pairs

    def usable(b: Backend) -> bool:
        if b is failed or b.url in tried:
            return False
        return failed.role != "decode" or pairs.refusal(b, failed) is None

    p, _ = watch.prefill.route((), usable)
    return p
