"""The bootstrap's registrations: which engine, at which dp/tp/pp rank, listens where.

Pure bookkeeping (no IO, no clock: every method takes the time from its caller); the HTTP
face that serves it is :mod:`pdactors.actors.bootstrap`.

The registry is bounded: at most ``max_workers`` registrations (one more raises
:class:`RegistryFull`), each field within :data:`MAX_ENGINE_ID_CHARS`, :data:`MAX_ADDR_CHARS`
and :data:`MAX_RANK`, so its memory and its ``/query`` answer stay within a few MB whatever
clients send. Registrations with a lease lapse unless renewed; :meth:`BootstrapRegistry.next_expiry`
says when the next one does, so that the server sleeps until then rather than polling.

A live lease is the holder's: a registration that would move a leased rank elsewhere (or give
its DP rank to another engine id) is refused with :class:`~pdactors.errors.RankHeld` (409)
unless it names the holder's epoch in ``replaces``; see :class:`BootstrapRegistry`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Final, Literal

from pdactors.errors import PdError, RankHeld
from pdactors.wire import BootstrapAnswer, BootstrapEntry, Compat, RegisterWorker

__all__ = [
    "MAX_ADDR_CHARS",
    "MAX_ENGINE_ID_CHARS",
    "MAX_RANK",
    "BadRegistration",
    "BootstrapRegistry",
    "RankHeld",
    "Registration",
    "RegistryFull",
]

# Limits on one registration, far above real values (a field beyond them: 400). With the
# number of registrations (BootstrapConfig.max_workers) they bound the registry's memory and
# its /query answer (4,096 workers: under 4 MB).
#: The longest engine id, in characters (vLLM's are UUIDs, 36).
MAX_ENGINE_ID_CHARS: Final = 256
#: The longest side-channel address, in characters (``tcp://`` and a DNS name and port fit).
MAX_ADDR_CHARS: Final = 512
#: The highest DP, TP or PP rank.
MAX_RANK: Final = 65535
#: What a registration changed, as :meth:`BootstrapRegistry.register` reports it.
Registration = Literal["added", "moved", "restarted", "unchanged", "engine_replaced"]


# --------------------------------------------------------------------------- registry (pure)


class BadRegistration(PdError, ValueError):
    """A registration with a field beyond its limit (answered 400)."""


class RegistryFull(PdError):
    """The registry holds its maximum number of workers; a new one must wait for a lease to
    lapse (answered 429)."""


def _check_fields(worker: RegisterWorker) -> None:
    """Raises :class:`BadRegistration` naming the first field beyond its limit."""
    if len(worker.engine_id) > MAX_ENGINE_ID_CHARS:
        raise BadRegistration(f"engine_id is longer than {MAX_ENGINE_ID_CHARS} characters")
    if len(worker.addr) > MAX_ADDR_CHARS:
        raise BadRegistration(f"addr is longer than {MAX_ADDR_CHARS} characters")
    if max(worker.dp_rank, worker.tp_rank, worker.pp_rank) > MAX_RANK:
        raise BadRegistration(f"ranks must be at most {MAX_RANK}")


@dataclass
class _DpRank:
    engine_id: str
    addrs: dict[tuple[int, int], str] = field(default_factory=dict)  # (tp, pp) -> addr
    expires: dict[tuple[int, int], float] = field(default_factory=dict)  # (tp, pp) -> when
    keys: dict[tuple[int, int], str] = field(default_factory=dict)  # (tp, pp) -> CURVE key
    compats: dict[tuple[int, int], Compat] = field(default_factory=dict)  # (tp, pp) -> its own
    epochs: dict[tuple[int, int], int] = field(default_factory=dict)  # (tp, pp) -> epoch


class BootstrapRegistry:
    """The registered workers, keyed by DP rank, then TP rank, then PP rank.

    Rules:

    * One engine id per DP rank. A different engine id registering on a DP rank that is
      already known replaces that rank's whole entry (the engine restarted with a new id;
      the old engine's workers are gone).
    * Registering a (dp, tp, pp) rank that is already known under the same engine id replaces
      its address and CURVE key (the worker restarted on a new port, or with a new key).
    * A registration with a ``lease`` lapses ``lease`` seconds after it was last renewed; one
      without never lapses. A DP rank whose every worker lapsed is gone.
    * A live lease is its holder's. A registration that would move a leased (dp, tp, pp) rank
      to another address, or give its DP rank (with any leased worker) to another engine id,
      is refused (:class:`~pdactors.errors.RankHeld`, HTTP 409) unless its ``replaces`` is the
      holder's (nonzero) epoch: the same process's next sender knows its predecessor's; a
      stranger or a misconfigured engine does not. Once the lease lapses, anyone may take the
      rank. The holder's address with another epoch is accepted (a restart on the same port),
      and so is the holder's own renewal. A rank held without a lease (upstream's P, tools
      that register once) is replaced as before: the rules above are for leases.
    * At most ``max_workers`` workers, each with fields within the module's limits.

    No IO and no checkpoints; every method is synchronous and takes the time from its caller.
    """

    def __init__(self, max_workers: int = 4096) -> None:
        self._ranks: dict[int, _DpRank] = {}
        self._max_workers = max_workers
        self._workers = 0  # registrations held, in all ranks
        #: (expires, dp, tp, pp) of every leased registration, earliest first. A renewal
        #: pushes a new entry and leaves the old one behind: an entry whose time is no longer
        #: its worker's is stale and dropped when it reaches the head.
        self._leases: list[tuple[float, int, int, int]] = []

    def __len__(self) -> int:
        """The number of workers registered (lapsed leases included until expired)."""
        return self._workers

    def register(
        self, worker: RegisterWorker, now: float = 0.0, lease: float | None = None
    ) -> Registration:
        """Record ``worker``'s address (until ``now + lease``, or for good) and say what changed.

        Returns ``"added"`` for a new rank, ``"moved"`` for a known rank at a new address (or
        with a new key), ``"restarted"`` for the same address with a new epoch,
        ``"unchanged"`` for a repeat (a renewal), ``"engine_replaced"`` when a new engine id
        took over the DP rank.

        Raises :class:`BadRegistration` (a :class:`ValueError`) for a field beyond its limit,
        :class:`~pdactors.errors.RankHeld` when a live lease holds what it would take, and
        :class:`RegistryFull` when the worker is new and the registry holds
        ``max_workers`` (a registration that replaces a DP rank's engine frees that rank's
        workers first); nothing changes then.
        """
        _check_fields(worker)
        self.expire(now)
        key = (worker.tp_rank, worker.pp_rank)
        expires = float("inf") if lease is None else now + lease
        rank = self._ranks.get(worker.dp_rank)
        replaced = rank is not None and rank.engine_id != worker.engine_id
        if rank is not None:
            self._check_held(worker, rank, key, replaced, now)
        freed = len(rank.addrs) if rank is not None and replaced else 0
        new_worker = rank is None or replaced or key not in rank.addrs
        if new_worker and self._workers - freed >= self._max_workers:
            raise RegistryFull(
                f"the registry holds its maximum of {self._max_workers} workers; "
                "a new one is taken once a lease lapses"
            )
        if rank is None or replaced:
            new = _DpRank(worker.engine_id)
            self._ranks[worker.dp_rank] = new
            self._record(worker.dp_rank, new, key, worker, expires)
            self._workers += 1 - freed
            return "added" if rank is None else "engine_replaced"
        old = (rank.addrs.get(key), rank.keys.get(key, ""))
        old_epoch = rank.epochs.get(key, 0)
        self._record(worker.dp_rank, rank, key, worker, expires)
        if old[0] is None:
            self._workers += 1
            return "added"
        if old != (worker.addr, worker.curve_key):
            return "moved"
        return "unchanged" if old_epoch == worker.epoch else "restarted"

    def _check_held(
        self,
        worker: RegisterWorker,
        rank: _DpRank,
        key: tuple[int, int],
        replaced: bool,
        now: float,
    ) -> None:
        """Raise :class:`~pdactors.errors.RankHeld` if a live lease holds what ``worker``
        would take: its rank at another address, or (``replaced``: a new engine id) any
        leased worker of its DP rank. Only the holder at ``key`` can be displaced, by naming
        its epoch in ``replaces``. Leases lapsed by ``now`` were expired before."""
        held = [k for k, t in rank.expires.items() if t != float("inf")]
        if not replaced:
            if key not in held or rank.addrs[key] == worker.addr:
                return
            held = [key]
        for k in held:
            if k == key and worker.replaces and rank.epochs.get(k) == worker.replaces:
                continue  # the same process's next sender displaces its predecessor
            tp, pp = k
            raise RankHeld(
                f"dp={worker.dp_rank} tp={tp} pp={pp} of engine {rank.engine_id!r} is held by "
                f"{rank.addrs[k]!r}, whose lease is live for {rank.expires[k] - now:.3g} s more; "
                "it can be taken once that lease lapses"
            )

    def expire(self, now: float) -> list[str]:
        """Forget the workers whose lease lapsed by ``now``; returns them, described. Costs
        what it ends (a heap pop per lapsed or renewed lease), not what the registry holds."""
        gone: list[str] = []
        while self._leases and self._leases[0][0] <= now:
            expires, dp, tp, pp = heapq.heappop(self._leases)
            rank = self._ranks.get(dp)
            if rank is None or rank.expires.get((tp, pp)) != expires:
                continue  # stale: renewed, replaced or already gone
            addr = rank.addrs.pop((tp, pp))
            del rank.expires[tp, pp]
            rank.keys.pop((tp, pp), None)
            rank.compats.pop((tp, pp), None)
            rank.epochs.pop((tp, pp), None)
            self._workers -= 1
            gone.append(f"{rank.engine_id!r} dp={dp} tp={tp} pp={pp} at {addr!r}")
            if not rank.addrs:
                del self._ranks[dp]
        return gone

    def next_expiry(self) -> float | None:
        """When the next lease lapses (None: no lease held), for a caller that sleeps until
        then. Drops the stale entries at the head first, so a renewed lease's old time is
        never returned."""
        while self._leases:
            expires, dp, tp, pp = self._leases[0]
            rank = self._ranks.get(dp)
            if rank is not None and rank.expires.get((tp, pp)) == expires:
                return expires
            heapq.heappop(self._leases)
        return None

    def answer(self, now: float = 0.0) -> BootstrapAnswer:
        """A fresh copy of the live registrations in upstream's ``GET /query`` shape, ranks in
        order."""
        self.expire(now)
        answer: BootstrapAnswer = {}
        for dp in sorted(self._ranks):
            rank = self._ranks[dp]
            worker_addr: dict[int, dict[int, str]] = {}
            curve_keys: dict[int, dict[int, str]] = {}
            compats: dict[int, dict[int, Compat]] = {}
            epochs: dict[int, dict[int, int]] = {}
            for tp, pp in sorted(rank.addrs):
                worker_addr.setdefault(tp, {})[pp] = rank.addrs[tp, pp]
                if key := rank.keys.get((tp, pp)):
                    curve_keys.setdefault(tp, {})[pp] = key
                if (compat := rank.compats.get((tp, pp))) is not None:
                    compats.setdefault(tp, {})[pp] = compat
                if epoch := rank.epochs.get((tp, pp)):
                    epochs.setdefault(tp, {})[pp] = epoch
            answer[dp] = BootstrapEntry(rank.engine_id, worker_addr, curve_keys, compats, epochs)
        return answer

    def _record(
        self,
        dp: int,
        rank: _DpRank,
        key: tuple[int, int],
        worker: RegisterWorker,
        expires: float,
    ) -> None:
        rank.addrs[key] = worker.addr
        rank.expires[key] = expires
        if expires != float("inf"):
            heapq.heappush(self._leases, (expires, dp, *key))
        if worker.curve_key:
            rank.keys[key] = worker.curve_key
        else:
            rank.keys.pop(key, None)
        if worker.compat is not None:
            rank.compats[key] = worker.compat
        else:
            rank.compats.pop(key, None)
        if worker.epoch:
            rank.epochs[key] = worker.epoch
        else:
            rank.epochs.pop(key, None)
