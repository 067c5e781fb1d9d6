"""KV checksums of KV on a GPU (pdactors_vllm.device_sums), run here on CPU tensors — the same
torch code runs on CUDA ones: the digests match the numpy specification, equal bytes hash
equal wherever they sit, every corruption kind changes the digest, and P and D hashing with it
over a real data plane verify a transfer and catch each corruption in flight."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from pdactors import Liveness, ReceiverConfig, RunHasher, SenderConfig, Xxh3Hasher  # noqa: E402
from pdactors.core.plan import packed_layout, plan_transfer  # noqa: E402
from pdactors.dataplane.base import DataPlane  # noqa: E402
from pdactors.testing import open_cluster, run_transfer  # noqa: E402
from pdactors.testing.corruption import CORRUPTIONS, CorruptingDataPlane  # noqa: E402
from pdactors.testing.kv import KVBuffer  # noqa: E402
from pdactors.testing.memory_dataplane import MemoryFabric  # noqa: E402
from pdactors.transport import MemoryTransport  # noqa: E402
from pdactors_vllm.device_sums import (  # noqa: E402
    ROW_BYTES,
    WMIX_HEADER,
    TorchRunHasher,
    reference_digest,
)

ROOT = Path(__file__).resolve().parents[2]
SEED = 0x0123456789ABCDEF
RUN = 3 * ROW_BYTES + 40  # three whole rows and a short one


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)


def _digest(t: torch.Tensor, offset: int, n: int, seed: int = SEED, **kw: int) -> int:
    hasher = TorchRunHasher([t], **kw)
    addr = np.array([t.untyped_storage().data_ptr() + offset], dtype=np.uint64)
    return int(hasher.digests(seed, addr, np.array([n], dtype=np.uint64))[0])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_digests_match_the_numpy_specification(data: st.DataObject) -> None:
    t = _bytes(4 * ROW_BYTES + 100, data.draw(st.integers(0, 9)))
    raw = t.numpy().tobytes()
    runs = []
    for _ in range(data.draw(st.integers(1, 5))):
        offset = data.draw(st.integers(0, len(raw) - 1))
        runs.append((offset, data.draw(st.integers(1, len(raw) - offset))))
    seed = data.draw(st.integers(0, 2**64 - 1))
    chunk = data.draw(st.sampled_from([ROW_BYTES, 2 * ROW_BYTES, 64 << 20]))
    base = t.data_ptr()
    addrs = np.array([base + o for o, _ in runs], dtype=np.uint64)
    lengths = np.array([n for _, n in runs], dtype=np.uint64)
    got = TorchRunHasher([t], chunk_bytes=chunk).digests(seed, addrs, lengths)
    assert got.tolist() == [reference_digest(seed, raw[o : o + n]) for o, n in runs]


def test_equal_bytes_hash_equal_wherever_they_sit_and_the_seed_binds_them() -> None:
    src = _bytes(RUN + 3)  # P's source starts 3 bytes into its memory (not word-aligned)
    dst = torch.zeros(RUN + 64, dtype=torch.uint8)
    dst[64:] = src[3:]
    kv = torch.zeros(2, RUN // 2 + 32, dtype=torch.bfloat16).t()  # a non-contiguous view
    torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage())[8 : 8 + RUN] = src[3:]
    digest = _digest(src, 3, RUN)
    assert digest == _digest(dst, 64, RUN) == _digest(dst, 64, RUN, chunk_bytes=ROW_BYTES)
    assert digest == _digest(kv, 8, RUN)
    assert _digest(src, 3, RUN, seed=SEED + 1) != digest


@settings(max_examples=200, deadline=None)
@given(st.integers(0, RUN - 1), st.integers(0, 7))
def test_any_flipped_bit_changes_the_digest(position: int, bit: int) -> None:
    t = _bytes(RUN)
    clean = _digest(t, 0, RUN)
    t[position] ^= 1 << bit
    assert _digest(t, 0, RUN) != clean


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, RUN // 8 - 1), min_size=2, max_size=4, unique=True))
def test_flipped_top_bits_of_several_words_change_the_digest(words: list[int]) -> None:
    # bf16 sign bits: in a plain multilinear hash (sum of word * odd key) two of them cancel
    t = _bytes(RUN)
    clean = _digest(t, 0, RUN)
    for w in words:
        t[8 * w + 7] ^= 0x80
    assert _digest(t, 0, RUN) != clean


@pytest.mark.parametrize("stale", ["zeros", "old"])
def test_truncated_shifted_and_swapped_runs_change_the_digest(stale: str) -> None:
    block = ROW_BYTES // 2
    p = _bytes(RUN, 1)
    want = _digest(p, 0, RUN)
    old = torch.zeros(RUN, dtype=torch.uint8) if stale == "zeros" else _bytes(RUN, 2)
    landed = []
    for tail in (1, 7, 8, 100, block, RUN - 1):  # the last bytes never written
        d = p.clone()
        d[RUN - tail :] = old[RUN - tail :]
        landed.append(d)
    for by in (1, 8, block):  # written ``by`` bytes late or early
        late, early = old.clone(), old.clone()
        late[by:] = p[: RUN - by]
        early[: RUN - by] = p[by:]
        landed += [late, early]
    swapped = p.clone()
    swapped[:block], swapped[block : 2 * block] = p[block : 2 * block], p[:block]
    landed.append(swapped)
    for d in landed:
        assert _digest(d, 0, RUN) != want


def test_runs_outside_the_tensors_memory_are_refused() -> None:
    t = _bytes(1000)
    hasher = TorchRunHasher([t])
    base = t.data_ptr()
    for addr, n in ((base + 900, 101), (base - 1, 10), (base, 0)):
        with pytest.raises(ValueError, match="not in the KV tensors' memory"):
            hasher.digests(1, np.array([addr], np.uint64), np.array([n], np.uint64))
    assert hasher.header == WMIX_HEADER and len(hasher.header) == 8


# ------------------------------------------------------------------ P and D over a data plane

SMALL = {"layers": 4, "num_blocks": 32, "block_bytes": 1024}
PATIENT = ReceiverConfig(
    pull_timeout=1000, lookup_timeout=1e6, liveness=Liveness(connect_timeout=1e6)
)
QUIET = SenderConfig(engine_id="p", register_timeout=1e6, lease_interval=0)


def _on_tensors(role: str, kv: KVBuffer) -> RunHasher:
    """Each worker's KV registered as vLLM's is: a tensor (here sharing the harness's buffer)."""
    return TorchRunHasher([torch.from_numpy(kv.data)])


def _corrupting(planes: list[CorruptingDataPlane]) -> object:
    def wrap(inner: DataPlane) -> DataPlane:
        planes.append(CorruptingDataPlane(inner, seed=len(planes)))
        return planes[-1]

    return wrap


@pytest.mark.parametrize("fabric", ["memory", "mooncake tcp"])
async def test_p_and_d_hashing_tensors_verify_and_catch_each_corruption(fabric: str) -> None:
    planes: list[CorruptingDataPlane] = []
    memory = {"fabric": MemoryFabric(), "transport": MemoryTransport()}
    async with open_cluster(
        sender=QUIET,
        receiver=PATIENT,
        wrap_prefill=_corrupting(planes),  # type: ignore[arg-type]
        hasher=_on_tensors,
        **(memory if fabric == "memory" else {}),  # type: ignore[arg-type]
        **SMALL,
    ) as cluster:
        assert (await run_transfer(cluster, "clean", 6)).verified
        for kind in CORRUPTIONS:
            planes[0].arm(kind)
            outcome = await run_transfer(cluster, f"bad-{kind}", 6)
            assert f"KV checksum mismatch in transfer bad-{kind} from P worker" in outcome.reason
        assert (await run_transfer(cluster, "clean-again", 6)).verified
        stats = cluster.decode[0].receiver.kv_check_statistics()
        assert (stats.verified, stats.corrupt, stats.unverified) == (2, 3, 0)
        with trio.fail_after(5):
            await cluster.wait_settled()
        assert cluster.blocks_in_use() == 0


@pytest.mark.parametrize("verify_kv", ["on", "require"])
async def test_a_d_on_host_memory_trusts_or_refuses_a_gpus_sums_by_name(
    mock_clock: trio.testing.MockClock, verify_kv: str
) -> None:
    async with open_cluster(
        fabric=MemoryFabric(),
        transport=MemoryTransport(),
        sender=QUIET,
        receiver=msgspec.structs.replace(PATIENT, verify_kv=verify_kv),
        hasher=lambda role, kv: _on_tensors(role, kv) if role == "prefill" else Xxh3Hasher(),
        **SMALL,
    ) as cluster:
        outcome = await run_transfer(cluster, "t", 5)
        if verify_kv == "on":
            assert outcome.ok and cluster.decode[0].receiver.kv_check_statistics().unverified == 1
        else:
            assert "sent KV checksums of kind 'wmix-64' v1, which this D cannot compute" in (
                outcome.reason
            )


# ------------------------------------------------------------------ the GPU bench, run on CPU


def test_the_gpu_checksum_bench_runs_on_cpu_over_plan_transfers_runs() -> None:
    from bench.kv_checksum import coalesced_runs

    layout = packed_layout(1 << 20, 3, 8, 512)
    for ids in ([0, 1, 2, 3], [0, 2, 4, 6], [5], [1, 2, 4, 5, 6]):
        plan = plan_transfer(layout, ids, layout, ids)
        addrs, lengths = coalesced_runs(1 << 20, 3, 8, 512, ids)
        assert sorted(zip(addrs.tolist(), lengths.tolist(), strict=True)) == sorted(
            zip(plan.src.tolist(), plan.lengths.tolist(), strict=True)
        )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'integrations' / 'vllm'}"}
    args = ["--gpu-checksums", "--device", "cpu", "--small", "--ttft-ms", "50"]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "kv_checksum.py"), *args],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 63 blocks")]
    assert len(rows) == 3 and all(row.endswith("| yes | yes |") for row in rows)
    assert "of a 50 ms TTFT" in done.stdout


