"""What ``pdactors launch`` shows: a live table of the deployment's components (rich), the few
lines worth keeping (a component healthy, the proxy's URL, a failure), and the figures read
from the components' ``/metrics``.

Sans-IO: the command feeds it states and metric texts; it renders.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

__all__ = ["LaunchView", "Stats", "metric_total"]

_ICONS = {"healthy": "[green]✓[/]", "ready": "[green]✓[/]", "failed": "[red]✗[/]"}


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

    def line(self) -> str:
        ttft = f"{1000 * self.ttft_sum / self.ttft_count:.0f} ms" if self.ttft_count else "–"
        return (
            f"requests {self.requests:.0f} ({self.in_flight:.0f} in flight) · "
            f"KV transfers {self.transfers:.0f} ({self.kv_bytes / 2**20:.1f} MiB) · "
            f"time to first token {ttft} (mean) · "
            f"prompt tokens D computed {self.d_local_prompt_tokens:.0f}"
        )


@dataclass
class _Component:
    name: str
    where: str
    state: str = "waiting"
    since: float = field(default_factory=time.monotonic)
    took: float | None = None  # seconds from start to healthy / built


class LaunchView:
    """The live status of one launch. Render it with ``rich.live.Live(view)`` on a terminal;
    :meth:`say` prints a line either way (above the live table on a terminal)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.components: dict[str, _Component] = {}
        self.stats: Stats | None = None
        self.started = time.monotonic()

    def add(self, name: str, where: str = "", state: str = "waiting") -> None:
        self.components[name] = _Component(name, where, state)

    def set(self, name: str, state: str, *, took: float | None = None) -> None:
        c = self.components[name]
        if c.state != state:
            c.state, c.since, c.took = state, time.monotonic(), took

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def progress(self, name: str, elapsed: float, ok: bool) -> None:
        """The launcher's health callback: a component answered ``/health`` (or not yet)."""
        c = self.components[name]
        if ok and c.state != "healthy":
            self.set(name, "healthy", took=elapsed)
            self.say(f"[green]✓[/] {name} healthy after {elapsed:.0f} s")
        elif not ok and c.state == "waiting":
            self.set(name, "starting")

    def __rich__(self) -> RenderableType:
        now = time.monotonic()
        table = Table(box=None, show_header=False, padding=(0, 2, 0, 0))
        for c in self.components.values():
            icon: RenderableType
            if c.state in _ICONS:
                icon = Text.from_markup(_ICONS[c.state])
            elif c.state == "waiting":
                icon = Text("·", style="dim")
            else:
                icon = Spinner("dots", style="cyan")
            seconds = c.took if c.took is not None else now - c.since
            table.add_row(icon, c.name, c.state, f"{seconds:.0f} s", Text(c.where, style="dim"))
        footer = Text(
            self.stats.line() if self.stats else f"{now - self.started:.0f} s", style="dim"
        )
        return Group(table, footer)
