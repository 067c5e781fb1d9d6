"""Whether a D's pull is this P worker's to answer, and with which heads: checked when the
pull arrives, before the sender's table sees it (a refusal is that pull's :class:`PlanError`).

The numbers it reads are already within :data:`~pdactors.wire.LIMITS` (the frame would
not have decoded otherwise), and the TP arithmetic is closed-form, so this costs microseconds
whatever the pull says.
"""

from __future__ import annotations

from pdactors.config import SenderConfig
from pdactors.core.plan import HeadSlice, tp_expected, tp_pulls
from pdactors.errors import PlanError
from pdactors.wire import PullRequest

__all__ = ["StaleView", "expected_pulls", "pull_heads"]


class StaleView(PlanError):
    """D planned a pull for another shape of P than this one (a partial bootstrap answer)."""


def _kv_heads(config: SenderConfig, pull: PullRequest) -> int:
    mine = config.kv_heads
    if mine and pull.kv_heads and mine != pull.kv_heads:
        raise PlanError(f"D's model has {pull.kv_heads} KV heads, P's {mine}")
    return mine or pull.kv_heads


def pull_heads(config: SenderConfig, pull: PullRequest) -> tuple[HeadSlice, ...]:
    """The heads of each block this P worker writes for ``pull`` (none: D's shape only needs
    it to hear the pull, to free its blocks). Raises :class:`PlanError` when the pull is not
    this worker's to answer (:class:`StaleView` when D planned for another shape of P)."""
    ranks = config.ranks
    if (pull.p_tp_size and pull.p_tp_size != ranks.tp_size) or (
        pull.p_pp_size and pull.p_pp_size != ranks.pp_size
    ):
        raise StaleView(
            f"D planned for a P with tp_size {pull.p_tp_size}, pp_size {pull.p_pp_size}; "
            f"this P has {ranks.tp_size}, {ranks.pp_size} (was the bootstrap's answer "
            "incomplete?)"
        )
    pulls = tp_pulls(pull.tp_rank, pull.tp_size, ranks.tp_size, _kv_heads(config, pull))
    # Equal PP sizes pair stage with stage; otherwise D pulls from every stage of P.
    other_stage = pull.pp_size == ranks.pp_size and pull.pp_rank != ranks.pp_rank
    if ranks.tp_rank not in pulls or other_stage:
        raise PlanError(
            f"pull for tp {pull.tp_rank}/{pull.tp_size}, pp {pull.pp_rank} reached P worker "
            f"{ranks}, which does not serve it"
        )
    return pulls[ranks.tp_rank]


def expected_pulls(config: SenderConfig, pull: PullRequest) -> int:
    """How many D workers pull each transfer from this P worker (D's shape says)."""
    ranks = config.ranks
    return tp_expected(ranks.tp_rank, pull.tp_size, ranks.tp_size, _kv_heads(config, pull))


#: What one D peer may leave waiting at P (pulls not answered yet), far beyond what a real D
#: has in flight (it cannot pull into more blocks than its KV cache has): pulls, and block ids
#: in them (2**22: ~100-150 MB of Python integers at most). Beyond, a pull is refused.
MAX_WAITING_PULLS = 16_384
MAX_WAITING_IDS = 1 << 22


class WaitingPulls:
    """The pulls each peer has waiting at P, with their block ids, against the bounds above.
    A pull is held from its acceptance to the reply about its transfer (or its peer's end)."""

    def __init__(self) -> None:
        self._held: dict[bytes, tuple[int, dict[str, int]]] = {}  # peer -> (ids, {tid: ids})

    def refusal(self, identity: bytes, pull: PullRequest) -> str | None:
        """Why ``pull`` would take its peer past a bound (None: it would not)."""
        total, held = self._held.get(identity, (0, {}))
        if pull.transfer_id in held:
            return None
        if len(held) >= MAX_WAITING_PULLS:
            return (
                f"this D has {len(held)} pulls waiting at P already (at most {MAX_WAITING_PULLS})"
            )
        if total + sum(map(len, pull.block_ids)) > MAX_WAITING_IDS:
            return f"this D's pulls waiting at P name {total} block ids (at most {MAX_WAITING_IDS})"
        return None

    def hold(self, identity: bytes, pull: PullRequest) -> None:
        total, held = self._held.get(identity, (0, {}))
        if pull.transfer_id not in held:
            held[pull.transfer_id] = n = sum(map(len, pull.block_ids))
            self._held[identity] = (total + n, held)

    def release(self, identity: bytes, transfer_id: str) -> None:
        entry = self._held.get(identity)
        if entry is not None and transfer_id in entry[1]:
            total, held = entry
            n = held.pop(transfer_id)
            if held:
                self._held[identity] = (total - n, held)
            else:
                del self._held[identity]

    def forget(self, identity: bytes) -> None:
        self._held.pop(identity, None)
