"""The proxy's P-first flow: P's token is the client's first, D continues after it.

One request: P is asked for one token (and its token ids); the moment it answers, a streamed
client gets that token; when it ends the answer (EOS, a stop string, or the client asked for
one token) the request is complete and no D is asked (P kept no KV: it frees it at once).
Otherwise D gets a completion of the prompt's ids and P's token (``first_token_from_p``: it
pulls the prompt's KV from P and computes P's token), and its answer follows P's token.
The bodies and answers: :mod:`pdactors.proxy._bodies`. Each step is an event of the
exchange's record (the P-first rows of :mod:`pdactors.core.exchange_rules`), which decides
what a failure leads to. A request whose P fails before its token is served by D alone (the
client's body as it came; ``fall_back_to_d``), or with that off fails as in the concurrent
flow (an HTTP status); so is one still waiting for the token of a P that the health loop
judges failed meanwhile (a stopped P: its leg is cut, counted as ``p_unhealthy``;
:mod:`pdactors.proxy._health`). A D whose KV did not come (P died or hung after its token)
fails before its first token: it is asked once more for the same continuation without
``kv_transfer_params`` (it computes the prompt and P's token itself). D failing otherwise
after P's token was streamed hands the stream to another engine, or ends it with an error
event (:mod:`pdactors.proxy._answer`).
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from pdactors.core.exchange_next import Next, after_failure
from pdactors.proxy import _bodies as ft
from pdactors.proxy._answer import Answers
from pdactors.proxy._effects import ExchangeEffects
from pdactors.proxy._exchange import Exchange
from pdactors.proxy._openai import COMPLETIONS, Failure
from pdactors.proxy._stream import ClientStream
from pdactors.wire import KVTransferParams

__all__ = ["complete_p_first"]


async def complete_p_first(answers: Answers, ex: Exchange, body: dict[str, Any]) -> None:
    """Serve ``ex`` (admitted P-first, its prompt sent to P) P first; ends it on every path
    but an exception (which the caller's :meth:`~pdactors.proxy._effects.ExchangeEffects.
    admitted` ends)."""
    effects = answers.effects
    chat = ex.endpoint.chat
    p_body = msgspec.json.encode(ft.prefill_body(body, chat, ex.transfer_id))
    answer = await answers.legs.prefill_leg(ex, p_body)
    first = ft.read_first(answer, chat) if answer is not None else None
    if isinstance(first, str):
        message = f"prefill engine {ex.p.url}: {first}"
        failure = Failure.of(502, message, "upstream_error", "prefill_error")
        effects.apply(ex, ex.state.p_failed(failure))
    if first is None or isinstance(first, str):
        now = trio.current_time()
        if after_failure(ex.state, now, answers.policy) is Next.FALL_BACK:  # D alone
            effects.apply(ex, ex.state.fall_back(now, effects.ahead(ex, ex.d)))
            await answers.answer_from_decode(ex, body)
        else:
            await answers.answer_failure(ex)
        return
    ends = ft.ends_at_p(first, body, chat)
    effects.apply(ex, ex.state.p_answer(len(first.prompt_ids), ends=ends))
    if ends:
        if ex.stream:
            await _start(effects, ex)
            await ex.reply.chunk(ft.first_event(first, body, chat, last=True))
            effects.apply(ex, ex.state.p_token_sent(trio.current_time()))
            effects.end(ex, "ok")
            await ex.reply.chunk(b"", more=False)
        else:
            effects.end(ex, "ok")
            whole = msgspec.json.encode(ft.ended_at_p(first, body))
            await ex.reply.whole(200, whole, ex.transfer_id)
        return
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=ex.p_engine_id,
        remote_bootstrap_addr=ex.p.bootstrap_url,
        transfer_id=ex.transfer_id,
        first_token_from_p=True,
    )
    d_body = msgspec.json.encode(ft.decode_body(body, chat, first, params))
    # The same continuation with D computing the prompt itself: asked once if D's leg fails
    # with its KV missing before any of its answer reached the client (P died or hung after
    # its token), so the stream never repeats or skips a token.
    local = msgspec.json.encode(ft.decode_body(body, chat, first, None))
    if ex.stream:
        await _start(effects, ex)
        await ex.reply.chunk(ft.first_event(first, body, chat, last=False))
        now = trio.current_time()
        effects.apply(ex, ex.state.p_token_sent(now))
        effects.apply(ex, ex.state.d_asked(now))
        stream = ClientStream(body, chat, first)
        await answers.relay_decode(ex, d_body, stream, local=local, path=COMPLETIONS.path)
        return
    effects.apply(ex, ex.state.d_asked(trio.current_time()))
    raw = await answers.decode_whole(ex, d_body, local=local, path=COMPLETIONS.path)
    if raw is None:
        await answers.answer_failure(ex)
        return
    try:
        merged = ft.merge_whole(first, msgspec.json.decode(raw), body, chat)
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        message = f"decode engine {ex.d.url}: unreadable answer ({type(exc).__name__})"
        failure = Failure.of(502, message, "upstream_error", "decode_error")
        effects.end(ex, failure.outcome)
        await ex.reply.failure(failure, ex.transfer_id)
        return
    effects.end(ex, "ok")
    await ex.reply.whole(200, merged, ex.transfer_id)


async def _start(effects: ExchangeEffects, ex: Exchange) -> None:
    effects.apply(ex, ex.state.stream_opened())
    await ex.reply.start(200, b"text/event-stream", ex.transfer_id, (b"cache-control", b"no-cache"))
