"""The :class:`DataPlane` protocol: what the actors need from a transfer engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["DataPlane"]

Addrs = npt.NDArray[np.uint64]


class DataPlane(Protocol):
    """A transfer engine as the actors use it.

    ``session`` is the name other engines write to (``"host:port"`` for Mooncake).
    """

    @property
    def session(self) -> str: ...

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Register ``(address, length)`` regions for transfers; overlapping or repeated
        regions (views of one storage) are registered once. Raises DataPlaneError."""

    async def write(
        self,
        peer: str,
        src: Addrs,
        dst: Addrs,
        lengths: Addrs,
        *,
        before: Callable[[], object] | None = None,
        after: Callable[[], object] | None = None,
    ) -> None:
        """Write ``lengths[i]`` bytes from local ``src[i]`` to ``peer``'s ``dst[i]``.

        Checkpoint. Runs in a worker thread; splits into chunks below the engine's per-peer
        descriptor limit. ``before`` (blocking) runs in that thread right before the first
        engine call: a wait for the KV to be complete, e.g. a CUDA event's ``synchronize``.
        ``after`` runs in a worker thread right after the write's last bytes landed, once,
        and only when every byte did (never for a failed or cancelled write); what it raises
        is logged and swallowed (e.g. D's fast completion notice, issue 28). Raises
        TransferError (naming peer and byte count) on failure, DataPlaneError when ``before``
        raised.
        """
