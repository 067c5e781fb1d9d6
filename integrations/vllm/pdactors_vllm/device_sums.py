"""KV checksums computed where the KV is: torch ops over the registered KV tensors, on their own
device (a GPU's KV never comes to the host; only one 64-bit sum per row of 8 KiB does).

:class:`TorchRunHasher` is a :class:`~pdactors.RunHasher` (header :data:`WMIX_HEADER`): P's
sender hashes the source runs of each write with it, D's receiver the runs that landed. It maps
each run's address to the KV tensor storage that holds it and hashes the bytes there.

The algorithm, ``wmix-64`` v1 (:func:`reference_digest` is the same in numpy, the spec): a run
of ``n`` bytes is zero-padded to whole rows of :data:`ROW_WORDS` little-endian 64-bit words
``x[r, j]``; from the transfer's seed come a key per column ``k[j]`` and an odd multiplier per
row ``m[r]``; each word becomes ``z = (x ^ k[j]) * m[r]``, then three rounds of "fold the high
32 bits into the low ones, multiply by an odd constant" (the last without the multiply), all
modulo 2^64; the digest is a 64-bit mix of the sum of every ``z``, the seed and ``n``.

* Any change confined to one word changes the sum: each step is a bijection of the word.
* A change of several words (a torn, truncated or shifted run, swapped blocks) changes the
  terms by amounts that the nonlinear rounds scatter; cancelling in the sum is as likely as a
  random 64-bit collision for the patterns the tests try. Not a cryptographic hash: integrity,
  not authenticity (docs/security.md).
* Integer sums modulo 2^64 are exact and order-free: a GPU, another GPU and a CPU give the same
  digest for the same bytes, however the reduction is split.

Cost: about ten elementwise passes over the bytes (one copy into a padded buffer, bounded by
``chunk_bytes``) and one reduction, on a stream of the hasher's own (not the forward's), then
one small copy of the row sums to the host. Blocking; run in a worker thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["ROW_WORDS", "WMIX_HEADER", "TorchRunHasher", "reference_digest"]

#: The first 8 bytes of the sums this hasher makes: the algorithm, then a version.
WMIX_HEADER: Final = b"wmix-64\x01"
#: 64-bit words per row: a run is hashed as whole rows (zero-padded), each with its multiplier.
ROW_WORDS: Final = 1024
ROW_BYTES: Final = 8 * ROW_WORDS

_GOLDEN: Final = 0x9E3779B97F4A7C15
_MIX1: Final = 0xBF58476D1CE4E5B9
_MIX2: Final = 0x94D049BB133111EB
_COLUMNS: Final = 0x243F6A8885A308D3  # the domains of the keys drawn from the seed
_ROWS: Final = 0x13198A2E03707344
_ROUNDS: Final = (0xD6E8FEB86659FD93, 0xCA5A826395121157)  # odd multipliers of the rounds
_M64: Final = (1 << 64) - 1
_U64 = npt.NDArray[np.uint64]


def _signed(c: int) -> int:
    """``c`` (a 64-bit constant) as the int64 with the same bits, for torch's scalars."""
    return c - (1 << 64) if c >> 63 else c


def _splitmix(x: _U64) -> _U64:
    """SplitMix64's output function, elementwise (numpy wraps uint64 arrays silently)."""
    z = x + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def _keys(seed: int, local_rows: _U64) -> tuple[_U64, _U64]:
    """The column keys and, for rows at ``local_rows`` (the row's index in its run), their
    odd multipliers."""
    s = np.uint64(seed & _M64)
    cols = _splitmix((s ^ np.uint64(_COLUMNS)) + np.arange(ROW_WORDS, dtype=np.uint64))
    a, g = _splitmix((s ^ np.uint64(_ROWS)) + np.arange(2, dtype=np.uint64))
    rows = (a | np.uint64(1)) + (g << np.uint64(1)) * local_rows
    return cols, rows


def _finish(seed: int, sums: _U64, lengths: _U64) -> _U64:
    """The digests from each run's sum of terms."""
    salt = np.uint64(seed & _M64) ^ (lengths * np.uint64(_GOLDEN))
    return _splitmix(sums ^ salt)


