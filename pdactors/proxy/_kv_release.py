"""P's KV kept for a pull no D will make now, freed at P on the proxy's word.

P keeps a prompt's KV until D pulls it (or D tells it over the side channel that it gave up),
else until its ``unclaimed_ttl`` (120 s by default). When the proxy gives up D's leg of a
request whose KV P may keep (D failed and the request moved to another engine, D was asked
again computing the prompt itself, the request ended without D, P was cut from it by the
health loop) and D's connector never heard of the request (D's API server had not handed it
to its engine, or D is gone), nobody else can tell P: the exchange record says so
(:class:`~pdactors.core.exchange_effects.FreeAtP`) and this module tells P, on the only door
the proxy has to it, vLLM's API. A one-token completion carries
``kv_transfer_params: {"release_transfer_ids": [...]}``; P's connector frees the KV of each
(one it does not know is remembered as given up, so KV it readies later is freed at once).

Transfers are batched per P (and DP rank): one request carries every id owed when it is
sent; while it is in flight more may queue for the next. A P that cannot be reached is tried
again (pauses of 1, 2, 4, 8 s; each try bounded by 30 s), then left to its ``unclaimed_ttl``,
logged once. Counted in
``pdactors_proxy_kv_freed_at_p_total{outcome="told"|"not_told"}`` (transfers).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import msgspec
import trio
from prometheus_client import Counter

from pdactors.proxy._engine_http import EngineClient, EngineError
from pdactors.wire import KVTransferParams

__all__ = ["KvReleases"]

log = logging.getLogger("pdactors.proxy")

#: The pauses between tries of one batch; after the last, P's ``unclaimed_ttl`` frees them.
PAUSES: Final = (1.0, 2.0, 4.0, 8.0)
#: The longest one try may take.
TRY_TIMEOUT: Final = 30.0
#: The headers a release keeps of P's request: the engine's key, and which DP rank kept it.
KEPT_HEADERS: Final = frozenset({b"authorization", b"x-data-parallel-rank"})

Key = tuple[str, tuple[tuple[bytes, bytes], ...]]  # P's URL, the headers its request had


@dataclass
class _Batch:
    model: str
    transfer_ids: list[str] = field(default_factory=list)


class KvReleases:
    """The transfers each P is to be told to free; one task per P tells it."""

    def __init__(self, engines: Mapping[str, EngineClient], counter: Counter) -> None:
        self._engines = engines
        self._counter = counter
        self._owed: dict[Key, _Batch] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self) -> None:
        """Serve until cancelled (the proxy's lifetime): the tasks that tell each P run here."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def free(
        self, url: str, headers: list[tuple[bytes, bytes]], model: str, transfer_id: str
    ) -> None:
        """Tell the P at ``url`` (its request had ``headers``, for ``model``) to free the KV it
        keeps for ``transfer_id``. Not a checkpoint."""
        if self._nursery is None:  # not serving (a proxy object in a test): P's TTL frees it
            return
        key = (url, tuple((k, v) for k, v in headers if k.lower() in KEPT_HEADERS))
        batch = self._owed.get(key)
        if batch is None:
            batch = self._owed[key] = _Batch(model)
            self._nursery.start_soon(self._tell, key, batch)
        batch.transfer_ids.append(transfer_id)

    async def _tell(self, key: Key, batch: _Batch) -> None:
        url, headers = key
        client = self._engines[url]
        try:
            while batch.transfer_ids:
                ids, batch.transfer_ids = batch.transfer_ids, []
                why = ""
                for pause in (*PAUSES, None):
                    why = await _release(client, list(headers), batch.model, ids)
                    if not why or pause is None:
                        break
                    await trio.sleep(pause)
                if why:
                    log.info("proxy: could not tell prefill engine %s to free the KV of %d "
                             "transfers (%s): %s; it frees them at its unclaimed_ttl", url,
                             len(ids), ", ".join(ids), why)  # fmt: skip
                self._counter.labels("not_told" if why else "told").inc(len(ids))
        finally:
            del self._owed[key]


async def _release(
    client: EngineClient, headers: list[tuple[bytes, bytes]], model: str, ids: list[str]
) -> str:
    """One try: "" once P answered 200, else why not."""
    body: dict[str, object] = {
        "prompt": [0],  # any one token: the request exists to carry its kv_transfer_params
        "max_tokens": 1,
        "kv_transfer_params": KVTransferParams(release_transfer_ids=ids),
    }
    if model:
        body["model"] = model
    headers = [(b"content-type", b"application/json"), *headers]
    with trio.move_on_after(TRY_TIMEOUT):
        try:
            encoded = msgspec.json.encode(body)
            resp = await client.request("POST", "/v1/completions", encoded, headers)
            answer = await resp.read()  # closes it, however it ends
        except EngineError as exc:
            return str(exc)
        if resp.status != 200:
            return f"HTTP {resp.status}: {answer[:200]!r}"
        return ""
    return f"no answer within {TRY_TIMEOUT:g} s"
