"""What every ``pdactors`` command does first (logging, Mooncake's log level, the timeline),
and Mooncake's own stderr lines set aside for the test tools: even at ERROR its engines print a
harmless "Local segment descriptor not found" each, which would bury the tools' reports. Part of
the command line's edge: it reads the environment."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from pdactors import timeline

__all__ = ["SCRATCH_NAME", "native_log_aside", "native_log_done", "scratch_dir", "setup"]

#: The folder under the temp folder where commands keep their run folders and logs. Not a
#: Python identifier: a Python started in the temp folder (``python -m
#: vllm.entrypoints.openai.api_server``) would import a folder named ``pdactors`` there as the
#: ``pdactors`` package (a namespace package: the path finder returns it before an editable
#: install's finder is asked), and the connector would fail to load.
SCRATCH_NAME = "pdactors-runs"


def scratch_dir() -> Path:
    """``$TMPDIR/pdactors-runs`` (:data:`SCRATCH_NAME`), not created here."""
    return Path(tempfile.gettempdir()) / SCRATCH_NAME


def setup(verbose: bool) -> None:
    """Logging for a command (INFO when ``verbose``), Mooncake kept to errors, and the
    transfers' timeline file when ``$PDACTORS_TIMELINE`` names one."""
    # Mooncake logs every connection at INFO to stderr; keep it to errors unless asked.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if sink := os.environ.get(timeline.ENV):  # where the transfers' timelines go (bench)
        timeline.enable(sink)


def native_log_aside(verbose: bool) -> Path | None:
    """Send what native code writes to stderr to a file, while Python's own output (logging,
    tracebacks, the command's) keeps the terminal. Returns the file (None when ``verbose``:
    then nothing is moved)."""
    if verbose:
        return None
    path = scratch_dir() / f"native-{os.getpid()}.log"
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


def native_log_done(path: Path | None, passed: bool, say: Callable[[str], object]) -> None:
    """Keep the native log of a failed run (and ``say`` where), drop a passed run's."""
    if path is None:
        return
    if passed:
        path.unlink(missing_ok=True)
    else:
        say(f"Mooncake's own log: {path}")
