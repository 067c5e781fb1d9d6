"""The D layouts a sender remembers, so that D sends each one once per connection.

Bounded in entries and in bytes (a layout's size is estimated from its regions and names:
the largest the wire allows is several MB), least recently used first out; a layout is
forgotten too when the peer that sent it is gone (D sends it again on its next connection).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from pdactors.core.plan import check_layout
from pdactors.errors import PlanError
from pdactors.wire import Layout, LayoutUnknown, PullFailed, PullRequest

__all__ = ["LayoutCache", "layout_bytes"]


def layout_bytes(layout: Layout) -> int:
    """About what ``layout`` holds in memory (Python objects: ~250 bytes a region, a name's
    characters plus ~60)."""
    return 256 + 250 * len(layout.regions) + sum(60 + len(n) for n in layout.names)


class LayoutCache:
    """Layouts by layout id, each with the peer that sent it last."""

    def __init__(self, *, max_entries: int = 1024, max_bytes: int = 64 << 20) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._layouts: OrderedDict[str, tuple[Layout, int, bytes]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._layouts)

    def get(self, layout_id: str) -> Layout | None:
        entry = self._layouts.get(layout_id)
        if entry is None:
            return None
        self._layouts.move_to_end(layout_id)
        return entry[0]

    def put(self, layout_id: str, layout: Layout, peer: bytes) -> None:
        self._drop(layout_id)
        cost = layout_bytes(layout)
        self._layouts[layout_id] = (layout, cost, peer)
        self.nbytes += cost
        while self._layouts and (
            len(self._layouts) > self.max_entries or self.nbytes > self.max_bytes
        ):
            self._drop(next(iter(self._layouts)))

    def attach(self, pull: PullRequest, peer: bytes) -> PullRequest | PullFailed | LayoutUnknown:
        """``pull`` with its layout: the one it carries (checked, then remembered as ``peer``'s)
        or the one remembered under its ``layout_id``; else the answer to send ``peer``. The
        pull keeps its layout: an eviction before the write cannot fail it."""
        tid = pull.transfer_id
        if pull.layout is not None:
            try:
                check_layout(pull.layout)
            except PlanError as exc:
                return PullFailed(tid, f"bad layout: {exc}")
            self.put(pull.layout_id, pull.layout, peer)
            return pull
        known = self.get(pull.layout_id)
        if known is None:
            return LayoutUnknown(tid, pull.layout_id)
        return msgspec.structs.replace(pull, layout=known)

    def forget_peer(self, peer: bytes) -> None:
        """``peer`` is gone: forget the layouts it sent."""
        for layout_id in [k for k, (_, _, p) in self._layouts.items() if p == peer]:
            self._drop(layout_id)

    def _drop(self, layout_id: str) -> None:
        entry = self._layouts.pop(layout_id, None)
        if entry is not None:
            self.nbytes -= entry[1]
