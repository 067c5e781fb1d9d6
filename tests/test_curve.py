"""ZMQ CURVE on the side channel: real sockets on loopback. P's ROUTER lets in only D keys it
was given; D talks only to the P key it was given; strangers get no answer and disturb no one;
the actors move and verify KV with CURVE on."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
import zmq
import zmq.auth

from pdactors.config import Liveness
from pdactors.testing import open_cluster, run_transfer
from pdactors.transport import ZmqTransport, open_dealer, open_router
from pdactors.transport.curve import Curve, curve_from_files, curve_from_secret

SECRET = "the deployment secret, long enough"
LIVE = Liveness(connect_timeout=2.0)


def stranger(server_key: str) -> Curve:
    public, secret = zmq.curve_keypair()
    return Curve(public=public.decode(), secret=secret.decode(), server_key=server_key)


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
                    Curve(public=d.public, secret=d.secret, server_key=d.public),  # not P's key
                    None,  # no CURVE at all
                ]
                for curve in attempts:
                    async with open_dealer(router.address, curve=curve, liveness=LIVE) as bad:
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


def test_keys_from_a_secret_and_from_certificate_files(tmp_path: Path) -> None:
    p, d = curve_from_secret(SECRET)
    assert p == curve_from_secret(SECRET)[0]  # derived, not random
    assert p.clients == (d.public,) and d.server_key == p.public
    assert curve_from_secret(SECRET + "!")[0].public != p.public
    assert SECRET not in repr(p) and p.secret not in repr(p)
    with pytest.raises(ValueError, match="at least 16"):
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
    assert client.server_key == server.public and client.public in server.clients
    with pytest.raises(ValueError, match="no secret key"):
        curve_from_files(tmp_path / "p.key", d_keys, server=True)
    with pytest.raises(ValueError, match="exactly one P key"):
        curve_from_files(tmp_path / "d1.key_secret", d_keys, server=False)


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
                # a D of another deployment, pointed at this P: handshake refused, pull fails
                from pdactors import PullFailedError

                d = other.decode[0]
                dst = d.pool.allocate(1)
                with pytest.raises(PullFailedError, match="handshake"):
                    await d.receiver.pull(
                        "foreign",
                        bootstrap_url=cluster.bootstrap_url,
                        engine_id=cluster.prefill[0].engine_id,
                        block_ids=dst,
                    )
                d.pool.free(dst)
            again = await run_transfer(cluster, "after-the-stranger", 2)
            assert again.ok and again.verified
            await cluster.wait_settled()


def test_a_transport_with_one_role_refuses_the_other() -> None:
    p, d = curve_from_secret(SECRET)
    with pytest.raises(ValueError, match="P needs server keys"):
        ZmqTransport(client=d).open_router("127.0.0.1")
    with pytest.raises(ValueError, match="D needs client keys"):
        ZmqTransport(server=p).open_dealer("tcp://127.0.0.1:1")


async def test_a_stranger_cannot_get_bytes_written_and_the_harness_runs_secure() -> None:
    """A DEALER without the deployment's keys sends a well-formed pull for a real, ready
    transfer straight to P's side channel: nothing is written and the transfer is untouched;
    D of the deployment then pulls it as usual. Then ``pdactors harness --secure``'s run."""
    from pdactors.core.send_table import SendState
    from pdactors.messages import PullRequest, encode_frames
    from pdactors.testing.harness import run_harness

    p_keys, _ = curve_from_secret(SECRET)
    with trio.fail_after(60):
        async with open_cluster(transport=ZmqTransport(*curve_from_secret(SECRET))) as cluster:
            p, d = cluster.prefill[0], cluster.decode[0]
            src = p.owned["target"] = p.pool.allocate(2)
            p.kv.fill("target", src)
            p.sender.transfer_ready("target", src)
            dst = d.pool.allocate(2)
            request = PullRequest(
                "target", d.dataplane.session, 0, 1, 0, 1, tuple(dst), "x", d.kv.layout
            )
            async with open_dealer(
                p.sender.address, curve=stranger(p_keys.public), liveness=LIVE
            ) as bad:
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
