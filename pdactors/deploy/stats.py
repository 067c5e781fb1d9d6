"""The deployment's figures, read from the proxy's and the engines' ``/metrics``:
:func:`read_stats` fetches them into a :class:`Stats` (what the live view's footer and the smoke
summary show); :func:`metric_total` sums one metric of a Prometheus text exposition."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdactors.deploy.plan import Plan

__all__ = ["Stats", "metric_total", "read_stats"]


def metric_total(text: str, sample: str, **labels: str) -> float:
    """Sum of the samples named ``sample`` (e.g. ``x_total``) in a Prometheus text exposition
    whose labels include ``labels``; 0 when there are none."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@dataclass
class Stats:
    """The deployment's figures, from the proxy's and the engines' ``/metrics``."""

    requests: float = 0.0  # answered by the proxy
    in_flight: float = 0.0
    ttft_sum: float = 0.0  # seconds, over ``ttft_count`` requests
    ttft_count: float = 0.0
    transfers: float = 0.0  # KV transfers P wrote into D
    kv_bytes: float = 0.0
    d_local_prompt_tokens: float = 0.0  # prompt tokens D computed itself (0 when KV moved)

    def add_proxy(self, text: str) -> None:
        self.requests = metric_total(text, "pdactors_proxy_requests_total")
        self.in_flight = metric_total(text, "pdactors_proxy_requests_in_flight")
        self.ttft_sum = metric_total(text, "pdactors_proxy_ttft_seconds_sum")
        self.ttft_count = metric_total(text, "pdactors_proxy_ttft_seconds_count")

    def add_prefill(self, texts: Iterable[str]) -> None:
        texts = list(texts)
        self.transfers = sum(metric_total(t, "vllm:pdactors_transfers_sent_total") for t in texts)
        self.kv_bytes = sum(metric_total(t, "vllm:pdactors_bytes_sent_total") for t in texts)

    def add_decode(self, texts: Iterable[str]) -> None:
        name, source = "vllm:prompt_tokens_by_source_total", "local_compute"
        self.d_local_prompt_tokens = sum(metric_total(t, name, source=source) for t in texts)

    def since(self, before: Stats) -> Stats:
        """The counts since ``before`` was read (``in_flight`` as it is now): what a run of
        requests did, without what came earlier (the proxy's calibration probes, warm-ups)."""
        return Stats(
            self.requests - before.requests,
            self.in_flight,
            self.ttft_sum - before.ttft_sum,
            self.ttft_count - before.ttft_count,
            self.transfers - before.transfers,
            self.kv_bytes - before.kv_bytes,
            self.d_local_prompt_tokens - before.d_local_prompt_tokens,
        )

    def line(self) -> str:
        ttft = f"{1000 * self.ttft_sum / self.ttft_count:.0f} ms" if self.ttft_count else "–"
        return (
            f"requests {self.requests:.0f} ({self.in_flight:.0f} in flight) · "
            f"KV transfers {self.transfers:.0f} ({self.kv_bytes / 2**20:.1f} MiB) · "
            f"time to first token {ttft} (mean) · "
            f"prompt tokens D computed {self.d_local_prompt_tokens:.0f}"
        )


async def read_stats(http: httpx.AsyncClient, plan: Plan) -> Stats:
    """The figures of ``plan``'s deployment now: one ``GET /metrics`` per component.
    Raises ``httpx.HTTPError`` when one cannot be read."""

    async def text(name: str) -> str:
        child = next(c for c in plan.children if c.name == name)
        return (await http.get(child.base_url + "/metrics")).text

    stats = Stats()
    names = [c.name for c in plan.children]
    stats.add_proxy(await text("proxy"))
    # An every-role engine (engine-*) counts with the P's: the KV it sent; the prompt tokens it
    # computed are a P's or a D's, which its metrics do not tell apart.
    stats.add_prefill([await text(n) for n in names if n.startswith(("prefill-", "engine-"))])
    stats.add_decode([await text(n) for n in names if n.startswith("decode-")])
    return stats
