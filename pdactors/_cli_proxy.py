"""``pdactors proxy``: the OpenAI-compatible PD proxy's command and its options (its HTTP
door's in :mod:`pdactors._cli_doors`). Registered on the app in :mod:`pdactors.cli`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from pdactors._cli_doors import (
    MAX_CONNECTIONS_PER_CLIENT,
    WRITE_TIMEOUT,
    PerClientCap,
    WriteTimeout,
    token_from,
)
from pdactors._cli_setup import setup
from pdactors.config import DEFAULT_BOOTSTRAP_PORT, default_of
from pdactors.proxy_config import ROUTINGS, ProxyConfig

__all__ = ["proxy"]


def proxy(
    prefill: Annotated[
        list[str] | None,
        typer.Option(
            metavar="URL@BOOTSTRAP",
            help="A prefill engine as ENGINE_URL@BOOTSTRAP_URL, e.g. "
            "http://10.0.0.5:8100@http://10.0.0.5:8998; a bare ENGINE_URL means its bootstrap "
            f"is on port {DEFAULT_BOOTSTRAP_PORT} of the same host. Repeat for several.",
        ),
    ] = None,
    decode: Annotated[
        list[str] | None,
        typer.Option(
            metavar="URL", help="A decode engine's URL, e.g. http://10.0.0.6:8200. Repeat."
        ),
    ] = None,
    engine: Annotated[
        list[str] | None,
        typer.Option(
            metavar="URL@BOOTSTRAP",
            help="An engine that takes every role (kv_role kv_both), as --prefill's: per "
            "request it computes a prompt for another, decodes after another, or serves the "
            "request whole. Repeat; may replace --prefill and --decode or join them.",
        ),
    ] = None,
    host: Annotated[str, typer.Option(metavar="ADDR", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(metavar="PORT", help="Port to bind (0: any free port).")
    ] = 8000,
    routing: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help=f"How P and D engines are picked: {', '.join(ROUTINGS)} (docs/proxy.md).",
        ),
    ] = default_of(ProxyConfig, "routing"),
    prefill_routing: Annotated[
        str | None, typer.Option(metavar="NAME", help="P's routing, when not --routing's.")
    ] = None,
    decode_routing: Annotated[
        str | None, typer.Option(metavar="NAME", help="D's routing, when not --routing's.")
    ] = None,
    prefix_imbalance: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="prefix_aware: the best-matching engine is picked unless it has more than N "
            "requests in flight beyond the least-loaded one.",
        ),
    ] = default_of(ProxyConfig, "prefix_imbalance"),
    prefix_max_blocks: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="prefix_aware: prompt blocks (64 characters or 16 token ids) remembered per "
            "role, least recently sent first out.",
        ),
    ] = default_of(ProxyConfig, "prefix_max_blocks"),
    prefix_max_age: Annotated[
        float,
        typer.Option(metavar="SECONDS", help="prefix_aware: how long a block is remembered."),
    ] = default_of(ProxyConfig, "prefix_max_age"),
    kv_events: Annotated[
        bool,
        typer.Option(
            help="prefix_aware: match prompts against the KV events of engines that publish "
            "them (vLLM's --kv-events-config), found at their /kv_event_sources.",
        ),
    ] = default_of(ProxyConfig, "kv_events"),
    first_token: Annotated[
        str,
        typer.Option(
            metavar="p|d",
            help="p: the client's first token is P's answer and D continues after it; d: "
            "upstream's flow (P and D at once, D computes every token).",
        ),
    ] = default_of(ProxyConfig, "first_token"),
    placement: Annotated[
        str,
        typer.Option(
            metavar="auto|disaggregate|local|whole-on-p",
            help="auto: per request, P or D computes the prompt, whichever the proxy's "
            "measurements say costs less; disaggregate: P computes every prompt; local: D "
            "serves each request whole; whole-on-p: a P serves each request whole.",
        ),
    ] = default_of(ProxyConfig, "placement"),
    placement_stall_weight: Annotated[
        float,
        typer.Option(
            metavar="W",
            help="auto: what a ms of pause to a request D is decoding counts for against a "
            "ms of the new request's time to first token.",
        ),
    ] = default_of(ProxyConfig, "placement_stall_weight"),
    slo_tpot_ms: Annotated[
        float,
        typer.Option(
            metavar="MS",
            help="auto: the time-per-output-token objective; once what D's clients get per "
            "token nears it, a P serves the next requests whole (0: never).",
        ),
    ] = default_of(ProxyConfig, "slo_tpot_ms"),
    slo_ttft_ms: Annotated[
        float,
        typer.Option(
            metavar="MS",
            help="auto: the time-to-first-token objective; when only one placement's "
            "estimate meets it, that one is taken (0: not weighed).",
        ),
    ] = default_of(ProxyConfig, "slo_ttft_ms"),
    fall_back_to_d: Annotated[
        bool,
        typer.Option(
            "--fall-back-to-d/--no-fall-back-to-d",
            help="With no P in rotation, or a P that fails (or is judged failed) before its "
            "first token, D serves the request alone (instead of a 503/502).",
        ),
    ] = default_of(ProxyConfig, "fall_back_to_d"),
    fall_back_to_p: Annotated[
        bool,
        typer.Option(
            "--fall-back-to-p/--no-fall-back-to-p",
            help="With no D in rotation, a P serves each request whole (instead of a 503).",
        ),
    ] = default_of(ProxyConfig, "fall_back_to_p"),
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate/--no-calibrate",
            help="auto: probe each engine with a few requests as it enters the rotation, so "
            "placement starts from what it measured.",
        ),
    ] = default_of(ProxyConfig, "calibrate"),
    migration_limit: Annotated[
        int,
        typer.Option(
            metavar="N",
            help="How many times one request may move to another engine when the one "
            "decoding it fails; the next continues after the tokens the client got (0: never).",
        ),
    ] = default_of(ProxyConfig, "migration_limit"),
    health_interval: Annotated[
        float, typer.Option(metavar="SECONDS", help="Seconds between health checks.")
    ] = default_of(ProxyConfig, "health_interval"),
    health_timeout: Annotated[
        float,
        typer.Option(
            metavar="SECONDS",
            help="An engine whose GET /health gives no answer within this is out of rotation, "
            "and the P-first requests waiting for its first token go to D.",
        ),
    ] = default_of(ProxyConfig, "health_timeout"),
    request_timeout: Annotated[
        float, typer.Option(metavar="SECONDS", help="The longest one request may take, in seconds.")
    ] = default_of(ProxyConfig, "request_timeout"),
    max_body_bytes: Annotated[
        int, typer.Option(metavar="BYTES", help="Larger request bodies are refused (413).")
    ] = default_of(ProxyConfig, "max_body_bytes"),
    body_timeout: Annotated[
        float,
        typer.Option(
            metavar="SECONDS",
            help="A request body not all in by then is refused (408), its connection closed.",
        ),
    ] = default_of(ProxyConfig, "body_timeout"),
    max_connections_per_client: PerClientCap = MAX_CONNECTIONS_PER_CLIENT,
    write_timeout: WriteTimeout = WRITE_TIMEOUT,
    bootstrap_token_file: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="File holding the bearer token P's bootstraps ask for."),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            metavar="KEY",
            envvar="PDACTORS_PROXY_API_KEY",
            help="Clients must send Authorization: Bearer KEY (OpenAI's convention; /health "
            "and /metrics stay open).",
        ),
    ] = None,
    engine_api_key: Annotated[
        str | None,
        typer.Option(
            metavar="KEY",
            envvar="PDACTORS_ENGINE_API_KEY",
            help="The --api-key the vLLM servers were started with; sent to them.",
        ),
    ] = None,
    certfile: Annotated[
        Path | None, typer.Option(metavar="FILE", help="PEM certificate (chain): serve HTTPS.")
    ] = None,
    keyfile: Annotated[
        Path | None, typer.Option(metavar="FILE", help="PEM private key of --certfile.")
    ] = None,
    ca_file: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="CA bundle that signs the certificates of HTTPS bootstraps and engines.",
        ),
    ] = None,
    otlp_traces_endpoint: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            help="OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces): a span per "
            "request, its traceparent sent to P and D (needs pdactors[tracing]).",
        ),
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose/--quiet", "-v", help="Log at INFO (--quiet: warnings only).")
    ] = True,
) -> None:
    """Serve the OpenAI-compatible PD proxy (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics) in front of prefill and decode engines until Ctrl-C."""
    setup(verbose)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line per engine call
    import trio

    from pdactors.config import Secret
    from pdactors.proxy import serve_proxy
    from pdactors.proxy_config import PrefillBackend, ProxyConfig

    parsed = []
    for option, values in (("--prefill", prefill), ("--engine", engine)):
        try:
            parsed.append(tuple(PrefillBackend.parse(p) for p in values or ()))
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint=option) from None
    try:
        config = ProxyConfig(
            prefill=parsed[0],
            decode=tuple(decode or ()),
            engines=parsed[1],
            host=host,
            port=port,
            routing=routing,  # type: ignore[arg-type]  # checked by ProxyConfig
            prefill_routing=prefill_routing,  # type: ignore[arg-type]  # checked by ProxyConfig
            decode_routing=decode_routing,  # type: ignore[arg-type]  # checked by ProxyConfig
            prefix_imbalance=prefix_imbalance,
            prefix_max_blocks=prefix_max_blocks,
            prefix_max_age=prefix_max_age,
            kv_events=kv_events,
            first_token=first_token,  # type: ignore[arg-type]  # checked by ProxyConfig
            placement=placement,  # type: ignore[arg-type]  # checked by ProxyConfig
            placement_stall_weight=placement_stall_weight,
            slo_tpot_ms=slo_tpot_ms,
            slo_ttft_ms=slo_ttft_ms,
            fall_back_to_d=fall_back_to_d,
            fall_back_to_p=fall_back_to_p,
            migration_limit=migration_limit,
            calibrate=calibrate,
            health_interval=health_interval,
            health_timeout=health_timeout,
            request_timeout=request_timeout,
            max_body_bytes=max_body_bytes,
            body_timeout=body_timeout,
            max_connections_per_client=max_connections_per_client,
            write_timeout=write_timeout,
            bootstrap_token=token_from(bootstrap_token_file, "--bootstrap-token-file"),
            api_key=Secret(api_key.strip()) if api_key and api_key.strip() else None,
            engine_api_key=Secret(engine_api_key.strip()) if engine_api_key else None,
            certfile=str(certfile) if certfile else None,
            keyfile=str(keyfile) if keyfile else None,
            ca_file=str(ca_file) if ca_file else None,
            otlp_traces_endpoint=otlp_traces_endpoint or None,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_proxy, config)
            typer.echo(f"proxy serving on {url}")

    try:
        trio.run(main)
    except KeyboardInterrupt:
        pass
