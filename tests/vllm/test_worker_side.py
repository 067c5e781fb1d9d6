"""PdActorsConnector's worker side with real CPU KV tensors (vLLM's CPU layout) and real Mooncake
TCP engines: a P worker and a D worker, each with its actors in its own Trio thread, driven
through the same calls vLLM makes (register_kv_caches, start_load_kv, get_transfer_results)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

pytest.importorskip("vllm")

import torch

from pdactors import RankInfo, SenderConfig, timeline
from pdactors.config import INLINE_MAX_BYTES
from pdactors_vllm.actor_configs import actor_configs
from pdactors_vllm.scheduler_side import PdActorsMetadata, PullSpec, SendSpec
from pdactors_vllm.settings import ConnectorSettings
from pdactors_vllm.worker_side import WorkerPlace, WorkerSide, layout_from_kv_caches
from tests.vllm.servers import free_port

pytestmark = pytest.mark.vllm

BLOCKS, LAYERS = 32, 2


def kv_caches() -> dict[str, torch.Tensor]:
    """vLLM CPU's KV: per layer [blocks, kv_heads, block_size, 2*head], slices of one tensor."""
    alloc = torch.zeros(LAYERS, BLOCKS, 2, 16, 64)
    return {f"model.layers.{i}.self_attn.attn": alloc[i] for i in range(LAYERS)}


def mla_caches() -> dict[str, torch.Tensor]:
    """MLA's KV as vLLM CPU binds it: per layer one latent of 512 + 64 rope dims per token,
    [blocks, 1, 16, 576], here block-outer across layers (one backing tensor, every layer's
    block strided by both layers' pages)."""
    alloc = torch.zeros(BLOCKS, LAYERS, 1, 16, 576)
    return {f"model.layers.{i}.self_attn.attn": alloc[:, i] for i in range(LAYERS)}


class Pair:
    def __init__(
        self,
        p_only: dict[str, Any] | None = None,
        d_only: dict[str, Any] | None = None,
        caches: Callable[[], dict[str, torch.Tensor]] = kv_caches,
        group_of: dict[str, int] | None = None,
        **settings: Any,
    ) -> None:
        """A P and a D worker side with ``settings``, plus ``p_only`` / ``d_only`` each, over
        KV tensors made by ``caches`` (``group_of``: each layer's KV-cache group)."""
        self.settings = ConnectorSettings(bootstrap_port=free_port(), ready_timeout=30, **settings)
        p_settings = msgspec.structs.replace(self.settings, **(p_only or {}))
        d_settings = msgspec.structs.replace(self.settings, **(d_only or {}))
        self.p_kv, self.d_kv = caches(), caches()
        self.p = WorkerSide(p_settings, WorkerPlace("prefill-w", True, False, RankInfo(), True))
        self.d = WorkerSide(d_settings, WorkerPlace("decode-w", False, True, RankInfo(), False))
        self.p.register_kv_caches(self.p_kv, BLOCKS, group_of)
        self.d.register_kv_caches(self.d_kv, BLOCKS, group_of)

    def move_and_check(self, tid: str, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
        """P fills ``src`` with random KV and sends transfer ``tid``; D pulls it into ``dst``;
        D's blocks then equal P's."""
        for layer in self.p_kv.values():
            layer[list(src)] = torch.randn(len(src), *layer.shape[1:])
        run_step(self.p, PdActorsMetadata(pending=[tid]))
        self.pull(f"dreq-{tid}", tid, dst)
        run_step(self.p, PdActorsMetadata(ready={f"preq-{tid}": SendSpec(tid, src)}))
        assert f"dreq-{tid}" not in wait_for(self.d, "recved", f"dreq-{tid}")["failed"]
        for name in self.p_kv:
            assert torch.equal(self.d_kv[name][list(dst)], self.p_kv[name][list(src)])
        wait_for(self.p, "sent", f"preq-{tid}")

    def pull(self, req: str, tid: str, blocks: Any, engine: str = "prefill-w") -> None:
        spec = PullSpec(tid, engine, self.settings.bootstrap_url, blocks)
        run_step(self.d, PdActorsMetadata(pulls={req: spec}))

    def wait_at_p(self, tid: str, timeout: float = 10) -> None:
        """Until D's pull of ``tid`` waits at P (P's sender holds it, unanswered)."""
        host, sender = self.p.host, self.p._actors._sender  # type: ignore[union-attr]
        assert host is not None and sender is not None
        deadline = time.monotonic() + timeout
        while not host.run_sync(sender.pulls_waiting, tid):
            assert time.monotonic() < deadline, f"D's pull of {tid} did not reach P"
            time.sleep(0.005)


def run_step(worker: WorkerSide, meta: PdActorsMetadata) -> None:
    """One step's connector hooks in vLLM 0.32's order (bind, then after the forward
    start_load_kv and wait_for_save)."""
    worker.begin_step(meta)
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)


