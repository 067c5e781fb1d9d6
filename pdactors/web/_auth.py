"""Bearer-token checks for the HTTP faces (the bootstrap registry; the proxy's API key).

``Authorization: Bearer <token>`` (RFC 6750; the scheme is case-insensitive), compared in
constant time. A refused client is answered every time and logged through a
:class:`~pdactors.web._refusals.RefusalLog` (once per client per interval: a scanner must
not flood the log).
"""

from __future__ import annotations

import hmac

from pdactors.web._refusals import RefusalLog

__all__ = ["BearerCheck"]


class BearerCheck:
    """Whether a request's ``Authorization`` header carries ``token`` (None: everyone may)."""

    def __init__(self, token: str | None, what: str, refusals: RefusalLog | None = None) -> None:
        self._token = token.encode() if token else None
        self._what = what
        self._refusals = refusals

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def refusal(self, header: str | None, client: str) -> str | None:
        """None when the request may pass; otherwise why not (for the 401 body), noted in the
        refusal log when there is one (else the caller logs it)."""
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
        if self._refusals is not None:
            self._refusals.refused(client, 401, reason)
        return reason
