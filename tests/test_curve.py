"""ZMQ CURVE on the side channel: real sockets on loopback. P's ROUTER lets in only D keys it
was given; D talks only to the P key it was given; strangers get no answer and disturb no one;
the actors move and verify KV with CURVE on."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import trio
import zmq
import zmq.auth

from pdactors import PullFailedError
from pdactors.config import Liveness, SenderConfig
from pdactors.testing import open_cluster, run_transfer
from pdactors.testing.cluster import DecodeNode
from pdactors.transport import ZmqTransport, open_dealer, open_router
from pdactors.transport.curve import (
    Curve,
    CurveError,
    UntrustedServer,
    curve_from_files,
    curve_from_secret,
)

SECRET = "the deployment secret, long enough"
LIVE = Liveness(connect_timeout=2.0)


def stranger(server_key: str = "") -> Curve:
    """A keypair nobody was given (trusting ``server_key``, or acting as a P)."""
    public, secret = zmq.curve_keypair()
    servers = (server_key,) if server_key else ()
    return Curve(public=public.decode(), secret=secret.decode(), servers=servers)


async def refused_pull(d: DecodeNode, url: str, engine_id: str, why: str) -> None:
    """D pulls a block from ``engine_id`` at ``url`` and is refused with ``why``; frees it."""
    dst = d.pool.allocate(1)
    try:
        with pytest.raises(PullFailedError, match=why):
            await d.receiver.pull("refused", bootstrap_url=url, engine_id=engine_id, block_ids=dst)
    finally:
        d.pool.free(dst)


async def test_only_the_right_keys_get_through_and_strangers_disturb_no_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "pdactors.transport.curve")
    p, d = curve_from_secret(SECRET)
    with trio.fail_after(60):
        async with open_router("127.0.0.1", curve=p, liveness=LIVE) as router:
            async with open_dealer(router.address, curve=d, liveness=LIVE) as good:
                await good.send([b"hello"])
                identity, frames = await router.receive()
                assert frames == [b"hello"]
                await router.send(identity, [b"back"])
                assert await good.receive() == [b"back"]
                outsider = stranger(p.public)
                attempts = [
                    outsider,  # a key P was not given
                    outsider,  # again: logged once
                    Curve(public=d.public, secret=d.secret, servers=(d.public,)),  # not P's key
                    None,  # no CURVE at all
                ]
                for curve in attempts:
                    async with open_dealer(router.address, curve=curve, liveness=LIVE) as bad:
                        with trio.move_on_after(1):  # waits if no connection is left to queue on
                            await bad.send([b"let me in"])
                        # never up: a failed handshake (at once, usually) or none within 5 s
                        reason = await bad.wait_lost(5.0)
                        assert "handshake" in reason or "no connection" in reason, reason
                with trio.move_on_after(0.5):
                    raise AssertionError(f"the router heard a stranger: {await router.receive()}")
                await good.send([b"still here"])  # the good connection was not disturbed
                assert (await router.receive())[1] == [b"still here"]
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and outsider.public in refusals[0].getMessage()
    assert d.secret not in caplog.text and p.secret not in caplog.text


async def test_fresh_stranger_keys_are_logged_once_an_interval_not_once_a_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 23: refusals were logged once per key, and a stranger makes a fresh key per
    connection (7,705 lines in 20 s)."""
    caplog.set_level(logging.WARNING, "pdactors.transport.curve")
    p, _ = curve_from_secret(SECRET)
    with trio.fail_after(60):
        async with open_router("127.0.0.1", curve=p, liveness=LIVE) as router:
            for _ in range(8):
                curve = stranger(p.public)
                async with open_dealer(router.address, curve=curve, liveness=LIVE) as bad:
                    with trio.move_on_after(1):
                        await bad.send([b"let me in"])
                    assert "handshake" in await bad.wait_lost(5.0)
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]


def test_keys_from_a_secret_and_from_certificate_files(tmp_path: Path) -> None:
    p, d = curve_from_secret(SECRET)
    assert p == curve_from_secret(SECRET)[0]  # derived, not random
    assert p.clients == (d.public,) and d.servers == (p.public,)
    assert curve_from_secret(SECRET + "!")[0].public != p.public
    assert SECRET not in repr(p) and p.secret not in repr(p)
    with pytest.raises(CurveError, match="at least 16"):
        curve_from_secret("short")
    for name in ("p", "d1", "d2"):
        zmq.auth.create_certificates(tmp_path, name)
    d_keys = tmp_path / "d_public"
    d_keys.mkdir()
    for name in ("d1", "d2"):
        (tmp_path / f"{name}.key").rename(d_keys / f"{name}.key")
    server = curve_from_files(tmp_path / "p.key_secret", d_keys, server=True)
    assert len(server.clients) == 2
    client = curve_from_files(tmp_path / "d1.key_secret", tmp_path / "p.key", server=False)
    assert client.servers == (server.public,) and client.public in server.clients
    with pytest.raises(CurveError, match="no secret key"):
        curve_from_files(tmp_path / "p.key", d_keys, server=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CurveError, match="no public keys"):
        curve_from_files(tmp_path / "d1.key_secret", tmp_path / "empty", server=False)
    # the key D demands of a P worker: the one it registered, if D trusts it
    trusting_two = curve_from_files(tmp_path / "d1.key_secret", d_keys, server=False)
    _, second = trusting_two.servers
    assert trusting_two.server_key(second, "tcp://p:1") == second
    with pytest.raises(UntrustedServer, match="was not given"):
        trusting_two.server_key(server.public, "tcp://p:1")
    with pytest.raises(UntrustedServer, match="registered no CURVE key"):
        trusting_two.server_key("", "tcp://p:1")
    assert client.server_key("", "tcp://p:1") == server.public  # the only key D trusts
    with pytest.raises(CurveError, match="Z85"):
        Curve(public="~" * 40, secret=client.secret)


