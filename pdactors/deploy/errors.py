"""The errors of the deployment tooling: every one a :class:`~pdactors.errors.PdError`."""

from __future__ import annotations

from pathlib import Path

from pdactors.errors import PdError

__all__ = [
    "BadDeployConfig",
    "ChildDied",
    "DeployError",
    "ModelBuildFailed",
    "NotHealthy",
    "UnsafeSecretsDir",
]


class DeployError(PdError):
    """Base class of what ``pdactors launch`` (and ``--render k8s``) raise on purpose."""


class BadDeployConfig(DeployError, ValueError):
    """A launch or ``[k8s]`` configuration that cannot be launched or rendered.

    A ``ValueError`` too: raised in a config's ``__post_init__``, msgspec reports it as a
    ``msgspec.ValidationError`` when a TOML file is converted.
    """


class UnsafeSecretsDir(DeployError, ValueError):
    """The directory for a run's credentials is not new, private (0700) and empty."""


class ModelBuildFailed(DeployError):
    """The tiny model could not be built (its log says why)."""


class ChildDied(DeployError):
    """A child process of the deployment exited while it should have been serving.

    ``log``: the file its output went to (None when it was not kept).
    """

    def __init__(self, name: str, code: int | None, log: Path | None = None) -> None:
        self.name, self.code, self.log = name, code, log
        super().__init__(f"{name} exited with code {code}")


class NotHealthy(DeployError):
    """Children of the deployment did not answer ``/health`` within the startup timeout."""

    def __init__(self, names: list[str], limit: float) -> None:
        self.names, self.limit = names, limit
        super().__init__(f"not healthy within {limit:g} s: {', '.join(names)}")
