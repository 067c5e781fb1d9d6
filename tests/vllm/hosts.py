"""Hosts of their own on one machine, for end-to-end tests across a network: each a network
namespace joined to a bridge in this one, as machines on one switch (root and iproute2
needed). This namespace (the proxy's, the test's) is the bridge's host ``.1``.

Each host's link is a pair of TAP devices, one on the bridge here and one in its namespace,
joined by :class:`_Wire`: a thread that carries every Ethernet frame from one to the other.
The wire is where a link is shaped (:meth:`Host.shape`: a delay each way and a share of frames
lost, what ``tc netem`` does; this kernel has no ``sch_netem``, and the frames' fate is drawn
from a seeded generator). A link is cut with :meth:`Host.cut` (its device here set down, both
ways: the engine and its peers see a dead network, not a refused connection). Everything is
removed on exit.

Each host has a name (:attr:`Host.hostname`) that every host resolves (``/etc/netns/<ns>/
hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``), and so does a process of this
namespace started under :meth:`Hosts.named` (its own mount namespace, the same file over
``/etc/hosts``). :meth:`Hosts.renumber` gives a host another address and points its name
there: a machine that comes back from a restart with a new address.
"""

from __future__ import annotations

import fcntl
import heapq
import os
import random
import selectors
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

__all__ = ["Host", "Hosts", "can_make_hosts", "hosts"]

_TUNSETIFF, _IFF_TAP, _IFF_NO_PI = 0x400454CA, 0x0002, 0x1000


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(args, check=check, capture_output=True, timeout=30)


