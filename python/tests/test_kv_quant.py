"""FP8-quantized caches from Python (``kv_scales=``): every op, every mode, against a judge written
here from docs/semantics.md §3.1 (the same call into a bf16 cache holding the quantized cache
dequantized, then every written group quantized: scale = amax / 448, codes E4M3(x / scale)); bad
scales raise an error naming ``kv_scales`` and write nothing."""

import ml_dtypes
import numpy as np
import pytest

import paged_qkv as pq
from test_direct import OPS, args_of, bits, make

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16


def start(shape, g, seed):
    """A quantized cache's start: random finite E4M3 codes and positive scales."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 0x7F, size=shape, dtype=np.uint8) | (rng.integers(0, 2, size=shape, dtype=np.uint8) << 7)
    scales = (rng.random(shape[:5] + (shape[5] // g,)) * 0.01 + 1e-4).astype(np.float32)
    return codes, scales


def dequantized(codes, scales, dtype):
    g = codes.shape[5] // scales.shape[5]
    x = codes.view(E4M3).astype(np.float32) * np.repeat(scales, g, axis=5)
    return x.astype(BF16).view(dtype) if dtype == np.uint16 else x.astype(dtype)


def quantize(x):
    """One group, from the semantics: (codes, scale)."""
    amax = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
    scale = np.float32(amax / np.float32(448))
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.float32(0) if scale == 0 or not np.isfinite(np.float32(1) / scale) else np.float32(1) / scale
    return (x * inv).astype(np.float32).astype(E4M3).view(np.uint8), scale


def written(kw, page):
    """(block, slot) of every token the call writes."""
    cl, lut = kw["cache_lengths"], kw["kv_lookup_table"]
    if "input_row_offsets" in kw:
        o = kw["input_row_offsets"]
        per = [(b, t) for b in range(len(o) - 1) for t in range(int(o[b + 1] - o[b]))]
    else:
        v = kw["valid_lengths"]
        per = [(b, t) for b in range(len(v)) for t in range(int(v[b]))]
    return [(int(lut[b, (cl[b] + t) // page]), int((cl[b] + t) % page)) for b, t in per]


def parts(op, kw, kv_dim):
    if op.startswith("rope"):
        return [0]
    if op.startswith("kv_store"):
        return [0 if kw["cache"] == "k" else 1]
    return list(range(kv_dim))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode", ["exact", "sequential", "fast"])
def test_quantized_cache_every_op(op, mode):
    case = make(op, "block" if op == "qkv_fp8_ragged" else "nvfp4", model="tiny", batch=3, seed=11)
    fn, kw = args_of(case)
    plain_dtype = kw["kv_blocks"].dtype
    shape = kw["kv_blocks"].shape
    g = shape[5] // 2 if shape[5] % 4 == 0 else shape[5]
    codes0, scales0 = start(shape, g, 3)
    plain = dequantized(codes0, scales0, plain_dtype)
    kw.pop("kv_blocks")
    out_plain = fn(mode=mode, kv_blocks=plain, **kw)
    codes, scales = codes0.copy(), scales0.copy()
    out_q = fn(mode=mode, kv_blocks=codes, kv_scales=scales, **kw)
    if out_plain is not None:
        assert bits(out_q) == bits(out_plain)
    # The judge: the start, with every written group quantized from the plain call's cache.
    want_codes, want_scales = codes0.copy(), scales0.copy()
    pf = plain.view(BF16).astype(np.float32) if plain_dtype == np.uint16 else plain.astype(np.float32)
    layer = kw["layer_idx"]
    for block, slot in written(kw, shape[3]):
        for p in parts(op, kw, shape[1]):
            for h in range(shape[4]):
                for q in range(shape[5] // g):
                    c, s = quantize(pf[block, p, layer, slot, h, q * g:(q + 1) * g])
                    want_codes[block, p, layer, slot, h, q * g:(q + 1) * g] = c
                    want_scales[block, p, layer, slot, h, q] = s
    assert scales.tobytes() == want_scales.tobytes()
    assert codes.tobytes() == want_codes.tobytes()


def test_bad_scales_are_errors_that_write_nothing():
    case = make("kv_store_ragged", "nvfp4", model="tiny", batch=2, seed=2)
    fn, kw = args_of(case)
    shape = kw["kv_blocks"].shape
    codes, scales = start(shape, shape[5] // 2, 4)
    kw.pop("kv_blocks")
    # Scales on a bf16 cache.
    plain = dequantized(codes, scales, np.float32)
    before = plain.copy()
    with pytest.raises(TypeError, match="kv_scales"):
        fn(kv_blocks=plain, kv_scales=scales, **kw)
    assert plain.tobytes() == before.tobytes()
    # Wrong shape, wrong dtype, a granularity that does not divide the head.
    c0, s0 = codes.copy(), scales.copy()
    with pytest.raises(ValueError, match="kv_scales"):
        fn(kv_blocks=codes, kv_scales=scales[:-1], **kw)
    with pytest.raises(TypeError, match="kv_scales"):
        fn(kv_blocks=codes, kv_scales=scales.astype(np.float16), **kw)
    odd = np.zeros(shape[:5] + (3,), np.float32) if shape[5] % 3 else np.zeros(shape[:5] + (shape[5] + 1,), np.float32)
    with pytest.raises(ValueError, match="kv_scales"):
        fn(kv_blocks=codes, kv_scales=odd, **kw)
    assert codes.tobytes() == c0.tobytes() and scales.tobytes() == s0.tobytes()


@pytest.mark.parametrize("op", OPS)
def test_check_op_judges_a_quantized_cache_by_value(op):
    """check_op on a quantized cache: the op's own results pass at zero tolerance and the inputs are
    not written; the same values as half the codes at twice the scale pass; a code one step off
    fails at zero ulps (named, one ulp) and passes at one; a changed scale of an unwritten group is
    corruption; missing actual scales are an error."""
    case = make(op, "block" if op == "qkv_fp8_ragged" else "nvfp4", model="tiny", batch=3, seed=7)
    fn, kw = args_of(case)
    shape = kw["kv_blocks"].shape
    g = shape[5] // 2
    codes, scales = start(shape, g, 8)
    c0, s0 = codes.copy(), scales.copy()
    inputs = dict(kw, kv_blocks=codes, kv_scales=scales)
    c, s = codes.copy(), scales.copy()
    out = fn(**dict(kw, kv_blocks=c, kv_scales=s, mode="exact"))
    actual = {"kv_blocks": c, "kv_scales": s} | ({} if out is None else {"output": out})
    r = pq.check_op(op, inputs, actual, ulps=0)
    assert r.passed, r
    assert codes.tobytes() == c0.tobytes() and scales.tobytes() == s0.tobytes()
    assert "kv_scales" in r.tensors and r.tensors["kv_blocks"].compared > 0
    # Written groups: scales that changed.
    wg = np.argwhere(s != s0)
    assert len(wg) > 0
    # The same values, stored differently: every code of a halvable written group one exponent down.
    b, p, l, sl, h, q = wg[0]
    grp = c[b, p, l, sl, h, q * g:(q + 1) * g]
    mag = grp & 0x7F
    if ((mag == 0) | ((mag >> 3) >= 2)).all() and (mag != 0).any():
        c2, s2 = c.copy(), s.copy()
        c2[b, p, l, sl, h, q * g:(q + 1) * g] = np.where(mag == 0, grp, grp - 8)
        s2[b, p, l, sl, h, q] *= 2
        r = pq.check_op(op, inputs, dict(actual, kv_blocks=c2, kv_scales=s2), ulps=0)
        assert r.passed, r
    # One written code one step up.
    i = next(
        j for j in range(q * g, (q + 1) * g) if 0 < (c[b, p, l, sl, h, j] & 0x7F) < 0x7E
    )
    c3 = c.copy()
    c3[b, p, l, sl, h, i] += 1
    r = pq.check_op(op, inputs, dict(actual, kv_blocks=c3), ulps=0)
    kvr = r.tensors["kv_blocks"]
    assert not r.passed and kvr.failures == 1 and kvr.ulps[0] == 1, r
    assert tuple(kvr.index[0]) == (b, p, l, sl, h, i)
    assert pq.check_op(op, inputs, dict(actual, kv_blocks=c3), ulps=1).passed
    # A written code made NaN (E4M3 0x7F): a NaN mismatch at ulps -1, whatever the tolerance.
    c5 = c.copy()
    c5[b, p, l, sl, h, i] = 0x7F
    r = pq.check_op(op, inputs, dict(actual, kv_blocks=c5), ulps=1 << 20, atol=1e30)
    kvr = r.tensors["kv_blocks"]
    assert not r.passed and kvr.failures == 1 and kvr.ulps[0] == -1, r
    assert kvr.ulp_histogram["NaN mismatch"] == 1
    # An unwritten group's scale changed.
    u = np.argwhere(s == s0)[0]
    s4 = s.copy()
    s4[tuple(u)] += 1.0
    r = pq.check_op(op, inputs, dict(actual, kv_scales=s4), ulps=0)
    assert not r.passed and r.tensors["kv_scales"].corrupted == 1, r
    with pytest.raises(ValueError, match="kv_scales"):
        pq.check_op(op, inputs, {k: v for k, v in actual.items() if k != "kv_scales"})


@pytest.mark.parametrize("op", ["qkv_ragged", "rope_ragged", "kv_store_bshd"])
def test_quantized_case_runs_and_checks_as_the_direct_path(op):
    case = make(op, "nvfp4", model="tiny", batch=3, seed=5)
    shape = case.tensors["kv_blocks"].shape
    codes, scales = start(shape, shape[5] // 2, 6)
    case.tensors["kv_blocks"] = codes.view(E4M3)
    case.tensors["kv_scales"] = scales
    case = pq.load_case(case.to_bytes())  # through the file format
    want = case.run("exact")
    assert set(want) >= {"kv_blocks", "kv_scales"}
    fn, kw = args_of(case)
    kw.pop("kv_blocks")
    c, s = codes.copy(), scales.copy()
    out = fn(mode="exact", kv_blocks=c, kv_scales=s, **kw)
    assert c.tobytes() == np.asarray(want["kv_blocks"]).tobytes()
    assert s.tobytes() == np.asarray(want["kv_scales"]).tobytes()
    if out is not None:
        assert bits(out) == bits(want["output"])
    pq.check(case, want, ulps=0).assert_ok()
    bad = dict(want, kv_scales=np.asarray(want["kv_scales"]) * np.float32(1.5))
    report = pq.check(case, bad, ulps=0)
    assert not report.passed and "kv_scales" in str(report)


@pytest.mark.parametrize("op", ["qkv_fp8_ragged", "rope_bshd", "kv_store_ragged"])
def test_make_case_with_a_quantized_cache(op):
    case = pq.make_case(op, kv_quant=8, seed=4)
    kv, sc = case.tensors["kv_blocks"], case.tensors["kv_scales"]
    assert kv.dtype == E4M3 and sc.dtype == np.float32
    assert sc.shape == kv.shape[:5] + (kv.shape[5] // 8,)
    got = case.run("fast")
    assert pq.check(case, got).passed
    assert "kv_values" in pq.check(case, got).text
    with pytest.raises(ValueError, match="kv_scales"):
        pq.make_case(op, kv_quant=3)


def test_quantized_case_files_load_in_safetensors_numpy(tmp_path):
    """A saved quantized case holds its codes as U8 (``safetensors.numpy`` loads it; numpy has no
    float8); ``load_case`` gives them back as float8_e4m3fn; a case or a kernel's results with
    ``uint8`` codes run and check as well, ``run`` returning the codes in the case's dtype."""
    st = pytest.importorskip("safetensors.numpy")
    case = pq.make_case("rope_ragged", model="tiny", kv_quant=8, seed=5)
    path = tmp_path / "q.safetensors"
    pq.save_case(path, case)
    raw = st.load_file(str(path))
    assert raw["kv_blocks"].dtype == np.uint8 and raw["kv_scales"].dtype == np.float32
    assert bytes(raw["kv_blocks"]) == bytes(np.asarray(case.tensors["kv_blocks"]).view(np.uint8))
    back = pq.load_case(path)
    assert back.tensors["kv_blocks"].dtype == E4M3
    want = back.run("exact")
    u8 = pq.Case(case.op, dict(case.tensors, kv_blocks=raw["kv_blocks"]), case.meta)
    got = u8.run("fast")
    assert got["kv_blocks"].dtype == np.uint8 and want["kv_blocks"].dtype == E4M3
    assert bytes(got["kv_blocks"]) == bytes(want["kv_blocks"].view(np.uint8))
    for c, actual in [(u8, want), (back, got), (u8, got)]:
        pq.check(c, actual, ulps=0).assert_ok()
    no_scales = pq.Case(case.op, {k: v for k, v in u8.tensors.items() if k != "kv_scales"}, case.meta)
    with pytest.raises(ValueError, match="kv_blocks.*U8.*kv_scales"):
        no_scales.run("exact")
