"""The receiver's bootstrap look-ups: a cache of ``GET /query`` answers per bootstrap URL, and
which of P's workers a D rank pulls from.

One query in flight per bootstrap; tasks queued behind a query that fails share its failure
instead of asking again (each gets an exception of its own, chained to the query's); an answer
is dropped when a pull finds P moved or gone. What is kept per bootstrap to queue tasks lives
only while some task asks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from pdactors.bootstrap_client import BootstrapClient
from pdactors.config import RankInfo
from pdactors.core.tp import tp_pulls
from pdactors.errors import BootstrapError
from pdactors.wire import BootstrapAnswer, BootstrapEntry, Compat

__all__ = ["Lookups"]


@dataclass(slots=True)
class _Asking:
    """The tasks asking one bootstrap now: one query at a time, and the last one's failure."""

    lock: trio.Lock = field(default_factory=trio.Lock)
    tasks: int = 0
    failed_at: float = float("-inf")
    failure: BootstrapError | None = None


class Lookups:
    """Where each engine's workers listen, as the bootstraps last said."""

    def __init__(self, client: BootstrapClient, timeout: float) -> None:
        self._client = client
        self._timeout = timeout
        self._answers: dict[str, BootstrapAnswer] = {}
        self._asking: dict[str, _Asking] = {}  # url -> its askers, while there are some

    async def resolve(self, url: str, engine_id: str) -> BootstrapEntry:
        """``engine_id``'s registration: its workers' side-channel addresses, ``worker_addr``
        ``{tp_rank: {pp_rank: address}}`` (P's TP size is how many TP ranks there are, as
        upstream reads it), and their CURVE keys. Checkpoint.

        Raises :class:`BootstrapError` when the bootstrap cannot be reached (at once when it
        refuses the connection), does not answer within the timeout, or does not know the
        engine.
        """
        entry = self._find(url, engine_id)
        if entry is not None:
            return entry
        asked = trio.current_time()
        asking = self._asking.setdefault(url, _Asking())
        asking.tasks += 1
        try:
            await self._query(url, engine_id, asked, asking)
        finally:
            asking.tasks -= 1
            if not asking.tasks:  # the last asker: nobody is queued behind a failure any more
                del self._asking[url]
        entry = self._find(url, engine_id)
        if entry is None:
            raise BootstrapError(f"engine {engine_id!r} is not registered at {url}")
        return entry

    async def _query(self, url: str, engine_id: str, asked: float, asking: _Asking) -> None:
        """Ask ``url`` unless another task just did; raises what that query raised."""
        async with asking.lock:  # one query in flight per bootstrap
            if self._find(url, engine_id) is not None:  # another task may have just asked
                return
            if asking.failure is not None and asking.failed_at >= asked:
                # The query we queued behind just failed: no second one. Each waiter raises an
                # exception of its own (a shared instance would share one traceback).
                raise BootstrapError(str(asking.failure)) from asking.failure
            try:
                with trio.move_on_after(self._timeout) as scope:
                    answer = await self._client.query(url, timeout=self._timeout, retry=False)
                if scope.cancelled_caught:
                    what = f"no answer from the bootstrap at {url} in {self._timeout:g} s"
                    raise BootstrapError(what)
            except BootstrapError as exc:
                asking.failed_at, asking.failure = trio.current_time(), exc
                raise
            asking.failure = None
            self._answers[url] = answer

    async def p_workers(
        self, url: str, engine_id: str, ranks: RankInfo, kv_heads: int
    ) -> tuple[int, int, list[tuple[str, str, Compat | None, int]]]:
        """P's TP and PP sizes (as registered) and the side-channel addresses, CURVE keys,
        compatibility descriptions and epochs (0: not registered) of the P workers D rank
        ``ranks`` pulls from. Checkpoint. Raises
        :class:`~pdactors.errors.PdError` when P's registration does not have them (asked
        twice: a cached answer may predate a P worker's registration)."""
        for fresh in (False, True):
            if fresh:
                self.forget(url)
            entry = await self.resolve(url, engine_id)
            workers = entry.worker_addr
            p_tp = len(workers)
            sources = tp_pulls(ranks.tp_rank, ranks.tp_size, p_tp, kv_heads)
            wanted = [(tp, pp) for tp in sources for pp in _stages(ranks, workers.get(tp, {}))]
            addresses = [workers.get(tp, {}).get(pp) for tp, pp in wanted]
            if None not in addresses:
                found = [a for a in addresses if a is not None]
                if len(set(found)) != len(found):
                    raise BootstrapError(f"engine {engine_id!r} at {url}: two workers share "
                                         f"one address ({found})")  # fmt: skip
                keys = [entry.curve_keys.get(tp, {}).get(pp, "") for tp, pp in wanted]
                compats = [entry.compats.get(tp, {}).get(pp) for tp, pp in wanted]
                epochs = [entry.epochs.get(tp, {}).get(pp, 0) for tp, pp in wanted]
                p_pp = max(len(by_pp) for by_pp in workers.values())
                return p_tp, p_pp, list(zip(found, keys, compats, epochs, strict=True))
        tp, pp = next(w for w, a in zip(wanted, addresses, strict=True) if a is None)
        raise BootstrapError(
            f"engine {engine_id!r} at {url} has no worker registered for tp rank {tp} "
            f"pp rank {pp} (registered: "
            f"{ {tp: sorted(pps) for tp, pps in sorted(workers.items())} })"
        )

    def forget(self, url: str) -> None:
        """Ask ``url`` again next time."""
        self._answers.pop(url, None)

    def forget_address(self, address: str) -> None:
        """Drop cached answers that point at ``address`` (P moved or died)."""
        for url, answer in list(self._answers.items()):
            by_tp = (e.worker_addr.values() for e in answer.values())
            if any(address in by_pp.values() for tps in by_tp for by_pp in tps):
                del self._answers[url]

    def _find(self, url: str, engine_id: str) -> BootstrapEntry | None:
        answer = self._answers.get(url)
        if answer is None:
            return None
        for entry in answer.values():
            if entry.engine_id == engine_id and entry.worker_addr:
                return entry
        return None


def _stages(ranks: RankInfo, by_pp: dict[int, str]) -> list[int]:
    """The P pipeline stages to pull from: the same stage when P has as many as D, else every
    stage (P PP 2 -> D PP 1: each stage writes its layers, matched by name). A TP rank with no
    stage registered: D's own stage, which is then reported missing."""
    if len(by_pp) in (0, ranks.pp_size):
        return [ranks.pp_rank]
    return sorted(by_pp)
