"""Whether a D's pull is this P worker's to answer, and with which heads: checked when the
pull arrives, before the sender's table sees it (a refusal is that pull's :class:`PlanError`).

The numbers it reads are already within :data:`~pdactors.messages.LIMITS` (the frame would
not have decoded otherwise), and the TP arithmetic is closed-form, so this costs microseconds
whatever the pull says.
"""

from __future__ import annotations

from pdactors.config import SenderConfig
from pdactors.core.plan import HeadSlice, tp_expected, tp_pulls
from pdactors.errors import PlanError
from pdactors.messages import PullRequest

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