async def test_actors_move_kv_with_curve_on_and_a_d_without_the_keys_fails_fast() -> None:
    secure = ZmqTransport(*curve_from_secret(SECRET))
    with trio.fail_after(60):
        async with open_cluster(transport=secure) as cluster:
            for i in range(3):
                outcome = await run_transfer(cluster, f"secure-{i}", 4)
                assert outcome.ok and outcome.verified, outcome.reason
            async with open_cluster(
                transport=ZmqTransport(*curve_from_secret(SECRET + "x"))
            ) as other:
                # a D of another deployment, pointed at this P: it does not trust the key P
                # registered, so it does not even connect; the pull fails at once
                await refused_pull(
                    other.decode[0], cluster.bootstrap_url, cluster.prefill[0].engine_id,
                    "which this D was not given",
                )  # fmt: skip
            again = await run_transfer(cluster, "after-the-stranger", 2)
            assert again.ok and again.verified
            await cluster.wait_settled()


def test_a_transport_with_one_role_refuses_the_other() -> None:
    p, d = curve_from_secret(SECRET)
    with pytest.raises(CurveError, match="P needs server keys"):
        ZmqTransport(client=d).open_router("127.0.0.1")
    with pytest.raises(CurveError, match="D needs client keys"):
        ZmqTransport(server=p).open_dealer("tcp://127.0.0.1:1")


async def test_a_stranger_cannot_get_bytes_written_and_the_harness_runs_secure() -> None:
    """A DEALER without the deployment's keys sends a well-formed pull for a real, ready
    transfer straight to P's side channel: nothing is written and the transfer is untouched;
    D of the deployment then pulls it as usual. Then ``pdactors harness --secure``'s run."""
    from pdactors.core.send_table import SendState
    from pdactors.testing.harness import run_harness
    from pdactors.wire import PullRequest, encode_frames

    p_keys, _ = curve_from_secret(SECRET)
    with trio.fail_after(60):
        async with open_cluster(transport=ZmqTransport(*curve_from_secret(SECRET))) as cluster:
            p, d = cluster.prefill[0], cluster.decode[0]
            src = p.owned["target"] = p.pool.allocate(2)
            p.kv.fill("target", src)
            p.sender.transfer_ready("target", src)
            dst = d.pool.allocate(2)
            request = PullRequest(
                "target", d.dataplane.session, 0, 1, 0, 1, (tuple(dst),), "x", d.kv.layout
            )
            async with open_dealer(
                p.sender.address, curve=stranger(p_keys.public), liveness=LIVE
            ) as bad:
                # queued, or (once the handshake failed and no connection is left to queue
                # on) refused: a DEALER's send waits for one; either way nothing reaches P
                with trio.move_on_after(1):
                    await bad.send(encode_frames(request))
                reason = await bad.wait_lost(5.0)
                assert "handshake" in reason or "no connection" in reason, reason
            assert p.sender.transfer_state("target") is SendState.READY  # nobody pulled it
            assert not d.kv.data[:, dst].any()  # and nothing was written into D
            await d.receiver.pull(
                "target",
                bootstrap_url=cluster.bootstrap_url,
                engine_id=p.engine_id,
                block_ids=dst,
            )
            assert d.kv.verify("target", dst, 2)
            d.pool.free(dst)
            await cluster.wait_settled()
    report = await run_harness(requests=4, blocks=4, layers=2, block_bytes=4096, secure=True)
    assert report.passed, report.summary()


def _certificates(root: Path, *names: str) -> dict[str, Path]:
    """``zmq.auth.create_certificates`` for each name: ``{name: secret file}``; the public
    ``.key`` files of names starting with ``p`` go to ``root/p_keys``, of ``d`` to ``d_keys``."""
    secrets_of: dict[str, Path] = {}
    for folder in ("p_keys", "d_keys"):
        (root / folder).mkdir()
    for name in names:
        public, secret = zmq.auth.create_certificates(root, name)
        Path(public).rename(root / f"{name[0]}_keys" / f"{name}.key")
        secrets_of[name] = Path(secret)
    return secrets_of


