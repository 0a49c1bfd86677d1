"""``python -m paged_qkv.bench``: the fused QKV from Python against the same kernel from Rust, and
against the peers that are installed.

For each model shape, format, M and thread count it prints the Python call's time (the package's
function on numpy arrays with a :class:`PackedWeight`, ``mode="fast"``), the same call's time
measured inside the extension around the crate's call (what it costs from Rust, in the same run
on the same arrays), their ratio, and each peer's time over the Python call's (above 1: this crate
is faster), where the peer is installed (else skipped with a note; none is a dependency):

* torch's ``F.linear`` on the same bf16 or f32 matrices (the matmul alone, oneDNN);
* Modular MAX's CPU ``fused_qkv_ragged_matmul`` (pip ``max``; bf16 or f32, the same cache), each
  thread count in a child process pinned to that many cores (MAX takes one per process);
* ggml's CPU matmul (llama.cpp) through ``--ggml BIN``, the driver ``tools/ggml_matmul.c`` built
  against a llama.cpp checkout (``tools/peers.sh`` builds it): q4_0 beside NVFP4/MXFP4, q8_0
  beside MXFP8, bf16 and f32 beside themselves. ggml converts the f32 activations per call (to
  q8_0 or bf16), which is part of its time; this crate's block-scaled ops take activations
  already quantized (MAX's signature).

M ≤ 8 is a decode step (M sequences, one new token each, mid-page cache lengths); larger M is
one sequence's prefill. Times are medians of repeated calls; the machine should be otherwise idle.
``--concurrency`` also measures two Python threads calling into two caches at once (each
``threads=1``) against one thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

import numpy as np

import paged_qkv as pq
from paged_qkv import _native

try:
    import ml_dtypes as _ml
except ImportError:  # pragma: no cover
    _ml = None

# The shapes of `paged-qkv bench` (the crate's `case::MODELS`): hidden, Q heads, KV heads, head.
MODELS = {
    "llama3-8b": (4096, 32, 8, 128),
    "qwen2.5-0.5b": (896, 14, 2, 64),
    "tiny": (64, 2, 1, 16),
}
PAGE = 128


def _bf16(x: np.ndarray) -> np.ndarray:
    if _ml is not None:
        return x.astype(_ml.bfloat16)
    b = x.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _time(f: Callable[[], object], budget: float, min_calls: int = 5) -> float:
    """Median seconds per call of `f` over about `budget` seconds (after one warm-up call)."""
    f()
    times: List[float] = []
    end = time.perf_counter() + budget
    while len(times) < min_calls or time.perf_counter() < end:
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
        if len(times) >= 10000:
            break
    return statistics.median(times)


class Call:
    """One fused QKV call's arrays (a decode step for M ≤ 8, else one prefill)."""

    def __init__(self, model: str, fmt: str, m: int, seed: int = 0):
        k, hq, hkv, d = MODELS[model]
        self.k, self.hq, self.hkv, self.d = k, hq, hkv, d
        self.n = (hq + 2 * hkv) * d
        self.fmt = fmt
        rng = np.random.default_rng(seed)
        w = (rng.standard_normal((self.n, k)) / np.sqrt(k)).astype(np.float32)
        x = rng.standard_normal((m, k)).astype(np.float32)
        if m <= 8:
            lens = np.array([100 + 37 * b for b in range(m)], np.uint32)
            offsets = np.arange(m + 1, dtype=np.uint32)
        else:
            lens = np.array([0], np.uint32)
            offsets = np.array([0, m], np.uint32)
        batch = len(lens)
        pages = int(max((int(lens.max()) + m) // PAGE + 1, 1))
        self.lookup = np.arange(batch * pages, dtype=np.uint32).reshape(batch, pages)
        self.cache_lengths, self.offsets = lens, offsets
        self.kv_shape = (batch * pages, 2, 1, PAGE, hkv, d)
        self.kv = _bf16(np.zeros(self.kv_shape, np.float32))
        self.max_prompt, self.max_cache = int(np.diff(offsets).max()), int(lens.max())
        if fmt in ("bf16", "f32"):
            conv = _bf16 if fmt == "bf16" else (lambda a: a.astype(np.float32))
            self.w_raw, self.x = conv(w), conv(x)
            self.kv = conv(np.zeros(self.kv_shape, np.float32))
            self.w = pq.pack_weight(self.w_raw)
        else:
            codes, scales, wts = pq.quantize(w, fmt)
            self.x, self.x_scale, xts = pq.quantize(x, fmt)
            self.w = pq.pack_weight(codes, scales, format=fmt)
            self.w_raw = (codes, scales)
            self.tensor_sf = float(wts * xts)

    def args(self, kv: Optional[np.ndarray] = None):
        kv = self.kv if kv is None else kv
        if self.fmt in ("bf16", "f32"):
            return (self.x, self.offsets, self.w, kv, self.cache_lengths, self.lookup, 0), {}
        a = (self.x, self.x_scale, self.offsets, self.w, None, kv, self.cache_lengths, self.lookup, 0, self.tensor_sf)
        return a, {}

    def python(self, threads: Optional[int], kv: Optional[np.ndarray] = None):
        a, kw = self.args(kv)
        f = pq.qkv_ragged if self.fmt in ("bf16", "f32") else pq.qkv_fp4_ragged
        return lambda: f(*a, mode="fast", threads=threads, **kw)

    def rust(self, threads: Optional[int], calls: int) -> float:
        """Median seconds of `calls` calls timed inside the extension (the crate's call alone)."""
        a, kw = self.args()
        f = _native.qkv_ragged if self.fmt in ("bf16", "f32") else _native.qkv_fp4_ragged
        f(*a, mode="fast", threads=threads, repeat=2, **kw)  # warm-up
        f(*a, mode="fast", threads=threads, repeat=calls, **kw)
        return statistics.median(_native.last_times())


def _torch_linear(call: Call, threads: int) -> Optional[Callable[[], object]]:
    """torch's `F.linear` on the same matrices (bf16 or f32), or None without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except Exception:  # noqa: BLE001 - any import failure means "not installed"
        return None
    torch.set_num_threads(threads)

    def t(a: np.ndarray):
        a = np.ascontiguousarray(a)
        if call.fmt == "bf16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    x, w = t(call.x), t(call.w_raw)
    return lambda: F.linear(x, w)


_MAX_CACHE: Dict[tuple, object] = {}


def _max_qkv(call: Call, threads: int) -> Optional[Callable[[], object]]:
    """MAX's `fused_qkv_ragged_matmul` on the CPU for this call (bf16 or f32), or None without `max`."""
    try:
        from max.driver import CPU, Buffer
        from max.dtype import DType
        from max.engine import InferenceSession
        from max.graph import BufferType, DeviceRef, Graph, TensorType
        from max.nn.kernels import fused_qkv_ragged_matmul
        from max.nn.kv_cache.cache_params import MHAKVCacheParams
        from max.nn.kv_cache.input_types import KVCacheInputsPerDevice
    except Exception:  # noqa: BLE001
        return None
    dt = DType.bfloat16 if call.fmt == "bf16" else DType.float32
    key = (call.k, call.hq, call.hkv, call.d, threads, call.fmt)
    if key not in _MAX_CACHE:
        # MAX's CPU device takes its thread count once per process (a session asking for another
        # is refused): the worker process runs on `threads` cores (its affinity) instead.
        session = InferenceSession(devices=[CPU()])
        dev = DeviceRef.CPU()
        params = MHAKVCacheParams(
            dtype=dt, n_kv_heads=call.hkv, head_dim=call.d, num_layers=1, page_size=PAGE, devices=[dev]
        )
        types = [
            TensorType(dt, ["M", call.k], dev),
            TensorType(DType.uint32, ["B1"], dev),
            TensorType(dt, [call.n, call.k], dev),
            BufferType(dt, ["blocks", 2, 1, PAGE, call.hkv, call.d], dev),
            TensorType(DType.int64, [1], dev),
            TensorType(DType.uint32, ["B"], dev),
            TensorType(DType.uint32, ["B", "P"], dev),
            TensorType(DType.uint32, [1], dev),
            TensorType(DType.uint32, [1], dev),
            TensorType(DType.uint32, [], dev),
        ]
        with Graph("qkv", input_types=types) as g:
            x, offs, w, kv, ps, lens, lut, mpl, mcl, layer = g.inputs
            coll = KVCacheInputsPerDevice(
                kv_blocks=kv.buffer, cache_lengths=lens.tensor, lookup_table=lut.tensor,
                max_prompt_length=mpl.tensor, max_cache_length=mcl.tensor, page_stride=ps.tensor,
            )
            g.output(fused_qkv_ragged_matmul(params, x.tensor, offs.tensor, w.tensor, coll, layer.tensor, call.hq))
        _MAX_CACHE[key] = (session.load(g), Buffer, DType)
    model, Buffer, DType = _MAX_CACHE[key]

    def buf(a: np.ndarray):
        if a.dtype.itemsize == 2 and a.dtype.kind not in "iuf":  # bfloat16
            return Buffer.from_numpy(a.view(np.uint16)).view(DType.bfloat16)
        return Buffer.from_numpy(a)

    kv = np.zeros(call.kv_shape, call.kv.dtype)
    inputs = [
        buf(np.ascontiguousarray(call.x)), buf(call.offsets), buf(np.ascontiguousarray(call.w_raw)), buf(kv),
        buf(np.array([-1], np.int64)), buf(call.cache_lengths), buf(call.lookup),
        buf(np.array([call.max_prompt], np.uint32)), buf(np.array([call.max_cache], np.uint32)),
        buf(np.array(0, np.uint32)),
    ]
    return lambda: model.execute(*inputs)


def _max_time(model: str, fmt: str, m: int, threads: int, budget: float) -> Optional[float]:
    """MAX's time, measured in a child process: MAX's engine takes one thread count per process."""
    import subprocess

    try:
        import max  # noqa: F401
    except Exception:  # noqa: BLE001
        return None
    cmd = [sys.executable, "-m", "paged_qkv.bench", "--max-worker", f"{model},{fmt},{m},{threads},{budget}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"note: MAX failed for {model} M={m} threads={threads}: {r.stderr.strip().splitlines()[-1:]}")
        return None
    return float(r.stdout.strip().splitlines()[-1])


# The ggml type that stands beside each of this crate's formats (bits per weight): NVFP4 4.5 ~
# q4_0 4.5, MXFP8 8.25 ~ q8_0 8.5, bf16, f32.
GGML_TYPE = {"bf16": "bf16", "f32": "f32", "nvfp4": "q4_0", "mxfp4": "q4_0", "mxfp8": "q8_0"}


def _ggml_time(binary: str, call: Call, m: int, threads: int, budget: float) -> Optional[float]:
    """ggml's matmul on the same shape (tools/ggml_matmul.c, built against llama.cpp)."""
    import subprocess

    cmd = [binary, str(call.k), str(call.n), str(m), GGML_TYPE[call.fmt], str(threads), str(budget)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"note: ggml failed ({' '.join(cmd)}): {r.stderr.strip()[-200:]}")
        return None
    return float(r.stdout.split()[-1])


def concurrency(model: str, fmt: str, m: int, budget: float) -> Dict[str, float]:
    """Calls per second of one Python thread, and of two threads on two caches, `threads=1` each."""
    calls = [Call(model, fmt, m, seed=s) for s in (0, 1)]
    fs = [c.python(1) for c in calls]
    for f in fs:
        f()

    def loop(f: Callable[[], object], out: List[int], stop: List[float]) -> None:
        n = 0
        while time.perf_counter() < stop[0]:
            f()
            n += 1
        out.append(n)

    res = {}
    for k in (1, 2):
        counts: List[int] = []
        stop = [time.perf_counter() + budget]
        ts = [threading.Thread(target=loop, args=(fs[i], counts, stop)) for i in range(k)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        res[f"{k}"] = sum(counts) / (time.perf_counter() - t0)
    return res


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paged_qkv.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama3-8b,qwen2.5-0.5b", help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--formats", default="bf16,nvfp4", help="bf16, f32, nvfp4, mxfp4, mxfp8")
    p.add_argument("--m", default="1,8,64,512", help="rows (tokens) per call")
    p.add_argument("--threads", default=None, help="thread counts (default: 1 and all cores)")
    p.add_argument("--time", type=float, default=0.5, help="seconds per measurement")
    p.add_argument("--no-peers", action="store_true", help="skip torch, MAX and ggml")
    p.add_argument("--ggml", help="the ggml_matmul driver (tools/ggml_matmul.c; tools/peers.sh builds it)")
    p.add_argument("--concurrency", action="store_true", help="also two Python threads on two caches")
    p.add_argument("--max-worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.max_worker:
        model, fmt, m, t, budget = a.max_worker.split(",")
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: int(t)])
        f = _max_qkv(Call(model, fmt, int(m)), int(t))
        print(_time(f, float(budget)) if f else "nan")
        return 0
    cores = os.cpu_count() or 1
    threads = [int(t) for t in a.threads.split(",")] if a.threads else sorted({1, cores})
    print(f"paged_qkv {pq.__version__}, ISA {pq.isa()}, {cores} cores, Python {sys.version.split()[0]}")
    peers_note = []
    if not a.no_peers:
        for name in ("torch", "max"):
            try:
                __import__(name)
            except Exception:  # noqa: BLE001
                peers_note.append(f"{name} not installed: its column is skipped")
        if not a.ggml:
            peers_note.append("no --ggml driver given: the ggml column is skipped (tools/peers.sh builds one)")
    for n in peers_note:
        print(f"note: {n}")
    head = f"{'model':<13} {'format':<6} {'M':>4} {'thr':>3} {'python':>10} {'rust':>10} {'py/rust':>7}"
    if not a.no_peers:
        head += f" {'torch linear':>12} {'MAX qkv':>10} {'ggml':>14}  (peer time / python time)"
    print(head)
    for model in a.models.split(","):
        for fmt in a.formats.split(","):
            for m in [int(x) for x in a.m.split(",")]:
                call = Call(model, fmt, m)
                for t in threads:
                    # Python and Rust alternate, three rounds each: the median of the rounds'
                    # medians (a shared machine drifts within seconds).
                    pys, rss = [], []
                    for _ in range(3):
                        pys.append(_time(call.python(t), a.time / 3))
                        calls = max(5, min(1000, int(a.time / 3 / max(pys[-1], 1e-7))))
                        rss.append(call.rust(t, calls))
                    py, rs = statistics.median(pys), statistics.median(rss)
                    line = f"{model:<13} {fmt:<6} {m:>4} {t:>3} {_fmt(py):>10} {_fmt(rs):>10} {py / rs:>7.3f}"
                    if not a.no_peers:
                        plain = fmt in ("bf16", "f32")
                        tl = _torch_linear(call, t) if plain else None
                        tt = _time(tl, a.time) if tl else None
                        mt = _max_time(model, fmt, m, t, a.time) if plain else None
                        gt = _ggml_time(a.ggml, call, m, t, a.time) if a.ggml else None
                        g = f"{GGML_TYPE[fmt]} {_ratio(gt, py)}" if gt else "-"
                        line += f" {_ratio(tt, py):>12} {_ratio(mt, py):>10} {g:>14}"
                    print(line, flush=True)
    if a.concurrency:
        for model in a.models.split(","):
            r = concurrency(model, a.formats.split(",")[0], 64, a.time * 4)
            print(
                f"concurrency {model} {a.formats.split(',')[0]} M=64 threads=1 each: one Python thread "
                f"{r['1']:.1f} calls/s, two threads {r['2']:.1f} calls/s ({r['2'] / r['1']:.2f}x)"
            )
    return 0


def _ratio(peer: Optional[float], ours: float) -> str:
    """`peer's time / ours` (above 1: this crate is faster), or "-" where the peer did not run."""
    return f"{peer / ours:.2f}x" if peer else "-"


def _fmt(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e3:.2f} ms"


if __name__ == "__main__":
    sys.exit(main())
