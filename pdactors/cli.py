"""The ``pdactors`` command. The only module (with the vLLM adapter) that reads env and argv."""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from pdactors import timeline
from pdactors.config import (
    DEFAULT_BOOTSTRAP_PORT,
    PROTOCOLS,
    ROUTINGS,
    BootstrapConfig,
    DataPlaneConfig,
    ProxyConfig,
    default_of,
)

if TYPE_CHECKING:
    from pdactors.testing.harness import HarnessReport

app = typer.Typer(
    help="pdactors: prefill/decode disaggregation for vLLM as Trio actors.",
    rich_markup_mode=None,  # click's plain help: flags without types, defaults in brackets
    no_args_is_help=True,
    add_completion=False,
)


def _setup(verbose: bool) -> None:
    # Mooncake logs every connection at INFO to stderr; keep it to errors unless asked.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if sink := os.environ.get(timeline.ENV):  # where the transfers' timelines go (bench)
        timeline.enable(sink)


def _native_log_aside(verbose: bool) -> Path | None:
    """Send what native code writes to stderr (Mooncake's glog lines: even at ERROR it prints
    a harmless "Local segment descriptor not found" per engine) to a file, while Python's own
    output (logging, tracebacks, this command's) keeps the terminal. Returns the file."""
    if verbose:
        return None
    import sys
    import tempfile

    path = Path(tempfile.gettempdir()) / "pdactors" / f"native-{os.getpid()}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal = os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 2)
    sys.stderr = os.fdopen(terminal, "w", buffering=1)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(
            handler, logging.FileHandler
        ):
            handler.setStream(sys.stderr)
    return path


def _native_log_done(path: Path | None, passed: bool) -> None:
    """Keep the native log of a failed run (and say where), drop a passed run's."""
    if path is None:
        return
    if passed:
        path.unlink(missing_ok=True)
    else:
        typer.echo(f"Mooncake's own log: {path}")


@app.command()
def harness(
    requests: Annotated[int, typer.Option(metavar="N", help="Requests to transfer.")] = 8,
    blocks: Annotated[int, typer.Option(metavar="N", help="KV blocks per request.")] = 63,
    layers: Annotated[int, typer.Option(metavar="N", help="Layers (one KV region each).")] = 36,
    block_bytes: Annotated[
        int, typer.Option(metavar="BYTES", help="Bytes per layer per block.")
    ] = 64 * 1024,
    concurrency: Annotated[int, typer.Option(metavar="N", help="Transfers in flight at once.")] = 1,
    protocol: Annotated[
        str, typer.Option(metavar="NAME", help=f"Mooncake protocol: {', '.join(PROTOCOLS)}.")
    ] = default_of(DataPlaneConfig, "protocol"),
    device: Annotated[
        str, typer.Option(metavar="NIC", help="Mooncake device name (RDMA NIC).")
    ] = "",
    p_tp: Annotated[int, typer.Option(metavar="N", help="P's tensor-parallel workers.")] = 1,
    d_tp: Annotated[int, typer.Option(metavar="N", help="D's tensor-parallel workers.")] = 1,
    kv_heads: Annotated[
        int,
        typer.Option(
            metavar="N", help="The model's KV heads (split --block-bytes); 8 when TP sizes differ."
        ),
    ] = 0,
    secure: Annotated[
        bool, typer.Option("--secure", help="ZMQ CURVE on the side channel (fresh keys).")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log at INFO, and Mooncake's own log too.")
    ] = False,
) -> None:
    """Run P and D actors with real Mooncake engines, move real KV bytes and verify them.

    Defaults are the reference request: 36 layers x 63 blocks x 64 KiB = 141.75 MiB.
    With --p-tp/--d-tp each engine runs that many workers (one Mooncake engine each), each
    holding its KV heads, and every head is verified on the D worker that holds it.
    Exits 1 when any byte is wrong, any transfer fails, or any block is left allocated.
    """
    _setup(verbose)
    native_log = _native_log_aside(verbose)
    import trio

    from pdactors.config import DataPlaneConfig
    from pdactors.testing.harness import run_harness

    if protocol not in PROTOCOLS:
        raise typer.BadParameter(f"unknown protocol {protocol!r}", param_hint="--protocol")
    dataplane = DataPlaneConfig(protocol=protocol, device_name=device)  # type: ignore[arg-type]
    run = partial(
        run_harness,
        requests=requests,
        blocks=blocks,
        layers=layers,
        block_bytes=block_bytes,
        concurrency=concurrency,
        dataplane=dataplane,
        progress=True,
        p_tp=p_tp,
        d_tp=d_tp,
        kv_heads=kv_heads or (8 if p_tp != d_tp else 0),
        secure=secure,
        on_report=_print_report,  # before the engines' teardown (~1 s each)
    )
    report = trio.run(run)
    _native_log_done(native_log, report.passed)
    raise typer.Exit(0 if report.passed else 1)


