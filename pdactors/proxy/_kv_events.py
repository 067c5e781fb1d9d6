"""The proxy's KV event feeds: what each engine's prefix cache holds, as vLLM publishes it
(``--kv-events-config``), for exact prefix-aware routing (:mod:`pdactors.core.kv_events`).

*Found, not configured.* For each engine of a ``prefix_aware`` pool the feed asks the engine's
``GET /kv_event_sources`` (vLLM's: its publisher's settings per DP rank) until it answers; an
engine that publishes nothing is asked again only once it restarts (health's
:meth:`KvEventFeeds.restarted`). A publisher bound on a wildcard (``tcp://*:5557``) is reached
at the engine's host. Each DP rank gets a SUB socket and an index of its own; an engine's match
is its best rank's.

*In order, or cleared.* Each message carries vLLM's sequence number. The first message seen,
or one after a gap, is preceded by a replay from the publisher's replay endpoint (its ROUTER:
``start seq`` in, the buffered batches from it out, then seq -1); when there is none, or its
buffer no longer holds the gap, or it gives no end within ``health_timeout`` (a last resort),
the engine's index is cleared and refills from what comes next. A sequence that starts again
is an engine that restarted: cleared. A payload that is not a batch is skipped and logged once
per engine.

*The prompt's tokens.* An index holds token ids; a request routed while some engine has one
needs its prompt's: the ids it sent, else ``POST /tokenize`` on an engine in rotation (vLLM's,
with the request's chat-template fields), within ``health_timeout``. Any failure routes the
request on the proxy's own remembered prefixes (:mod:`pdactors.core.prefixes`): a request
never fails for the index.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import trio

from pdactors.core import prefixes
from pdactors.core.kv_events import BadBatch, EngineBlocks, decode_batch
from pdactors.core.prefixes import BLOCK_IDS, MAX_BLOCKS
from pdactors.errors import describe
from pdactors.proxy._state import Metrics, Pool
from pdactors.proxy_config import ProxyConfig
from pdactors.transport.zmq import SubSocket, TransportError, open_dealer, open_subscriber

__all__ = ["KvEventFeeds"]

log = logging.getLogger("pdactors.proxy")

#: The replay's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``).
_END: Final = -1
#: Body fields of a chat request that change its template's tokens (passed to ``/tokenize``).
_CHAT_FIELDS: Final = (
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "tools", "documents",
)  # fmt: skip


class KvEventFeeds:
    """Every engine's indexes (by engine URL, one per DP rank) while its feed follows them."""

    def __init__(
        self, config: ProxyConfig, http: httpx.AsyncClient, urls: Sequence[str], metrics: Metrics
    ) -> None:
        self.config = config
        self.http = http
        self.urls = list(dict.fromkeys(urls))  # an engine of every role is one feed
        self.metrics = metrics
        self.blocks: dict[str, list[EngineBlocks]] = {}
        self._restarts = {url: trio.Event() for url in self.urls}

    @classmethod
    def of(
        cls, config: ProxyConfig, http: httpx.AsyncClient, pools: Sequence[Pool], metrics: Metrics
    ) -> KvEventFeeds | None:
        """The feeds of the engines of the ``prefix_aware`` ``pools``, set as their
        :attr:`Pool.exact`; None when no pool is, or ``config.kv_events`` is off."""
        keyed = [pool for pool in pools if pool.prefixes is not None]
        if not keyed or not config.kv_events:
            return None
        feeds = cls(config, http, [b.url for pool in keyed for b in pool.backends], metrics)
        for pool in keyed:
            pool.exact = feeds
        return feeds

    @property
    def following(self) -> bool:
        """Some engine's events are followed (else a prompt's tokens would match nothing)."""
        return any(self.blocks.values())

    def matched(
        self, url: str, keys_of: dict[int, list[int]], token_ids: Sequence[int]
    ) -> int | None:
        """How many leading tokens of the prompt ``url``'s engine holds; None when it has no
        index (it does not publish, or its feed is not following it)."""
        ranks = self.blocks.get(url)
        if not ranks:
            return None
        return max(b.matched(keys_of, token_ids, MAX_BLOCKS) for b in ranks)

    def restarted(self, url: str) -> None:
        """``url``'s engine restarted (health says): its index is cleared and its sources
        asked again (a restart may publish elsewhere, or start or stop publishing)."""
        for b in self.blocks.pop(url, ()):
            b.clear()
        if url in self._restarts:
            self._restarts[url].set()
            self._restarts[url] = trio.Event()

    def report(self) -> dict[str, int]:
        """Blocks indexed per engine, for the proxy's ``/health``."""
        return {url: sum(len(b) for b in ranks) for url, ranks in self.blocks.items()}

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for url in self.urls:
                nursery.start_soon(self._follow, url)

    async def _follow(self, url: str) -> None:
        while True:
            restart = self._restarts[url]
            sources = await self._sources(url)
            if not sources:
                await restart.wait()
                continue
            ranks = [EngineBlocks() for _ in sources]
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    for (pub, replay), blocks in zip(sources, ranks, strict=True):
                        nursery.start_soon(self._feed, url, pub, replay, blocks)
                    self.blocks[url] = ranks
                    await restart.wait()
                    scope.cancel()
            self.blocks.pop(url, None)

    async def _sources(self, url: str) -> list[tuple[str, str | None]]:
        """The engine's publishers (SUB address, replay address), asked until it answers."""
        while True:
            with trio.move_on_after(self.config.health_timeout):
                try:
                    resp = await self.http.get(f"{url}/kv_event_sources")
                    if resp.status_code == 404:
                        return []  # a vLLM without the route: nothing to follow
                    if resp.status_code == 200:
                        return _publishers(resp.json(), urlsplit(url).hostname or "127.0.0.1")
                except (httpx.HTTPError, ValueError) as exc:
                    log.debug("proxy: %s/kv_event_sources: %s", url, describe(exc))
            await trio.sleep(self.config.health_interval)

    async def _feed(self, url: str, pub: str, replay: str | None, blocks: EngineBlocks) -> None:
        last: int | None = None
        said_bad = False
        try:
            async with open_subscriber(pub) as sub:
                log.info("proxy: following %s's KV events at %s", url, pub)
                while True:
                    seq, payload = await _next(sub)
                    if last is not None and seq <= last:  # the counter began again: a restart
                        blocks.clear()
                        last = None
                    expected = 0 if last is None else last + 1
                    if seq > expected:  # missed (or published before this SUB joined)
                        if not await self._replay(url, replay, expected, seq, blocks):
                            self.metrics.kv_event_gaps.labels(url, "cleared").inc()
                        else:
                            self.metrics.kv_event_gaps.labels(url, "replayed").inc()
                    last = seq
                    try:
                        events, _ = decode_batch(payload)
                    except BadBatch as exc:
                        if not said_bad:
                            log.warning("proxy: %s's KV events at %s: %s", url, pub, exc)
                            said_bad = True
                        continue
                    blocks.apply(events)
        except TransportError as exc:
            log.warning("proxy: cannot follow %s's KV events: %s", url, exc)
            await trio.sleep_forever()  # until the engine restarts (the scope is cancelled)

    async def _replay(
        self, url: str, address: str | None, start: int, upto: int, blocks: EngineBlocks
    ) -> bool:
        """Apply the publisher's buffered batches ``start`` .. ``upto - 1``; whether they were
        all there (else ``blocks`` is cleared first: what the gap held is lost, as when the
        replay address cannot be connected to: logged, the feed goes on)."""
        got: list[tuple[int, bytes]] = []
        ended = False
        if address is not None:
            with trio.move_on_after(self.config.health_timeout):
                try:
                    async with open_dealer(address) as dealer:
                        await dealer.send([b"", start.to_bytes(8, "big")])
                        while not ended:
                            frames = await dealer.receive()
                            if len(frames) == 4 and len(frames[2]) == 8:
                                seq = int.from_bytes(frames[2], "big", signed=True)
                                ended = seq == _END
                                if start <= seq < upto:
                                    got.append((seq, frames[3]))
                except TransportError as exc:  # e.g. a malformed address in its sources
                    log.warning("proxy: %s's KV event replay at %s: %s", url, address, exc)
        whole = ended and [seq for seq, _ in got] == list(range(start, upto))
        if not whole:
            blocks.clear()
        for _, payload in got:
            try:
                blocks.apply(decode_batch(payload)[0])
            except BadBatch:
                continue
        return whole

    async def prompt_ids(
        self, read: tuple[dict[str, Any], bool], pools: Sequence[Pool], auth: dict[str, str]
    ) -> list[int] | None:
        """The prompt's token ids while some engine's events are followed (else a prompt's
        tokens would match nothing), asked of the first engine of ``pools`` in rotation (the
        routing's turn untouched); None: routed on remembered prefixes."""
        if not self.following:
            return None
        engine = next((b for pool in pools for b in pool.backends if b.serving), None)
        if engine is None:
            return None
        return await self.token_ids(*read, engine.url, auth)

    async def token_ids(
        self, body: dict[str, Any], chat: bool, engine: str, headers: dict[str, str]
    ) -> list[int] | None:
        """The prompt's token ids (:mod:`this module's docstring <pdactors.proxy._kv_events>`),
        asked of ``engine``; None when they could not be had. A checkpoint when it asks."""
        if not chat:
            ids = prefixes.prompt_ids(body)
            if ids is not None:
                return ids[: BLOCK_IDS * MAX_BLOCKS]
            ask: dict[str, Any] = {"prompt": prefixes.prompt_text(body, chat=False)}
            if "add_special_tokens" in body:
                ask["add_special_tokens"] = body["add_special_tokens"]
        else:
            ask = {"messages": body.get("messages")}
            ask |= {k: body[k] for k in _CHAT_FIELDS if k in body}
        if isinstance(body.get("model"), str):
            ask["model"] = body["model"]
        with trio.move_on_after(self.config.health_timeout):
            try:
                resp = await self.http.post(f"{engine}/tokenize", json=ask, headers=headers)
                tokens = resp.json().get("tokens") if resp.status_code == 200 else None
                if isinstance(tokens, list) and all(type(t) is int for t in tokens):
                    return tokens
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                log.debug("proxy: %s/tokenize: %s", engine, describe(exc))
        return None