def wait_for(worker: WorkerSide, what: str, req: str, timeout: float = 10) -> dict[str, set[str]]:
    """Poll get_transfer_results (as vLLM does every step) until ``req`` shows up in ``what``."""
    seen: dict[str, set[str]] = {"sent": set(), "recved": set(), "failed": set()}
    deadline = time.monotonic() + timeout
    while req not in seen[what]:
        assert time.monotonic() < deadline, f"{req} not in {what}: {seen}"
        sent, recved, failed = worker.get_transfer_results()
        seen["sent"] |= sent
        seen["recved"] |= recved
        seen["failed"] |= failed
        time.sleep(0.005)
    return seen


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    workers = Pair()
    try:
        yield workers
    finally:
        start = time.monotonic()
        workers.p.shutdown()
        workers.d.shutdown()
        assert time.monotonic() - start < 25


def test_layout_follows_vllm_cpu_tensors() -> None:
    caches = kv_caches()
    layout, memory, layers = layout_from_kv_caches(caches, BLOCKS)
    assert layers == {name: (i,) for i, name in enumerate(sorted(caches))}
    assert len(layout.regions) == LAYERS
    assert layout.regions[0].block_bytes == 2 * 16 * 64 * 4
    assert layout.regions[0].stride == layout.regions[0].block_bytes
    assert len(memory) == 1  # both layers are views of one allocation


def test_kv_moves_from_p_blocks_into_d_blocks(pair: Pair) -> None:
    for layer in pair.p_kv.values():
        layer[3:6].copy_(torch.randn(3, 2, 16, 64))
    run_step(pair.p, PdActorsMetadata(pending=["t1"]))
    pair.pull("dreq1", "t1", (10, 11, 12))
    run_step(pair.p, PdActorsMetadata(ready={"preq1": SendSpec("t1", (3, 4, 5))}))
    assert "dreq1" not in wait_for(pair.d, "recved", "dreq1")["failed"]
    for name in pair.p_kv:
        assert torch.equal(pair.d_kv[name][10:13], pair.p_kv[name][3:6])
    wait_for(pair.p, "sent", "preq1")


def test_eager_send_at_the_end_of_the_forward_moves_the_kv_and_marks_the_timeline(
    pair: Pair, tmp_path: Path
) -> None:
    """The step that completes P's prompt: start_load_kv (its pending) then wait_for_save
    (its eager send), as vLLM calls them after the forward; D's pull came first."""
    sink = tmp_path / "timeline.jsonl"
    timeline.enable(sink)
    try:
        for layer in pair.p_kv.values():
            layer[22:24].copy_(torch.randn(2, 2, 16, 64))
        pair.pull("dreq-e", "t-e", (25, 26))
        pair.wait_at_p("t-e")
        meta = PdActorsMetadata(pending=["t-e"], eager={"preq-e": SendSpec("t-e", (22, 23))})
        run_step(pair.p, meta)
        assert "dreq-e" not in wait_for(pair.d, "recved", "dreq-e")["failed"]
        for name in pair.p_kv:
            assert torch.equal(pair.d_kv[name][25:27], pair.p_kv[name][22:24])
        wait_for(pair.p, "sent", "preq-e")
    finally:
        timeline.disable()
    marks = timeline.read_timelines(sink)["t-e"]
    order = [
        "pull_sent", "pull_at_p", "p_computed", "ready", "write_start", "write_end", "landed",
        "reported",
    ]  # fmt: skip
    assert sorted(marks, key=marks.__getitem__) == order


