"""The credentials of a ``pdactors launch --secure`` run (:func:`make_secrets`), and whether a
host is reachable only from this machine (:func:`is_loopback`: without ``--secure``, anything
else is a warning)."""

from __future__ import annotations

import ipaddress
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from pdactors.deploy.errors import UnsafeSecretsDir

__all__ = ["SECRET_FILES", "RunSecrets", "is_loopback", "make_secrets"]

#: The files :func:`make_secrets` writes; the Kubernetes Secret has the same keys.
SECRET_FILES = ("side-channel.secret", "bootstrap.token", "proxy.key", "engine.key")


@dataclass(frozen=True)
class RunSecrets:
    """The credentials of one secure run, in files of a private (0700) directory (0600)."""

    directory: Path
    side_channel: Path  # the deployment secret CURVE keys are derived from
    bootstrap_token: Path
    api_key: str = field(repr=False)  # the proxy's (clients send it as a bearer token)
    engine_key: str = field(default="", repr=False)  # the vLLM servers' --api-key


def make_secrets(directory: Path) -> RunSecrets:
    """Fresh random credentials for a run, written under ``directory`` (created 0700; it may
    exist only if it is empty and private, e.g. from ``tempfile.mkdtemp``).

    Raises :class:`~pdactors.deploy.errors.UnsafeSecretsDir` for any other directory.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if any(directory.iterdir()) or directory.stat().st_mode & 0o077:
        raise UnsafeSecretsDir(f"{directory} must be a new, private (0700), empty directory")
    files = {}
    for name in SECRET_FILES:
        path = directory / name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
        files[name] = path
    api_key = files["proxy.key"].read_text().strip()
    engine_key = files["engine.key"].read_text().strip()
    return RunSecrets(
        directory, files["side-channel.secret"], files["bootstrap.token"], api_key, engine_key
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
