"""The receiver's bootstrap look-ups: shared failures, and nothing kept per bootstrap after."""

from __future__ import annotations

from typing import Any, cast

import pytest
import trio
import trio.testing

from pdactors.actors._lookups import Lookups
from pdactors.bootstrap_client import BootstrapClient
from pdactors.errors import BootstrapError
from pdactors.wire import BootstrapAnswer, BootstrapEntry


class _Client:
    """A bootstrap client whose queries wait for the test to answer them."""

    def __init__(self) -> None:
        self.queries = 0
        self.answer: BootstrapAnswer | BootstrapError = BootstrapError("refused")
        self.release = trio.Event()

    async def query(self, url: str, *, timeout: float, retry: bool) -> BootstrapAnswer:  # noqa: ASYNC109 (the client's signature)
        self.queries += 1
        await self.release.wait()
        if isinstance(self.answer, BootstrapError):
            raise self.answer
        return self.answer


def _lookups(client: _Client) -> Lookups:
    return Lookups(cast(BootstrapClient, client), timeout=1e6)


def _state(lookups: Lookups) -> dict[str, Any]:
    """Every per-bootstrap map of ``lookups`` but the answers (a cache, bounded by the
    bootstraps D trusts)."""
    return {k: v for k, v in vars(lookups).items() if isinstance(v, dict) and k != "_answers"}


async def test_tasks_queued_behind_a_failed_query_each_get_their_own_exception() -> None:
    client = _Client()
    lookups = _lookups(client)
    errors: list[BootstrapError] = []

    async def ask() -> None:
        with pytest.raises(BootstrapError) as info:
            await lookups.resolve("http://b", "p")
        errors.append(info.value)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        client.release.set()
    assert client.queries == 1  # the queued tasks shared the failure, asking no more
    assert len({id(e) for e in errors}) == 3  # ...but each raised an exception of its own
    first = next(e for e in errors if e is client.answer)
    assert all(e.__cause__ is first for e in errors if e is not first)
    assert all(str(e) == "refused" for e in errors)


async def test_nothing_is_kept_per_bootstrap_once_its_askers_are_done() -> None:
    client = _Client()
    client.release.set()
    lookups = _lookups(client)
    before = {k: len(v) for k, v in _state(lookups).items()}
    for n in range(20):  # bootstraps that come and go, failing
        with pytest.raises(BootstrapError):
            await lookups.resolve(f"http://b{n}", "p")
    client.answer = {0: BootstrapEntry("p", {0: {0: "tcp://p:1"}})}
    for n in range(20):  # and answering
        await lookups.resolve(f"http://c{n}", "p")
    assert {k: len(v) for k, v in _state(lookups).items()} == before
