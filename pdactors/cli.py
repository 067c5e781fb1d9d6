"""The ``pdactors`` command. The only module (with the vLLM adapter) that reads env and argv."""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Annotated

import typer

app = typer.Typer(
    help="pdactors: prefill/decode disaggregation for vLLM as Trio actors.",
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


@app.command()
def harness(
    requests: Annotated[int, typer.Option(help="Requests to transfer.")] = 8,
    blocks: Annotated[int, typer.Option(help="KV blocks per request.")] = 63,
    layers: Annotated[int, typer.Option(help="Layers (one KV region each).")] = 36,
    block_bytes: Annotated[int, typer.Option(help="Bytes per layer per block.")] = 64 * 1024,
    concurrency: Annotated[int, typer.Option(help="Transfers in flight at once.")] = 1,
    protocol: Annotated[
        str, typer.Option(help="Mooncake protocol: tcp, rdma, nvlink_intra.")
    ] = "tcp",
    device: Annotated[str, typer.Option(help="Mooncake device name (RDMA NIC).")] = "",
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run P and D actors with real Mooncake engines, move real KV bytes and verify them.

    Defaults are DESIGN.md's reference request: 36 layers x 63 blocks x 64 KiB = 141.75 MiB.
    Exits 1 when any byte is wrong, any transfer fails, or any block is left allocated.
    """
    _setup(verbose)
    import trio

    from pdactors.config import DataPlaneConfig
    from pdactors.testing.harness import run_harness

    if protocol not in ("tcp", "rdma", "nvlink_intra"):
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
    )
    report = trio.run(run)
    typer.echo(report.summary())
    typer.echo("PASS: every byte verified, no block leaked" if report.passed else "FAIL")
    raise typer.Exit(0 if report.passed else 1)


@app.command()
def bootstrap(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind (0: any free port).")] = 8998,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = True,
) -> None:
    """Serve the bootstrap registry (POST /register, GET /query, GET /health) until Ctrl-C."""
    _setup(verbose)
    import trio

    from pdactors.actors.bootstrap import serve_bootstrap
    from pdactors.config import BootstrapConfig

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_bootstrap, BootstrapConfig(host=host, port=port))
            typer.echo(f"bootstrap serving on {url}")

    try:
        trio.run(main)
    except KeyboardInterrupt:
        pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()
