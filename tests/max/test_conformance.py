"""Conformance against Modular MAX's own CPU kernels (the `max` package, MAX 26.7 when written):
`fused_qkv_ragged_matmul` (with and without bias), `fused_qkv_padded_matmul` and
`fused_qk_ragged_rope`, run side by side with this crate on random paged cases — ragged lengths
including 1 and non-multiples of the page, cache lengths landing mid-page, scattered page tables,
GQA, head sizes 64 and 128, caches pre-filled with garbage, both RoPE pairings, f32 and bf16
freqs, position ids and partial rotary.

What must hold (docs/semantics.md):
* the same cache slots are written, and nothing else in the cache changes;
* `mode="sequential"` (MAX's CPU order) gives MAX's bits for bf16 and f32, with and without bias;
* RoPE in MAX's math (`rope_math="max"`) gives MAX's bits in every mode;
* `"exact"`, `"fast"` (and RoPE's `"f32"` math) stay within the crate's stated bounds of MAX.

Skipped, with the reason, where `max` cannot be imported. The first run compiles each MAX graph
(about 30 s each on 2 cores); MAX caches them on disk.
"""

from __future__ import annotations

import numpy as np
import pytest

mg = pytest.importorskip("max_graphs", reason="Modular's `max` package is not installed (pip install max)")
ml_dtypes = pytest.importorskip("ml_dtypes")
import paged_qkv as pq  # noqa: E402

BF16 = ml_dtypes.bfloat16
MODES = ("sequential", "exact", "fast")
PREC = {"bfloat16": 8, "float32": 24}


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def ulp(v: np.ndarray, dtype) -> np.ndarray:
    """One unit in the last place of `dtype` at |v| (at least the smallest normal's)."""
    p = PREC[np.dtype(dtype).name]
    mag = np.maximum(np.abs(v.astype(np.float64)), 2.0**-126)
    return 2.0 ** (np.floor(np.log2(mag)) - (p - 1))


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


