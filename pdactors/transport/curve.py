"""ZMQ CURVE on the side channel: P's ROUTER is a CURVE server, D's DEALERs are clients.

Nothing here is home-made cryptography: libzmq's CURVE (Curve25519, via libsodium) encrypts and
authenticates every connection; pyzmq's :class:`zmq.auth.thread.ThreadAuthenticator` answers
libzmq's ZAP requests, and checks each D's public key against the keys P was given. D is given
the P keys it trusts (``servers``); each P worker registers its public key with its bootstrap
entry, and D connects to a worker only if that key is one it trusts, and only to a socket that
proves it holds the key (a P with another key fails the handshake and D judges it gone at
once). A DEALER whose key P was not given never completes the handshake: it gets no answer,
and no actor sees it.

Keys come from ``zmq.auth.create_certificates`` files (:func:`curve_from_files`: per-engine
keys, D trusting a directory of P keys and P a directory of D keys) or from one deployment
secret (:func:`curve_from_secret`: every P worker shares one keypair and every D worker
another, both derived from the secret with BLAKE2b under distinct personalisations, so a
process that knows the secret knows both public keys).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from pdactors._once import Every
from pdactors.config import Secret
from pdactors.errors import PdError
from pdactors.wire import is_curve_key

__all__ = ["Curve", "CurveError", "UntrustedServer", "curve_from_files", "curve_from_secret"]

log = logging.getLogger("pdactors.transport.curve")


class Curve(msgspec.Struct, frozen=True, kw_only=True):
    """One end's CURVE keys (Z85 text, 40 characters each).

    * ``public`` / ``secret``: this end's keypair.
    * ``servers``: (D) the public keys of the P workers it may talk to.
    * ``clients``: (P) the public keys of the D workers allowed to connect.
    """

    public: str
    secret: str
    servers: tuple[str, ...] = ()
    clients: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key in (self.public, self.secret, *self.servers, *self.clients):
            if not is_curve_key(key):
                raise CurveError("CURVE keys are 40 characters of Z85 text")

    def server_key(self, registered: str, address: str) -> str:
        """(D) The key to demand of the P worker at ``address``, which registered the public
        key ``registered`` ("": none). Raises :class:`UntrustedServer` for a key D was not
        given, or for no key when D trusts several (it cannot tell which one to demand)."""
        if registered:
            if registered not in self.servers:
                raise UntrustedServer(
                    f"P worker {address} registered the CURVE key {registered}, "
                    "which this D was not given"
                )
            return registered
        if len(self.servers) == 1:
            return self.servers[0]
        raise UntrustedServer(
            f"P worker {address} registered no CURVE key and this D trusts "
            f"{len(self.servers)} keys: it cannot tell which one to demand"
        )


class CurveError(PdError, ValueError):
    """CURVE keys that cannot be used: malformed, missing, or too short a secret."""


class UntrustedServer(CurveError):
    """D was not given the CURVE key a P worker registered (or cannot tell which to demand)."""


def check_key(key: str) -> str:
    """``key`` if it is a CURVE key in Z85 text; raises :class:`CurveError`."""
    if not is_curve_key(key):
        raise CurveError("a CURVE key is 40 characters of Z85 text")
    return key


def _derived(secret: str, role: bytes) -> tuple[str, str]:
    raw = hashlib.blake2b(secret.encode(), digest_size=32, person=b"pdactors-" + role).digest()
    private = z85.encode(raw)
    return zmq.curve_public(private).decode(), Secret(private.decode())


def curve_from_secret(secret: str) -> tuple[Curve, Curve]:
    """P's and D's CURVE keys, both derived from one deployment ``secret``: ``(prefill,
    decode)``; P allows exactly D's key and D trusts exactly P's."""
    if len(secret) < 16:
        raise CurveError("a deployment secret needs at least 16 characters")
    p_public, p_secret = _derived(secret, b"prefill")
    d_public, d_secret = _derived(secret, b"decode")
    return (
        Curve(public=p_public, secret=p_secret, clients=(d_public,)),
        Curve(public=d_public, secret=d_secret, servers=(p_public,)),
    )


def curve_from_files(own: str | Path, peers: str | Path, *, server: bool) -> Curve:
    """Keys from ``zmq.auth.create_certificates`` files: ``own`` is this end's ``.key_secret``
    file; ``peers`` a public ``.key`` file or a directory of them (P: the D keys it lets in;
    D: the P keys it trusts). Raises :class:`OSError` or :class:`CurveError`."""
    public, secret = zmq.auth.load_certificate(own)
    if secret is None:
        raise CurveError(f"{own} holds no secret key (pass the .key_secret file)")
    peer_path = Path(peers)
    if peer_path.is_dir():
        keys = sorted(k.decode() for k in zmq.auth.load_certificates(peer_path))
    else:
        keys = [zmq.auth.load_certificate(peer_path)[0].decode()]
    if not keys:
        raise CurveError(f"no public keys in {peers}")
    mine, peer_keys = Curve(public=public.decode(), secret=Secret(secret.decode())), tuple(keys)
    if server:
        return msgspec.structs.replace(mine, clients=peer_keys)
    return msgspec.structs.replace(mine, servers=peer_keys)


# --------------------------------------------------------------------------- ZAP on P


class _Allowed:
    """The ZAP callback of one ROUTER: its allowed client keys. Refusals are counted and
    logged once per ``LOG_INTERVAL`` (not once per key: a stranger can make fresh keys as fast
    as it connects); the line names the last key refused and how many refusals it stands for."""

    LOG_INTERVAL = 60.0

    def __init__(self, clients: tuple[str, ...]) -> None:
        self.clients = frozenset(clients)
        self.refused = 0
        self._every = Every(self.LOG_INTERVAL)

    def callback(self, domain: str, key: bytes) -> bool:
        if key.decode() in self.clients:
            return True
        self.refused += 1
        if (n := self._every.due(None, time.monotonic())) is not None:
            log.warning("side channel %s refused %d D(s) with unknown keys in %g s (the last: %r)",
                        domain, n, self.LOG_INTERVAL, key.decode())  # fmt: skip
        return False


class _Zap:
    """The ZAP handler of one ZMQ context, owned by its CURVE routers: started for the first,
    stopped when the last one closes (no thread outlives the sockets it answers for)."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        self.auth = ThreadAuthenticator(context, log=log)
        self.domains: set[str] = set()


