"""The proxy's flows, performed: an admitted exchange served in the flow its record names
(:class:`~pdactors.core.exchange_rules.Flow`; what each is, row by row, is
:mod:`pdactors.core.exchange_rules`'):

* P-first (:mod:`pdactors.proxy._p_first`): P's token first, D continues after it, or D
  alone when P fails before its token (a fall-back);
* concurrent: P's leg started beside D's (:func:`_concurrent`);
* local and whole-on-P: one engine answers (D, or a P in D's place).

In every flow D's answer goes through :class:`~pdactors.proxy._answer.Answers` (retries,
migrations, the failure told).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import msgspec
import trio

from pdactors.core.exchange import Flow
from pdactors.proxy import _bodies
from pdactors.proxy._answer import Answers
from pdactors.proxy._exchange import Exchange
from pdactors.proxy._p_first import complete_p_first
from pdactors.wire import KVTransferParams

__all__ = ["serve_flow"]


async def serve_flow(
    answers: Answers, ex: Exchange, body: dict[str, Any], nursery: trio.Nursery
) -> None:
    """Serve ``ex`` (admitted) in its flow; ``nursery`` holds a concurrent request's P leg
    (cancelled once the answer is complete, after a grace). Ends ``ex`` on every path but an
    exception (which :meth:`~pdactors.proxy._effects.ExchangeEffects.admitted` ends)."""
    match ex.state.flow:
        case Flow.P_FIRST:
            await complete_p_first(answers, ex, body)
        case Flow.CONCURRENT:
            await _concurrent(answers, ex, body, nursery)
        case Flow.LOCAL | Flow.WHOLE_ON_P:
            await answers.answer_from_decode(ex, body)
        case flow:
            raise AssertionError(f"not admitted: {flow}")


async def _concurrent(
    answers: Answers, ex: Exchange, body: dict[str, Any], nursery: trio.Nursery
) -> None:
    """P and D at once, upstream's flow: P computes the prompt for one token, D pulls its KV
    and answers. P's leg runs beside D's for as long as the request does: it is cancelled
    when the client's answer is complete (D no longer needs P) or when D fails. P failing
    cancels nothing but for a 4xx: D's answer decides, and a D whose KV did not come is asked
    again with the client's body (computing it all)."""
    chat, tid = ex.endpoint.chat, ex.transfer_id
    p_params = KVTransferParams(do_remote_decode=True, transfer_id=tid)
    d_params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=ex.p_engine_id,
        remote_bootstrap_addr=ex.p.bootstrap_url,
        transfer_id=tid,
    )
    p_body, d_body = _bodies.concurrent_bodies(body, chat, p_params, d_params)
    nursery.start_soon(partial(answers.legs.prefill_leg, ex, p_body))
    local = msgspec.json.encode(body)
    await answers.answer_from_decode(ex, body, d_body=d_body, local=local)
