"""The operator's routes on the proxy: take an engine out without failing a request (drain), put
it back (resume), and see every engine's state. Behind the proxy's key like every route but
``/health`` and ``/metrics`` (set ``--api-key`` wherever the proxy's port is reachable by
others than its operators).

* ``GET /admin/engines``: each engine's URL, role, whether it is up, draining, and what it
  holds (``outstanding`` requests, ``waiting_tokens``...).
* ``POST /admin/drain`` with ``{"engine": URL}``: the engine gets no new request (routing skips
  it: a D's requests go to another D, or to a P serving them whole; a P's to another P, or to D
  alone), while what it holds goes on to its end. ``"migrate": true`` also hands over what it
  holds now: each request waiting on it is cut from it at once, as if it were judged failed —
  a decoding one continues on another engine after the tokens its client got (migration), a
  P-first one still waiting for P's token goes to D alone. ``"wait": S`` answers once the
  engine holds nothing, or after ``S`` seconds (at most ``request_timeout``): the answer's
  ``empty`` says which. The engine's health is still checked; a drained engine that restarts
  stays drained until resumed.
* ``POST /admin/resume`` with ``{"engine": URL}``: back in the routing.

``pdactors drain`` calls these (:mod:`pdactors.cli`).
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio

from pdactors.proxy._completions import Proxy
from pdactors.proxy._openai import Failure
from pdactors.proxy._state import Backend
from pdactors.web._app import json_response

__all__ = ["add_admin_routes"]

log = logging.getLogger("pdactors.proxy")


def add_admin_routes(app: QuartTrio, proxy: Proxy) -> None:
    """``/admin/engines``, ``/admin/drain`` and ``/admin/resume`` on ``app``."""

    @app.get("/admin/engines")
    async def engines() -> Response:
        return json_response({"engines": [_state(b) for b in _backends(proxy)]})

    @app.post("/admin/drain")
    async def drain() -> Response:
        asked = await _asked(proxy)
        if isinstance(asked, Response):
            return asked
        halves, body = asked
        migrate, wait = body.get("migrate", False), body.get("wait", 0)
        if not isinstance(migrate, bool) or not isinstance(wait, int | float) or wait < 0:
            message = '"migrate" must be true or false, "wait" a number of seconds >= 0'
            return Failure.of(400, message, "invalid_request_error", "").response()
        for b in halves:  # an engine of every role: both its records
            if not b.draining:
                log.warning(
                    "proxy: %s %s draining (by the operator): %d requests in flight %s",
                    b.role, b.url, b.outstanding,
                    "handed to other engines" if migrate else "left to finish",
                )  # fmt: skip
            b.draining = True
            if migrate:
                for cut in b.waiting_on:
                    cut.cancel()
                b.waiting_on.clear()
        with trio.move_on_after(min(float(wait), proxy.config.request_timeout)):
            for b in halves:
                await b.wait_empty()
        empty = all(b.outstanding == 0 for b in halves)
        return json_response({**_state(halves[0]), "empty": empty})

    @app.post("/admin/resume")
    async def resume() -> Response:
        asked = await _asked(proxy)
        if isinstance(asked, Response):
            return asked
        halves, _ = asked
        for b in halves:
            if b.draining:
                log.warning("proxy: %s %s resumed (by the operator)", b.role, b.url)
            b.draining = False
        return json_response(_state(halves[0]))


def _backends(proxy: Proxy) -> list[Backend]:
    return [*proxy.prefill.backends, *proxy.decode.backends]


def _state(b: Backend) -> dict[str, Any]:
    return {"role": b.role, **b.describe()}


async def _asked(proxy: Proxy) -> tuple[list[Backend], dict[str, Any]] | Response:
    """The engine the request names (``{"engine": URL}``: its record, or for an engine of
    every role its two) and the request's body, or the 4xx answer: no JSON object, no such
    engine."""
    body = await request.get_json(silent=True)
    if not isinstance(body, dict) or not isinstance(body.get("engine"), str):
        message = 'the body must be a JSON object with "engine": the engine\'s URL'
        return Failure.of(400, message, "invalid_request_error", "").response()
    url = body["engine"].rstrip("/")
    found = [b for b in _backends(proxy) if b.url == url]
    if not found:
        known = ", ".join(b.url for b in _backends(proxy))
        message = f"no engine {url} behind this proxy (it has {known})"
        return Failure.of(404, message, "invalid_request_error", "").response()
    return found, body
