"""Shared test setup and the helpers the actor tests share (import them from ``tests.conftest``).

Mooncake logs every connection at INFO; tests keep it to errors.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import trio
import trio.testing
from hypothesis import settings

from pdactors import Liveness
from pdactors.testing import Cluster

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

#: ``pytest --hypothesis-profile=fuzz-deep``: the fuzz suites' long runs (tests/
#: test_fuzz_bodies.py takes its example counts from the profile when they are larger).
settings.register_profile("fuzz-deep", max_examples=5000)

#: Under the autojump clock a handshake slower than the jump threshold must not count as a dead
#: peer: connection loss is still noticed (refusals, ZMQ heartbeats, which run on real time).
PATIENT = Liveness(connect_timeout=1e6)


@pytest.fixture
def mock_clock() -> trio.testing.MockClock:
    """The autojump clock for tests whose actors talk over real loopback sockets.

    It jumps only after 10 ms of real idleness: loopback I/O always finishes first, so only the
    timeouts under test are skipped over. (With no socket and no engine thread — the memory
    transport and :class:`~pdactors.testing.memory_dataplane.MemoryFabric` — use pytest-trio's
    ``autojump_clock``, which jumps at once.)
    """
    return trio.testing.MockClock(autojump_threshold=0.01)


async def wait_until(predicate: Callable[[], bool], *, within: float = 10) -> None:
    """Wait until ``predicate()`` holds, looking after every scheduling round; fail after
    ``within`` seconds (of the test's clock)."""
    with trio.fail_after(within):
        while not predicate():
            await trio.sleep(0.005)


async def settled(cluster: Cluster, *, within: float = 5) -> None:
    """Wait until every block of the cluster is back (P frees when its sender releases)."""
    with trio.fail_after(within):
        await cluster.wait_settled()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Last in the output (CI shows its tail): what each vLLM server was doing when a failure
    passed through it (``tests.vllm.servers.post_mortem``)."""
    import sys

    servers = sys.modules.get("tests.vllm.servers")
    for report in getattr(servers, "POST_MORTEMS", []):
        terminalreporter.write_sep("=", "vLLM server post-mortem")
        terminalreporter.write_line(report[-6000:])