class Paged:
    """A random paged batch: ragged (or padded) rows, mid-page cache lengths, a scattered table,
    a cache of garbage."""

    def __init__(self, rng, dtype, lens, hkv, hd, page=16, layers=2, blocks=40):
        self.lens = np.array(lens)
        self.cache_lengths = rng.integers(0, 3 * page, len(lens)).astype(np.uint32)
        self.cache_lengths[0] = page - 1  # a first token at a page's last slot
        pages = int(max((c + n) // page + 1 for c, n in zip(self.cache_lengths, lens)))
        assert len(lens) * pages <= blocks
        self.lookup = rng.permutation(blocks)[: len(lens) * pages].reshape(len(lens), pages).astype(np.uint32)
        self.kv = rand(rng, (blocks, 2, layers, page, hkv, hd), dtype)
        self.offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.uint32)
        self.page = page

    def written_slots(self, after: np.ndarray) -> np.ndarray:
        """Which (block, K/V, layer, slot) of `after` differ from the garbage anywhere."""
        return (bits(after) != bits(self.kv)).any(axis=(4, 5))


def abs_dot(x, w):
    """Σ_k |x[m, k] · w[n, k]| in f64, [M, N]."""
    return np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T


def assert_within(ours, theirs, bound, what):
    diff = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
    bad = ~(diff <= bound) & ~(np.isnan(ours.astype(np.float64)) & np.isnan(theirs.astype(np.float64)))
    assert not bad.any(), f"{what}: {bad.sum()} elements beyond the bound, e.g. ours {ours[bad][:3]} MAX {theirs[bad][:3]}"


# ----------------------------------------------------------------------------------------------
# fused_qkv_ragged_matmul (+ bias)

QKV_CASES = [
    # dtype, q heads, kv heads, head size, bias
    (BF16, 4, 2, 64, False),
    (BF16, 4, 2, 64, True),
    (np.float32, 4, 2, 64, False),
    (np.float32, 4, 2, 64, True),
    (BF16, 2, 1, 128, True),
]


@pytest.mark.parametrize("dtype,hq,hkv,hd,with_bias", QKV_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("seed,k,lens", [(1, 256, [1, 5, 17]), (2, 64, [16, 1]), (3, 320, [33])])
def test_qkv_ragged_matches_max(dtype, hq, hkv, hd, with_bias, seed, k, lens):
    rng = np.random.default_rng(seed)
    c = Paged(rng, dtype, lens, hkv, hd)
    n = (hq + 2 * hkv) * hd
    m = sum(lens)
    x = rand(rng, (m, k), dtype)
    w = rand(rng, (n, k), dtype, 1 / np.sqrt(k))
    bias = rand(rng, (n,), dtype) if with_bias else None
    layer = 1
    q_max, kv_max = mg.qkv_ragged(x, c.offsets, w, c.kv, c.cache_lengths, c.lookup, layer, hq, bias=bias)
    s = abs_dot(x, w)
    for mode in MODES:
        kv = c.kv.copy()
        q = pq.qkv_ragged(x, c.offsets, w, kv, c.cache_lengths, c.lookup, layer, bias=bias, q_dim=hq * hd, mode=mode)
        assert np.array_equal(c.written_slots(kv), c.written_slots(kv_max)), f"{mode}: other slots written"
        if mode == "sequential":
            assert np.array_equal(bits(q), bits(q_max)), "sequential Q differs from MAX"
            assert np.array_equal(bits(kv), bits(kv_max)), "sequential K/V differ from MAX"
            continue
        # Both orders within (K + 2)·2^-24·Σ|x·w| of the exact product; then one rounding (two
        # with a bias) in the output's dtype each.
        bound_q = 2 * (k + 2) * 2.0**-24 * s[:, : hq * hd] + 2 * ulp(q_max, dtype) + 2 * ulp(q, dtype)
        assert_within(q, q_max, bound_q, f"{mode} Q")
        unwritten = ~c.written_slots(kv_max)
        assert np.array_equal(bits(kv)[unwritten], bits(c.kv)[unwritten]), f"{mode}: garbage changed"


# ----------------------------------------------------------------------------------------------
# fused_qkv_padded_matmul


@pytest.mark.parametrize("dtype,hq,hkv,hd,k", [(BF16, 4, 2, 64, 192), (np.float32, 2, 1, 128, 96)])
@pytest.mark.parametrize("seed", [4, 5])
def test_qkv_padded_matches_max(dtype, hq, hkv, hd, k, seed):
    rng = np.random.default_rng(seed)
    batch, seq = 3, 9
    valid = np.array([9, 1, 5], np.uint32) if seed == 4 else np.array([0, 9, 3], np.uint32)
    c = Paged(rng, dtype, [seq] * batch, hkv, hd)
    n = (hq + 2 * hkv) * hd
    x = rand(rng, (batch, seq, k), dtype)
    w = rand(rng, (n, k), dtype, 1 / np.sqrt(k))
    q_max, kv_max = mg.qkv_padded(x, w, c.kv, c.cache_lengths, c.lookup, valid, 0, hq)
    rows = np.arange(seq)[None, :] < valid[:, None]  # MAX leaves nothing undefined here; compared
    for mode in MODES:
        kv = c.kv.copy()
        q = pq.qkv_bshd(x, w, kv, c.cache_lengths, c.lookup, valid, 0, q_dim=hq * hd, mode=mode)
        assert np.array_equal(c.written_slots(kv), c.written_slots(kv_max)), f"{mode}: other slots written"
        if mode == "sequential":
            assert np.array_equal(bits(q), bits(q_max)), "sequential Q (every row) differs from MAX"
            assert np.array_equal(bits(kv), bits(kv_max)), "sequential K/V differ from MAX"
        else:
            s = abs_dot(x.reshape(-1, k), w)[:, : hq * hd].reshape(batch, seq, -1)
            bound = 2 * (k + 2) * 2.0**-24 * s + 2 * ulp(q_max, dtype) + 2 * ulp(q, dtype)
            assert_within(q[rows], q_max[rows], bound[rows], f"{mode} Q")


# ----------------------------------------------------------------------------------------------
# fused_qk_ragged_rope


def freqs_table(rows, rope_dim, dtype, theta=10000.0):
    """MAX's table (`max/nn/rotary_embedding.py`): f32 cos/sin, then the dtype asked."""
    return _freqs(rows, rope_dim, theta).astype(dtype)


def _freqs(rows, d, theta):
    p = np.arange(rows, dtype=np.float32)[:, None]
    inv = np.array([theta ** (-2 * i / d) for i in range(d // 2)], dtype=np.float64).astype(np.float32)
    a = p * inv
    return np.stack([np.cos(a), np.sin(a)], axis=-1).reshape(rows, d).astype(np.float32)


ROPE_CASES = [
    # q dtype, freqs dtype, interleaved, position ids, head size, rope_dim
    (BF16, np.float32, True, False, 64, 64),
    (BF16, BF16, False, False, 64, 64),
    (BF16, BF16, True, True, 64, 64),
    (np.float32, np.float32, False, False, 64, 32),
    (BF16, BF16, True, False, 128, 32),
]


@pytest.mark.parametrize("qdt,fdt,interleaved,with_ids,hd,rope_dim", ROPE_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("seed", [6, 7])
def test_rope_ragged_matches_max(qdt, fdt, interleaved, with_ids, hd, rope_dim, seed):
    rng = np.random.default_rng(seed)
    lens = [1, 6, 17] if seed == 6 else [16, 3]
    hq, hkv = 4, 2
    c = Paged(rng, qdt, lens, hkv, hd)
    m = sum(lens)
    q_in = rand(rng, (m, hq, hd), qdt)
    freqs = freqs_table(160, rope_dim, fdt)
    ids = rng.integers(0, 150, m).astype(np.uint32) if with_ids else None
    q_max, kv_max = mg.rope_ragged(q_in, c.offsets, freqs, c.kv, c.cache_lengths, c.lookup, 1, interleaved, ids)
    for mode in MODES:
        for math in ("max", "f32"):
            kv = c.kv.copy()
            q = pq.rope_ragged(
                q_in, c.offsets, freqs, kv, c.cache_lengths, c.lookup, 1, interleaved=interleaved, position_ids=ids,
                rope_math=math, mode=mode,
            )
            assert np.array_equal(c.written_slots(kv), c.written_slots(kv_max)), f"{mode}/{math}: other slots"
            if math == "max":
                assert np.array_equal(bits(q), bits(q_max)), f"{mode}: Q differs from MAX in MAX's math"
                assert np.array_equal(bits(kv), bits(kv_max)), f"{mode}: K differs from MAX in MAX's math"
            else:
                # f32 math against MAX's roundings in the freqs dtype: the intermediate products
                # are rounded there (then they cancel), so a few of its units at the head's
                # largest input, plus the output's rounding.
                head_max = np.abs(q_in.astype(np.float64)).max(axis=-1, keepdims=True)
                tol = 4 * ulp(np.broadcast_to(head_max, q.shape), fdt) + 2 * ulp(q_max, qdt)
                assert_within(q, q_max, tol, f"{mode} f32-math Q")
