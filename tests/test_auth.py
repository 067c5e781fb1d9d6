"""The bootstrap's bearer token: ``/register`` and ``/query`` refuse a request without the
right token (401, a JSON error, one log line per client), ``/health`` stays open, the registry
keeps serving, and P and D with the token work through it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from pdactors import PullFailedError, ReceiverConfig, SenderConfig
from pdactors.actors.bootstrap import serve_bootstrap
from pdactors.bootstrap_client import open_bootstrap_client
from pdactors.config import BootstrapConfig, Secret, read_token_file
from pdactors.errors import BootstrapError
from pdactors.testing import open_cluster, run_transfer
from pdactors.web._auth import BearerCheck
from pdactors.wire import RegisterWorker

TOKEN = "s3cret-token-for-the-tests"
WORKER = RegisterWorker("prefill-0", 0, 0, 0, "tcp://127.0.0.1:5555")
REGISTER = (
    b'{"engine_id":"prefill-0","dp_rank":0,"tp_rank":0,"pp_rank":0,"addr":"tcp://127.0.0.1:5555"}'
)


@asynccontextmanager
async def guarded_bootstrap(token: str = TOKEN) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(serve_bootstrap, BootstrapConfig(token=token))
        yield url
        nursery.cancel_scope.cancel()


BAD_HEADERS: list[str | bytes | None] = [
    None,
    "",
    "Bearer",
    f"Basic {TOKEN}",
    f"Bearer {TOKEN}x",
    f"Bearer {TOKEN[:-1]}",
    f"Token {TOKEN}",
    b"Bearer \xe9\xe9",  # not ASCII
    "Bearer " + "A" * 10_000,
]


async def test_register_and_query_need_the_token_health_does_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "pdactors.bootstrap")
    with trio.fail_after(20):
        async with guarded_bootstrap() as url, httpx.AsyncClient(trust_env=False) as http:
            assert (await http.get(f"{url}/health")).status_code == 200
            for header in BAD_HEADERS:
                headers = {} if header is None else {"authorization": header}
                for method, route, body in (("POST", "register", REGISTER), ("GET", "query", b"")):
                    resp = await http.request(
                        method, f"{url}/{route}", content=body, headers=headers
                    )
                    assert resp.status_code == 401, (header, route, resp.text)
                    assert "error" in resp.json()
                    assert resp.headers["www-authenticate"].startswith("Bearer")
            good = {"authorization": f"Bearer {TOKEN}"}
            assert (await http.get(f"{url}/query", headers=good)).json() == {}  # nothing got in
            resp = await http.post(f"{url}/register", content=REGISTER, headers=good)
            assert resp.status_code == 200
            lower = {"authorization": f"bearer {TOKEN}"}  # the scheme is case-insensitive
            assert "0" in (await http.get(f"{url}/query", headers=lower)).json()
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]  # once per client
    assert TOKEN not in caplog.text


@settings(max_examples=300, deadline=None)
@given(header=st.one_of(st.none(), st.text(max_size=80)), client=st.sampled_from(["a", "b"]))
def test_bearer_check_passes_exactly_the_token(header: str | None, client: str) -> None:
    check = BearerCheck(TOKEN, "the registry")
    passes = (
        header is not None
        and header.strip().lower().startswith("bearer ")
        and (header.strip()[len("bearer ") :].strip() == TOKEN)
    )
    assert (check.refusal(header, client) is None) == passes
    assert check.refusal(f"Bearer {TOKEN}", client) is None
    assert BearerCheck(None, "open").refusal(header, client) is None


async def test_clients_with_the_token_work_and_without_are_refused_at_once() -> None:
    with trio.fail_after(20):
        async with guarded_bootstrap() as url:
            async with open_bootstrap_client(TOKEN) as client:
                await client.register(url, WORKER, timeout=5)
                assert (await client.query(url, timeout=5))[0].engine_id == "prefill-0"
            async with open_bootstrap_client() as client:
                start = trio.current_time()
                with pytest.raises(BootstrapError, match="HTTP 401"):
                    await client.register(url, WORKER, timeout=30)
                with pytest.raises(BootstrapError, match="HTTP 401"):
                    await client.query(url, timeout=30)
                assert trio.current_time() - start < 5  # a refusal is not retried


async def test_p_and_d_with_the_token_move_kv_and_a_d_without_it_is_told_why() -> None:
    with trio.fail_after(60):
        async with open_cluster(
            sender=SenderConfig(engine_id="p", bootstrap_token=TOKEN),
            receiver=ReceiverConfig(bootstrap_token=TOKEN),
            bootstrap_token=TOKEN,
        ) as cluster:
            outcome = await run_transfer(cluster, "with-token", 3)
            assert outcome.ok and outcome.verified
            async with trio.open_nursery() as nursery:
                from pdactors import serve_receiver

                d = cluster.decode[0]
                stranger = await nursery.start(
                    serve_receiver, ReceiverConfig(engine_id="stranger"), d.dataplane, d.kv.layout
                )
                with pytest.raises(PullFailedError, match="401"):
                    await stranger.pull(
                        "no-token",
                        bootstrap_url=cluster.bootstrap_url,
                        engine_id=cluster.prefill[0].engine_id,
                        block_ids=[0],
                    )
                nursery.cancel_scope.cancel()
            again = await run_transfer(cluster, "still-serving", 2)
            assert again.ok and again.verified
            await cluster.wait_settled()


def test_token_files_and_secrets(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "token"
    path.write_text(f"  {TOKEN}\n")
    token = read_token_file(path)
    assert token == TOKEN and isinstance(token, Secret)
    assert TOKEN not in repr(token) and TOKEN not in repr(BootstrapConfig(token=token))
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token_file(path)


async def test_d_sends_its_token_only_to_trusted_bootstraps() -> None:
    """A request names its bootstrap (remote_bootstrap_addr): a D holding the token must not
    send it to one it was not given, or anyone could collect it by naming their own."""
    seen: list[str | None] = []
    from quart import request
    from quart_trio import QuartTrio

    from pdactors.web._server import bind_listener, serve_http

    collector = QuartTrio("collector")

    @collector.get("/query")
    async def query() -> dict[str, object]:
        seen.append(request.headers.get("authorization"))
        return {}

    with trio.fail_after(30):
        async with (
            open_cluster(
                sender=SenderConfig(engine_id="p", bootstrap_token=TOKEN),
                receiver=ReceiverConfig(bootstrap_token=TOKEN),
                bootstrap_token=TOKEN,
            ) as cluster,
            trio.open_nursery() as nursery,
        ):
            sock = await bind_listener("127.0.0.1", 0, "the collector")
            evil = await nursery.start(
                partial(
                    serve_http, collector, sock, errorlog=logging.getLogger("x"), announce=print
                )
            )
            d = cluster.decode[0]
            with pytest.raises(PullFailedError, match="not among this D's trusted_bootstraps"):
                await d.receiver.pull(
                    "lure",
                    bootstrap_url=evil,
                    engine_id=cluster.prefill[0].engine_id,
                    block_ids=[0],
                )
            assert seen == []  # no request, so no token, reached it
            outcome = await run_transfer(cluster, "trusted", 2)  # the real one still works
            assert outcome.ok and outcome.verified
            nursery.cancel_scope.cancel()
            await cluster.wait_settled()