async def test_per_engine_keys_travel_with_the_bootstrap_entry(tmp_path: Path) -> None:
    """Two P engines with keys of their own (certificate files): each registers its public key
    with its bootstrap entry, D (trusting both) demands of each worker the key it registered
    and moves verified KV from both; a D that trusts only one P refuses the other before
    connecting; a registration under P's engine id with a key D does not trust, or with P's
    real public key at a socket that lacks P's secret, gets no byte of D's request."""
    from pdactors.bootstrap_client import open_bootstrap_client
    from pdactors.wire import RegisterWorker

    files = _certificates(tmp_path, "p0", "p1", "d0")
    p_curves = [curve_from_files(files[p], tmp_path / "d_keys", server=True) for p in ("p0", "p1")]
    d_curve = curve_from_files(files["d0"], tmp_path / "p_keys", server=False)
    assert p_curves[0].public != p_curves[1].public and len(d_curve.servers) == 2

    def side(role: str, engine: int) -> ZmqTransport:
        return (
            ZmqTransport(server=p_curves[engine])
            if role == "prefill"
            else ZmqTransport(client=d_curve)
        )

    with trio.fail_after(90):
        # registered once (no lease renewals): the forged entries below stay until replaced
        once = SenderConfig(engine_id="prefill", lease_interval=0)
        async with open_cluster(prefill=2, transport=side, sender=once) as cluster:
            async with open_bootstrap_client() as client:
                answer = await client.query(cluster.bootstrap_url, timeout=5)
            assert [answer[dp].curve_keys for dp in (0, 1)] == [
                {0: {0: p_curves[0].public}},
                {0: {0: p_curves[1].public}},
            ]
            for p in (0, 1):
                outcome = await run_transfer(cluster, f"from-p{p}", 3, p=p)
                assert outcome.ok and outcome.verified, outcome.reason

            p1 = cluster.prefill[1]
            only_p0 = Curve(
                public=d_curve.public, secret=d_curve.secret, servers=(p_curves[0].public,)
            )
            async with open_cluster(prefill=0, transport=ZmqTransport(client=only_p0)) as other:
                await refused_pull(
                    other.decode[0], cluster.bootstrap_url, p1.engine_id,
                    "which this D was not given",
                )  # fmt: skip

            # Impostors take over P1's DP rank in the (open) bootstrap: their own key, then
            # P1's public key at a socket that lacks P1's secret. A fresh D (nothing cached)
            # looks P1 up each time.
            impostor = stranger()
            served = Curve(
                public=impostor.public, secret=impostor.secret, clients=(d_curve.public,)
            )
            for registered, expected in [
                (impostor.public, "which this D was not given"),
                (p_curves[1].public, "handshake"),
            ]:
                async with (
                    open_router("127.0.0.1", curve=served, liveness=LIVE) as fake,
                    open_cluster(prefill=0, transport=ZmqTransport(client=d_curve)) as fresh,
                ):
                    forged = RegisterWorker("prefill-1", 1, 0, 0, fake.address, registered)
                    async with open_bootstrap_client() as client:
                        await client.register(cluster.bootstrap_url, forged, timeout=5)
                    await refused_pull(
                        fresh.decode[0], cluster.bootstrap_url, "prefill-1", expected
                    )
                    with trio.move_on_after(0.5):
                        raise AssertionError(f"the impostor heard D: {await fake.receive()}")
            again = await run_transfer(cluster, "p0-untouched", 2, p=0)
            assert again.ok and again.verified, again.reason


def _zap_threads() -> int:
    from zmq.auth.thread import AuthenticationThread

    return sum(isinstance(t, AuthenticationThread) and t.is_alive() for t in threading.enumerate())


async def test_the_zap_thread_lives_while_curve_routers_do() -> None:
    """The ZAP handler starts with the first CURVE router and stops with the last; a router
    opened after that starts a fresh one, which lets the right D in again."""
    p_keys, d_keys = curve_from_secret(SECRET)
    before = _zap_threads()
    with trio.fail_after(10):
        for _ in range(2):
            async with open_router("127.0.0.1", curve=p_keys) as router:
                async with open_router("127.0.0.1", curve=p_keys):
                    assert _zap_threads() == before + 1  # one per ZMQ context
                async with open_dealer(router.address, curve=d_keys) as dealer:
                    await dealer.send([b"hello"])
                    assert (await router.receive())[1] == [b"hello"]
            assert _zap_threads() == before


async def test_a_curve_router_reopened_at_once_starts_its_zap_handler_again() -> None:
    """The last CURVE router's close releases the ZAP endpoint only later (libzmq's reaper):
    a router opened right after must still start (it failed with EADDRINUSE more often than
    not)."""
    p_keys, _ = curve_from_secret(SECRET)
    with trio.fail_after(30):
        for _ in range(50):
            async with open_router("127.0.0.1", curve=p_keys):
                pass
