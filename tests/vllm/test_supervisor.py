"""The worker's restart supervisor with real Trio hosts: a death restarts the host, a close
stops every restart (the closed flag), and a close during a restart's start leaks nothing."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("vllm")

from pdactors.errors import PdError
from pdactors.host import TrioHost
from pdactors_vllm.supervisor import Supervisor

pytestmark = pytest.mark.vllm


class Hosts:
    """Starts hosts for a supervisor and keeps them; ``gate`` (when given) holds each start
    until set, and ``starting`` is set when a start waits on it."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.made: list[TrioHost] = []
        self.gate = gate
        self.starting = threading.Event()
        self.up = threading.Event()
        self.supervisor = Supervisor("test worker", self.start, self.up.set, delays=(0.0,) * 3)

    def start(self) -> TrioHost:
        if self.gate is not None:
            self.starting.set()
            assert self.gate.wait(10)
        host = TrioHost(name="supervised", on_death=lambda _: self.supervisor.died())
        self.made.append(host)
        return host


def crash(host: TrioHost) -> None:
    async def fail() -> None:
        raise RuntimeError("injected: the Trio thread dies")

    host.run_sync(host.nursery.start_soon, fail)


def test_a_death_restarts_the_host() -> None:
    hosts = Hosts()
    hosts.supervisor.start()
    first = hosts.supervisor.host
    assert first is not None
    crash(first)
    assert hosts.up.wait(10)
    second = hosts.supervisor.host
    assert second is not None and second is not first and second.alive
    hosts.supervisor.close()
    assert not second.alive and hosts.supervisor.host is None


def test_no_restart_once_closed() -> None:
    hosts = Hosts()
    hosts.supervisor.start()
    hosts.supervisor.close()
    hosts.supervisor.died()  # a death reported after the close
    assert len(hosts.made) == 1 and not hosts.made[0].alive
    with pytest.raises(PdError):
        hosts.supervisor.start()
    assert all(not host.alive for host in hosts.made)


def test_a_close_while_a_restart_starts_closes_the_new_host() -> None:
    gate = threading.Event()
    gate.set()
    hosts = Hosts(gate)
    hosts.supervisor.start()
    first = hosts.supervisor.host
    assert first is not None
    gate.clear()
    hosts.starting.clear()
    crash(first)
    assert hosts.starting.wait(10)  # the restart is starting a host
    closer = threading.Thread(target=hosts.supervisor.close)
    closer.start()
    gate.set()  # the start completes after the close began
    closer.join(15)
    assert not closer.is_alive()
    assert len(hosts.made) == 2
    assert all(not host.alive for host in hosts.made)
    assert not hosts.up.is_set()
