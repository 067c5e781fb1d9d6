"""D's stream relayed to the client, chunk by chunk, for one leg of an exchange: its chunks
made the client's (``feed``: :class:`~pdactors.proxy._stream.ClientStream`), its events fed to
the exchange's record (D's first chunk timed), and what ends the leg early — an error event
before D's first token (what vLLM sends when the KV did not come), one later, a broken
answer, the deadline — made the exchange's failure, after which the record says what follows
(ask D again, migrate, or tell the client: :mod:`pdactors.proxy._flows`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, aclosing, nullcontext
from typing import Final

import trio

from pdactors.proxy._asgi import Reply
from pdactors.proxy._effects import ExchangeEffects
from pdactors.proxy._engine_failures import EngineFailures, error_event_at
from pdactors.proxy._engine_http import EngineError, EngineResponse
from pdactors.proxy._exchange import Exchange

__all__ = ["relay_stream"]

#: A chat stream's first event (vLLM's): the role, no token yet.
_ROLE_ONLY: Final = b'"delta":{"role":"assistant","content":""}'
#: A Responses API stream's first events (vLLM's), before any output.
_PREAMBLE: Final = (b"event: response.created\n", b"event: response.in_progress\n")


async def relay_stream(
    effects: ExchangeEffects,
    failures: EngineFailures,
    ex: Exchange,
    resp: EngineResponse,
    feed: Callable[[bytes], bytes],
    writing: Callable[[], AbstractContextManager[None]] = nullcontext,
) -> str | None:
    """Relay D's stream (``feed`` makes each chunk the client's): ``"ok"``, or None with
    ``ex.failure`` set and nothing more sent: D's stream began with an error event (what
    vLLM sends when the KV did not come), had one later (what came before it relayed),
    broke, or ran past the deadline.

    Each write to the client is inside ``writing()`` (the leg's cut held off: ``feed``
    counted its tokens as the client's, the next engine continues after them) and is followed
    by the cut if one came (the engine's bytes may be read without a checkpoint)."""
    reply = ex.reply
    began = False  # this leg relayed something (events before any output do not count)
    held = b""  # events before any output, relayed with what follows them
    with ex.decode_scope(), trio.move_on_at(ex.deadline):
        try:
            async with aclosing(resp.chunks()) as chunks:
                async for chunk in chunks:
                    ex.d.heard = trio.current_time()  # it is alive (for the health loop)
                    if not began:
                        chunk, held = held + chunk, b""
                        rest = _after_preamble(chunk)
                        if error_event_at(rest) == 0:  # before any of D's tokens
                            effects.fail(ex, failures.event_failure(ex.d, rest))
                            return None
                        if not rest:  # nothing but a preamble so far: held until output
                            held = chunk
                            continue
                    # Only the client's first chunk of D's is timed (TTFT); D's step is
                    # learnt from the stream's span when it ends.
                    first = not ex.state.d_relayed
                    effects.apply(ex, ex.state.d_chunk(trio.current_time() if first else None))
                    began = True
                    at = error_event_at(chunk)
                    if at >= 0:  # D reports a failure in a stream it began (200)
                        if data := feed(chunk[:at]):
                            await _write(reply, data, writing)
                        event = chunk[at:].split(b"\n\n", 1)[0]
                        failure = failures.event_failure(ex.d, event, before_token=False)
                        effects.fail(ex, failure)
                        return None
                    if data := feed(chunk):
                        await _write(reply, data, writing)
            if held:  # a stream of a preamble only
                effects.apply(ex, ex.state.d_chunk(trio.current_time()))
                await _write(reply, feed(held), writing)
            return "ok"
        except EngineError as exc:
            effects.fail(ex, failures.transport_failure(ex.d, exc))
    if ex.failure is None:
        effects.fail(ex, failures.timeout_failure("D did not finish"))
    return None


async def _write(
    reply: Reply, data: bytes, writing: Callable[[], AbstractContextManager[None]]
) -> None:
    """``data`` to the client, the leg's cut held off meanwhile; then the cut, if it came
    (see :func:`relay_stream`)."""
    with writing():
        await reply.chunk(data)
    await trio.lowlevel.checkpoint_if_cancelled()


def _after_preamble(chunk: bytes) -> bytes:
    """``chunk`` without the leading events that carry no token, if it begins with any: a
    chat stream's role announcement, the Responses API's ``response.created`` and
    ``response.in_progress`` (vLLM sends them before the engine's first step)."""
    while True:
        end = chunk.find(b"\n\n")
        if end < 0:
            return chunk
        head = chunk[:end]
        if (head.startswith(b"data: ") and _ROLE_ONLY in head) or head.startswith(_PREAMBLE):
            chunk = chunk[end + 2 :]
        else:
            return chunk
