"""Bearer-token checks for the HTTP faces (the bootstrap registry; the proxy's API key).

``Authorization: Bearer <token>`` (RFC 6750; the scheme is case-insensitive), compared in
constant time. A refused client is logged once per client address (a scanner must not flood
the log) and answered every time.
"""

from __future__ import annotations

import hmac
import logging

from pdactors._once import FirstTimes

__all__ = ["BearerCheck"]


class BearerCheck:
    """Whether a request's ``Authorization`` header carries ``token`` (None: everyone may)."""

    def __init__(self, token: str | None, what: str, log: logging.Logger) -> None:
        self._token = token.encode() if token else None
        self._what = what
        self._log = log
        self._refused = FirstTimes()  # clients logged as refused

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def refusal(self, header: str | None, client: str) -> str | None:
        """None when the request may pass; otherwise why not (for the 401 body). Logs the
        first refusal of each client."""
        if self._token is None:
            return None
        scheme, _, presented = (header or "").strip().partition(" ")
        if header is None:
            reason = f"{self._what} needs an Authorization: Bearer token"
        elif scheme.lower() != "bearer" or not presented.strip():
            reason = f"{self._what} needs an Authorization: Bearer token (bad header)"
        elif hmac.compare_digest(presented.strip().encode("utf-8", "surrogateescape"), self._token):
            return None
        else:
            reason = f"{self._what}: wrong token"
        if self._refused.first(client):
            self._log.warning("%s refused for %s: %s", self._what, client, reason)
        return reason
