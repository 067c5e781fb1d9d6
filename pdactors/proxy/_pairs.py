"""Which P may compute a prompt for which D: only one that answers with the same model.

In the P-first flow the client's first token is P's, streamed before D's pull (where D checks
P's compatibility description) could refuse P's KV; a P serving other weights than D would
have started D's answer with a token of the wrong model. So the proxy compares P's and D's
identity fields (:data:`pdactors.core.compat.IDENTITY_FIELDS`: model config digest, weights
fingerprint, dtype) before it pairs them:

* P's come with its bootstrap's ``GET /query`` answer (each worker's registered
  :class:`~pdactors.wire.Compat`), read each health round before P enters the rotation;
* D's from the info gauge :data:`~pdactors.wire.COMPAT_INFO` on its ``GET /metrics``
  (exported by our connector from start-up), read before D enters the rotation and every
  :data:`REREAD_ROUNDS` health rounds after (:func:`read_identity`);
* a side without a description (an older engine, an engine without our connector, a field
  empty on either side) is not compared: today's behaviour, D's own check at its pull stays;
* a pair whose fields differ (the first differing field not in D's ``compat_relax``) is never
  used disaggregated (:meth:`Pairs.refusal`; logged once per pair, naming the field).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Final

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from pdactors.core.compat import IDENTITY_FIELDS, Identity, Mismatch, identity, judge
from pdactors.errors import describe
from pdactors.proxy._state import Backend
from pdactors.wire import COMPAT_INFO, MAX_COMPAT_FIELD, BootstrapAnswer, Compat

__all__ = [
    "REREAD_ROUNDS",
    "Identity",
    "IdentityUnread",
    "Pairs",
    "parse_identity",
    "prefill_identity",
    "read_identity",
]

log = logging.getLogger("pdactors.proxy")

#: Health rounds between two reads of an in-rotation D's identity (a D that restarted
#: between two probes with other weights is caught within this many rounds).
REREAD_ROUNDS: Final = 10
#: The most of D's ``/metrics`` answer read (vLLM's is some hundreds of KB).
MAX_METRICS_BYTES: Final = 16 << 20


class IdentityUnread(Exception):
    """D's ``/metrics`` gave no answer in time, or its connection failed."""


def parse_identity(text: str) -> Identity | None:
    """The identity in a Prometheus text exposition's first :data:`COMPAT_INFO` sample; None
    without one (or with one that cannot be parsed). Each field is cut to
    :data:`~pdactors.wire.MAX_COMPAT_FIELD` characters. Pure."""
    prefix = COMPAT_INFO + "{"
    line = next((x for x in text.splitlines() if x.startswith(prefix)), None)
    if line is None:
        return None
    try:
        labels = next(s.labels for f in text_string_to_metric_families(line) for s in f.samples)
    except (ValueError, StopIteration):
        return None
    model, weights, dtype = (labels.get(name, "")[:MAX_COMPAT_FIELD] for name in IDENTITY_FIELDS)
    relax = tuple(n for n in labels.get("relax", "").split(",") if n in IDENTITY_FIELDS)
    return Identity(Compat(model=model, weights=weights, dtype=dtype), relax)


def prefill_identity(answer: BootstrapAnswer) -> Identity | None:
    """P's identity from its bootstrap's answer: its lowest DP rank's first registered
    description (every worker of P serves one model); None when none registered one."""
    for dp in sorted(answer):
        compats = answer[dp].compats
        for tp in sorted(compats):
            for pp in sorted(compats[tp]):
                found = identity(compats[tp][pp])
                assert found is not None
                return Identity(found)
    return None


async def read_identity(http: httpx.AsyncClient, url: str, timeout: float) -> Identity | None:  # noqa: ASYNC109
    """D's identity from its ``GET /metrics`` (at most :data:`MAX_METRICS_BYTES` read, within
    ``timeout`` seconds); None when it answered without the gauge (an error status, an older
    D, a D without our connector, ``--disable-log-stats``). A checkpoint. Raises
    :class:`IdentityUnread` when it gave no answer in time or its connection failed."""
    body = bytearray()
    with trio.move_on_after(timeout) as scope:
        try:
            async with http.stream("GET", f"{url}/metrics") as resp:
                if resp.status_code != 200:
                    return None
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_METRICS_BYTES:
                        break
        except httpx.HTTPError as exc:
            raise IdentityUnread(f"GET /metrics failed: {describe(exc)}") from None
    if scope.cancelled_caught:
        raise IdentityUnread(f"GET /metrics gave no answer within {timeout:g} s")
    return parse_identity(body[:MAX_METRICS_BYTES].decode("utf-8", errors="replace"))


class Pairs:
    """The verdicts on P–D pairs, from their :attr:`Backend.identity`; each refused pair is
    logged once (and again only when its mismatch changes, or once when it is compatible
    again)."""

    def __init__(self) -> None:
        self._said: dict[tuple[str, str], Mismatch] = {}

    def refusal(self, p: Backend, d: Backend) -> Mismatch | None:
        """Why ``p`` may not compute prompts for ``d``: the first identity field that differs
        and D does not relax (P's value ``mine``); None when they agree or either is not
        known. Not a checkpoint."""
        if p.identity is None or d.identity is None:
            found = None
        else:
            found = judge(p.identity.compat, d.identity.compat, d.identity.relax).refused
        key = (p.url, d.url)
        said = self._said.get(key)
        if found is not None and found != said:
            self._said[key] = found
            log.warning(
                "proxy: prefill %s and decode %s are never paired: %s; requests for that D "
                "go to a compatible P, else to D alone",
                p.url, d.url, found.reason("P"),
            )  # fmt: skip
        elif found is None and said is not None and p.identity and d.identity:
            del self._said[key]
            log.info("proxy: prefill %s and decode %s are compatible again", p.url, d.url)
        return found

    def report(self, prefill: Iterable[Backend], decode: Iterable[Backend]) -> list[Any]:
        """Every refused pair, for ``GET /health``: its P, its D and why."""
        return [
            {"prefill": p.url, "decode": d.url, "reason": found.reason("P")}
            for d in decode
            for p in prefill
            if (found := self.refusal(p, d)) is not None
        ]