def can_make_hosts() -> bool:
    """Whether this process may create network namespaces, TAP devices and mount namespaces
    (root, iproute2, ``/dev/net/tun``, util-linux's ``unshare``)."""
    try:
        os.close(_tap(f"pdtap{os.getpid() % 100000}"))  # (not persistent: gone with its fd)
        named = _run("unshare", "--mount", "true", check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    if not named:
        return False
    name = f"pdprobe{os.getpid() % 100000}"
    try:
        made = _run("ip", "netns", "add", name, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    if made:
        _run("ip", "netns", "del", name, check=False)
    return made


def _tap(name: str) -> int:
    """A TAP device ``name`` in this namespace; its frames are read and written on the fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class _Shape:
    delay: float = 0.0  # seconds, each way
    loss: float = 0.0  # share of frames dropped, each way
    rng: random.Random = field(default_factory=lambda: random.Random(0))


class _Wire(threading.Thread):
    """Carries frames between the TAP pairs of every host, each frame after its link's delay
    unless its link's loss drops it; frames of one direction keep their order."""

    def __init__(self) -> None:
        super().__init__(name="hosts-wire", daemon=True)
        self._sel = selectors.DefaultSelector()
        self._due: list[tuple[float, int, int, bytes]] = []
        self._seq = 0
        self._done = threading.Event()

    def join_pair(self, a: int, b: int, shape: _Shape) -> None:
        self._sel.register(a, selectors.EVENT_READ, (b, shape))
        self._sel.register(b, selectors.EVENT_READ, (a, shape))

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)

    def run(self) -> None:
        while not self._done.is_set():
            wait = 0.1 if not self._due else max(0.0, self._due[0][0] - time.monotonic())
            for key, _ in self._sel.select(timeout=min(wait, 0.1)):
                out, shape = key.data
                self._take(key.fd, out, shape)
            now = time.monotonic()
            while self._due and self._due[0][0] <= now:
                _, _, out, frame = heapq.heappop(self._due)
                self._put(out, frame)

    def _take(self, fd: int, out: int, shape: _Shape) -> None:
        for _ in range(256):  # a burst, then the others' turn
            try:
                frame = os.read(fd, 65536)
            except (BlockingIOError, OSError):
                return
            if shape.loss and shape.rng.random() < shape.loss:
                continue  # lost on the wire
            if shape.delay:
                self._seq += 1
                heapq.heappush(self._due, (time.monotonic() + shape.delay, self._seq, out, frame))
            else:
                self._put(out, frame)

    @staticmethod
    def _put(out: int, frame: bytes) -> None:
        try:
            os.write(out, frame)
        except OSError:  # its device is down (a cut link): the frame is lost, as on a wire
            pass


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    ip: str
    link: str  # its device in this namespace (on the bridge)
    inner: str  # its device in its own namespace
    _shape: _Shape = field(default_factory=_Shape, repr=False, compare=False)

    @property
    def hostname(self) -> str:
        return self.netns

    def cut(self) -> None:
        """Its link down: nothing passes either way."""
        _run("ip", "link", "set", self.link, "down")

    def restore(self) -> None:
        _run("ip", "link", "set", self.link, "up")

    def shape(self, delay_ms: float = 0.0, loss: float = 0.0, seed: int = 0) -> None:
        """Each frame on its link, either way, delayed ``delay_ms`` and lost with probability
        ``loss`` (``tc netem delay … loss …`` on both ends); no arguments: a plain link again."""
        self._shape.rng.seed(seed)
        self._shape.delay, self._shape.loss = delay_ms / 1000, loss


class Hosts(dict[str, Host]):
    """The hosts by their short names, with the names every one of them resolves."""

    def __init__(self, hosts: list[Host], files: list[Path]) -> None:
        super().__init__((h.name, h) for h in hosts)
        self._files = files  # every hosts file: the namespaces' and this one's (the last)

    def named(self, *command: str) -> tuple[str, ...]:
        """``command`` as run here resolving the hosts' names (a mount namespace of its own
        with their hosts file over ``/etc/hosts``; ``unshare`` execs it: same pid)."""
        mount = f'mount --bind {self._files[-1]} /etc/hosts && exec "$@"'
        return ("unshare", "--mount", "sh", "-c", mount, "sh", *command)

    def renumber(self, name: str, last: int) -> Host:
        """Host ``name`` at the address ending ``.last`` from now on, its name pointed there
        (its old address gone: what was sent there is lost)."""
        old = self[name]
        new = replace(old, ip=f"{old.ip.rsplit('.', 1)[0]}.{last}")
        inside = ("ip", "netns", "exec", old.netns, "ip", "addr")
        # (the old one first: deleting a primary address deletes the secondaries of its subnet)
        _run(*inside, "del", f"{old.ip}/24", "dev", old.inner)
        _run(*inside, "add", f"{new.ip}/24", "dev", old.inner)
        self[name] = new
        self._write()
        return new

    def _write(self) -> None:
        lines = ["127.0.0.1 localhost", *(f"{h.ip} {h.hostname}" for h in self.values())]
        for file in self._files:
            with open(file, "w") as out:  # in place: a file mounted over /etc/hosts stays it
                out.write("\n".join(lines) + "\n")


@contextmanager
def hosts(*names: str) -> Iterator[tuple[str, Hosts]]:
    """Namespaces ``names`` on a bridge; yields this namespace's address on it and the hosts."""
    tag = os.getpid() % 10000
    net = f"10.{150 + tag % 50}.{tag % 250}"
    bridge = f"pdbr{tag}"
    made: list[Host] = []
    fds: list[int] = []
    files: list[Path] = []
    wire = _Wire()
    try:
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{net}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        for i, name in enumerate(names):
            ns = f"pd{tag}{name}"
            host = Host(name, ns, f"{net}.{i + 2}", f"{ns}r", f"{ns}n")
            _run("ip", "netns", "add", host.netns)
            made.append(host)
            files.append(Path("/etc/netns", ns, "hosts"))
            files[-1].parent.mkdir(parents=True, exist_ok=True)
            fds += [_tap(host.link), _tap(host.inner)]
            wire.join_pair(fds[-2], fds[-1], host._shape)
            _run("ip", "link", "set", host.inner, "netns", host.netns)
            _run("ip", "link", "set", host.link, "master", bridge)
            _run("ip", "link", "set", host.link, "up")
            inside = ("ip", "netns", "exec", host.netns, "ip")
            _run(*inside, "addr", "add", f"{host.ip}/24", "dev", host.inner)
            _run(*inside, "link", "set", host.inner, "up")
            _run(*inside, "link", "set", "lo", "up")
        files.append(Path(f"/tmp/pdhosts{tag}"))
        every = Hosts(made, files)
        every._write()
        wire.start()
        yield f"{net}.1", every
    finally:
        if wire.is_alive():
            wire.stop()
        for fd in fds:
            os.close(fd)  # a TAP device goes with its last fd
        for host in made:
            _run("ip", "link", "del", host.link, check=False)
            _run("ip", "netns", "del", host.netns, check=False)  # (and /etc/netns/<ns>)
        for file in files:
            file.unlink(missing_ok=True)
            if file.parent.name.startswith("pd"):  # /etc/netns/<ns>: ours alone
                file.parent.rmdir()
        _run("ip", "link", "del", bridge, check=False)