@pytest.mark.parametrize("verify_kv", ["on", "require", "off", "auto"])
def test_the_adapter_keeps_verify_kv_wherever_the_kv_is_and_xxh3_on_the_host(
    verify_kv: str,
) -> None:
    """``on``, ``require`` and ``off`` hold wherever the KV lives; ``auto`` (the default) is on
    for host KV and off for a GPU's (the measured cost there: docs/benchmarks.md)."""
    pytest.importorskip("vllm")
    from pdactors import RankInfo
    from pdactors_vllm.actor_configs import WorkerPlace, actor_configs
    from pdactors_vllm.settings import settings_from_extra_config
    from pdactors_vllm.worker_side import kv_hasher

    s = settings_from_extra_config({"verify_kv": verify_kv})
    assert settings_from_extra_config({}).verify_kv == "auto"
    place = WorkerPlace("e", True, True, RankInfo(), False)
    for host_kv in (True, False):
        want = {"auto": "on" if host_kv else "off"}.get(verify_kv, verify_kv)
        configs = actor_configs(s, place, host_kv=host_kv)
        assert configs.sender is not None and configs.receiver is not None
        assert configs.sender.checksum_kv is (want != "off")
        assert configs.receiver.verify_kv == want
    assert isinstance(kv_hasher([torch.zeros(8)]), Xxh3Hasher)  # host KV: the same wire bytes