def _print_report(report: HarnessReport) -> None:
    typer.echo(report.summary())
    typer.echo("PASS: every byte verified, no block leaked" if report.passed else "FAIL")


@app.command()
def chaos(
    seconds: Annotated[
        float, typer.Option(metavar="SECONDS", help="How long to inject faults.")
    ] = 30.0,
    seed: Annotated[
        int, typer.Option(metavar="N", help="Seed of the fault schedule and the transfers.")
    ] = 0,
    concurrency: Annotated[int, typer.Option(metavar="N", help="Transfers in flight at once.")] = 8,
    netns: Annotated[
        bool,
        typer.Option(
            "--netns",
            help="P in a network namespace of its own, joined by a veth pair (root); adds "
            "cut links and, where the kernel has netem, packet loss.",
        ),
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log at INFO, and Mooncake's own log too.")
    ] = False,
) -> None:
    """Move transfers through a P process and a D receiver while killing, stopping and
    restarting P, aborting on D, dropping and delaying messages, failing writes and restarting
    the bootstrap. Prints per fault kind how fast the transfers it hit ended, then
    "chaos: N transfers, N ok, N failed, N hung, N leaked blocks". Exits 1 if any transfer
    hung, any block leaked or any delivered byte was wrong.
    """
    _setup(verbose)
    native_log = _native_log_aside(verbose)
    import trio

    from pdactors.testing.chaos import run_chaos

    typer.echo(f"chaos: {seconds:g} s, seed {seed}, concurrency {concurrency}")
    run = partial(
        run_chaos, seconds=seconds, seed=seed, concurrency=concurrency, progress=True, netns=netns
    )
    report = trio.run(run)
    typer.echo(report.table())
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(report.reasons.items()))
    typer.echo(f"failures by reason: {reasons or 'none'}")
    typer.echo(report.last_line())
    _native_log_done(native_log, report.passed)
    raise typer.Exit(0 if report.passed else 1)


@app.command()
def bootstrap(
    host: Annotated[str, typer.Option(metavar="ADDR", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(metavar="PORT", help="Port to bind (0: any free port).")
    ] = DEFAULT_BOOTSTRAP_PORT,
    token_file: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="File holding a bearer token that POST /register and GET /query must carry "
            "(GET /health stays open). Without it anyone who can reach the port may register.",
        ),
    ] = None,
    certfile: Annotated[
        Path | None, typer.Option(metavar="FILE", help="PEM certificate (chain): serve HTTPS.")
    ] = None,
    keyfile: Annotated[
        Path | None, typer.Option(metavar="FILE", help="PEM private key of --certfile.")
    ] = None,
    max_workers: Annotated[
        int,
        typer.Option(
            metavar="N", help="The most registrations (dp/tp/pp ranks) held; one more gets 429."
        ),
    ] = default_of(BootstrapConfig, "max_workers"),
    verbose: Annotated[
        bool, typer.Option("--verbose/--quiet", "-v", help="Log at INFO (--quiet: warnings only).")
    ] = True,
) -> None:
    """Serve the bootstrap registry (POST /register, GET /query, GET /health) until Ctrl-C."""
    _setup(verbose)
    import trio

    from pdactors.actors.bootstrap import serve_bootstrap

    if (certfile is None) != (keyfile is None):
        raise typer.BadParameter("give both --certfile and --keyfile, or neither")
    config = BootstrapConfig(
        host=host,
        port=port,
        token=_token(token_file, "--token-file"),
        certfile=str(certfile) if certfile else None,
        keyfile=str(keyfile) if keyfile else None,
        max_workers=max_workers,
    )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_bootstrap, config)
            typer.echo(f"bootstrap serving on {url}")

    try:
        trio.run(main)
    except KeyboardInterrupt:
        pass


