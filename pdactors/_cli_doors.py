"""The options of every command that serves an HTTP door (``pdactors bootstrap``, ``pdactors
proxy``): its limits on one client (docs/security.md, "Limits on the HTTP doors"), with the
defaults both configs share, and the token files they read."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdactors.config import MAX_CONNECTIONS_PER_CLIENT, WRITE_TIMEOUT

__all__ = [
    "MAX_CONNECTIONS_PER_CLIENT",
    "WRITE_TIMEOUT",
    "PerClientCap",
    "WriteTimeout",
    "token_from",
]

PerClientCap = Annotated[
    int,
    typer.Option(
        metavar="N",
        help="A client (an address) holding N connections has its next closed at once (0: any).",
    ),
]
WriteTimeout = Annotated[
    float,
    typer.Option(
        metavar="SECONDS",
        help="A connection whose client takes none of its answer for this long is closed, its "
        "request cancelled (0: never).",
    ),
]


def token_from(path: Path | None, option: str) -> str | None:
    """The token in the file ``path`` names (None: no file), or a clean CLI error naming
    ``option``."""
    if path is None:
        return None
    from pdactors.config import read_token_file

    try:
        return read_token_file(path)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None
