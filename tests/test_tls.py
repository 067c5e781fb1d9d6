"""TLS at the HTTP edges: the bootstrap and the proxy serve HTTPS with a certificate from a
private CA (trustme); clients given that CA verify it, clients without it refuse the server,
and P and D register, look up and move KV through an HTTPS bootstrap."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
import trustme

from pdactors import PrefillBackend, ProxyConfig, ReceiverConfig, SenderConfig, serve_proxy
from pdactors.actors.bootstrap import serve_bootstrap
from pdactors.bootstrap_client import open_bootstrap_client, tls_verify
from pdactors.config import BootstrapConfig
from pdactors.errors import BootstrapError
from pdactors.proxy._engine_http import ConnectFailed, EngineClient
from pdactors.testing import open_cluster, run_transfer
from pdactors.wire import RegisterWorker


class Pki:
    def __init__(self, tmp: Path) -> None:
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "localhost")
        self.ca_file = str(tmp / "ca.pem")
        self.certfile = str(tmp / "server.pem")
        self.keyfile = str(tmp / "server.key")
        ca.cert_pem.write_to_path(self.ca_file)
        cert.cert_chain_pems[0].write_to_path(self.certfile)
        for extra in cert.cert_chain_pems[1:]:
            extra.write_to_path(self.certfile, append=True)
        cert.private_key_pem.write_to_path(self.keyfile)


@pytest.fixture
def pki(tmp_path: Path) -> Iterator[Pki]:
    yield Pki(tmp_path)


async def test_an_https_bootstrap_is_verified_with_the_private_ca(pki: Pki) -> None:
    config = BootstrapConfig(certfile=pki.certfile, keyfile=pki.keyfile)
    worker = RegisterWorker("p", 0, 0, 0, "tcp://127.0.0.1:5555")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_bootstrap, config)
            assert url.startswith("https://127.0.0.1:")
            async with open_bootstrap_client(ca_file=pki.ca_file) as client:
                await client.register(url, worker, timeout=5)
                assert (await client.query(url, timeout=5))[0].engine_id == "p"
            async with open_bootstrap_client() as client:  # the system's CAs: not this one
                with pytest.raises(BootstrapError, match=r"CERTIFICATE_VERIFY_FAILED"):
                    await client.query(url, timeout=5, retry=False)
            plain = url.replace("https://", "http://")
            async with httpx.AsyncClient(trust_env=False) as http:
                with pytest.raises(httpx.HTTPError):
                    await http.get(f"{plain}/health")  # no plain HTTP on a TLS port
            nursery.cancel_scope.cancel()


async def test_p_and_d_through_an_https_bootstrap(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdactors.testing.cluster as cluster_module

    real = cluster_module.BootstrapConfig

    def with_tls(**kwargs: object) -> BootstrapConfig:
        return real(certfile=pki.certfile, keyfile=pki.keyfile, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cluster_module, "BootstrapConfig", with_tls)
    with trio.fail_after(60):
        async with open_cluster(
            sender=SenderConfig(engine_id="p", bootstrap_ca_file=pki.ca_file),
            receiver=ReceiverConfig(bootstrap_ca_file=pki.ca_file),
        ) as cluster:
            assert cluster.bootstrap_url.startswith("https://")
            outcome = await run_transfer(cluster, "over-tls", 3)
            assert outcome.ok and outcome.verified, outcome.reason
            await cluster.wait_settled()


async def test_the_proxy_serves_https_and_reads_an_https_bootstrap(pki: Pki) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            tls = BootstrapConfig(certfile=pki.certfile, keyfile=pki.keyfile)
            boot = await nursery.start(serve_bootstrap, tls)
            # stand-ins for P's and D's engines (plain HTTP): servers whose /health answers 200
            p_engine = await nursery.start(serve_bootstrap, BootstrapConfig())
            d_engine = await nursery.start(serve_bootstrap, BootstrapConfig())
            async with open_bootstrap_client(ca_file=pki.ca_file) as client:
                await client.register(
                    boot, RegisterWorker("p-tls", 0, 0, 0, "tcp://127.0.0.1:9"), timeout=5
                )
            config = ProxyConfig(
                prefill=(PrefillBackend(p_engine, boot),),
                decode=(d_engine,),
                certfile=pki.certfile,
                keyfile=pki.keyfile,
                ca_file=pki.ca_file,
                health_interval=0.05,
                first_token="d",  # the stand-ins give no token ids
            )
            url = await nursery.start(serve_proxy, config)
            assert url.startswith("https://")
            async with httpx.AsyncClient(trust_env=False, verify=tls_verify(pki.ca_file)) as http:
                with trio.fail_after(10):
                    while True:  # the proxy read P's engine id from the HTTPS bootstrap
                        resp = await http.get(f"{url}/health")
                        if resp.status_code == 200:
                            break
                        await trio.sleep(0.05)
                assert resp.json()["prefill"][0]["engine_id"] == "p-tls"
            # the same proxy without the private CA cannot trust that bootstrap: P stays out
            blind = await nursery.start(
                serve_proxy, msgspec.structs.replace(config, ca_file=None, port=0)
            )
            async with httpx.AsyncClient(trust_env=False, verify=tls_verify(pki.ca_file)) as http:
                with trio.fail_after(10):
                    while True:
                        report = (await http.get(f"{blind}/health")).json()
                        if "CERTIFICATE_VERIFY_FAILED" in report["prefill"][0].get("problem", ""):
                            break
                        await trio.sleep(0.05)
                # P is out, not D: the proxy still serves (D alone), degraded
                resp = await http.get(f"{blind}/health")
                assert (resp.status_code, resp.json()["status"]) == (200, "degraded")
                assert not resp.json()["prefill"][0]["up"]
            nursery.cancel_scope.cancel()


async def test_the_proxy_speaks_https_to_engines_and_verifies_them(pki: Pki) -> None:
    """Engines serving HTTPS (vLLM's --ssl-certfile): the proxy with the private CA probes
    them, reads P's bootstrap and relays completions (plain and streamed) over TLS, reusing
    its connections; without the CA, the engines are never trusted and nothing reaches them."""
    from tests.test_proxy import completion_body, open_setup

    tls = (pki.certfile, pki.keyfile)
    with trio.fail_after(30):
        # Both engines asked (P's token, then D's): the placement is pinned.
        async with open_setup(engine_tls=tls, ca_file=pki.ca_file, placement="disaggregate") as s:
            assert s.p[0].url.startswith("https://") and s.d[0].url.startswith("https://")
            for _ in range(3):
                resp = await s.client.post("/v1/completions", json=completion_body())
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"] == "p0 says hid0 says hi"
            streamed = await s.client.post("/v1/completions", json=completion_body(stream=True))
            assert streamed.status_code == 200 and "[DONE]" in streamed.text
            assert len(s.p[0].received) == len(s.d[0].received) == 4
            # the engine client itself: connections kept and reused over TLS; without the CA,
            # the engine's certificate is refused before a byte of a request is sent
            slots = trio.Semaphore(4)
            trusting = EngineClient(
                s.d[0].url,
                connect_timeout=5,
                slots=slots,
                tls=ssl.create_default_context(cafile=pki.ca_file),
            )
            for _ in range(2):
                answer = await trusting.request("GET", "/health", b"", [])
                assert answer.status == 200
                await answer.read()
            assert len(trusting._idle) == 1  # one connection served both
            first = trusting._idle[0]
            answer = await trusting.request("GET", "/health", b"", [])
            await answer.read()
            assert trusting._idle == [first]
            trusting.close()
            untrusting = EngineClient(s.d[0].url, connect_timeout=5, slots=slots)
            with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.request("POST", "/v1/completions", b"{}", [])
            assert len(s.d[0].received) == 4
        async with open_setup(engine_tls=tls, healthy=False) as blind:
            with trio.fail_after(10):
                while True:
                    code, report = await blind.health()
                    if "CERTIFICATE_VERIFY_FAILED" in str(report):
                        break
                    await trio.sleep(0.05)
            assert code == 503
            resp = await blind.client.post("/v1/completions", json=completion_body())
            assert resp.status_code in (502, 503), resp.text
            assert not blind.p[0].received and not blind.d[0].received


async def test_a_tls_handshake_cancelled_leaves_no_socket_to_the_gc() -> None:
    """httpcore closes the TCP stream when a handshake fails, not when it is cancelled: the
    proxy's and the bootstrap client's httpx clients close it themselves (else the garbage
    collector's ResourceWarning fails whichever test runs when it collects the socket)."""
    import gc
    from functools import partial

    from pdactors._http_client import async_client

    accepted: list[trio.SocketStream] = []

    async def silent(stream: trio.SocketStream) -> None:  # accepts, never answers a hello
        accepted.append(stream)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        async with async_client(verify=tls_verify(None)) as http:
            with trio.move_on_after(0.5):
                await http.get(f"https://127.0.0.1:{port}/health")
            await wait_until_accepted(accepted)
        nursery.cancel_scope.cancel()
    gc.collect()  # a socket left open raises its ResourceWarning here (an error in tests)


async def wait_until_accepted(accepted: list[trio.SocketStream]) -> None:
    with trio.fail_after(5):
        while not accepted:
            await trio.sleep(0.01)
