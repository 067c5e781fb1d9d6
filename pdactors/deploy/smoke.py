"""The smoke check of ``pdactors launch --smoke``: the same prompts to a plain vLLM server and
through the proxy, disaggregated and then placed by the proxy; the answers must be equal, the
KV must have moved, and D must not have computed the prompts (:class:`Smoke` says so)."""

from __future__ import annotations

import collections
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx

from pdactors.deploy.plan import Plan
from pdactors.deploy.stats import Stats, read_stats

__all__ = ["SMOKE_PROMPTS", "Smoke", "run_smoke"]

SMOKE_PROMPTS = [
    "The river runs past the old mill and",
    "In the morning the market opens",
    "She looked at the map once more,",
    "A short story about a lighthouse:",
]


@dataclass
class Smoke:
    """What the smoke check saw: ``same`` of ``total`` answers equal the single server's, the
    median times to first token, and the figures read after the disaggregated requests."""

    same: int
    total: int
    ttft_single: float
    ttft_pd: float
    stats: Stats
    #: Requests through the proxy disaggregated: with the first token from P, D computes one
    #: prompt token of each it continues (P's token), and none of the prompt.
    proxied: int = 0
    second_pd: float = 0.0  # disaggregated: the second token (D's first chunk), median
    #: The same prompts with the proxy's own placement (``--placement auto`` by default): the
    #: median time to first token, and how many went local (D alone) and disaggregated.
    ttft_auto: float = 0.0
    auto_placed: dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Every answer equal, KV moved, and D computed no more than P's tokens."""
        return (
            self.same == self.total
            and self.stats.kv_bytes > 0
            and self.stats.d_local_prompt_tokens <= self.proxied
        )

    def lines(self) -> list[str]:
        """The summary ``pdactors launch --smoke`` prints."""
        s = self.stats

        def vs_single(t: float) -> str:
            return f" (×{t / self.ttft_single:.1f})" if self.ttft_single else ""

        verdict = "PASS" if self.passed else "FAIL"
        out = [
            f"smoke: {self.same}/{self.total} answers through the proxy equal the single "
            f"server's — {verdict}",
            f"  time to first token (median): single {1000 * self.ttft_single:.0f} ms, "
            f"PD {1000 * self.ttft_pd:.0f} ms{vs_single(self.ttft_pd)} (P's token), "
            f"second token {1000 * self.second_pd:.0f} ms (D's first)",
        ]
        if self.auto_placed:
            placed = ", ".join(f"{n} {where}" for where, n in sorted(self.auto_placed.items()))
            out.append(
                f"  with the proxy's own placement: {1000 * self.ttft_auto:.0f} ms"
                f"{vs_single(self.ttft_auto)} ({placed})"
            )
        out += [
            f"  KV moved P → D: {s.transfers:.0f} transfers, {s.kv_bytes / 2**20:.2f} MiB",
            f"  prompt tokens D computed itself: {s.d_local_prompt_tokens:.0f} "
            f"(P's first token of each request D continued; {self.proxied} requests)",
        ]
        return out


@dataclass
class Streamed:
    """One streamed answer: its text, seconds to its first and second chunks, and where the
    proxy placed it (its ``x-pdactors-placement`` header; "" from an engine)."""

    text: str
    first: float
    second: float
    placement: str


async def _stream(
    http: httpx.AsyncClient, url: str, model: str, prompt: str, placement: str | None = None
) -> Streamed:
    """One greedy streamed completion (through the proxy, ``placement`` pinned when given)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    headers = {"x-pdactors-placement": placement} if placement else None
    start, times, text = time.monotonic(), [], []
    async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            times.append(time.monotonic() - start)
            text += [c.get("text", "") for c in json.loads(line[6:]).get("choices", ())]
    times += [0.0, 0.0]
    where = answer.headers.get("x-pdactors-placement", "")
    return Streamed("".join(text), times[0], times[1], where)


def _headers(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


async def run_smoke(plan: Plan, api_key: str | None) -> Smoke:
    """Each prompt to the single server and through the proxy disaggregated (the answers must
    be equal, the KV must have moved, D must not have computed the prompts), then through the
    proxy with its own placement (equal answers again). ``plan`` must have its ``single``
    server; ``api_key`` is the proxy's. Raises ``httpx.HTTPError`` when a request fails."""
    single = next(c for c in plan.children if c.name == "single")
    single_url = single.base_url
    engine_key = plan.engine_key or None
    got, want, auto = [], [], []
    async with (
        httpx.AsyncClient(trust_env=False, timeout=120, headers=_headers(api_key)) as proxy,
        httpx.AsyncClient(trust_env=False, timeout=120, headers=_headers(engine_key)) as direct,
    ):
        # What the engines did before (the proxy's calibration probes) is not the smoke's.
        before = await read_stats(direct, plan)
        # One request each first, not counted: an engine's first request is slow (warm-up).
        await _stream(proxy, plan.proxy_url, plan.model_name, "Hello", "disaggregate")
        await _stream(direct, single_url, plan.model_name, "Hello")
        for prompt in SMOKE_PROMPTS:
            got.append(
                await _stream(proxy, plan.proxy_url, plan.model_name, prompt, "disaggregate")
            )
            want.append(await _stream(direct, single_url, plan.model_name, prompt))
        # (before any prompt is computed on D)
        stats = (await read_stats(direct, plan)).since(before)
        for prompt in SMOKE_PROMPTS:
            auto.append(await _stream(proxy, plan.proxy_url, plan.model_name, prompt))
    same = sum(g.text == w.text for g, w in zip([*got, *auto], want * 2, strict=True))
    return Smoke(
        same,
        2 * len(SMOKE_PROMPTS),
        statistics.median(w.first for w in want),
        statistics.median(g.first for g in got),
        stats,
        proxied=len(SMOKE_PROMPTS) + 1,  # and the warm-up
        second_pd=statistics.median(g.second for g in got),
        ttft_auto=statistics.median(a.first for a in auto),
        auto_placed=dict(collections.Counter(a.placement or "?" for a in auto)),
    )
