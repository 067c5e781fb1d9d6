"""What ``pdactors launch`` shows: a live table of the deployment's components (rich), the few
lines worth keeping (a component healthy, the proxy's URL, a failure), and under the table the
figures (:class:`~pdactors.deploy.stats.Stats`) read from the components' ``/metrics``.

Sans-IO: the command feeds it states and figures; it renders.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import Console, Group, RenderableType
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from pdactors.deploy.stats import Stats

__all__ = ["LaunchView"]

_ICONS = {"healthy": "[green]✓[/]", "ready": "[green]✓[/]", "failed": "[red]✗[/]"}


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

    def add(self, name: str, where: str = "") -> None:
        """A component to show, ``waiting`` until :meth:`set` or :meth:`progress` says more."""
        self.components[name] = _Component(name, where)

    def set(self, name: str, state: str, *, took: float | None = None) -> None:
        c = self.components[name]
        if c.state != state:
            c.state, c.since, c.took = state, time.monotonic(), took

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def progress(self, name: str, elapsed: float, ok: bool) -> None:
        """The ``progress`` callback of :func:`~pdactors.deploy.supervise.launch`: a component
        answered ``/health`` (or not yet)."""
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
