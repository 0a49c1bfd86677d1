"""MAX's own CPU kernels as callables on numpy arrays: `fused_qkv_ragged_matmul`,
`fused_qkv_padded_matmul` and `fused_qk_ragged_rope` (the `max` package's Python API, graphs on
`InferenceSession(devices=[CPU()])`), for the conformance suite. Each graph is built and compiled
once per static configuration (dtypes, heads, head size, page size, bias, pairing) and cached.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import ml_dtypes
import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType
from max.nn.kernels import fused_qk_ragged_rope, fused_qkv_padded_matmul, fused_qkv_ragged_matmul
from max.nn.kv_cache.cache_params import MHAKVCacheParams
from max.nn.kv_cache.input_types import KVCacheInputsPerDevice

_SESSION: Optional[InferenceSession] = None
_MODELS: Dict[tuple, object] = {}
DTYPES = {"bfloat16": DType.bfloat16, "float32": DType.float32}


def _session() -> InferenceSession:
    global _SESSION
    if _SESSION is None:
        _SESSION = InferenceSession(devices=[CPU()])
    return _SESSION


def _dt(a: np.ndarray) -> DType:
    return DTYPES[a.dtype.name]


def buf(a: np.ndarray) -> Buffer:
    """A MAX buffer over a copy of `a` (bf16 through its bits)."""
    a = np.array(a, copy=True, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    if a.dtype == ml_dtypes.bfloat16:
        return Buffer.from_numpy(a.view(np.uint16)).view(DType.bfloat16)
    return Buffer.from_numpy(a)


def back(b: Buffer, like: np.ndarray) -> np.ndarray:
    """A MAX buffer's contents as a numpy array of `like`'s dtype."""
    if like.dtype == ml_dtypes.bfloat16:
        return b.view(DType.uint16).to_numpy().view(ml_dtypes.bfloat16).copy()
    return b.to_numpy().copy()


def _cache_types(dt: DType, layers: int, page: int, hkv: int, hd: int):
    dev = DeviceRef.CPU()
    return [
        BufferType(dt, ["blocks", 2, layers, page, hkv, hd], dev),
        TensorType(DType.int64, [1], dev),  # page_stride (-1: packed)
        TensorType(DType.uint32, ["B"], dev),  # cache_lengths
        TensorType(DType.uint32, ["B", "P"], dev),  # lookup table
        TensorType(DType.uint32, [1], dev),  # max_prompt_length
        TensorType(DType.uint32, [1], dev),  # max_cache_length
    ]


def _collection(vals):
    kv, ps, lens, lut, mpl, mcl = vals
    return KVCacheInputsPerDevice(
        kv_blocks=kv.buffer, cache_lengths=lens.tensor, lookup_table=lut.tensor,
        max_prompt_length=mpl.tensor, max_cache_length=mcl.tensor, page_stride=ps.tensor,
    )


def _params(dt: DType, layers: int, page: int, hkv: int, hd: int) -> MHAKVCacheParams:
    return MHAKVCacheParams(
        dtype=dt, n_kv_heads=hkv, head_dim=hd, num_layers=layers, page_size=page, devices=[DeviceRef.CPU()]
    )


def _cache_args(kv: np.ndarray, lens: np.ndarray, lut: np.ndarray, max_prompt: int):
    return [
        buf(kv), buf(np.array([-1], np.int64)), buf(lens.astype(np.uint32)), buf(lut.astype(np.uint32)),
        buf(np.array([max_prompt], np.uint32)), buf(np.array([int(lens.max()) if len(lens) else 0], np.uint32)),
    ]


def qkv_ragged(x, offsets, w, kv, lens, lut, layer: int, n_heads: int, bias=None) -> Tuple[np.ndarray, np.ndarray]:
    """MAX's `fused_qkv_ragged_matmul` (with `bias`: its `.bias` op): (Q, kv_blocks after)."""
    _, _, layers, page, hkv, hd = kv.shape
    n, k = w.shape
    dt = _dt(x)
    key = ("qkv_ragged", dt, n, layers, page, hkv, hd, n_heads, bias is not None)
    if key not in _MODELS:
        session = _session()
        dev = DeviceRef.CPU()
        types = [TensorType(dt, ["M", "K"], dev), TensorType(DType.uint32, ["B1"], dev), TensorType(dt, [n, "K"], dev)]
        types += _cache_types(dt, layers, page, hkv, hd) + [TensorType(DType.uint32, [], dev)]
        if bias is not None:
            types.append(TensorType(dt, [n], dev))
        with Graph("qkv_ragged", input_types=types) as g:
            v = g.inputs
            q = fused_qkv_ragged_matmul(
                _params(dt, layers, page, hkv, hd), v[0].tensor, v[1].tensor, v[2].tensor, _collection(v[3:9]),
                v[9].tensor, n_heads, bias=v[10].tensor if bias is not None else None,
            )
            g.output(q)
        _MODELS[key] = session.load(g)
    max_prompt = int(np.diff(offsets).max()) if len(offsets) > 1 else 0
    args = [buf(x), buf(offsets.astype(np.uint32)), buf(w)] + _cache_args(kv, lens, lut, max_prompt)
    args.append(buf(np.array(layer, np.uint32)))
    if bias is not None:
        args.append(buf(bias))
    (q,) = _MODELS[key].execute(*args)
    return back(q, x), back(args[3], kv)


