"""The ``pdactors launch`` command: its options, and the flow from them to a running (or
smoke-checked, or rendered) deployment.

What to start is :mod:`pdactors.deploy.plan`; running it, :mod:`pdactors.deploy.supervise`; what
the terminal shows, :mod:`pdactors.deploy.view`; the smoke check, :mod:`pdactors.deploy.smoke`.
Every child's output goes to a log file in the run directory; the terminal gets a screen: the
components' states, the proxy's URL, figures, and on a failure the tail of the failed
component's log. The environment is read here (and passed on to the children), nowhere below.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec
import trio
import typer
from rich.console import Console
from rich.live import Live
from rich.panel import Panel

from pdactors._cli_setup import scratch_dir
from pdactors.config import PROTOCOLS
from pdactors.deploy.credentials import RunSecrets, is_loopback, make_secrets
from pdactors.deploy.errors import BadDeployConfig, ChildDied, DeployError, ModelBuildFailed
from pdactors.deploy.k8s import write_manifests
from pdactors.deploy.launch_config import LaunchConfig
from pdactors.deploy.plan import Plan, plan_deployment
from pdactors.deploy.restart import rolling_restart
from pdactors.deploy.smoke import Smoke, run_smoke
from pdactors.deploy.stats import read_stats
from pdactors.deploy.supervise import launch, log_tail
from pdactors.deploy.view import LaunchView

__all__ = ["launch_command"]

_DEFAULTS = LaunchConfig()
#: A rolling restart waits this long for a drained engine's requests, then hands them over.
_DRAIN_TIMEOUT = 120.0
_METRICS_EVERY = 2.0  # seconds between reads of the components' /metrics once serving


def _default(key: str) -> str:
    return f"[default: {getattr(_DEFAULTS, key)}]"


def _run_dir(path: Path | None) -> Path:
    if path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = scratch_dir() / f"run-{stamp}-{os.getpid()}"
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


async def _watch(view: LaunchView, plan: Plan) -> None:
    """Refresh the view's figures every few seconds, until cancelled."""
    async with httpx.AsyncClient(trust_env=False, timeout=5) as http:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                view.stats = await read_stats(http, plan)
            await trio.sleep(_METRICS_EVERY)


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
    try:
        paths = write_manifests(config, out)
    except BadDeployConfig as exc:
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
    both: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Servers that take every role (kv_both): per request the proxy makes one a P "
            "for another, a D after another, or has it serve the request whole. Alone, they "
            f"replace the P and D servers (--prefill/--decode then default to 0). "
            f"{_default('both')}",
        ),
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
    both_gpus: Annotated[
        list[str] | None,
        typer.Option(metavar="GPUS", help="CUDA_VISIBLE_DEVICES of one --both server (repeat)."),
    ] = None,
    placement: Annotated[
        str | None,
        typer.Option(
            metavar="auto|disaggregate|local|whole-on-p",
            help="The proxy's --placement: where each prompt is computed (docs/proxy.md). "
            f"{_default('placement')}",
        ),
    ] = None,
    slo_tpot_ms: Annotated[
        float | None,
        typer.Option(
            metavar="MS",
            help="The proxy's --slo-tpot-ms: with auto placement, the time-per-output-token "
            f"objective past which P serves requests whole (0: never). {_default('slo_tpot_ms')}",
        ),
    ] = None,
    slo_ttft_ms: Annotated[
        float | None,
        typer.Option(
            metavar="MS",
            help="The proxy's --slo-ttft-ms: with auto placement, the time-to-first-token "
            "objective a placement must meet to be taken (0: not weighed). "
            f"{_default('slo_ttft_ms')}",
        ),
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
            f"{scratch_dir()}]",
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
    """Start a disaggregated deployment: P and D vLLM servers (or servers of both roles) with
    PdActorsConnector, and the proxy. With no options: the tiny model on CPU, 1P1D. Ctrl-C
    stops everything."""
    console = Console(stderr=True, soft_wrap=True)  # paths and URLs stay whole
    config = _load(
        config_file,
        {
            "model": model,
            "prefill": 0 if both and prefill is None else prefill,
            "decode": 0 if both and decode is None else decode,
            "both": both,
            "proxy_port": 0 if smoke and proxy_port is None else proxy_port,
            "protocol": protocol,
            "device_name": device,
            "prefill_gpus": tuple(prefill_gpus) if prefill_gpus else None,
            "decode_gpus": tuple(decode_gpus) if decode_gpus else None,
            "both_gpus": tuple(both_gpus) if both_gpus else None,
            "secure": secure,
            "placement": placement,
            "slo_tpot_ms": slo_tpot_ms,
            "slo_ttft_ms": slo_ttft_ms,
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
    stopped: list[signal.Signals] = []  # the signal that stopped it (SIGTERM, SIGHUP)

    async def ready(plan: Plan) -> None:
        view.say(f"[bold]proxy: {plan.proxy_url}[/]")
        view.say(f"kill -USR1 {os.getpid()}: restart every engine, one at a time, under load")
        auth = f"-H 'Authorization: Bearer {api_key}' " if api_key else ""
        view.say(
            f"curl {plan.proxy_url}/v1/completions -H 'Content-Type: application/json' {auth}"
            f'-d \'{{"model": "{plan.model_name}", "prompt": "Hello", "max_tokens": 16}}\''
        )
        if smoke:
            view.say("smoke: comparing answers through the proxy with the single server's")
            result.append(await run_smoke(plan, api_key))
            return
        await _watch(view, plan)

    async def main() -> None:
        with _live(view):
            path = config.model or await _tiny_model(view, logs)
            plan = plan_deployment(
                config,
                path,
                env=os.environ,
                served_name=None if config.model else "tiny",
                single=smoke,
                run_secrets=run_secrets,
            )
            for child in plan.children:
                view.add(child.name, child.base_url)
            restarts = partial(
                rolling_restart,
                grace=config.shutdown_timeout,
                startup_timeout=config.startup_timeout,
                drain_timeout=_DRAIN_TIMEOUT,
                say=view.say,
                proxy_key=api_key,
            )
            by = await launch(
                plan,
                startup_timeout=config.startup_timeout,
                shutdown_timeout=config.shutdown_timeout,
                log_dir=logs,
                progress=view.progress,
                when_ready=ready,
                out=(lambda line: print(line, flush=True)) if verbose else None,
                stop_on=(signal.SIGTERM, signal.SIGHUP),
                restart_on=(signal.SIGUSR1,),
                restarts=restarts,
            )
            if by is not None:
                stopped.append(by)

    try:
        trio.run(main)
    except* KeyboardInterrupt:
        console.print("stopped by Ctrl-C; every component is stopped")
        raise typer.Exit(1 if smoke else 0) from None
    except* (DeployError, httpx.HTTPError) as group:
        _report_failure(console, group)
        console.print(f"[red]deployment ended; logs in {logs}[/]")
        raise typer.Exit(1) from None
    if stopped:
        console.print(f"stopped by {stopped[0].name}; every component is stopped")
        raise typer.Exit(1 if smoke else 0)
    if smoke:
        (outcome,) = result
        for line in outcome.lines():
            console.print(line, highlight=False)
        raise typer.Exit(0 if outcome.passed else 1)