async def _next(sub: SubSocket) -> tuple[int, bytes]:
    """The next ``(seq, payload)`` published; a message of another shape is skipped."""
    while True:
        frames = await sub.receive()
        if len(frames) == 3 and len(frames[1]) == 8:
            return int.from_bytes(frames[1], "big", signed=True), frames[2]


def _publishers(answer: Any, host: str) -> list[tuple[str, str | None]]:
    """The ZMQ publishers of a ``/kv_event_sources`` answer ({rank: KVEventsConfig}), their
    wildcard hosts replaced by the engine's."""
    found = []
    for _, source in sorted((answer or {}).items()) if isinstance(answer, dict) else ():
        if not isinstance(source, dict) or source.get("publisher") != "zmq":
            continue
        if not source.get("enable_kv_cache_events", True):
            continue
        pub = source.get("endpoint")
        if isinstance(pub, str):
            replay = source.get("replay_endpoint")
            again = _reach(replay, host) if isinstance(replay, str) else None
            found.append((_reach(pub, host), again))
    return found


def _reach(endpoint: str, host: str) -> str:
    """``tcp://*:5557`` (a bind) as the address to connect to on ``host``."""
    for wildcard in ("*", "0.0.0.0", "[::]"):
        prefix = f"tcp://{wildcard}:"
        if endpoint.startswith(prefix):
            return f"tcp://{host}:{endpoint[len(prefix) :]}"
    return endpoint
