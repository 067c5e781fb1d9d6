"""An HTTP client for the bootstrap registry's upstream-compatible routes.

``async with open_bootstrap_client() as client:`` then ``await client.register(url, worker,
timeout=...)`` or ``await client.query(url, timeout=...)``. It speaks to ours
(:func:`pdactors.actors.bootstrap.serve_bootstrap`) and to upstream vLLM's bootstrap server.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Final

import httpx
import msgspec
import trio

from pdactors._http_client import async_client
from pdactors.errors import BootstrapError, BootstrapTimeout, RankHeld, describe
from pdactors.wire import BootstrapAnswer, BootstrapEntry, RegisterWorker

__all__ = ["BootstrapClient", "open_bootstrap_client", "tls_verify"]

_FIRST_DELAY: Final = 0.05
_MAX_DELAY: Final = 1.0
# 4xx answers that may succeed if asked again; any other 4xx is a refusal and ends the retries.
_RETRYABLE_4XX: Final = frozenset({408, 425, 429})

_answer_decoder = msgspec.json.Decoder(dict[int, BootstrapEntry])


class _Refused(Exception):
    """The registry answered, and asking again will not change its answer (``error``: the
    type it is raised as)."""

    def __init__(self, detail: str, error: type[BootstrapError] = BootstrapError) -> None:
        super().__init__(detail)
        self.error = error


class BootstrapClient:
    """Registers workers with, and looks engines up in, a bootstrap registry over HTTP.

    Wraps an ``httpx.AsyncClient`` that the caller owns (see :func:`open_bootstrap_client`).
    URLs are the registry's base URL, e.g. ``"http://127.0.0.1:8998"``. ``token``: the
    registry's bearer token (``pdactors bootstrap --token-file``), sent with every register
    and query.
    """

    def __init__(self, http: httpx.AsyncClient, token: str | None = None) -> None:
        self._http = http
        self._auth = {"authorization": f"Bearer {token}"} if token else {}

    # ASYNC109 (use fail_after): ``timeout`` is a retry budget, and the error it ends in must
    # name the last failed attempt, which a caller's fail_after could not do.
    async def register(
        self,
        url: str,
        worker: RegisterWorker,
        *,
        timeout: float,  # noqa: ASYNC109
        lease: float | None = None,
    ) -> None:
        """``POST /register`` ``worker`` at ``url``, retrying until it is accepted.

        With ``lease``, the registration lapses unless renewed within ``lease`` seconds
        (``?lease=`` on the request; upstream's bootstrap ignores it and keeps the entry).

        Connection failures, 5xx and 408/425/429 answers are retried with exponential backoff
        (0.05 s, doubling, at most 1 s apart) until ``timeout`` seconds have passed. A checkpoint.

        Raises :class:`BootstrapError`, naming ``url`` and the last error, when the time runs
        out or at once when the registry refuses the registration (any other 4xx); for a 409
        (the rank is held by another worker's live lease) the :class:`RankHeld` subclass.
        """
        body = msgspec.json.encode(worker)
        params = {} if lease is None else {"lease": f"{lease:g}"}

        async def attempt() -> None:
            resp = await self._http.post(
                _route(url, "register"),
                content=body,
                params=params,
                headers={"content-type": "application/json", **self._auth},
            )
            if resp.status_code == 200:
                return
            detail = f"HTTP {resp.status_code}: {resp.text[:400]}"
            if resp.status_code == 409:
                raise _Refused(detail, RankHeld)
            if 400 <= resp.status_code < 500 and resp.status_code not in _RETRYABLE_4XX:
                raise _Refused(detail)
            raise BootstrapError(detail)

        await _retry(f"registering {worker.engine_id} with {url}", attempt, timeout)

    async def query(
        self,
        url: str,
        *,
        timeout: float,  # noqa: ASYNC109
        retry: bool = True,
    ) -> BootstrapAnswer:
        """``GET /query`` at ``url``: every registered engine, keyed by DP rank.

        Connection failures are retried with exponential backoff until ``timeout`` seconds
        have passed; with ``retry=False`` the first failure is final (a refused connection
        means nothing serves there now). A checkpoint.

        Raises :class:`BootstrapError`, naming ``url``, on a non-200 answer, an answer that is
        not the bootstrap JSON shape, or when the time runs out.
        """
        result: BootstrapAnswer = {}

        async def attempt() -> None:
            nonlocal result
            resp = await self._http.get(_route(url, "query"), headers=self._auth)
            if resp.status_code != 200:
                raise _Refused(f"HTTP {resp.status_code}: {resp.text[:200]}")
            try:
                result = _answer_decoder.decode(resp.content)
            except msgspec.DecodeError as exc:
                raise _Refused(f"undecodable answer: {exc}") from None

        await _retry(f"querying {url}", attempt, timeout, retry=retry)
        return result


@asynccontextmanager
async def open_bootstrap_client(
    token: str | None = None, ca_file: str | None = None
) -> AsyncIterator[BootstrapClient]:
    """Open a :class:`BootstrapClient` that owns its HTTP connection pool (``token``: the
    registry's bearer token, if it asks for one; ``ca_file``: the CA bundle that signs an
    ``https://`` registry's certificate, the system's CAs otherwise).

    Proxy settings in the environment are ignored: the registry is always dialled directly.
    """
    async with async_client(verify=tls_verify(ca_file)) as http:
        yield BootstrapClient(http, token)


def tls_verify(ca_file: str | None) -> ssl.SSLContext | bool:
    """What httpx verifies servers with: a context trusting ``ca_file``, or the system's CAs."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


_NO_ANSWER: Final = "no attempt finished"


def _route(url: str, route: str) -> str:
    return f"{url.rstrip('/')}/{route}"


async def _retry(
    what: str, attempt: Callable[[], Awaitable[None]], budget: float, *, retry: bool = True
) -> None:
    """Run ``attempt`` until it returns, backing off between failures, for ``budget`` seconds.

    Retried (unless ``retry`` is false): transport errors and :class:`BootstrapError`.
    :class:`_Refused` ends at once. Raises :class:`BootstrapError` naming ``what`` and the last
    error.
    """
    last_error = _NO_ANSWER
    delay = _FIRST_DELAY
    with trio.move_on_after(budget):
        while True:
            try:
                await attempt()
                return
            except _Refused as exc:
                raise exc.error(f"{what}: {exc}") from None
            except httpx.InvalidURL as exc:
                raise BootstrapError(f"{what}: {exc}") from None
            except (httpx.HTTPError, BootstrapError) as exc:
                last_error = describe(exc)
                if not retry:
                    raise BootstrapError(f"{what}: {last_error}") from None
            await trio.sleep(delay)
            delay = min(delay * 2, _MAX_DELAY)
    message = f"{what}: gave up after {budget:g} s; last error: {last_error}"
    if last_error == _NO_ANSWER:
        raise BootstrapTimeout(message)
    raise BootstrapError(message)
