"""Hosts of their own on one machine, for end-to-end tests across a network: each a network
namespace joined to a bridge in this one by a veth pair, as machines on one switch (root and
iproute2 needed). This namespace (the proxy's, the test's) is the bridge's host ``.1``.

A link is cut with :meth:`Host.cut` (its veth end here set down, both ways: the engine and its
peers see a dead network, not a refused connection) and shaped with :meth:`Host.netem`
(``tc netem`` on both ends: delay, loss). Everything is removed on exit.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Host", "can_make_hosts", "hosts"]


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(args, check=check, capture_output=True, timeout=30)


def can_make_hosts() -> bool:
    """Whether this process may create network namespaces and veth pairs (root, iproute2)."""
    name = f"pdprobe{os.getpid() % 100000}"
    try:
        made = _run("ip", "netns", "add", name, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    if made:
        _run("ip", "netns", "del", name, check=False)
    return made


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    ip: str
    link: str  # its veth end in this namespace (on the bridge)
    inner: str  # its veth end in its own namespace

    def cut(self) -> None:
        """Its link down: nothing passes either way."""
        _run("ip", "link", "set", self.link, "down")

    def restore(self) -> None:
        _run("ip", "link", "set", self.link, "up")

    def netem(self, *spec: str) -> None:
        """``tc netem`` with ``spec`` (e.g. ``delay 20ms loss 1%``) on both ends of its link;
        none to remove it."""
        for cmd in (("tc",), ("ip", "netns", "exec", self.netns, "tc")):
            dev = self.link if len(cmd) == 1 else self.inner
            _run(*cmd, "qdisc", "del", "dev", dev, "root", check=False)
            if spec:
                _run(*cmd, "qdisc", "add", "dev", dev, "root", "netem", *spec)


@contextmanager
def hosts(*names: str) -> Iterator[tuple[str, dict[str, Host]]]:
    """Namespaces ``names`` on a bridge; yields this namespace's address on it and the hosts."""
    tag = os.getpid() % 10000
    net = f"10.{150 + tag % 50}.{tag % 250}"
    bridge = f"pdbr{tag}"
    made: list[Host] = []
    try:
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{net}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        for i, name in enumerate(names):
            ns = f"pd{tag}{name}"
            host = Host(name, ns, f"{net}.{i + 2}", f"{ns}r", f"{ns}n")
            _run("ip", "netns", "add", host.netns)
            made.append(host)
            _run("ip", "link", "add", host.link, "type", "veth", "peer", "name", host.inner)
            _run("ip", "link", "set", host.inner, "netns", host.netns)
            _run("ip", "link", "set", host.link, "master", bridge)
            _run("ip", "link", "set", host.link, "up")
            inside = ("ip", "netns", "exec", host.netns, "ip")
            _run(*inside, "addr", "add", f"{host.ip}/24", "dev", host.inner)
            _run(*inside, "link", "set", host.inner, "up")
            _run(*inside, "link", "set", "lo", "up")
        yield f"{net}.1", {h.name: h for h in made}
    finally:
        for host in made:
            _run("ip", "link", "del", host.link, check=False)
            _run("ip", "netns", "del", host.netns, check=False)
        _run("ip", "link", "del", bridge, check=False)
