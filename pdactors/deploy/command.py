"""The ``pdactors launch`` command: options, the live status, the smoke check and its summary.

The supervision itself is :mod:`pdactors.launcher`; what the terminal shows is
:mod:`pdactors.launch_view`. Every child's output goes to a log file in the run directory; the
terminal gets a screen: the components' states, the proxy's URL, figures, and on a failure the
tail of the failed component's log.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec
import trio
import typer
from rich.console import Console
from rich.live import Live
from rich.panel import Panel

from pdactors.config import PROTOCOLS
from pdactors.launch_view import LaunchView, Stats
from pdactors.launcher import (
    ChildDied,
    LaunchConfig,
    Plan,
    RunSecrets,
    is_loopback,
    launch,
    log_tail,
    make_secrets,
    plan_deployment,
)

__all__ = ["launch_command"]

SMOKE_PROMPTS = [
    "The river runs past the old mill and",
    "In the morning the market opens",
    "She looked at the map once more,",
    "A short story about a lighthouse:",
]
_DEFAULTS = LaunchConfig()
_METRICS_EVERY = 2.0  # seconds between reads of the components' /metrics once serving


def _default(key: str) -> str:
    return f"[default: {getattr(_DEFAULTS, key)}]"


def _run_dir(path: Path | None) -> Path:
    if path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(tempfile.gettempdir()) / "pdactors" / f"run-{stamp}-{os.getpid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load(config_file: Path | None, overrides: dict[str, Any]) -> LaunchConfig:
    data: dict[str, Any] = {}
    if config_file is not None:
        data = tomllib.loads(config_file.read_text())
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(data, LaunchConfig)
    except msgspec.ValidationError as exc:
        raise typer.BadParameter(str(exc)) from None


class ModelBuildFailed(Exception):
    """The tiny model could not be built (its log says why)."""


async def _tiny_model(view: LaunchView, run_dir: Path) -> str:
    """Build (once) and locate the project's tiny model, in a child process (torch stays out
    of this one); its output goes to ``tiny-model.log``."""
    log, answer = run_dir / "tiny-model.log", run_dir / "tiny-model.path"
    code = (
        "import sys; from pdactors_vllm.tiny_model import ensure_tiny_model; "
        "open(sys.argv[1], 'w').write(str(ensure_tiny_model()))"
    )
    view.set("tiny model", "building")
    start = time.monotonic()
    with log.open("ab") as out:
        done = await trio.run_process(
            [sys.executable, "-c", code, str(answer)], stdout=out, stderr=out, check=False
        )
    if done.returncode != 0:
        view.set("tiny model", "failed")
        raise ModelBuildFailed(f"cannot build the tiny model (is pdactors-vllm installed?); {log}")
    view.set("tiny model", "ready", took=time.monotonic() - start)
    return answer.read_text().strip()


@dataclass
class Smoke:
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
        return (
            self.same == self.total
            and self.stats.kv_bytes > 0
            and self.stats.d_local_prompt_tokens <= self.proxied
        )

    def lines(self) -> list[str]:
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


async def _read_stats(http: httpx.AsyncClient, plan: Plan) -> Stats:
    def url(name: str) -> str:
        child = next(c for c in plan.children if c.name == name)
        return child.base_url + "/metrics"

    async def text(name: str) -> str:
        return (await http.get(url(name))).text

    stats = Stats()
    names = [c.name for c in plan.children]
    stats.add_proxy(await text("proxy"))
    stats.add_prefill([await text(n) for n in names if n.startswith("prefill-")])
    stats.add_decode([await text(n) for n in names if n.startswith("decode-")])
    return stats


async def _watch(view: LaunchView, plan: Plan) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                view.stats = await _read_stats(http, plan)
            await trio.sleep(_METRICS_EVERY)


async def _smoke(plan: Plan, api_key: str | None) -> Smoke:
    """Each prompt to the single server and through the proxy disaggregated (the answers must
    be equal, the KV must have moved, D must not have computed the prompts), then through the
    proxy with its own placement (equal answers again)."""
    single = next(c for c in plan.children if c.name == "single")
    single_url = single.base_url
    engine_key = plan.extra.get("engine_key")
    got, want, auto = [], [], []
    async with (
        httpx.AsyncClient(trust_env=False, timeout=120, headers=_headers(api_key)) as proxy,
        httpx.AsyncClient(trust_env=False, timeout=120, headers=_headers(engine_key)) as direct,
    ):
        # One request each first, not counted: an engine's first request is slow (warm-up).
        await _stream(proxy, plan.proxy_url, plan.model_name, "Hello", "disaggregate")
        await _stream(direct, single_url, plan.model_name, "Hello")
        for prompt in SMOKE_PROMPTS:
            got.append(
                await _stream(proxy, plan.proxy_url, plan.model_name, prompt, "disaggregate")
            )
            want.append(await _stream(direct, single_url, plan.model_name, prompt))
        stats = await _read_stats(direct, plan)  # before any prompt is computed on D
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


@contextlib.contextmanager
def _live(view: LaunchView) -> Iterator[None]:
    """The live table on a terminal; elsewhere (a pipe, CI) only the lines :meth:`say` prints."""
    if not view.console.is_terminal:
        yield
        return
    with Live(view, console=view.console, refresh_per_second=4, transient=True):
        yield


def _secrets(console: Console, config: LaunchConfig) -> RunSecrets | None:
    run_secrets = None
    if config.secure:
        run_secrets = make_secrets(Path(tempfile.mkdtemp(prefix="pdactors-secrets-")))
        console.print(f"credentials for this run (0600): {run_secrets.directory}")
    elif not is_loopback(config.host):
        console.print(
            f"[yellow]warning: serving on {config.host} without --secure: anyone who can reach "
            "it can register with the bootstrap, pull or write KV and use the proxy[/]"
        )
    if config.secure and not is_loopback(config.host):
        console.print(
            f"[yellow]note: the HTTP edges on {config.host} are not TLS here: tokens and keys "
            "cross the network in the clear (see docs/security.md for certfile/keyfile)[/]"
        )
    return run_secrets


def _leaves(group: BaseExceptionGroup[Exception]) -> Iterator[Exception]:
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


def _report_failure(console: Console, group: BaseExceptionGroup[Exception]) -> None:
    errors = list(_leaves(group))
    died = [e for e in errors if isinstance(e, ChildDied)]
    for child in died[:1]:  # the first to die; the others are stopped because of it
        console.print(f"[red]✗ {child}[/]")
        if child.log is not None:
            tail = "\n".join(log_tail(child.log)) or "(empty)"
            console.print(Panel(tail, title=f"last lines of {child.log}", title_align="left"))
    for error in errors:
        if not isinstance(error, ChildDied):
            console.print(f"[red]✗ {type(error).__name__}: {error}[/]")


def _render(config: LaunchConfig, kind: str, out: Path) -> None:
    if kind != "k8s":
        raise typer.BadParameter(
            f"unknown render target {kind!r}; known: k8s", param_hint="--render"
        )
    from pdactors.k8s import write_manifests

    try:
        paths = write_manifests(config, out)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from None
    for path in paths:
        typer.echo(str(path))
    typer.echo(f"kubectl apply -f {out}/")


def launch_command(
    config_file: Annotated[
        Path | None,
        typer.Option("--config", metavar="FILE", help="TOML file with the keys of these options."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(metavar="PATH", help="Model to serve. [default: the tiny model, built once]"),
    ] = None,
    prefill: Annotated[
        int | None, typer.Option(metavar="N", help=f"P servers. {_default('prefill')}")
    ] = None,
    decode: Annotated[
        int | None, typer.Option(metavar="N", help=f"D servers. {_default('decode')}")
    ] = None,
    proxy_port: Annotated[
        int | None,
        typer.Option(metavar="PORT", help=f"Proxy port, 0: any. {_default('proxy_port')}"),
    ] = None,
    protocol: Annotated[
        str | None,
        typer.Option(
            metavar="NAME", help=f"KV data plane: {', '.join(PROTOCOLS)}. {_default('protocol')}"
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option(metavar="NIC", help="RDMA device name, e.g. mlx5_0.")
    ] = None,
    prefill_gpus: Annotated[
        list[str] | None,
        typer.Option(metavar="GPUS", help="CUDA_VISIBLE_DEVICES of one P server (repeat)."),
    ] = None,
    decode_gpus: Annotated[
        list[str] | None,
        typer.Option(metavar="GPUS", help="CUDA_VISIBLE_DEVICES of one D server (repeat)."),
    ] = None,
    smoke: Annotated[
        bool,
        typer.Option(
            "--smoke",
            help="Also start a plain server, compare answers through the proxy with its, print "
            "a summary and exit 0 (pass) or 1.",
        ),
    ] = False,
    secure: Annotated[
        bool | None,
        typer.Option(
            "--secure",
            help="Generate a side-channel secret (ZMQ CURVE), a bootstrap token and a proxy API "
            "key for the run (in a private directory) and wire every component with them.",
        ),
    ] = None,
    run_dir: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            help="Where the components' logs go. [default: a new run-* directory under "
            f"{Path(tempfile.gettempdir()) / 'pdactors'}]",
        ),
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Also stream every component's log here.")
    ] = False,
    render: Annotated[
        str | None,
        typer.Option(
            metavar="k8s",
            help="Start nothing: write the deployment as Kubernetes manifests into --out "
            "(the [k8s] table of --config; docs/deploy.md).",
        ),
    ] = None,
    out: Annotated[
        Path, typer.Option(metavar="DIR", help="Where --render writes the manifests.")
    ] = Path("manifests"),
) -> None:
    """Start a disaggregated deployment: P and D vLLM servers with PdActorsConnector, and the
    proxy. With no options: the tiny model on CPU, 1P1D. Ctrl-C stops everything."""
    console = Console(stderr=True, soft_wrap=True)  # paths and URLs stay whole
    config = _load(
        config_file,
        {
            "model": model,
            "prefill": prefill,
            "decode": decode,
            "proxy_port": 0 if smoke and proxy_port is None else proxy_port,
            "protocol": protocol,
            "device_name": device,
            "prefill_gpus": tuple(prefill_gpus) if prefill_gpus else None,
            "decode_gpus": tuple(decode_gpus) if decode_gpus else None,
            "secure": secure,
        },
    )
    if render is not None:
        _render(config, render, out)
        return
    logs = _run_dir(run_dir)
    console.print(f"logs: {logs}")
    run_secrets = _secrets(console, config)
    api_key = run_secrets.api_key if run_secrets else None
    view = LaunchView(console)
    if config.model is None:
        view.add("tiny model", "built once, then cached")
    result: list[Smoke] = []

    async def ready(plan: Plan) -> None:
        view.say(f"[bold]proxy: {plan.proxy_url}[/]")
        auth = f"-H 'Authorization: Bearer {api_key}' " if api_key else ""
        view.say(
            f"curl {plan.proxy_url}/v1/completions -H 'Content-Type: application/json' {auth}"
            f'-d \'{{"model": "{plan.model_name}", "prompt": "Hello", "max_tokens": 16}}\''
        )
        if smoke:
            view.say("smoke: comparing answers through the proxy with the single server's")
            result.append(await _smoke(plan, api_key))
            return
        await _watch(view, plan)

    async def main() -> None:
        with _live(view):
            path = config.model or await _tiny_model(view, logs)
            plan = plan_deployment(
                config,
                path,
                served_name=None if config.model else "tiny",
                single=smoke,
                run_secrets=run_secrets,
            )
            for child in plan.children:
                view.add(child.name, child.base_url)
            await launch(
                plan,
                startup_timeout=config.startup_timeout,
                shutdown_timeout=config.shutdown_timeout,
                log_dir=logs,
                progress=view.progress,
                when_ready=ready,
                out=(lambda line: print(line, flush=True)) if verbose else None,
            )

    try:
        trio.run(main)
    except* KeyboardInterrupt:
        console.print("stopped by Ctrl-C; every component is stopped")
        raise typer.Exit(1 if smoke else 0) from None
    except* (ChildDied, trio.TooSlowError, httpx.HTTPError, ModelBuildFailed) as group:
        _report_failure(console, group)
        if group.subgroup(trio.TooSlowError) is not None:
            pending = [c.name for c in view.components.values() if c.state == "starting"]
            console.print(f"not healthy in time: {', '.join(pending)}")
        console.print(f"[red]deployment ended; logs in {logs}[/]")
        raise typer.Exit(1) from None
    if smoke:
        (outcome,) = result
        for line in outcome.lines():
            console.print(line, highlight=False)
        raise typer.Exit(0 if outcome.passed else 1)
