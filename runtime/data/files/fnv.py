"""The stable hash of categorical values: FNV-1a 64 of `prefix + value`, for every value of an
arrow string array at once, compiled with numba (one pass over the array's bytes, no Python per
value; the compiled loop releases the GIL so it overlaps the trainer's thread). Compiled on the
first call of a process and cached beside this file (numba's `cache=True`)."""

from __future__ import annotations

import numba
import numpy as np
import pyarrow as pa

OFFSET, PRIME = 0xCBF29CE484222325, 0x100000001B3


def ids(col: pa.Array, prefix: bytes, first: int, vocab: int, out: np.ndarray | None = None) -> np.ndarray:
    """int64 ids `first + FNV-1a(prefix + value) % (vocab - first)` of a string array's values (a
    null hashes as the empty string), written into `out` (any int64 vector of len(col)) if given.

    `vocab` 0: the raw 64-bit hash, no modulo (`hash64` schemas, unbounded tables): the id is the
    hash's bits as an int64 (`np.uint64` view gives the hash back; ids >= 2^63 are negative int64),
    except that a hash below `first` (probability first / 2^64) is moved up by `first`."""
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise TypeError(f"fnv.ids hashes string arrays, got {col.type}")
    n = len(col)
    out = np.empty(n, np.int64) if out is None else out
    if out.shape != (n,) or out.dtype != np.int64:
        raise ValueError(f"fnv.ids writes {n} int64 ids; `out` is {out.dtype} {out.shape}")
    h0 = _fold(OFFSET, prefix)
    if n == 0:
        return out
    bufs = col.buffers()
    wide = pa.types.is_large_string(col.type)
    offsets = np.frombuffer(bufs[1], np.int64 if wide else np.int32, n + 1, col.offset * (8 if wide else 4))
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None and bufs[2].size else np.zeros(1, np.uint8)
    valid = np.frombuffer(bufs[0], np.uint8) if col.null_count else np.zeros(0, np.uint8)
    mod = np.uint64(vocab - first if vocab else 0)
    _hash(np.uint64(h0), offsets, data, valid, col.offset, mod, np.uint64(first), out.view(np.uint64))
    return out


def _fold(h: int, data: bytes) -> int:
    for b in data:
        h = ((h ^ b) * PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


@numba.njit(cache=True, nogil=True)
def _hash(h0, offsets, data, valid, bit, mod, first, out):  # pragma: no cover - compiled
    """out[i] = first + FNV-1a(value i, from h0) % mod (mod 0: the hash, moved up by `first` when
    below it), as uint64; value i is null where bit `bit + i` of
    the validity bitmap `valid` (empty: no nulls) is 0, and hashes as the empty string."""
    prime = np.uint64(PRIME)
    for i in range(out.shape[0]):
        h = h0
        if valid.shape[0] == 0 or (valid[(bit + i) >> 3] >> ((bit + i) & 7)) & 1:
            for j in range(offsets[i], offsets[i + 1]):
                h = (h ^ np.uint64(data[j])) * prime
        if mod == 0:
            out[i] = h if h >= first else h + first
        else:
            out[i] = h % mod + first
