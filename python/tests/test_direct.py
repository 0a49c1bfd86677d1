"""The direct path (the caller's memory, no case file): bit for bit the case-file path for every op
and mode, packed weights, torch tensors, every bad input with its exception and nothing written,
zero copies, the GIL released, cached pools, and check_op."""

import ast
import os
import re
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import paged_qkv as pq
from paged_qkv import _native

ROOT = Path(__file__).resolve().parents[2]
OPS = ["qkv_fp4_ragged", "qkv_fp8_ragged", "qkv_ragged", "qkv_bshd", "rope_bshd", "rope_ragged", "kv_store_ragged", "kv_store_bshd"]
MODES = ["exact", "sequential", "fast"]


def bits(a) -> bytes:
    return np.ascontiguousarray(pq.as_array(a)).view(np.uint8).tobytes()


def args_of(case: pq.Case, kv=None):
    """(function, positional-free kwargs) calling `case` through the op function."""
    t, m = case.tensors, case.meta
    kw = dict(
        kv_blocks=t["kv_blocks"].copy() if kv is None else kv,
        cache_lengths=t["cache_lengths"],
        kv_lookup_table=t["kv_lookup_table"],
        layer_idx=int(m["layer_idx"]),
    )
    op = case.op
    if op == "qkv_fp4_ragged":
        kw.update(hidden_state=t["hidden_state"], input_scale=t["input_scale"], input_row_offsets=t["input_row_offsets"],
                  weight=t["weight"], weight_scale=t["weight_scale"], tensor_sf=float(m["tensor_sf"]), format=m["format"],
                  q_dim=t["output"].shape[1], output_dtype=t["output"].dtype.name if t["output"].dtype.name != "uint16" else "bf16")
    elif op == "qkv_fp8_ragged":
        kw.update(hidden_state=t["hidden_state"], input_scale=t["input_scale"], input_row_offsets=t["input_row_offsets"],
                  weight=t["weight"], weight_scale=t["weight_scale"], bias=t.get("bias"), q_dim=t["output"].shape[1])
    elif op == "qkv_ragged":
        kw.update(hidden_state=t["hidden_state"], input_row_offsets=t["input_row_offsets"], weight=t["weight"],
                  bias=t.get("bias"), q_dim=t["output"].shape[1])
    elif op == "qkv_bshd":
        kw.update(hidden_state=t["hidden_state"], weight=t["weight"], valid_lengths=t["valid_lengths"], q_dim=t["output"].shape[2])
    elif op == "rope_bshd":
        kw.update(q_proj=t["q_proj"], freqs_cis=t["freqs_cis"], valid_lengths=t["valid_lengths"],
                  interleaved=m["interleaved"] == "true", output=t["output"])
    elif op == "rope_ragged":
        kw.update(q_proj=t["q_proj"], input_row_offsets=t["input_row_offsets"], freqs_cis=t["freqs_cis"],
                  interleaved=m["interleaved"] == "true")
        if "position_ids" in t:
            kw["position_ids"] = t["position_ids"]
    elif op == "kv_store_ragged":
        kw.update(values=t["hidden_state"], input_row_offsets=t["input_row_offsets"], cache=m.get("cache", "k"))
    else:
        kw.update(values=t["hidden_state"], valid_lengths=t["valid_lengths"], cache=m.get("cache", "k"))
    return getattr(pq, op), kw


CASES = [(op, fmt, seed, model) for op in OPS if op != "qkv_fp8_ragged" for (fmt, seed, model) in [("nvfp4", 1, "tiny"), ("nvfp4", 7, "tiny"), ("nvfp4", 2, "qwen2.5-0.5b")]]
CASES += [("qkv_fp4_ragged", f, 3, "tiny") for f in ("mxfp4", "mxfp8")]
# FP8 W8A8: `fmt` is the scale granularity.
CASES += [("qkv_fp8_ragged", g, s, m) for g in ("tensor", "channel", "block") for (s, m) in [(1, "tiny"), (2, "qwen2.5-0.5b")]]


def make(op, fmt, **kw):
    """A case of `op`; `fmt` is the block format, or the scale granularity of qkv_fp8_ragged."""
    return pq.make_case(op, **kw, **({"granularity": fmt} if op == "qkv_fp8_ragged" else {"format": fmt}))