def reference_digest(seed: int, data: bytes) -> int:
    """``wmix-64`` of ``data`` in numpy: the specification the torch code must match."""
    rows = -(-len(data) // ROW_BYTES)
    x = np.zeros(rows * ROW_WORDS, dtype="<u8")
    x.view(np.uint8)[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    cols, mults = _keys(seed, np.arange(rows, dtype=np.uint64))
    z = (x.reshape(rows, ROW_WORDS) ^ cols[None, :]) * mults[:, None]
    for c in _ROUNDS:
        z ^= z >> np.uint64(32)
        z *= np.uint64(c)
    z ^= z >> np.uint64(32)
    total = np.add.reduce(z.reshape(-1), dtype=np.uint64)
    one = np.array([total], dtype=np.uint64)
    return int(_finish(seed, one, np.array([len(data)], dtype=np.uint64))[0])


def _fold(z: torch.Tensor) -> None:
    """``z ^= z >> 32`` (logical) in place, on a contiguous int64 ``z``: the low 32-bit half of
    each word (first: little-endian) takes the xor of the high half."""
    halves = z.view(torch.int32).view(*z.shape, 2)
    halves[..., 0].bitwise_xor_(halves[..., 1])


class TorchRunHasher:
    """Hashes runs of the memory of ``tensors`` (vLLM's KV caches: any views; their whole
    storages count) with torch ops on their device. ``chunk_bytes`` bounds the scratch
    buffer (the runs of one call are hashed in chunks of whole rows).

    On CUDA the work runs on a stream of its own: it does not wait for the forward, and the
    forward does not wait for it; the caller makes sure the bytes are complete first (P: the
    write's ``before`` waits for the forward's event; D: the write landed before P answered).
    Raises :class:`ValueError` for tensors on several devices, and from :meth:`digests` for a
    run outside their memory.
    """

    header: Final = WMIX_HEADER

    def __init__(self, tensors: Iterable[torch.Tensor], *, chunk_bytes: int = 64 << 20) -> None:
        spans: dict[int, torch.Tensor] = {}
        for t in tensors:
            storage = t.untyped_storage()
            flat = t.new_empty(0, dtype=torch.uint8).set_(storage)  # every byte of it
            spans.setdefault(storage.data_ptr(), flat)
        devices = {flat.device for flat in spans.values()}
        if len(devices) != 1:
            raise ValueError(f"KV tensors on {len(devices)} devices; one hasher per device")
        (self.device,) = devices
        bases = sorted(spans)
        self._flats = [spans[b] for b in bases]
        self._bases = np.array(bases, dtype=np.uint64)
        self._ends = self._bases + np.array([f.numel() for f in self._flats], dtype=np.uint64)
        self._chunk_rows = max(1, chunk_bytes // ROW_BYTES)
        self._zeros = torch.zeros(ROW_WORDS, dtype=torch.int64, device=self.device)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]

    def digests(self, seed: int, addrs: npt.NDArray[np.uint64],
                lengths: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:  # fmt: skip
        """``wmix-64`` of each run of ``lengths[i]`` bytes at ``addrs[i]``. Blocking."""
        if not len(lengths):
            return np.empty(0, dtype=np.uint64)
        which = self._locate(addrs, lengths)
        rows = ((lengths + np.uint64(ROW_BYTES - 1)) // np.uint64(ROW_BYTES)).astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        total = int(rows.sum())
        local = (np.arange(total) - np.repeat(starts, rows)).astype(np.uint64)
        cols, mults = _keys(seed, local)
        stream = torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext()
        with stream, torch.inference_mode():
            keys = torch.from_numpy(np.concatenate([cols, mults]).view(np.int64)).to(self.device)
            row_sums = torch.empty(total, dtype=torch.int64, device=self.device)
            buf = torch.empty(min(total, self._chunk_rows) * ROW_WORDS, dtype=torch.int64,
                              device=self.device)  # fmt: skip
            for first, pieces in self._chunks(which, addrs, lengths, rows):
                self._rows(buf, pieces, keys, first, row_sums)
            sums = row_sums.cpu().numpy().view(np.uint64)
        return _finish(seed, np.add.reduceat(sums, starts), lengths.astype(np.uint64))

    def _locate(self, addrs: _U64, lengths: _U64) -> npt.NDArray[np.intp]:
        """The storage that holds each run; raises ValueError for one that none holds."""
        which = np.searchsorted(self._bases, addrs, side="right") - 1
        ok = (which >= 0) & (lengths > 0)
        ok &= addrs + lengths <= self._ends[np.maximum(which, 0)]
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"run {i} ({int(lengths[i])} bytes at {int(addrs[i]):#x}) is not "
                             "in the KV tensors' memory")  # fmt: skip
        return which

    def _chunks(
        self, which: npt.NDArray[np.intp], addrs: _U64, lengths: _U64, rows: npt.NDArray[np.int64]
    ) -> Iterable[tuple[int, list[tuple[torch.Tensor, int]]]]:
        """Pieces of runs (their bytes, then the zero bytes that pad them) filling at most
        ``chunk_rows`` rows each, split at row boundaries; with the first row's index."""
        pieces: list[tuple[torch.Tensor, int]] = []
        first = used = 0
        for k, addr, n, r in zip(which.tolist(), addrs.tolist(), lengths.tolist(),
                                 rows.tolist(), strict=True):  # fmt: skip
            flat, offset, done = self._flats[k], addr - int(self._bases[k]), 0
            while done < r:
                take = min(r - done, self._chunk_rows - used)
                lo = done * ROW_BYTES
                hi = min(n, (done + take) * ROW_BYTES)
                pieces.append((flat[offset + lo : offset + hi], take * ROW_BYTES - (hi - lo)))
                done, used = done + take, used + take
                if used == self._chunk_rows:
                    yield first, pieces
                    pieces, first, used = [], first + used, 0
        if pieces:
            yield first, pieces

    def _rows(
        self,
        buf: torch.Tensor,
        pieces: Sequence[tuple[torch.Tensor, int]],
        keys: torch.Tensor,
        first: int,
        row_sums: torch.Tensor,
    ) -> None:
        """Hash one chunk's rows into ``row_sums[first:]``."""
        words = sum(b.numel() + pad for b, pad in pieces) // 8
        out = buf[:words]
        wide = all(b.numel() % 8 == 0 and b.data_ptr() % 8 == 0 for b, _ in pieces)
        zeros = self._zeros if wide else self._zeros.view(torch.uint8)
        parts: list[torch.Tensor] = []
        for b, pad in pieces:
            parts.append(b.view(torch.int64) if wide else b)
            if pad:
                parts.append(zeros[: pad // 8 if wide else pad])
        torch.cat(parts, out=out if wide else out.view(torch.uint8))
        n = words // ROW_WORDS
        z = out.view(n, ROW_WORDS)
        z.bitwise_xor_(keys[:ROW_WORDS])
        z.mul_(keys[ROW_WORDS + first : ROW_WORDS + first + n, None])
        for c in _ROUNDS:
            _fold(z)
            z.mul_(_signed(c))
        _fold(z)
        torch.sum(z, dim=1, out=row_sums[first : first + n])