def _token(path: Path | None, option: str) -> str | None:
    """The token in the file ``path`` names (None: no file), or a clean CLI error."""
    if path is None:
        return None
    from pdactors.config import read_token_file

    try:
        return read_token_file(path)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


def _prefill_backend(value: str) -> tuple[str, str]:
    """``URL@BOOTSTRAP_URL`` (or just ``URL``) → (engine URL, bootstrap URL)."""
    from urllib.parse import urlsplit

    engine, sep, bootstrap = value.partition("@")
    if not sep:
        parts = urlsplit(engine)
        if not parts.hostname:
            raise typer.BadParameter(f"{value!r} is not a URL", param_hint="--prefill")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        bootstrap = f"http://{host}:{DEFAULT_BOOTSTRAP_PORT}"
    return engine, bootstrap


@app.command()
def proxy(
    prefill: Annotated[
        list[str],
        typer.Option(
            metavar="URL@BOOTSTRAP",
            help="A prefill engine as ENGINE_URL@BOOTSTRAP_URL, e.g. "
            "http://10.0.0.5:8100@http://10.0.0.5:8998; a bare ENGINE_URL means its bootstrap "
            f"is on port {DEFAULT_BOOTSTRAP_PORT} of the same host. Repeat for several.",
        ),
    ],
    decode: Annotated[
        list[str],
        typer.Option(
            metavar="URL", help="A decode engine's URL, e.g. http://10.0.0.6:8200. Repeat."
        ),
    ],
    host: Annotated[str, typer.Option(metavar="ADDR", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(metavar="PORT", help="Port to bind (0: any free port).")
    ] = 8000,
    routing: Annotated[
        str, typer.Option(metavar="NAME", help=f"{' or '.join(ROUTINGS)} (per role).")
    ] = default_of(ProxyConfig, "routing"),
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
            metavar="auto|disaggregate|local",
            help="auto: per request, P or D computes the prompt, whichever the proxy's "
            "measurements say costs less; disaggregate: P computes every prompt; local: D "
            "serves each request whole.",
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
    fall_back_to_d: Annotated[
        bool,
        typer.Option(
            "--fall-back-to-d/--no-fall-back-to-d",
            help="With no P in rotation, or a P that fails before its first token, D serves "
            "the request alone (instead of a 503/502).",
        ),
    ] = default_of(ProxyConfig, "fall_back_to_d"),
    health_interval: Annotated[
        float, typer.Option(metavar="SECONDS", help="Seconds between health checks.")
    ] = default_of(ProxyConfig, "health_interval"),
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
    verbose: Annotated[
        bool, typer.Option("--verbose/--quiet", "-v", help="Log at INFO (--quiet: warnings only).")
    ] = True,
) -> None:
    """Serve the OpenAI-compatible PD proxy (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics) in front of prefill and decode engines until Ctrl-C."""
    _setup(verbose)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line per engine call
    import trio

    from pdactors.config import PrefillBackend, ProxyConfig, Secret
    from pdactors.proxy import serve_proxy

    backends = tuple(PrefillBackend(*_prefill_backend(p)) for p in prefill)
    try:
        config = ProxyConfig(
            prefill=backends,
            decode=tuple(decode),
            host=host,
            port=port,
            routing=routing,  # type: ignore[arg-type]  # checked by ProxyConfig
            first_token=first_token,  # type: ignore[arg-type]  # checked by ProxyConfig
            placement=placement,  # type: ignore[arg-type]  # checked by ProxyConfig
            placement_stall_weight=placement_stall_weight,
            fall_back_to_d=fall_back_to_d,
            health_interval=health_interval,
            request_timeout=request_timeout,
            max_body_bytes=max_body_bytes,
            body_timeout=body_timeout,
            bootstrap_token=_token(bootstrap_token_file, "--bootstrap-token-file"),
            api_key=Secret(api_key.strip()) if api_key and api_key.strip() else None,
            engine_api_key=Secret(engine_api_key.strip()) if engine_api_key else None,
            certfile=str(certfile) if certfile else None,
            keyfile=str(keyfile) if keyfile else None,
            ca_file=str(ca_file) if ca_file else None,
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


def _register_launch() -> None:
    from pdactors.deploy import launch_command

    app.command("launch")(launch_command)


_register_launch()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