@pytest.mark.parametrize("op,fmt,seed,model", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_the_direct_path_equals_the_case_file_path(op, fmt, seed, model, mode):
    case = make(op, fmt, model=model, batch=3, seed=seed)
    want = case.run(mode)  # through the case file (the command line's code path)
    fn, kw = args_of(case)
    out = fn(mode=mode, **kw)
    assert bits(kw["kv_blocks"]) == bits(want["kv_blocks"])
    if "output" in want:
        assert bits(out) == bits(want["output"])
    else:
        assert out is None


@pytest.mark.parametrize("mode", MODES)
def test_fused_rope_f32_cache_and_f16_through_both_paths(mode):
    """QKV cases with a fused RoPE (freqs_cis, position ids), f32/f16 activations, an f32 cache."""
    for op, dt in [("qkv_ragged", np.float32), ("qkv_ragged", np.float16), ("qkv_bshd", np.float32)]:
        case = pq.make_case(op, seed=4)
        t = case.tensors
        hd = t["kv_blocks"].shape[5]
        t["hidden_state"] = t["hidden_state"].astype(np.float32).astype(dt)
        t["weight"] = t["weight"].astype(np.float32).astype(dt)
        if "bias" in t:
            t["bias"] = t["bias"].astype(np.float32).astype(dt)
        t["output"] = t["output"].astype(np.float32)
        t["kv_blocks"] = t["kv_blocks"].astype(np.float32)
        t["freqs_cis"] = _freqs(64, hd)
        want = case.run(mode)
        fn, kw = args_of(case)
        kw["output_dtype"] = "float32"
        kw["rope"] = {"freqs_cis": t["freqs_cis"], "interleaved": False}
        out = fn(mode=mode, **kw)
        assert bits(out) == bits(want["output"]), (op, dt)
        assert bits(kw["kv_blocks"]) == bits(want["kv_blocks"]), (op, dt)


def _freqs(rows, d, theta=10000.0):
    p = np.arange(rows, dtype=np.float32)[:, None]
    th = np.array([theta ** (-2 * i / d) for i in range(d // 2)], dtype=np.float64).astype(np.float32)
    a = p * th
    return np.stack([np.cos(a), np.sin(a)], axis=-1).reshape(rows, d).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Packed weights


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "bf16", "fp8"])
@pytest.mark.parametrize("mode", MODES)
def test_a_packed_weight_gives_the_raw_weights_bits(fmt, mode):
    op = {"bf16": "qkv_ragged", "fp8": "qkv_fp8_ragged"}.get(fmt, "qkv_fp4_ragged")
    case = pq.make_case(op, seed=5, format=fmt if op == "qkv_fp4_ragged" else "nvfp4", granularity="block")
    fn, kw = args_of(case)
    want = fn(mode=mode, **kw)
    kv_want = bits(kw["kv_blocks"])
    if fmt == "fp8":
        packed = pq.pack_weight(kw["weight"], format="fp8")
        assert packed.format == "fp8" and packed.shape == kw["weight"].shape and packed.nbytes > 0
        w2, s2 = packed.unpack()
        assert bits(w2) == bits(kw["weight"]) and s2 is None
        with pytest.raises(TypeError, match="qkv_fp8_ragged"):
            x = np.zeros(kw["hidden_state"].shape, np.float32)
            pq.qkv_ragged(x, kw["input_row_offsets"], packed, kw["kv_blocks"], kw["cache_lengths"],
                          kw["kv_lookup_table"], kw["layer_idx"])
    elif fmt == "bf16":
        packed = pq.pack_weight(kw["weight"])
        assert packed.format == "bfloat16" and packed.shape == kw["weight"].shape
        w2, s2 = packed.unpack()
        assert bits(w2) == bits(kw["weight"]) and s2 is None
    else:
        packed = pq.pack_weight(kw["weight"], kw["weight_scale"], format=fmt)
        assert packed.format == fmt and packed.nbytes > 0
        codes, scales = packed.unpack()
        assert bits(codes) == bits(kw["weight"])
        # Every scale the operation reads comes back (the 5-D padding entries as zeros).
        n, k = packed.shape
        v = 16 if fmt == "nvfp4" else 32
        for r in range(n):
            for b in range(-(-k // v)):
                i = pq.scale_index(r, b)
                assert scales[i] == kw["weight_scale"][i]
        kw["weight_scale"] = None
    kw["weight"] = packed
    kw["kv_blocks"] = case.tensors["kv_blocks"].copy()
    got = fn(mode=mode, **kw)
    assert bits(got) == bits(want) and bits(kw["kv_blocks"]) == kv_want


def test_packed_weight_errors():
    case = pq.make_case("qkv_ragged", seed=1)
    fn, kw = args_of(case)
    packed = pq.pack_weight(kw["weight"])
    with pytest.raises(TypeError, match="use qkv_ragged or qkv_bshd"):
        c4 = pq.make_case("qkv_fp4_ragged", seed=1)
        f4, k4 = args_of(c4)
        pq.qkv_fp4_ragged(**dict(k4, weight=packed, weight_scale=None))
    with pytest.raises(ValueError, match="weight"):
        fn(**dict(kw, hidden_state=kw["hidden_state"].astype(np.float32), weight=packed))
    with pytest.raises(ValueError, match="weight_scale"):
        pq.pack_weight(np.zeros((4, 8), np.uint8), format="nvfp4")
    with pytest.raises(ValueError, match="format"):
        pq.pack_weight(np.zeros((4, 8), np.float32), format="bf16")
    with pytest.raises(TypeError, match="weight"):
        pq.pack_weight(np.zeros((4, 8), np.float64))


# ----------------------------------------------------------------------------------------------
# torch tensors (skipped without torch)


def test_torch_tensors_equal_numpy_inputs_for_every_op():
    torch = pytest.importorskip("torch")

    def tt(a):
        a = np.ascontiguousarray(a)
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        if a.dtype.name.startswith("float8"):
            return torch.from_numpy(a.view(np.uint8).copy())
        return torch.from_numpy(a.copy())

    for op in OPS:
        case = pq.make_case(op, seed=6)
        fn, kw = args_of(case)
        want = fn(mode="fast", **kw)
        kv_want = bits(kw["kv_blocks"])
        kw2 = {k: (tt(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
        kw2["kv_blocks"] = tt(case.tensors["kv_blocks"])
        if op == "rope_bshd":
            kw2.pop("output")
            out = tt(case.tensors["output"])
            got = fn(mode="fast", out=out, **kw2)
            assert got is out
        else:
            got = fn(mode="fast", **kw2)
        assert isinstance(kw2["kv_blocks"], torch.Tensor)
        assert bits(kw2["kv_blocks"]) == kv_want, op
        if want is not None:
            assert bits(got) == bits(want), op


def test_torch_out_and_errors():
    torch = pytest.importorskip("torch")
    case = pq.make_case("qkv_ragged", seed=2)
    fn, kw = args_of(case)
    want = fn(mode="fast", **kw)
    out = torch.empty(want.shape, dtype=torch.bfloat16)
    kw["kv_blocks"] = case.tensors["kv_blocks"].copy()
    assert fn(mode="fast", out=out, **kw) is out
    assert bits(out) == bits(want)
    kv = case.tensors["kv_blocks"].copy()
    before = bits(kv)
    with pytest.raises(TypeError, match="`hidden_state`.*float64"):
        fn(**dict(kw, kv_blocks=kv, hidden_state=torch.zeros(kw["hidden_state"].shape, dtype=torch.float64)))
    assert bits(kv) == before
    t = torch.zeros(4, requires_grad=True)
    with pytest.raises(TypeError, match="input_row_offsets"):
        fn(**dict(kw, kv_blocks=kv, input_row_offsets=t))
    assert bits(kv) == before


# ----------------------------------------------------------------------------------------------
# Bad input: the exception names the argument, nothing is written


class _OnGpu:
    """An object that claims to live on a CUDA device (DLPack)."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):  # pragma: no cover - never reached: the device is checked first
        raise AssertionError("exported a non-CPU tensor")


def _bad_inputs():
    case = pq.make_case("qkv_ragged", seed=3)
    fn, kw = args_of(case)
    t = case.tensors
    x = kw["hidden_state"]
    c4 = pq.make_case("qkv_fp4_ragged", seed=3)
    f4, k4 = args_of(c4)
    kv = kw["kv_blocks"]
    yield "float64 data", fn, dict(kw, hidden_state=x.astype(np.float64)), TypeError, "`hidden_state`.*float64"
    yield "float64 cache", fn, dict(kw, kv_blocks=kv.astype(np.float64)), TypeError, "`kv_blocks`.*float64"
    yield "non-contiguous cache", fn, dict(kw, kv_blocks=np.zeros(kv.shape[:-1] + (2 * kv.shape[-1],), kv.dtype)[..., ::2]), ValueError, "`kv_blocks`.*C-contiguous"
    ro = kv.copy()
    ro.flags.writeable = False
    yield "read-only cache", fn, dict(kw, kv_blocks=ro), ValueError, "`kv_blocks`.*read-only"
    yield "cache on a GPU", fn, dict(kw, kv_blocks=_OnGpu()), ValueError, "`kv_blocks`.*cuda.*CPU"
    yield "weight on a GPU", fn, dict(kw, weight=_OnGpu()), ValueError, "`weight`.*cuda"
    yield "negative index", fn, dict(kw, cache_lengths=t["cache_lengths"].astype(np.int64) - 100), ValueError, "`cache_lengths`.*uint32"
    yield "index over 2^32", fn, dict(kw, cache_lengths=t["cache_lengths"].astype(np.int64) + 2**32), ValueError, "`cache_lengths`.*uint32"
    yield "float indices", fn, dict(kw, input_row_offsets=t["input_row_offsets"].astype(np.float32)), TypeError, "`input_row_offsets`.*integer"
    yield "bad output_dtype", fn, dict(kw, output_dtype="float64"), ValueError, "output_dtype"
    yield "FP4 codes as float32", f4, dict(k4, hidden_state=k4["hidden_state"].astype(np.float32)), TypeError, "`hidden_state`.*uint8"
    yield "FP4 weight as float32", f4, dict(k4, weight=k4["weight"].astype(np.float32)), TypeError, "`weight`.*uint8"
    yield "scales of the wrong shape", f4, dict(k4, weight_scale=k4["weight_scale"][..., :2].copy()), ValueError, "`weight_scale`.*5-D"
    yield "bad format", f4, dict(k4, format="nvfp8"), ValueError, "format"
    yield "out of the wrong shape", fn, dict(kw, out=np.zeros((1, 1), x.dtype)), ValueError, "`out`"
    yield "out of the wrong dtype", fn, dict(kw, out=np.zeros(t["output"].shape, np.float64)), TypeError, "`out`"
    yield "out aliasing an input", fn, dict(kw, out=x.reshape(-1)[: t["output"].size].reshape(t["output"].shape)), ValueError, "`out`: shares memory with `hidden_state`"
    yield "hidden_state of rank 3", fn, dict(kw, hidden_state=x[None]), ValueError, "`hidden_state`.*rank|`hidden_state`: expected"
    yield "weight of another K", fn, dict(kw, weight=kw["weight"][:, :-2].copy()), ValueError, "`weight`"
    yield "lookup of another batch", fn, dict(kw, kv_lookup_table=t["kv_lookup_table"][:1]), ValueError, "`kv_lookup_table`"
    yield "layer out of range", fn, dict(kw, layer_idx=99), ValueError, "layer_idx"
    yield "bad mode", fn, dict(kw, mode="fastest"), ValueError, "mode"
    yield "threads=0", fn, dict(kw, threads=0), ValueError, "threads"
    yield "unknown rope key", fn, dict(kw, rope={"freqs_cis": _freqs(64, 16), "theta": 1.0}), ValueError, "rope.*theta"
    yield "a string as data", fn, dict(kw, hidden_state="abc"), TypeError, "`hidden_state`"


@pytest.mark.parametrize("what,fn,kw,exc,pattern", list(_bad_inputs()), ids=[b[0] for b in _bad_inputs()])
def test_bad_input_is_named_and_writes_nothing(what, fn, kw, exc, pattern):
    kv = kw["kv_blocks"]
    before = bits(kv) if isinstance(kv, np.ndarray) else None
    out = kw.get("out")
    out_before = bits(out) if isinstance(out, np.ndarray) else None
    with pytest.raises(exc, match=pattern) as e:
        fn(**kw)
    assert "__metadata__" not in str(e.value)
    if before is not None:
        assert bits(kv) == before, f"{what}: kv_blocks changed"
    if out_before is not None:
        assert bits(out) == out_before, f"{what}: out changed"


def test_other_integer_index_types_are_accepted_after_a_range_check():
    case = pq.make_case("qkv_ragged", seed=8)
    fn, kw = args_of(case)
    want = fn(mode="fast", **kw)
    kv_want = bits(kw["kv_blocks"])
    for dt in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64, np.uint64):
        k2 = dict(kw, kv_blocks=case.tensors["kv_blocks"].copy())
        for name in ("input_row_offsets", "cache_lengths", "kv_lookup_table"):
            k2[name] = kw[name].astype(dt)
        assert bits(fn(mode="fast", **k2)) == bits(want), dt
        assert bits(k2["kv_blocks"]) == kv_want, dt
    # Lists (the buffer-protocol fallback through numpy) work too.
    k2 = dict(kw, kv_blocks=case.tensors["kv_blocks"].copy(), input_row_offsets=kw["input_row_offsets"].tolist())
    assert bits(fn(mode="fast", **k2)) == bits(want)


def test_a_failing_call_in_any_mode_writes_nothing():
    for op in OPS:
        case = pq.make_case(op, seed=9)
        fn, kw = args_of(case)
        bad = case.tensors["kv_lookup_table"].copy()
        bad[-1, -1] = 10**6
        for mode in MODES:
            kv = case.tensors["kv_blocks"].copy()
            # Every row's page points out of the cache in the last sequence (one page suffices).
            with pytest.raises(ValueError):
                fn(**dict(kw, kv_blocks=kv, kv_lookup_table=np.full_like(bad, 10**6), mode=mode))
            assert bits(kv) == bits(case.tensors["kv_blocks"]), (op, mode)


# ----------------------------------------------------------------------------------------------
# Zero copies, the GIL, pools


def test_kv_blocks_and_out_are_written_in_place():
    case = pq.make_case("qkv_ragged", seed=10)
    fn, kw = args_of(case)
    kv = kw["kv_blocks"]
    addr, before = kv.ctypes.data, kv.copy()
    out = np.zeros(case.tensors["output"].shape, case.tensors["output"].dtype)
    oaddr = out.ctypes.data
    r = fn(mode="fast", out=out, **kw)
    assert r is out and out.ctypes.data == oaddr and kv.ctypes.data == addr
    assert bits(kv) != bits(before) and np.count_nonzero(out.view(np.uint16))
    # A view into a bigger buffer: the buffer itself changes.
    big = np.zeros((2,) + kv.shape, kv.dtype)
    big[1] = case.tensors["kv_blocks"]
    fn(mode="fast", **dict(kw, kv_blocks=big[1]))
    assert bits(big[1]) == bits(kv) and not np.any(big[0].view(np.uint16))


def test_a_packed_weight_is_not_copied_per_call(tmp_path):
    """A 100 MB weight: packing holds one copy; a call adds no copy, and 50 calls no more peak."""
    code = r"""
import resource, numpy as np, paged_qkv as pq
import ml_dtypes
k, n = 4096, 12288                      # 100.7 MB of bf16
rng = np.random.default_rng(0)
w = rng.standard_normal((n, k), dtype=np.float32).astype(ml_dtypes.bfloat16)
packed = pq.pack_weight(w)
del w
x = rng.standard_normal((1, k), dtype=np.float32).astype(ml_dtypes.bfloat16)
kv = np.zeros((4, 2, 1, 16, 8, 128), ml_dtypes.bfloat16)
args = (x, np.array([0, 1], np.uint32), packed, kv, np.array([3], np.uint32), np.array([[1]], np.uint32), 0)
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
import gc; gc.collect()
base = peak()
pq.qkv_ragged(*args, mode="fast", threads=1)
one = peak()
for _ in range(49):
    pq.qkv_ragged(*args, mode="fast", threads=1)
fifty = peak()
print(base, one, fifty, packed.nbytes)
"""
    pytest.importorskip("ml_dtypes")
    # env=: Python's view of the environment (MAX's runtime, if a test loaded it, edits the C-level one).
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    base, one, fifty, nbytes = map(int, p.stdout.split())
    assert nbytes >= 100_000_000
    assert one - base < nbytes // 4, f"one call raised the peak by {one - base} bytes"
    assert fifty <= 1.1 * one, f"50 calls: peak {fifty} against one call's {one}"


def test_the_gil_is_released_while_a_kernel_runs():
    """A long oracle call in one thread; the main thread keeps running Python meanwhile."""
    case = pq.make_case("qkv_ragged", model="qwen2.5-0.5b", batch=8, seed=1)
    fn, kw = args_of(case)
    done = threading.Event()
    errors = []

    def work():
        try:
            fn(mode="exact", threads=1, **kw)
        except Exception as e:  # pragma: no cover
            errors.append(e)
        done.set()

    th = threading.Thread(target=work)
    count = 0
    th.start()
    while not done.is_set():
        count += 1
    th.join()
    assert not errors
    # If the call held the GIL, the loop would not run while it does (a few iterations at most).
    assert count > 1000, count


def test_two_threads_on_one_cache_and_on_two_caches_give_the_sequential_bits():
    case = pq.make_case("qkv_ragged", model="qwen2.5-0.5b", batch=4, seed=2)
    fn, kw = args_of(case)
    # Sequentially: layer 0 then layer 1 of one cache (two layers: the case has them).
    layers = case.tensors["kv_blocks"].shape[2]
    assert layers >= 2
    seq_kv = case.tensors["kv_blocks"].copy()
    outs = [fn(mode="fast", threads=1, **dict(kw, kv_blocks=seq_kv, layer_idx=l)) for l in range(2)]
    for shared in (True, False):
        kvs = [case.tensors["kv_blocks"].copy() for _ in range(2)]
        res = [None, None]

        def run(i):
            kv = kvs[0] if shared else kvs[i]
            for _ in range(20):
                res[i] = fn(mode="fast", threads=1, **dict(kw, kv_blocks=kv, layer_idx=i))

        ths = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        [t.start() for t in ths]
        [t.join() for t in ths]
        assert bits(res[0]) == bits(outs[0]) and bits(res[1]) == bits(outs[1])
        if shared:
            assert bits(kvs[0]) == bits(seq_kv)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads thread names from /proc")
def test_a_pool_per_thread_count_is_built_once():
    case = pq.make_case("qkv_ragged", seed=3)
    fn, kw = args_of(case)

    def pool_threads(n):
        names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
        return sum(1 for x in names if x.startswith(f"paged-qkv-{n}-"))

    # A team of n threads is the calling thread and n - 1 helpers, started once per n.
    for _ in range(5):
        fn(mode="fast", threads=3, **kw)
    assert pool_threads(3) == 2
    for _ in range(3):
        fn(mode="fast", threads=5, **kw)
    assert pool_threads(3) == 2 and pool_threads(5) == 4


# ----------------------------------------------------------------------------------------------
# check_op


def _kernel(case):
    fn, kw = args_of(case)
    kv_before = kw["kv_blocks"].copy()
    out = fn(mode="fast", **kw)
    inputs = dict(kw, kv_blocks=kv_before)
    actual = {"kv_blocks": kw["kv_blocks"]}
    if out is not None:
        actual["output"] = out
    return inputs, actual


@pytest.mark.parametrize("op", OPS)
def test_check_op_passes_the_fast_kernels(op):
    case = pq.make_case(op, seed=12)
    inputs, actual = _kernel(case)
    r = pq.check_op(op, inputs, actual)
    r.assert_ok()
    assert r.passed and "verdict: PASS" in r.text and r.tensors["kv_blocks"].compared > 0
    # The function works as well as its name.
    assert pq.check_op(getattr(pq, op), inputs, actual).passed


def test_check_op_finds_planted_bugs_and_names_them():
    case = pq.make_case("qkv_ragged", model="qwen2.5-0.5b", batch=3, seed=13)
    inputs, actual = _kernel(case)
    kv0 = inputs["kv_blocks"]
    page = kv0.shape[3]
    lens, lut = case.tensors["cache_lengths"], case.tensors["kv_lookup_table"]
    offs = case.tensors["input_row_offsets"]
    layer = int(case.meta["layer_idx"])

    # 1. K and V swapped.
    kv = actual["kv_blocks"].copy()
    swapped = kv0.copy()
    for b in range(len(lens)):
        for t in range(int(offs[b + 1] - offs[b])):
            pos = int(lens[b]) + t
            blk, sl = lut[b, pos // page], pos % page
            swapped[blk, 0, layer, sl], swapped[blk, 1, layer, sl] = kv[blk, 1, layer, sl], kv[blk, 0, layer, sl]
    r = pq.check_op("qkv_ragged", inputs, dict(actual, kv_blocks=swapped))
    assert not r.passed and any("swapped" in h for h in r.hints), r.text

    # 2. Every token written one position later.
    shifted = kv0.copy()
    for b in range(len(lens)):
        for t in range(int(offs[b + 1] - offs[b])):
            pos = int(lens[b]) + t
            blk, sl = lut[b, pos // page], pos % page
            p2 = pos + 1
            shifted[lut[b, p2 // page], :, layer, p2 % page] = kv[blk, :, layer, sl]
    r = pq.check_op("qkv_ragged", inputs, dict(actual, kv_blocks=shifted))
    assert not r.passed and any("one position later" in h for h in r.hints), r.text
    assert r.tensors["kv_blocks"].corrupted > 0

    # 3. Q scaled by 2 (a scale applied twice).
    r = pq.check_op("qkv_ragged", inputs, dict(actual, output=(actual["output"].astype(np.float32) * 2).astype(actual["output"].dtype)))
    assert not r.passed and any("≈ 2 ×" in h for h in r.hints), r.text

    # 4. One wrong element: named in the tensor and as (sequence, position, head, dim).
    bad = actual["kv_blocks"].copy()
    b = 1
    pos = int(lens[b]) + 0
    blk, sl = lut[b, pos // page], pos % page
    bad[blk, 1, layer, sl, 1, 5] = bad[blk, 1, layer, sl, 1, 5] * 3 + 1
    r = pq.check_op("qkv_ragged", inputs, dict(actual, kv_blocks=bad))
    tc = r.tensors["kv_blocks"]
    assert tc.failures == 1 and tc.corrupted == 0
    assert tuple(tc.index[0]) == (blk, 1, layer, sl, 1, 5)
    assert tuple(tc.positions[0]) == (b, pos, 1, 5)
    assert tc.actual[0] != tc.reference[0] and tc.ulps[0] > 2

    # 5. A write outside the op's slots: corruption, with its coordinates.
    bad = actual["kv_blocks"].copy()
    spare = [x for x in range(kv0.shape[0]) if x not in set(lut.reshape(-1).tolist())]
    target = spare[0] if spare else 0
    bad[target, 0, 0, 0, 0, 0] = 7
    r = pq.check_op("qkv_ragged", inputs, dict(actual, kv_blocks=bad))
    assert not r.passed and r.tensors["kv_blocks"].corrupted >= 1

    # 6. A NaN where the reference is a number: a failure at ulps -1, counted as a NaN mismatch,
    # whatever the tolerance.
    out = actual["output"].copy()
    out.reshape(-1)[3] = np.nan
    r = pq.check_op("qkv_ragged", inputs, dict(actual, output=out), ulps=1 << 20, atol=1e30)
    tc = r.tensors["output"]
    assert not r.passed and tc.failures == 1 and tc.ulps[0] == -1, r.text
    assert tc.ulp_histogram["NaN mismatch"] == 1 and np.isnan(tc.actual[0]) and np.isfinite(tc.reference[0])


def test_check_op_cost_follows_the_written_slots():
    """A one-token store into a 128 MiB cache: the checker's numpy memory stays far below it."""
    ml = pytest.importorskip("ml_dtypes")
    kv = np.zeros((64, 2, 32, 16, 8, 128), ml.bfloat16)  # 128 MiB: Llama-3-8B's 32 layers, pages of 16
    assert kv.nbytes == 128 << 20
    values = np.ones((1, 8, 128), ml.bfloat16)
    lens, lut = np.array([5], np.uint32), np.array([[37]], np.uint32)
    inputs = dict(values=values, input_row_offsets=np.array([0, 1], np.uint32), kv_blocks=kv.copy(), cache_lengths=lens,
                  kv_lookup_table=lut, layer_idx=2)
    pq.kv_store_ragged(**dict(inputs, kv_blocks=kv), mode="fast")
    tracemalloc.start()
    r = pq.check_op("kv_store_ragged", inputs, {"kv_blocks": kv})
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert r.passed
    assert r.tensors["kv_blocks"].compared == 8 * 128
    assert peak < kv.nbytes // 64, f"check_op traced {peak} bytes for a {kv.nbytes}-byte cache"
    # A planted error in another block and another layer is still found.
    kv[3, 1, 7, 2, 0, 0] = 1
    r = pq.check_op("kv_store_ragged", inputs, {"kv_blocks": kv})
    assert not r.passed and tuple(r.tensors["kv_blocks"].corrupted_index[0]) == (3, 1, 7, 2, 0, 0)


def test_padded_q_rows_are_dont_care_by_default_everywhere(tmp_path):
    for op in ("qkv_bshd", "rope_bshd"):
        case = pq.make_case(op, seed=14)
        t = case.tensors
        valid = t["valid_lengths"]
        assert (valid < t["output"].shape[1]).any(), "the case has padded rows"
        inputs, actual = _kernel(case)
        out = actual["output"].copy()
        for b, v in enumerate(valid):
            out[b, v:] = out[b, v:].astype(np.float32) + 5  # garbage in the padded rows
        actual = dict(actual, output=out)
        assert pq.check_op(op, inputs, actual).passed
        assert not pq.check_op(op, inputs, actual, padded_q="compare").passed
        res = {"output": out, "kv_blocks": actual["kv_blocks"]}
        assert pq.check(case, res).passed
        assert not pq.check(case, res, padded_q="compare").passed


def test_check_op_argument_errors():
    case = pq.make_case("qkv_ragged", seed=15)
    inputs, actual = _kernel(case)
    with pytest.raises(ValueError, match="op"):
        pq.check_op("qkv_ragged_typo", inputs, actual)
    with pytest.raises(ValueError, match="bogus"):
        pq.check_op("qkv_ragged", dict(inputs, bogus=1), actual)
    with pytest.raises(TypeError, match="weight"):
        pq.check_op("qkv_ragged", {k: v for k, v in inputs.items() if k != "weight"}, actual)
    with pytest.raises(ValueError, match="missing `output`"):
        pq.check_op("qkv_ragged", inputs, {"kv_blocks": actual["kv_blocks"]})
    with pytest.raises(ValueError, match="kv_lookup_table"):
        lut = case.tensors["kv_lookup_table"].copy()
        lut[:] = 10**6
        pq.check_op("qkv_ragged", dict(inputs, kv_lookup_table=lut), actual)


# ----------------------------------------------------------------------------------------------
# The package's surface


def test_version_and_type_stubs_cover_every_public_name():
    pyproject = (ROOT / "python" / "pyproject.toml").read_text()
    assert f'version = "{pq.__version__}"' in pyproject
    pkg = Path(pq.__file__).parent
    assert (pkg / "py.typed").exists()
    stub = ast.parse((pkg / "__init__.pyi").read_text())
    names = {n.name for n in stub.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    names |= {t.id for n in stub.body if isinstance(n, (ast.Assign, ast.AnnAssign)) for t in ([n.target] if isinstance(n, ast.AnnAssign) else n.targets) if isinstance(t, ast.Name)}
    missing = [n for n in pq.__all__ if n not in names]
    assert not missing, f"names without a stub: {missing}"
    for n in pq.__all__:
        assert hasattr(pq, n), n


def test_the_python_benchmark_runs_and_prints_its_table(capsys):
    from paged_qkv import bench

    assert bench.main(["--models", "tiny", "--m", "1,8", "--formats", "bf16,nvfp4", "--threads", "1", "--time", "0.02", "--no-peers", "--concurrency"]) == 0
    out = capsys.readouterr().out
    rows = [l for l in out.splitlines() if l.startswith("tiny ")]
    assert len(rows) == 4, out
    for r in rows:  # model format M threads python(2) rust(2) ratio
        assert float(r.split()[8]) > 0, r
    assert "concurrency tiny bf16 M=64" in out