def qkv_padded(x, w, kv, lens, lut, valid, layer: int, n_heads: int) -> Tuple[np.ndarray, np.ndarray]:
    """MAX's `fused_qkv_padded_matmul`: (Q [batch, seq, q_dim], kv_blocks after)."""
    _, _, layers, page, hkv, hd = kv.shape
    n, k = w.shape
    dt = _dt(x)
    key = ("qkv_padded", dt, n, k, layers, page, hkv, hd, n_heads)
    if key not in _MODELS:
        session = _session()
        dev = DeviceRef.CPU()
        # The padded kernel wants a static weight shape (K included).
        types = [TensorType(dt, ["B", "S", k], dev), TensorType(dt, [n, k], dev)]
        types += _cache_types(dt, layers, page, hkv, hd)
        types += [TensorType(DType.uint32, [], dev), TensorType(DType.uint32, ["B"], dev)]
        with Graph("qkv_padded", input_types=types) as g:
            v = g.inputs
            q = fused_qkv_padded_matmul(
                _params(dt, layers, page, hkv, hd), v[0].tensor, v[1].tensor, _collection(v[2:8]), v[8].tensor,
                v[9].tensor, n_heads,
            )
            g.output(q)
        _MODELS[key] = session.load(g)
    args = [buf(x), buf(w)] + _cache_args(kv, lens, lut, x.shape[1])
    args += [buf(np.array(layer, np.uint32)), buf(valid.astype(np.uint32))]
    (q,) = _MODELS[key].execute(*args)
    return back(q, x), back(args[2], kv)


def rope_ragged(q, offsets, freqs, kv, lens, lut, layer: int, interleaved: bool, position_ids=None):
    """MAX's `fused_qk_ragged_rope`: (rotated Q, kv_blocks after)."""
    _, _, layers, page, hkv, hd = kv.shape
    m, hq, dq = q.shape
    dt, ft = _dt(q), _dt(freqs)
    key = ("rope", dt, ft, freqs.shape[1], layers, page, hkv, hd, hq, dq, interleaved, position_ids is not None)
    if key not in _MODELS:
        session = _session()
        dev = DeviceRef.CPU()
        types = [TensorType(dt, ["M", hq, dq], dev), TensorType(DType.uint32, ["B1"], dev)]
        types += _cache_types(_dt(kv), layers, page, hkv, hd)
        types += [TensorType(ft, ["R", freqs.shape[1]], dev), TensorType(DType.uint32, [], dev)]
        if position_ids is not None:
            types.append(TensorType(DType.uint32, [1, "M"], dev))
        with Graph("rope", input_types=types) as g:
            v = g.inputs
            out = fused_qk_ragged_rope(
                _params(_dt(kv), layers, page, hkv, hd), v[0].tensor, v[1].tensor, _collection(v[2:8]), v[8].tensor,
                v[9].tensor, interleaved=interleaved,
                position_ids=v[10].tensor if position_ids is not None else None,
            )
            g.output(out)
        _MODELS[key] = session.load(g)
    max_prompt = int(np.diff(offsets).max()) if len(offsets) > 1 else 0
    args = [buf(q), buf(offsets.astype(np.uint32))] + _cache_args(kv, lens, lut, max_prompt)
    args += [buf(freqs), buf(np.array(layer, np.uint32))]
    if position_ids is not None:
        args.append(buf(position_ids.astype(np.uint32).reshape(1, -1)))
    (out,) = _MODELS[key].execute(*args)
    return back(out, q), back(args[2], kv)
