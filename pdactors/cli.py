"""The ``pdactors`` command: its app, the ``bootstrap`` command (its HTTP door's options in
:mod:`pdactors._cli_doors`) and the others registered on it (``proxy`` from
:mod:`pdactors._cli_proxy`, ``harness`` and
``chaos`` from :mod:`pdactors._cli_tools`, ``drain`` from :mod:`pdactors._cli_admin`,
``launch`` from :mod:`pdactors.deploy`). With those and the vLLM adapter's settings, the only
code that reads the environment and argv."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdactors._cli_admin import drain
from pdactors._cli_doors import (
    MAX_CONNECTIONS_PER_CLIENT,
    WRITE_TIMEOUT,
    PerClientCap,
    WriteTimeout,
    token_from,
)
from pdactors._cli_proxy import proxy
from pdactors._cli_setup import setup
from pdactors._cli_tools import chaos, harness
from pdactors.config import DEFAULT_BOOTSTRAP_PORT, BootstrapConfig, default_of

app = typer.Typer(
    help="pdactors: prefill/decode disaggregation for vLLM as Trio actors.",
    rich_markup_mode=None,  # click's plain help: flags without types, defaults in brackets
    no_args_is_help=True,
    add_completion=False,
)


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
    max_connections_per_client: PerClientCap = MAX_CONNECTIONS_PER_CLIENT,
    write_timeout: WriteTimeout = WRITE_TIMEOUT,
    verbose: Annotated[
        bool, typer.Option("--verbose/--quiet", "-v", help="Log at INFO (--quiet: warnings only).")
    ] = True,
) -> None:
    """Serve the bootstrap registry (POST /register, GET /query, GET /health) until Ctrl-C."""
    setup(verbose)
    import trio

    from pdactors.actors.bootstrap import serve_bootstrap

    if (certfile is None) != (keyfile is None):
        raise typer.BadParameter("give both --certfile and --keyfile, or neither")
    config = BootstrapConfig(
        host=host,
        port=port,
        token=token_from(token_file, "--token-file"),
        certfile=str(certfile) if certfile else None,
        keyfile=str(keyfile) if keyfile else None,
        max_workers=max_workers,
        max_connections_per_client=max_connections_per_client,
        write_timeout=write_timeout,
    )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_bootstrap, config)
            typer.echo(f"bootstrap serving on {url}")

    try:
        trio.run(main)
    except KeyboardInterrupt:
        pass


app.command()(proxy)
app.command()(harness)
app.command()(chaos)
app.command()(drain)


def _register_launch() -> None:
    from pdactors.deploy import launch_command

    app.command("launch")(launch_command)


_register_launch()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
