"""Running a :class:`~pdactors.deploy.plan.Plan`: :func:`launch` starts every child in one trio
nursery, each in its own process group with its output in ``<log_dir>/<name>.log`` (and, when
asked, line by line with a ``[name]`` prefix to ``out``); it waits for every child to be healthy
(reporting progress), then serves until cancelled (Ctrl-C) or until any child dies. Either way
every child is stopped (SIGTERM, then SIGKILL after ``shutdown_timeout``), so no process is left
behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO

import httpx
import trio

from pdactors.deploy.errors import ChildDied, NotHealthy
from pdactors.deploy.plan import Child, Plan

__all__ = ["Running", "launch", "log_tail", "restart"]


def log_tail(path: Path, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of the log file ``path`` (read from its end; [] if missing)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * lines))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


async def _forward(
    name: str, stream: trio.abc.ReceiveStream, log: BinaryIO, out: Callable[[str], None] | None
) -> None:
    """Copy the child's output into its log file as it comes, and lines to ``out`` if given."""
    buffer = b""
    async for chunk in stream:
        log.write(chunk)
        log.flush()
        if out is None:
            continue
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            out(f"[{name}] {line.decode(errors='replace')}")
    if buffer and out is not None:
        out(f"[{name}] {buffer.decode(errors='replace')}")


async def _stop(process: trio.Process, grace: float) -> None:
    """SIGTERM the child's process group, then SIGKILL after ``grace`` seconds. Shielded."""
    with trio.CancelScope(shield=True):
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if process.returncode is not None:
                break
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            with trio.move_on_after(wait):
                await process.wait()
        try:  # stragglers in the group (vLLM's engine core and workers)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass(eq=False)
class Running:
    """A child as it runs now: its process (a new one after each :func:`restart`)."""

    child: Child
    process: trio.Process | None = None
    restarting: bool = False


async def restart(running: Running, grace: float) -> None:
    """Stop ``running``'s process as at the end (SIGTERM, then SIGKILL after ``grace``); its
    supervisor starts it again with the same command line (it does not count as a death)."""
    running.restarting = True
    assert running.process is not None
    await _stop(running.process, grace)


