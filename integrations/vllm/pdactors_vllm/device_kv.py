"""KV memory on a CUDA device for the standalone harness and the GPU benchmarks: the one place
outside vLLM where pdactors allocates GPU KV (torch lives in this package, never in
``pdactors``: tests/test_layers.py).

* :func:`kv_tensor`: a zeroed ``uint8`` tensor on a device, from PyTorch's plain cudaMalloc
  allocator (``nvlink_intra`` shares it through cudaIpc handles), with the device made current
  first (CUDA memory is registered with its own device current). ``bench/gpu_handoff.py`` and
  ``bench/gpu_dataplane.py`` take their KV from it.
* :class:`DeviceKVBuffer`: a harness worker's KV (:class:`~pdactors.testing.kv.KVMemory`) in
  such a tensor, holding the same bytes as the host harness's
  :class:`~pdactors.testing.kv.KVBuffer` (:func:`~pdactors.testing.kv.head_offsets`), filled
  and checked on the device.
* ``python -m pdactors_vllm.device_kv``: a harness worker process
  (:mod:`pdactors.testing.kv_worker`) with its KV there, hashed by :class:`TorchRunHasher`.
  ``pdactors harness --kv-device cuda:N`` starts these; where CUDA is not there it answers
  why and exits 2.
"""

from __future__ import annotations

import re

import torch

from pdactors.core.plan import packed_layout
from pdactors.dataplane import RunHasher
from pdactors.testing.kv import KVDeviceUnavailable, head_offsets
from pdactors.testing.kv_worker import main as serve_worker
from pdactors.testing.worker_wire import WorkerSpec
from pdactors.wire import Layout
from pdactors_vllm.device_sums import TorchRunHasher

__all__ = ["DeviceKVBuffer", "check_device", "device_kv", "kv_tensor"]

_CUDA = re.compile(r"cuda(:\d+)?")


def check_device(device: str) -> torch.device:
    """``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``) if this process can use it. Raises
    :class:`KVDeviceUnavailable` with a sentence saying why not."""
    if device == "cpu":
        return torch.device("cpu")
    if not _CUDA.fullmatch(device):
        raise KVDeviceUnavailable(f"unknown KV device {device!r}: use cpu or cuda:N")
    if not torch.cuda.is_available():
        build = torch.version.cuda
        why = (
            f"this torch ({torch.__version__}) has no CUDA"
            if build is None
            else "no GPU is visible"
        )
        raise KVDeviceUnavailable(f"KV device {device} is not available: {why}")
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise KVDeviceUnavailable(f"KV device {device} is not available: {count} GPU(s) visible")
    return torch.device("cuda", index)


def kv_tensor(shape: tuple[int, ...], device: str) -> torch.Tensor:
    """A zeroed ``uint8`` tensor of ``shape`` on ``device`` (made current first when a GPU)."""
    where = check_device(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    return torch.zeros(shape, dtype=torch.uint8, device=where)


class DeviceKVBuffer:
    """One harness worker's KV in a tensor ``[layers, num_blocks, block_bytes]`` on
    ``device``, one region; the bytes of a transfer are those of
    :meth:`pdactors.testing.kv.KVBuffer.expected`, made on the device. Fills and checks wait
    for the device (P's engine reads the bytes on a stream of its own)."""

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_bytes: int,
        device: str,
        *,
        heads: range = range(1),
        total_heads: int = 1,
    ) -> None:
        if block_bytes % len(heads):
            raise ValueError(f"{block_bytes} block bytes do not split into {len(heads)} heads")
        self.heads, self.total_heads = heads, total_heads
        self.head_bytes = block_bytes // len(heads)
        self.tensor = kv_tensor((layers, num_blocks, block_bytes), device)
        packed = packed_layout(self.tensor.data_ptr(), layers, num_blocks, block_bytes)
        self.layout = Layout(packed.regions, tuple(f"layers.{i}" for i in range(layers)))
        self._ramp = torch.arange(self.head_bytes, device=self.tensor.device) % 256

    @property
    def regions(self) -> list[tuple[int, int]]:
        return [(self.tensor.data_ptr(), self.tensor.numel())]

    def expected(self, transfer_id: str, count: int) -> torch.Tensor:
        """The bytes P writes for ``transfer_id``: ``[layers, count, block_bytes]``."""
        layers = self.tensor.shape[0]
        offsets = head_offsets(transfer_id, layers, count, self.heads, self.total_heads, 0)
        cells = torch.from_numpy(offsets).to(self.tensor.device, torch.int64)
        block = (self._ramp[None, None, :] + cells[:, :, None]) % 256
        return block.to(torch.uint8).reshape(layers, count, -1)

    def fill(self, transfer_id: str, blocks: list[int]) -> None:
        ids = torch.tensor(blocks, device=self.tensor.device)
        self.tensor.index_copy_(1, ids, self.expected(transfer_id, len(blocks)))
        _wait(self.tensor)

    def verify(self, transfer_id: str, blocks: list[int], src_count: int) -> bool:
        """True when ``blocks`` hold the last ``len(blocks)`` of P's ``src_count`` blocks."""
        want = self.expected(transfer_id, src_count)[:, src_count - len(blocks) :, :]
        ids = torch.tensor(blocks, device=self.tensor.device)
        return bool(torch.equal(self.tensor.index_select(1, ids), want))


def _wait(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def device_kv(spec: WorkerSpec) -> tuple[DeviceKVBuffer, RunHasher | None]:
    """A harness worker's KV on ``spec.kv_device`` and its hasher (torch ops there): the
    :data:`~pdactors.testing.kv_worker.KVPlace` of ``python -m pdactors_vllm.device_kv``."""
    kv = DeviceKVBuffer(
        spec.layers,
        spec.num_blocks,
        spec.local_block_bytes,
        spec.kv_device,
        heads=spec.heads,
        total_heads=spec.kv_heads or 1,
    )
    hasher = TorchRunHasher([kv.tensor]) if spec.checksums else None
    return kv, hasher


if __name__ == "__main__":
    serve_worker(device_kv)