def test_layerwise_streams_each_layer_during_the_forward() -> None:
    """layerwise: with D's pull at P, each layer reaches D as the forward reports it
    (save_kv_layer), before the step ends; D hears once, after wait_for_save."""
    pair = Pair(layerwise=True)
    try:
        names = sorted(pair.p_kv)
        data = {name: torch.randn(2, 2, 16, 64) for name in names}
        pair.pull("dreq-l", "t-l", (5, 6))
        pair.wait_at_p("t-l")
        meta = PdActorsMetadata(pending=["t-l"], eager={"preq-l": SendSpec("t-l", (1, 2))})
        pair.p.begin_step(meta)  # bind: the prompt's last chunk starts computing
        for name in names:  # the forward, layer by layer
            pair.p_kv[name][1:3].copy_(data[name])
            pair.p.save_kv_layer(name)
            deadline = time.monotonic() + 5
            while not torch.equal(pair.d_kv[name][5:7], data[name]):
                assert time.monotonic() < deadline, f"{name} did not reach D during the forward"
                time.sleep(0.005)
        assert pair.d.get_transfer_results() == (set(), set(), set())  # not told yet
        pair.p.start_load_kv(meta)
        pair.p.wait_for_save(meta)  # the step's end
        assert "dreq-l" not in wait_for(pair.d, "recved", "dreq-l")["failed"]
        wait_for(pair.p, "sent", "preq-l")
        assert pair.p.take_counters()["bytes_sent"] == 2 * LAYERS * 2 * 16 * 64 * 4
    finally:
        pair.p.shutdown()
        pair.d.shutdown()


def test_eager_send_with_the_actors_down_releases_the_blocks() -> None:
    settings = ConnectorSettings(bootstrap_port=free_port())
    worker = WorkerSide(settings, WorkerPlace("prefill-x", True, False, RankInfo(), True))
    # never registered: no actors run
    worker.wait_for_save(PdActorsMetadata(eager={"preq-x": SendSpec("t-x", (1,))}))
    assert worker.get_transfer_results()[0] == {"preq-x"}


def test_failed_pull_is_reported_as_failed_and_finished(pair: Pair) -> None:
    pair.pull("dreq2", "t2", (1,), engine="no-such-engine")
    wait_for(pair.d, "failed", "dreq2")


def test_p_drop_fails_the_waiting_pull_at_once(pair: Pair) -> None:
    run_step(pair.p, PdActorsMetadata(pending=["t3"]))
    pair.pull("dreq3", "t3", (2,))
    pair.wait_at_p("t3")
    start = time.monotonic()
    run_step(pair.p, PdActorsMetadata(dropped=["t3"]))
    wait_for(pair.d, "failed", "dreq3")
    assert time.monotonic() - start < 5  # not the 30 s ready_timeout


def test_d_abort_frees_p_blocks(pair: Pair) -> None:
    run_step(pair.p, PdActorsMetadata(pending=["t4"]))
    pair.pull("dreq4", "t4", (4,))
    pair.wait_at_p("t4")
    run_step(pair.d, PdActorsMetadata(aborts={"dreq4": "t4"}))
    wait_for(pair.d, "failed", "dreq4")  # ends once P confirms it is not writing
    # P finishes afterwards: nobody will pull, its blocks are released at once
    run_step(pair.p, PdActorsMetadata(ready={"preq4": SendSpec("t4", (7,))}))
    wait_for(pair.p, "sent", "preq4")