async def _supervise(
    running: Running,
    grace: float,
    log_dir: Path,
    out: Callable[[str], None] | None,
    *,
    task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED,
) -> None:
    child = running.child
    path = log_dir / f"{child.name}.log"
    first = True
    while True:  # once, unless restarted
        with path.open("ab") as log:
            process = await trio.lowlevel.open_process(
                child.argv, env=child.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            running.process, running.restarting = process, False
            try:
                async with trio.open_nursery() as nursery:
                    assert process.stdout is not None
                    nursery.start_soon(_forward, child.name, process.stdout, log, out)
                    if first:
                        task_status.started(process)
                        first = False
                    await process.wait()
                    # Its own children may hold the pipe open; what they print after this is
                    # lost.
                    nursery.cancel_scope.cancel()
                if not running.restarting:
                    raise ChildDied(child.name, process.returncode, path)
            finally:
                await _stop(process, grace)


async def _wait_healthy(
    children: list[Child],
    processes: dict[str, trio.Process],
    limit: float,
    progress: Callable[[str, float, bool], None],
) -> None:
    """Poll each child's ``/health`` until all answer; :class:`NotHealthy` (naming the others)
    after ``limit`` seconds. A child that exits first is reported by its own supervisor
    (:func:`_supervise` raises :class:`ChildDied`, which cancels this wait): raising it here
    too reported one death twice when both saw it before the cancel (a loaded machine)."""
    start = trio.current_time()
    pending = {c.name: c for c in children}
    async with httpx.AsyncClient(trust_env=False, timeout=2) as http:
        with trio.move_on_after(limit):
            while pending:
                for name, child in list(pending.items()):
                    if processes[name].returncode is not None:
                        await trio.sleep_forever()  # its supervisor raises ChildDied
                    try:
                        ok = _ready(child, await http.get(child.health_url))
                    except httpx.HTTPError:
                        ok = False
                    progress(name, trio.current_time() - start, ok)
                    if ok:
                        del pending[name]
                await trio.sleep(0.5)
    if pending:
        raise NotHealthy(list(pending), limit)


def _ready(child: Child, resp: httpx.Response) -> bool:
    """``child`` answered its health check as a ready one: 200, and for the proxy not
    ``"status": "degraded"`` (it serves with one role only: P or D not in rotation yet)."""
    if not resp.is_success:
        return False
    if child.name != "proxy":
        return True
    try:
        report = resp.json()
    except ValueError:
        return True  # no report: its 200 says all it says
    return not isinstance(report, dict) or report.get("status", "ok") == "ok"


async def launch(
    plan: Plan,
    *,
    startup_timeout: float,
    shutdown_timeout: float,
    log_dir: Path,
    progress: Callable[[str, float, bool], None],
    when_ready: Callable[[Plan], Awaitable[None]],
    out: Callable[[str], None] | None = None,
    stop_on: tuple[signal.Signals, ...] = (),
    restart_on: tuple[signal.Signals, ...] = (),
    restarts: Callable[[Plan, dict[str, Running]], Awaitable[None]] | None = None,
) -> signal.Signals | None:
    """Start ``plan``'s children, wait until all are healthy, then run ``when_ready``.

    Each child's output goes to ``log_dir/<name>.log`` (``log_dir`` must exist), and with
    ``out`` also line by line, prefixed ``[name]``. Returns when ``when_ready`` returns (None),
    or when this process receives one of the signals ``stop_on`` (that signal; what
    ``timeout``, systemd, ``docker stop`` and Kubernetes send is SIGTERM, a closed terminal
    SIGHUP: without this they end the launcher at once and leave its children running);
    raises (in an exception group) :class:`~pdactors.deploy.errors.ChildDied` if a child exits
    first, and :class:`~pdactors.deploy.errors.NotHealthy` if they are not healthy within
    ``startup_timeout``. The proxy (the child named ``proxy``) starts once the others are
    healthy. Every child is stopped on the way out, whatever happened. Once all are healthy,
    each of the signals ``restart_on`` runs ``restarts`` (the plan and its running children:
    :func:`pdactors.deploy.restart.rolling_restart`), one at a time.
    """
    processes: dict[str, trio.Process] = {}
    running = {c.name: Running(c) for c in plan.children}
    start = partial(_supervise, grace=shutdown_timeout, log_dir=log_dir, out=out)
    received: list[signal.Signals] = []
    async with trio.open_nursery() as nursery:
        if stop_on:
            await nursery.start(_stop_on, stop_on, nursery.cancel_scope, received)
        servers = [c for c in plan.children if c.name != "proxy"]
        proxy = [c for c in plan.children if c.name == "proxy"]
        for child in servers:
            processes[child.name] = await nursery.start(start, running[child.name])
        await _wait_healthy(servers, processes, startup_timeout, progress)
        for child in proxy:  # the proxy's /health needs its backends up
            processes[child.name] = await nursery.start(start, running[child.name])
        await _wait_healthy(proxy, processes, startup_timeout, progress)
        if restart_on and restarts is not None:
            await nursery.start(_restart_on, restart_on, partial(restarts, plan, running))
        await when_ready(plan)
        nursery.cancel_scope.cancel()
    return received[0] if received else None


async def _stop_on(
    signals: tuple[signal.Signals, ...],
    scope: trio.CancelScope,
    received: list[signal.Signals],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Cancel ``scope`` at the first of ``signals`` this process receives (noted in
    ``received``); the handlers are in place when it has started."""
    with trio.open_signal_receiver(*signals) as arrivals:
        task_status.started()
        async for signum in arrivals:
            received.append(signal.Signals(signum))
            scope.cancel()
            return


async def _restart_on(
    signals: tuple[signal.Signals, ...],
    restarts: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``restarts`` at each of ``signals`` this process receives, one run at a time (the
    same signal again while they run is run once after them: trio coalesces repeats)."""
    with trio.open_signal_receiver(*signals) as arrivals:
        task_status.started()
        async for _ in arrivals:
            await restarts()
