"""D's answer to the client, whole or streamed, whatever becomes of its legs: each engine's leg
is a call of :class:`~pdactors.proxy._legs.Legs`; when one fails, the exchange's record says
what follows (:func:`~pdactors.core.exchange_next.after_failure`) and this module
does it — D asked again computing the prompt itself (a retry), another engine continuing after
what the client got (a migration: :func:`~pdactors.proxy._retry.successor` finds it), or the
failure told: as an HTTP status while nothing was sent, as the stream's last event once it
began.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import msgspec
import trio

from pdactors.core.exchange_next import Next, Policy, after_failure
from pdactors.proxy._effects import ExchangeEffects
from pdactors.proxy._exchange import Exchange
from pdactors.proxy._health import HealthWatch
from pdactors.proxy._legs import Legs
from pdactors.proxy._openai import COMPLETIONS
from pdactors.proxy._retry import successor
from pdactors.proxy._stream import ClientStream
from pdactors.proxy_config import ProxyConfig

__all__ = ["Answers"]

log = logging.getLogger("pdactors.proxy")

#: How long a relay waits to hand a final error event to a slow client.
_LAST_EVENT_TIMEOUT: Final = 1.0


class Answers:
    """D's answers of every exchange, and what follows a failed leg of them."""

    def __init__(
        self, config: ProxyConfig, legs: Legs, effects: ExchangeEffects, watch: HealthWatch
    ) -> None:
        self.config = config
        self.legs = legs
        self.effects = effects
        self.watch = watch
        self.policy = Policy(config.fall_back_to_d, config.migration_limit)

    async def answer_from_decode(
        self,
        ex: Exchange,
        body: dict[str, Any],
        *,
        d_body: bytes | None = None,
        local: bytes | None = None,
    ) -> None:
        """Ask D and answer the client with D's answer, as it comes (ends ``ex``): D gets
        ``d_body`` (default: the client's ``body``). ``local``: the same request with D
        computing the prompt itself, for a retry (a flow whose D pulls KV)."""
        if ex.stream:
            stream = ClientStream(body, ex.endpoint.chat)
            native = stream.native_body(body if d_body is None else msgspec.json.decode(d_body))
            if local is not None:
                local = msgspec.json.encode(stream.native_body(msgspec.json.decode(local)))
            await self.relay_decode(ex, msgspec.json.encode(native), stream, local=local)
            return
        plain = msgspec.json.encode(body)
        raw = await self.decode_whole(ex, plain if d_body is None else d_body, local=local)
        if raw is None:
            await self.answer_failure(ex)
            return
        self.effects.end(ex, "ok")
        await ex.reply.whole(200, raw, ex.transfer_id)

    async def answer_failure(self, ex: Exchange) -> None:
        """End ``ex`` with its failure, answered as an HTTP status."""
        failure = ex.told()
        log.warning("proxy: request %s failed: %s", ex.transfer_id, failure.body[:500])
        self.effects.end(ex, failure.outcome)
        await ex.reply.failure(failure, ex.transfer_id)

    def _again(
        self, ex: Exchange, stream: ClientStream | None = None
    ) -> tuple[Next, tuple[dict[str, Any], bool] | None]:
        """What follows ``ex``'s failed decoding leg, as the record says, carried out: a
        retry or a migration (their effects applied; for a stream, a migration comes with
        the body the next engine continues with and whether it is a completion); else
        :attr:`Next.TELL` (no engine could take it over, or the stream could not go on)."""
        now = trio.current_time()
        decided = after_failure(ex.state, now, self.policy)
        if decided is Next.RETRY:
            self.effects.apply(ex, ex.state.retry(now, self.effects.ahead(ex, ex.d)))
            return decided, None
        if decided is Next.MIGRATE:
            leg = None if stream is None else stream.next_leg()
            if stream is None or leg is not None:
                tried = {b.url for b in ex.state.tried}
                fall_back_to_p = self.config.fall_back_to_p
                to = successor(self.watch, ex.d, fall_back_to_p=fall_back_to_p, tried=tried)
                if to is not None:
                    self.effects.apply(ex, ex.state.migrate(to))
                    return decided, leg
        return Next.TELL, None

    async def decode_whole(
        self, ex: Exchange, body: bytes, *, local: bytes | None = None, path: str | None = None
    ) -> bytes | None:
        """D's whole answer (not streamed) to ``body`` on ``path``, asked again with
        ``local`` when the record says so (a retry), and handed to another engine with
        ``local`` (or ``body`` when D computed the prompt already) on a migration; None with
        ``ex.failure`` set."""
        attempt = body
        while True:
            raw = await self.legs.whole_answer(ex, attempt, path)
            if raw is not None:
                return raw
            decided, _ = self._again(ex)
            if decided is Next.RETRY:
                assert local is not None
                attempt = local
            elif decided is Next.MIGRATE:
                attempt = local or body
            else:
                return None

    async def relay_decode(
        self,
        ex: Exchange,
        body: bytes,
        stream: ClientStream,
        *,
        local: bytes | None = None,
        path: str | None = None,
    ) -> None:
        """Hand D's streamed answer to ``body`` to the client as it comes, made into the
        client's stream by ``stream``: asking D again with ``local`` (a retry), or another
        engine right after what the client got (a migration), when the record says so; a
        failure with nothing sent yet is answered as an HTTP status, one in a begun stream
        as its last event. Ends ``ex``."""
        outcome = "cancelled"
        try:
            attempt = body
            while True:
                relayed = await self.legs.streamed_answer(ex, attempt, path, stream)
                if relayed is not None:
                    outcome = relayed
                    break
                decided, leg = self._again(ex, stream)
                if decided is Next.RETRY:
                    assert local is not None
                    attempt = local
                    continue
                if decided is Next.MIGRATE:
                    assert leg is not None
                    next_body, completion = leg
                    attempt = msgspec.json.encode(next_body)
                    path = COMPLETIONS.path if completion else None
                    continue
                if not ex.state.streaming:
                    await self.answer_failure(ex)
                    return
                await self.stream_failure(ex)
                outcome = ex.told().outcome
                break
            await ex.reply.chunk(b"", more=False)
        finally:
            self.effects.end(ex, outcome)  # not ok: P's leg is cancelled now

    async def stream_failure(self, ex: Exchange) -> None:
        """End a begun stream with the request's failure (or D's timeout) as an event."""
        if ex.failure is None:
            self.effects.fail(ex, self.legs.failures.timeout_failure("D did not finish"))
        failure = ex.told()
        log.warning("proxy: request %s failed mid-stream: %s", ex.transfer_id, failure.body[:500])
        with trio.move_on_after(_LAST_EVENT_TIMEOUT):
            await ex.reply.chunk(failure.sse_event())