def test_counters_reach_connector_stats(pair: Pair) -> None:
    pair.p.take_counters()
    run_step(pair.p, PdActorsMetadata(pending=["t5"]))
    run_step(pair.p, PdActorsMetadata(ready={"preq5": SendSpec("t5", (8, 9))}))
    pair.pull("dreq5", "t5", (20, 21))
    assert "dreq5" not in wait_for(pair.d, "recved", "dreq5")["failed"]
    wait_for(pair.p, "sent", "preq5")
    sent = pair.p.take_counters()
    assert sent["sent"] == 1
    assert sent["bytes_sent"] == 2 * LAYERS * 2 * 16 * 64 * 4
    assert pair.d.take_counters()["received"] >= 1


def test_a_bug_in_posted_work_is_logged_and_the_thread_lives(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    host = pair.d.host
    assert host is not None

    def buggy() -> None:
        raise ZeroDivisionError("injected")

    host.post(buggy)
    deadline = time.monotonic() + 5
    while "buggy posted into the Trio thread failed" not in caplog.text:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    run_step(pair.p, PdActorsMetadata(pending=["t7"]))
    pair.pull("dreq7", "t7", (13,))
    run_step(pair.p, PdActorsMetadata(ready={"preq7": SendSpec("t7", (14,))}))
    assert "dreq7" not in wait_for(pair.d, "recved", "dreq7")["failed"]
    assert pair.d.host is not None and pair.d.host.alive


def test_a_dead_trio_thread_fails_its_pulls_then_the_actors_come_back(pair: Pair) -> None:
    run_step(pair.p, PdActorsMetadata(pending=["t8"]))
    pair.pull("dreq8", "t8", (15,))
    pair.wait_at_p("t8")
    host = pair.d.host
    assert host is not None

    async def crash() -> None:
        raise RuntimeError("injected: the Trio thread dies")

    host.run_sync(host.nursery.start_soon, crash)
    wait_for(pair.d, "failed", "dreq8")  # reported at the next get_finished, not never
    # while the actors are down, new pulls fail at once (with a log line), never hang
    pair.pull("dreq9", "t9", (16,))
    wait_for(pair.d, "failed", "dreq9")
    # the actors restart in the background, and pulls work again
    deadline = time.monotonic() + 20
    while (now := pair.d.host) is None or now is host or not now.alive or pair.d.down:
        assert time.monotonic() < deadline, "the actors did not restart"
        time.sleep(0.05)
    run_step(pair.p, PdActorsMetadata(pending=["t10"]))
    pair.pull("dreq10", "t10", (17,))
    run_step(pair.p, PdActorsMetadata(ready={"preq10": SendSpec("t10", (18,))}))
    assert "dreq10" not in wait_for(pair.d, "recved", "dreq10")["failed"]
    run_step(pair.p, PdActorsMetadata(dropped=["t8"]))  # P's side of the dead pull


def test_a_pull_told_landed_by_ps_notice_is_not_failed_when_the_trio_thread_dies() -> None:
    """P's landed notice told vLLM that D's KV landed (the notices thread); D's Trio thread
    dies before P's PullDone reaches it: the pull is not reported failed as well (its KV did
    land, and vLLM already counts the request as received)."""
    workers = Pair(d_only={"verify_kv": "off"})  # the fast completion path (issue 28)
    try:
        d_host = workers.d.host
        assert d_host is not None
        run_step(workers.p, PdActorsMetadata(pending=["n1"]))
        workers.pull("dreq-n1", "n1", (3,))
        workers.wait_at_p("n1")
        frozen, thaw = threading.Event(), threading.Event()

        async def freeze_then_die() -> None:  # P's PullDone cannot reach D's Trio tasks
            frozen.set()
            thaw.wait(20)
            raise RuntimeError("injected: the Trio thread dies")

        d_host.post(d_host.nursery.start_soon, freeze_then_die)
        assert frozen.wait(10)
        run_step(workers.p, PdActorsMetadata(ready={"preq-n1": SendSpec("n1", (2,))}))
        told = wait_for(workers.d, "recved", "dreq-n1")  # by the notice, D's loop frozen
        assert "dreq-n1" not in told["failed"]
        thaw.set()
        deadline = time.monotonic() + 20
        while (now := workers.d.host) is d_host or now is None or not now.alive:
            assert time.monotonic() < deadline, "the actors did not restart"
            time.sleep(0.05)
        _, _, failed = workers.d.get_transfer_results()  # the death's reports came before
        assert "dreq-n1" not in failed
        for name in workers.p_kv:
            assert torch.equal(workers.d_kv[name][3], workers.p_kv[name][2])
    finally:
        workers.p.shutdown()
        workers.d.shutdown()


def hybrid_caches() -> dict[str, torch.Tensor]:
    """vLLM's hybrid KV cache manager with one sliding-window and one full-attention layer
    (a group each): both layers are views of one tensor (a block id belongs to one group at a
    time, so the groups share the memory)."""
    alloc = torch.zeros(BLOCKS, 2, 16, 64)
    return {f"model.layers.{i}.self_attn.attn": alloc for i in range(LAYERS)}


def test_each_kv_cache_group_moves_its_own_blocks() -> None:
    """Per-group block ids through both worker sides: the sliding-window layer's blocks (D
    keeps fewer: its window's tail) and the full layer's land in D's blocks of each group,
    and no other block of D changes."""
    names = sorted(hybrid_caches())
    pair = Pair(caches=hybrid_caches, group_of={names[0]: 0, names[1]: 1})
    try:
        layout = layout_from_kv_caches(pair.p_kv, BLOCKS, {names[0]: 0, names[1]: 1}).layout
        assert layout.groups == (0, 1)
        src, dst = ((4, 5, 6), (7, 8, 9)), ((13,), (20, 21, 22))
        p_kv = pair.p_kv[names[0]]  # one tensor: both layers
        p_kv[1:12] = torch.randn(11, *p_kv.shape[1:])
        run_step(pair.p, PdActorsMetadata(pending=["g1"]))
        pair.pull("dreq-g1", "g1", dst)
        run_step(pair.p, PdActorsMetadata(ready={"preq-g1": SendSpec("g1", src)}))
        assert "dreq-g1" not in wait_for(pair.d, "recved", "dreq-g1")["failed"]
        wait_for(pair.p, "sent", "preq-g1")
        d_kv = pair.d_kv[names[0]]
        assert torch.equal(d_kv[13], p_kv[6])  # the window's last block only
        assert torch.equal(d_kv[[20, 21, 22]], p_kv[[7, 8, 9]])
        untouched = [b for b in range(BLOCKS) if b not in (13, 20, 21, 22)]
        assert not d_kv[untouched].any()
    finally:
        pair.p.shutdown()
        pair.d.shutdown()


def test_mla_latent_caches_move_byte_for_byte() -> None:
    """MLA-shaped caches (strided, one latent per layer): the blocks D pulls equal P's, and
    the blocks around them are untouched."""
    pair = Pair(caches=mla_caches)
    try:
        layout = layout_from_kv_caches(pair.p_kv, BLOCKS).layout
        assert [r.block_bytes for r in layout.regions] == [16 * 576 * 4] * LAYERS
        assert {r.stride for r in layout.regions} == {LAYERS * 16 * 576 * 4}
        pair.move_and_check("m1", (3, 4, 9), (10, 11, 2))
        untouched = [b for b in range(BLOCKS) if b not in (10, 11, 2)]
        for name in pair.d_kv:
            assert not pair.d_kv[name][untouched].any()
    finally:
        pair.p.shutdown()
        pair.d.shutdown()


def test_keys_of_their_own_secure_the_worker_sides(tmp_path: Path) -> None:
    """side_channel_key_file / side_channel_peer_keys (certificate files): P registers its
    public key with its bootstrap entry, D demands it, and KV moves."""
    import zmq.auth

    (tmp_path / "p_keys").mkdir()
    (tmp_path / "d_keys").mkdir()
    keys = {}
    for name in ("p", "d"):
        public, secret = zmq.auth.create_certificates(tmp_path, name)
        Path(public).rename(tmp_path / f"{name}_keys" / f"{name}.key")
        keys[name] = str(secret)
    pair = Pair(
        p_only={
            "side_channel_key_file": keys["p"],
            "side_channel_peer_keys": str(tmp_path / "d_keys"),
        },
        d_only={
            "side_channel_key_file": keys["d"],
            "side_channel_peer_keys": str(tmp_path / "p_keys"),
        },
    )
    try:
        pair.move_and_check("k1", (1, 2), (5, 6))
        answer = httpx.get(f"{pair.settings.bootstrap_url}/query", timeout=5, trust_env=False)
        p_public = zmq.auth.load_certificate(keys["p"])[0].decode()
        assert answer.json()["0"]["curve_keys"] == {"0": {"0": p_public}}
    finally:
        pair.p.shutdown()
        pair.d.shutdown()
    with pytest.raises(ValueError, match="go together"):
        ConnectorSettings(side_channel_key_file=keys["p"])
    with pytest.raises(ValueError, match="not both"):
        ConnectorSettings(
            side_channel_key_file=keys["p"],
            side_channel_peer_keys=str(tmp_path / "d_keys"),
            side_channel_secret_file=keys["p"],
        )


def test_a_shared_secret_and_bootstrap_token_secure_the_worker_sides(tmp_path: Path) -> None:
    """side_channel_secret_file (CURVE) and bootstrap_token_file: P and D of the deployment
    move KV; the bootstrap answers nobody without the token."""
    secret, token = tmp_path / "secret", tmp_path / "token"
    secret.write_text("a deployment secret of the tests\n")
    token.write_text("bootstrap-token\n")
    pair = Pair(side_channel_secret_file=str(secret), bootstrap_token_file=str(token))
    try:
        pair.move_and_check("s1", (1, 2), (7, 8))
        url = pair.settings.bootstrap_url
        assert httpx.get(f"{url}/query", timeout=5, trust_env=False).status_code == 401
        assert httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200
    finally:
        pair.p.shutdown()
        pair.d.shutdown()


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def test_no_restart_after_shutdown() -> None:
    """The Trio thread dies, and the connector shuts down before the restart's first attempt:
    the restart must not start the actors again (a leaked thread and Mooncake engine)."""
    settings = ConnectorSettings(bootstrap_port=free_port())
    worker = WorkerSide(settings, WorkerPlace("decode-restart", False, True, RankInfo(), False))
    worker.register_kv_caches(kv_caches(), BLOCKS)
    host = worker.host
    assert host is not None
    restarts_before = set(_threads("pdactors-restart"))

    async def crash() -> None:
        raise RuntimeError("injected: the Trio thread dies")

    host.run_sync(host.nursery.start_soon, crash)
    deadline = time.monotonic() + 10
    while not (restarter := set(_threads("pdactors-restart")) - restarts_before):
        assert time.monotonic() < deadline, "the death started no restart"
        time.sleep(0.005)
    worker.shutdown()  # the first restart attempt waits 1 s: this comes first
    for thread in restarter:  # the restart's end, whatever it did
        thread.join(timeout=15)
        assert not thread.is_alive()
    assert _threads("pdactors-decode-restart") == [], "the actors restarted after shutdown"


def test_mooncakes_environment_follows_the_settings() -> None:
    assert ConnectorSettings().mooncake_environment() == {"MC_LOG_LEVEL": "ERROR"}
    nvlink = ConnectorSettings(protocol="nvlink_intra").mooncake_environment()
    assert nvlink == {"MC_LOG_LEVEL": "ERROR", "MC_INTRANODE_NVLINK": "1"}


@pytest.mark.parametrize(
    ("settings", "limit"),
    [
        ({}, 0),  # tcp: a call takes milliseconds; never in the Trio thread
        ({"protocol": "rdma"}, 0),
        ({"protocol": "nvlink_intra"}, INLINE_MAX_BYTES["nvlink_intra"]),
        ({"protocol": "nvlink_intra", "inline_max_bytes": 0}, 0),
        ({"inline_max_bytes": 4096}, 4096),
    ],
)
def test_calls_in_the_trio_thread_follow_the_protocol_unless_set(
    settings: dict[str, Any], limit: int
) -> None:
    place = WorkerPlace("prefill-i", True, False, RankInfo(), False)
    configs = actor_configs(ConnectorSettings(**settings), place, host_kv=False)
    assert configs.plane.inline_limit == limit


def test_a_restarted_p_worker_takes_its_rank_back_at_once_by_its_predecessors_epoch(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    """A P worker without the bootstrap (as TP rank 1 is) whose Trio thread dies: the restarted
    sender registers at a new port while the dead one's lease is live; it names its
    predecessor's epoch (``replaces``), so it takes the rank at once instead of waiting for
    that lease to lapse, and D pulls from it."""
    url = pair.settings.bootstrap_url

    def entry() -> tuple[str, int]:
        found = httpx.get(f"{url}/query", trust_env=False).json()["1"]
        return found["worker_addr"]["0"]["0"], found["epochs"]["0"]["0"]

    place = WorkerPlace("prefill-r", True, False, RankInfo(dp_rank=1), False)
    worker = WorkerSide(pair.settings, place)
    worker.register_kv_caches(kv_caches(), BLOCKS)
    try:
        host = worker.host
        assert host is not None
        before = entry()

        async def crash() -> None:
            raise RuntimeError("injected: the Trio thread dies")

        host.run_sync(host.nursery.start_soon, crash)
        died = time.monotonic()
        while (now := worker.host) is None or now is host or not now.alive or worker.down:
            assert time.monotonic() - died < 20, "the actors did not restart"
            time.sleep(0.05)
        after = entry()
        assert after[0] != before[0] and after[1] != before[1]  # a new port, a new epoch
        # the first restart waits 1 s; the old lease (5 s) would have kept it out until then
        assert time.monotonic() - died < SenderConfig(engine_id="x").lease_ttl
        assert not [r for r in caplog.records if "waiting for that lease" in r.getMessage()]
        run_step(worker, PdActorsMetadata(pending=["t-r"]))
        pair.pull("dreq-r", "t-r", (20,), engine="prefill-r")
        run_step(worker, PdActorsMetadata(ready={"preq-r": SendSpec("t-r", (21,))}))
        assert "dreq-r" not in wait_for(pair.d, "recved", "dreq-r")["failed"]
    finally:
        worker.shutdown()


def test_gil_switch_ms_lowers_the_processes_switch_interval_and_never_raises_it() -> None:
    import sys

    before = sys.getswitchinterval()
    place = WorkerPlace("gil-w", True, False, RankInfo(), True)
    try:
        sys.setswitchinterval(0.005)
        WorkerSide(ConnectorSettings(bootstrap_port=free_port()), place)
        assert sys.getswitchinterval() == 0.005  # not given (the connector resolves it): kept
        WorkerSide(ConnectorSettings(bootstrap_port=free_port(), gil_switch_ms=0.5), place)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        WorkerSide(ConnectorSettings(bootstrap_port=free_port(), gil_switch_ms=2), place)
        assert sys.getswitchinterval() == pytest.approx(0.0005)  # a shorter one is kept
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"gil_switch_ms": -1}, ConnectorSettings)
    finally:
        sys.setswitchinterval(before)
