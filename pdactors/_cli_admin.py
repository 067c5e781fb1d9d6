"""The operator's commands on a running proxy: ``pdactors drain`` (and ``--resume``), through
its ``/admin`` routes (:mod:`pdactors.proxy._admin`). Registered on the app in
:mod:`pdactors.cli`."""

from __future__ import annotations

import json
from typing import Annotated

import httpx
import typer

__all__ = ["drain"]


def drain(
    proxy_url: Annotated[
        str, typer.Argument(metavar="PROXY_URL", help="The proxy, e.g. http://127.0.0.1:8000.")
    ],
    engine: Annotated[
        str, typer.Argument(metavar="ENGINE_URL", help="The engine, as the proxy knows it.")
    ],
    migrate: Annotated[
        bool,
        typer.Option(help="Also hand what the engine holds now to other engines (migration)."),
    ] = False,
    wait: Annotated[
        float,
        typer.Option(
            metavar="SECONDS", help="Answer once the engine holds nothing, or after this."
        ),
    ] = 600.0,
    resume: Annotated[
        bool, typer.Option("--resume", help="Put the engine back in the routing instead.")
    ] = False,
    api_key: Annotated[
        str | None,
        typer.Option(metavar="KEY", envvar="PDACTORS_PROXY_API_KEY", help="The proxy's key."),
    ] = None,
) -> None:
    """Take an engine out of a running proxy's routing without failing a request: it gets no
    new request, what it holds finishes (or, with --migrate, goes on on other engines), and
    the command returns once it holds nothing (exit 0) or --wait passed (exit 1). Prints the
    engine's state as the proxy sees it."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    route = "resume" if resume else "drain"
    body: dict[str, object] = {"engine": engine}
    if not resume:
        body |= {"migrate": migrate, "wait": wait}
    try:
        timeout = httpx.Timeout(10.0, read=wait + 10.0)
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            resp = client.post(f"{proxy_url.rstrip('/')}/admin/{route}", json=body, headers=headers)
    except httpx.HTTPError as exc:
        typer.echo(f"pdactors {route}: {proxy_url}: {exc}", err=True)
        raise typer.Exit(2) from exc
    if resp.status_code != 200:
        typer.echo(f"pdactors {route}: HTTP {resp.status_code}: {resp.text[:500]}", err=True)
        raise typer.Exit(2)
    state = resp.json()
    typer.echo(json.dumps(state, indent=2))
    if not resume and not state.get("empty"):
        raise typer.Exit(1)
