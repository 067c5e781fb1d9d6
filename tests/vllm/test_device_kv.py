"""The harness's KV on a device (pdactors_vllm.device_kv), run here on CPU tensors — the same
torch code runs on CUDA ones: it holds the bytes of the host harness's KVBuffer, its check
catches a wrong byte, it names a missing GPU in one sentence, and its worker processes (torch
fill and check, torch KV checksums) move and verify a TP shape through the process harness."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

torch = pytest.importorskip("torch")

from pdactors.config import DataPlaneConfig  # noqa: E402
from pdactors.testing.kv import KVBuffer, KVDeviceUnavailable  # noqa: E402
from pdactors.testing.process_cluster import open_process_cluster  # noqa: E402
from pdactors_vllm.device_kv import DeviceKVBuffer, check_device, kv_tensor  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("heads", "total"), [(range(1), 1), (range(2, 4), 8), (range(4), 8)])
def test_device_kv_holds_the_host_harness_bytes(heads: range, total: int) -> None:
    host = KVBuffer(3, 8, 1024, heads=heads, total_heads=total)
    device = DeviceKVBuffer(3, 8, 1024, "cpu", heads=heads, total_heads=total)
    host.fill("req-7", [5, 1, 2])
    device.fill("req-7", [5, 1, 2])
    assert np.array_equal(host.data, device.tensor.numpy())
    assert device.verify("req-7", [5, 1, 2], 3) and device.verify("req-7", [1, 2], 3)
    assert not device.verify("req-8", [5, 1, 2], 3)
    device.tensor[1, 2, 100] ^= 1
    assert not device.verify("req-7", [5, 1, 2], 3)


def test_kv_tensor_is_zeroed_uint8_and_regions_cover_it() -> None:
    t = kv_tensor((2, 4, 64), "cpu")
    assert t.dtype == torch.uint8 and not t.any()
    kv = DeviceKVBuffer(2, 4, 64, "cpu")
    assert kv.regions == [(kv.tensor.data_ptr(), 2 * 4 * 64)]
    assert kv.layout.bytes_per_block == 2 * 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_a_missing_gpu_is_named_in_one_sentence() -> None:
    with pytest.raises(KVDeviceUnavailable, match=r"KV device cuda:0 is not available: "):
        check_device("cuda:0")
    with pytest.raises(KVDeviceUnavailable, match="use cpu or cuda:N"):
        check_device("gpu0")


async def test_device_workers_move_a_tp_shape_with_torch_checksums(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU workers' code (``python -m pdactors_vllm.device_kv``) on host tensors: P TP 2
    → D TP 1, torch fills and checks, the torch KV checksums on both sides."""
    path = f"{ROOT}:{ROOT / 'integrations' / 'vllm'}"
    monkeypatch.setenv("PYTHONPATH", path)  # the worker processes import pdactors_vllm
    with trio.fail_after(120):
        async with open_process_cluster(
            layers=2, num_blocks=8, block_bytes=4096, dataplane=DataPlaneConfig(),
            p_tp=2, d_tp=1, kv_heads=8, module="pdactors_vllm.device_kv",
        ) as cluster:  # fmt: skip
            outcomes = [await cluster.run_transfer(f"req-{i}", 4) for i in range(3)]
            with trio.fail_after(10):
                await cluster.wait_settled()
            assert cluster.blocks_in_use() == 0
    assert all(o.ok and o.verified for o in outcomes), outcomes
    assert {o.nbytes for o in outcomes} == {2 * 4 * 4096}
