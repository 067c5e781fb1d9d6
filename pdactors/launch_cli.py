"""The ``pdactors launch`` command: argument handling, progress display and the smoke check.

The supervision itself is :mod:`pdactors.launcher`.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec
import trio
import typer
from rich.console import Console

from pdactors.config import PROTOCOLS
from pdactors.launcher import (
    ChildDied,
    LaunchConfig,
    Plan,
    is_loopback,
    launch,
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


def _tiny_model() -> str:
    """Build (once) and locate the project's tiny model; torch stays out of this process."""
    code = "from pdactors_vllm.tiny_model import ensure_tiny_model; print(ensure_tiny_model())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise typer.BadParameter(f"cannot build the tiny model:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def _load(config_file: Path | None, overrides: dict[str, Any]) -> LaunchConfig:
    data: dict[str, Any] = {}
    if config_file is not None:
        data = tomllib.loads(config_file.read_text())
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(data, LaunchConfig)
    except msgspec.ValidationError as exc:
        raise typer.BadParameter(str(exc)) from None


async def _completions(
    url: str, model: str, prompts: list[str], api_key: str | None = None
) -> list[str]:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(trust_env=False, timeout=120, headers=headers) as http:
        texts = []
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            answer = await http.post(f"{url}/v1/completions", json=body)
            answer.raise_for_status()
            texts.append(answer.json()["choices"][0]["text"])
        return texts


def launch_command(
    config_file: Annotated[
        Path | None, typer.Option("--config", help="TOML file with LaunchConfig keys.")
    ] = None,
    model: Annotated[str | None, typer.Option(help="Model path (default: the tiny model).")] = None,
    prefill: Annotated[int | None, typer.Option(help="Number of P servers.")] = None,
    decode: Annotated[int | None, typer.Option(help="Number of D servers.")] = None,
    proxy_port: Annotated[int | None, typer.Option(help="Proxy port (0: any).")] = None,
    protocol: Annotated[str | None, typer.Option(help=" or ".join(PROTOCOLS) + ".")] = None,
    device: Annotated[str | None, typer.Option(help="RDMA device name.")] = None,
    prefill_gpus: Annotated[
        list[str] | None, typer.Option(help="CUDA_VISIBLE_DEVICES per P server (repeat).")
    ] = None,
    decode_gpus: Annotated[
        list[str] | None, typer.Option(help="CUDA_VISIBLE_DEVICES per D server (repeat).")
    ] = None,
    smoke: Annotated[
        bool, typer.Option("--smoke", help="Check answers against a single server, then exit.")
    ] = False,
    secure: Annotated[
        bool | None,
        typer.Option(
            "--secure",
            help="Generate a side-channel secret (ZMQ CURVE), a bootstrap token and a proxy API "
            "key for the run (in a private directory) and wire every component with them.",
        ),
    ] = None,
) -> None:
    """Start a disaggregated deployment: P and D vLLM servers with PdActorsConnector, and the
    proxy. With no options: the tiny model on CPU, 1P1D. Ctrl-C stops everything."""
    console = Console(stderr=True)
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
    path = config.model or _tiny_model()
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
    plan = plan_deployment(
        config,
        path,
        served_name=None if config.model else "tiny",
        single=smoke,
        run_secrets=run_secrets,
    )
    api_key = run_secrets.api_key if run_secrets else None
    status = console.status("starting")
    healthy: set[str] = set()

    def progress(name: str, elapsed: float, ok: bool) -> None:
        if ok and name not in healthy:
            healthy.add(name)
            console.print(f"[green]✓[/] {name} healthy after {elapsed:.0f} s")
        waiting = [c.name for c in plan.children if c.name not in healthy]
        status.update(f"starting {', '.join(waiting)} ({elapsed:.0f} s)")

    result: dict[str, Any] = {}

    async def ready(plan: Plan) -> None:
        status.stop()
        console.print(f"[bold]proxy: {plan.proxy_url}[/]")
        auth = f"-H 'Authorization: Bearer {api_key}' " if api_key else ""
        console.print(
            f"curl {plan.proxy_url}/v1/completions -H 'Content-Type: application/json' {auth}"
            f'-d \'{{"model": "{plan.model_name}", "prompt": "Hello", "max_tokens": 16}}\''
        )
        if not smoke:
            await trio.sleep_forever()
        single = next(c for c in plan.children if c.name == "single")
        single_url = single.health_url.removesuffix("/health")
        got = await _completions(plan.proxy_url, plan.model_name, SMOKE_PROMPTS, api_key)
        engine_key = plan.extra.get("engine_key")
        want = await _completions(single_url, plan.model_name, SMOKE_PROMPTS, engine_key)
        result["same"] = sum(g == w for g, w in zip(got, want, strict=True))
        for prompt, g, w in zip(SMOKE_PROMPTS, got, want, strict=True):
            mark = "[green]same[/]" if g == w else "[red]DIFFERENT[/]"
            console.print(f"{mark} {prompt!r} -> {g!r}" + ("" if g == w else f" (single: {w!r})"))

    failure: list[str] = []
    status.start()
    try:
        trio.run(
            lambda: launch(
                plan,
                startup_timeout=config.startup_timeout,
                shutdown_timeout=config.shutdown_timeout,
                out=lambda line: print(line, flush=True),
                progress=progress,
                when_ready=ready,
            )
        )
    except* KeyboardInterrupt:
        failure.append("stopped by Ctrl-C")
    except* (ChildDied, trio.TooSlowError, httpx.HTTPError) as group:
        failure += [f"{type(e).__name__}: {e}" for e in group.exceptions]
    finally:
        status.stop()
    if failure:
        console.print("[red]deployment ended: " + "; ".join(failure) + "[/]")
        raise typer.Exit(0 if failure == ["stopped by Ctrl-C"] and not smoke else 1)
    if smoke:
        n = len(SMOKE_PROMPTS)
        ok = result.get("same") == n
        console.print(
            f"smoke: {result.get('same', 0)}/{n} answers through the proxy"
            " equal the single server's" + (" — PASS" if ok else " — FAIL")
        )
        raise typer.Exit(0 if ok else 1)
