"""The adapter's own errors, each a :class:`~pdactors.errors.PdError` and the builtin that
callers (vLLM, tools) already catch."""

from __future__ import annotations

from pdactors.errors import PdError

__all__ = ["ConnectorConfigError", "WrongRoleError"]


class ConnectorConfigError(PdError, ValueError):
    """A configuration PdActorsConnector refuses: bad ``kv_connector_extra_config`` values,
    or a model it cannot serve in this configuration."""


class WrongRoleError(PdError, RuntimeError):
    """A scheduler hook called on a worker's connector, or a worker hook on the scheduler's."""