_lock = threading.Lock()
_zaps: dict[int, _Zap] = {}  # per ZMQ context, while it has CURVE routers
_domains = itertools.count()


def serve_curve(socket: zmq.Socket[Any], curve: Curve) -> str:
    """Make ``socket`` (a ROUTER, not bound yet) a CURVE server that lets in ``curve.clients``
    only; returns its ZAP domain (give it to :func:`stop_curve` when the socket closes)."""
    if not curve.clients:
        raise CurveError("a CURVE side channel needs the D keys it lets in")
    context = socket.context
    domain = f"pdactors-{next(_domains)}"
    with _lock:
        zap = _zaps.get(id(context))
        if zap is None:
            zap = _Zap(context)
            _start(zap.auth)
            _zaps[id(context)] = zap
        zap.domains.add(domain)
        zap.auth.configure_curve_callback(domain, _Allowed(curve.clients))
    try:
        socket.curve_secretkey = curve.secret.encode()
        socket.curve_publickey = curve.public.encode()
        socket.curve_server = True
        socket.zap_domain = domain.encode()
        # Fail closed: without a ZAP handler answering, refuse rather than let anyone in.
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    except BaseException:
        stop_curve(context, domain)
        raise
    return domain


#: How long a new ZAP handler waits for the last one's endpoint (see :func:`_start`).
ZAP_REBIND_S = 1.0


def _start(auth: ThreadAuthenticator) -> None:
    """Start ``auth``. libzmq releases a closed socket's inproc endpoint in its reaper thread,
    after ``close`` returned: a handler started just after the context's last one stopped
    can find ``inproc://zeromq.zap.01`` still taken (measured: more than half of immediate
    rebinds). So a refused bind is retried every millisecond for up to
    :data:`ZAP_REBIND_S`."""
    deadline = time.monotonic() + ZAP_REBIND_S
    while True:
        try:
            auth.start()
            return
        except zmq.ZMQError as exc:
            if auth.zap_socket is not None:  # created, not bound
                auth.zap_socket.close(linger=0)
                auth.zap_socket = None  # type: ignore[assignment]
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
        time.sleep(0.001)


def stop_curve(context: zmq.Context[Any], domain: str) -> None:
    """Forget a closed ROUTER's ZAP domain; the last one of ``context`` stops its ZAP thread
    (blocking for as long as that thread takes to end: milliseconds)."""
    with _lock:
        zap = _zaps.get(id(context))
        if zap is None or domain not in zap.domains:
            return
        zap.auth.credentials_providers.pop(domain, None)
        zap.domains.discard(domain)
        if not zap.domains:
            del _zaps[id(context)]
            zap.auth.stop()


def connect_curve(socket: zmq.Socket[Any], curve: Curve, server_key: str) -> None:
    """Make ``socket`` (a DEALER, not connected yet) a CURVE client of ``server_key``."""
    socket.curve_secretkey = curve.secret.encode()
    socket.curve_publickey = curve.public.encode()
    socket.curve_serverkey = check_key(server_key).encode()
