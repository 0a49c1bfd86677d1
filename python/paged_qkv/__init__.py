"""paged_qkv: fused QKV + paged KV cache + RoPE on the CPU, from numpy or torch.

The exact oracle (the judge of GPU kernels), a checker with the same report as the ``paged-qkv``
command line (:func:`check`, :func:`check_op`), and the crate's fast SIMD kernels, called on the
caller's own memory: no copy of the weight, the activations or the cache.

Arrays: numpy arrays, any object with ``__dlpack__`` (torch CPU tensors, ``torch.bfloat16``
included; no torch dependency) or the buffer protocol.

* packed FP4 data as ``uint8 [rows, K/2]``; FP8 data and all block scales as ``uint8`` (or
  ``ml_dtypes`` float8 arrays); scales in NVIDIA's 5-D layout (see :func:`scale_index`) or flat;
* bf16 as ``ml_dtypes.bfloat16``, ``torch.bfloat16``, or a 16-bit integer view of the bits; f16 as
  ``float16``, f32 as ``float32``; an FP8 cache as ``float8_e4m3fn`` or a ``uint8`` view;
* indices (offsets, cache lengths, the page table, valid lengths, position ids): ``uint32`` is
  used in place, ``int32`` in place once no value is negative, every other integer type
  (``int64``, ``uint8``, …) is converted after checking each value fits ``uint32``.

Every operation writes ``kv_blocks`` **in place** and returns its output: a new numpy array, or the
caller's ``out=`` array/tensor, written in place. All arguments are validated first: on error (a
``TypeError`` or ``ValueError`` naming the argument) nothing is written. Inputs that are strided
are copied; ``kv_blocks`` and ``out`` must be C-contiguous and writeable. The GIL is released while
a kernel runs (two threads writing disjoint caches run side by side; calls that write memory
another call uses wait for it). ``mode`` is ``"exact"`` (the oracle, exact accumulation),
``"sequential"`` (MAX's CPU order: an f32 FMA chain) or ``"fast"`` (the SIMD kernels); RoPE's
rounding is its own argument (``rope_math``, MAX's by default), the same bits in every mode. ``threads`` picks a team of that many threads (a ``Workers`` team, built once per size and kept; its threads spin briefly after each call, then park);
``threads=1`` runs on the calling thread; ``None`` uses all cores.

A quantized cache (MAX's FP8 KV cache): ``kv_blocks`` of ``float8_e4m3fn`` (or ``uint8``) codes and
``kv_scales=`` float32 ``[num_blocks, kv_dim, num_layers, page_size, num_kv_heads, head_size / g]``
(one scale per ``g`` elements of a head, MAX's default ``g`` 128), both written in place by every
operation (each written group: ``scale = amax / 448``, codes ``E4M3(x / scale)``; RoPE dequantizes,
rotates and requantizes the K). Semantics: docs/semantics.md §3.1.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple, Union

import numpy as np

from . import _native
from ._native import PackedWeight, pack_weight
from ._report import Report

try:  # optional: numpy dtypes for bf16 and FP8
    import ml_dtypes as _ml
except ImportError:  # pragma: no cover - exercised by the torch/ml_dtypes-free run
    _ml = None

__version__: str = _native.__version__

__all__ = [
    "Case",
    "OpReport",
    "PackedWeight",
    "Report",
    "TensorCheck",
    "__version__",
    "as_array",
    "check",
    "check_op",
    "dequantize",
    "isa",
    "kv_store_bshd",
    "kv_store_ragged",
    "load_case",
    "make_case",
    "pack_weight",
    "qkv_bshd",
    "qkv_fp4_ragged",
    "qkv_fp8_ragged",
    "qkv_ragged",
    "quantize",
    "rope_bshd",
    "rope_ragged",
    "save_case",
    "scale_index",
    "scale_offset",
]

_MODES = ("exact", "sequential", "fast")
_FORMATS = ("nvfp4", "mxfp4", "mxfp8")

# ----------------------------------------------------------------------------------------------
# Arrays <-> the native layer's (dtype, shape, bytes) tensors


def _wire_dtype(a: np.ndarray, kind: Optional[str]) -> str:
    """The case-file dtype of an array (``kind`` overrides: "bf16", "f16", "f32")."""
    name = a.dtype.name
    if kind is not None:
        want = {"bf16": "BF16", "bfloat16": "BF16", "f16": "F16", "float16": "F16", "f32": "F32", "float32": "F32"}
        if kind not in want:
            raise ValueError(f"dtype: expected bf16, f16 or f32, found {kind!r}")
        return want[kind]
    if name == "float32":
        return "F32"
    if name == "float16":
        return "F16"
    if name == "bfloat16" or (a.dtype.itemsize == 2 and a.dtype.kind in "iu"):
        return "BF16"
    if name.startswith("float8_e4m3") or name.startswith("float8_e8m0") or name == "uint8" or name == "int8":
        return "U8"
    if a.dtype.kind in "iu":
        return "U32"
    raise ValueError(f"unsupported dtype {a.dtype} (expected float32, float16, bfloat16, uint8 or integers)")


# Tensors whose FP8 elements are values (an FP8 cache), not codes or scales: sent as F8_E4M3.
_VALUE_TENSORS = ("kv_blocks", "output")


def _to_wire(
    name: str, a: Any, kind: Optional[str] = None, codes: bool = False
) -> Tuple[str, str, list, np.ndarray]:
    """``codes``: a float8 ``kv_blocks`` goes as U8 (a quantized cache's codes in a file)."""
    a = np.asarray(a)
    dtype = _wire_dtype(a, kind)
    if dtype == "U8" and name in _VALUE_TENSORS and a.dtype.name.startswith("float8_e4m3") and not codes:
        dtype = "F8_E4M3"
    if dtype == "U32":
        if a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF):
            raise ValueError(f"`{name}`: values must fit uint32")
        a = a.astype(np.uint32)
    elif dtype in ("BF16", "F16") and a.dtype.kind in "iu":
        a = a.view(np.uint16)
    a = np.ascontiguousarray(a)  # copies a strided or non-contiguous array, never misreads it
    return (name, dtype, list(a.shape), a.reshape(-1).view(np.uint8))


def _from_wire(dtype: str, shape: Iterable[int], data: np.ndarray) -> np.ndarray:
    shape = tuple(shape)
    if dtype == "F32":
        return data.view(np.float32).reshape(shape)
    if dtype == "F16":
        return data.view(np.float16).reshape(shape)
    if dtype == "BF16":
        return data.view(_ml.bfloat16 if _ml else np.uint16).reshape(shape)
    if dtype == "U32":
        return data.view(np.uint32).reshape(shape)
    if dtype == "F8_E4M3":
        return data.view(_ml.float8_e4m3fn if _ml else np.uint8).reshape(shape)
    if dtype == "F4":
        return data.reshape((shape[0], shape[1] // 2) if len(shape) == 2 else (-1,))
    return data.reshape(shape)


# ----------------------------------------------------------------------------------------------
# Cases


class Case:
    """One call of one operation: ``op``, metadata and named numpy arrays (MAX's argument names)."""

    def __init__(self, op: str, tensors: Mapping[str, np.ndarray], meta: Optional[Mapping[str, Any]] = None):
        self.op = op
        self.tensors: Dict[str, np.ndarray] = dict(tensors)
        self.meta: Dict[str, str] = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in (meta or {}).items()}

    def _wire(self, file: bool = False):
        # In a file, a quantized cache's codes (the case has ``kv_scales``) go as U8.
        codes = file and "kv_scales" in self.tensors
        return [_to_wire(k, v, codes=codes) for k, v in self.tensors.items()]

    def to_bytes(self) -> bytes:
        """The safetensors bytes (FP8 and scales as U8, a quantized cache's codes included:
        readable by ``safetensors.numpy``)."""
        return _native.case_to_bytes(self.op, self.meta, self._wire(file=True))

    def run(self, mode: str = "exact", threads: Optional[int] = None) -> Dict[str, np.ndarray]:
        """Runs the case: ``{"output": …, "kv_blocks": …}`` (no ``output`` for the KV stores;
        ``kv_scales`` too for a quantized cache)."""
        _check_mode(mode)
        out = _native.run_case(self.op, self.meta, self._wire(), mode, threads)
        return {name: _from_wire(d, s, b) for (name, d, s, b) in out}

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items())
        return f"Case(op={self.op!r}, meta={self.meta!r}, {shapes})"


def load_case(source: Union[str, os.PathLike, bytes]) -> Case:
    """Reads a case file (a path or its bytes). Scales and FP8 data may be U8, F8_E4M3 or F8_E8M0;
    a quantized cache's codes come back as ``float8_e4m3fn`` where ml_dtypes is installed."""
    data = source if isinstance(source, (bytes, bytearray)) else open(source, "rb").read()
    op, meta, tensors = _native.case_from_bytes(bytes(data))
    return Case(op, _case_tensors(tensors), meta)


def _case_tensors(tensors) -> Dict[str, np.ndarray]:
    """A case's arrays from the wire; a quantized cache's U8 codes (the case has ``kv_scales``)
    as ``float8_e4m3fn`` where ml_dtypes is installed."""
    t = {name: _from_wire(d, s, b) for (name, d, s, b) in tensors}
    kv = t.get("kv_blocks")
    if _ml and kv is not None and "kv_scales" in t and kv.dtype == np.uint8:
        t["kv_blocks"] = kv.view(_ml.float8_e4m3fn)
    return t


def save_case(path: Union[str, os.PathLike], case: Case) -> None:
    """Writes a case file (safetensors; FP8 and scales as U8, which ``safetensors.numpy`` loads)."""
    with open(path, "wb") as f:
        f.write(case.to_bytes())


def make_case(
    op: str,
    model: str = "tiny",
    batch: int = 3,
    seed: int = 0,
    format: str = "nvfp4",
    granularity: str = "tensor",
    kv_quant: Optional[int] = None,
) -> Case:
    """A realistic random case, as ``paged-qkv make-case`` writes it (``format`` for
    ``qkv_fp4_ragged``, ``granularity`` — ``"tensor"``, ``"channel"`` or ``"block"`` — for
    ``qkv_fp8_ragged``). ``kv_quant=g`` makes the cache FP8-quantized (``--kv-quant``): E4M3
    codes in ``kv_blocks`` and float32 ``kv_scales``, one scale per ``g`` elements of a head
    (MAX's default 128; ``g`` divides the head size)."""
    op_, meta, tensors = _native.make_case(op, model, batch, seed, format, granularity, kv_quant)
    return Case(op_, _case_tensors(tensors), meta)


def check(
    case: Union[Case, str, os.PathLike, bytes],
    actual: Union[Mapping[str, np.ndarray], str, os.PathLike, bytes],
    ulps: int = 2,
    atol: float = 0.0,
    rtol: float = 0.0,
    mode: str = "exact",
    padded_q: str = "ignore",
) -> Report:
    """Compares a kernel's results (``{"output": …, "kv_blocks": …}`` or a safetensors file)
    with the oracle on ``case``: an element passes within ``atol + rtol·|ref|`` or within ``ulps``
    units in the last place of its dtype; cache elements the operation does not write must be
    unchanged. The padded operations' Q rows past ``valid_lengths[b]`` (undefined in MAX) are not
    compared unless ``padded_q="compare"``. Returns a :class:`Report` (``report.assert_ok()``
    makes a pytest one line). :func:`check_op` checks from the operation's arguments instead."""
    _check_mode(mode)
    if padded_q not in ("ignore", "compare"):
        raise ValueError(f"padded_q: expected 'ignore' or 'compare', found {padded_q!r}")
    if not isinstance(case, Case):
        case = load_case(case)
    if isinstance(actual, Mapping):
        act = [_to_wire(k, v, _kind_like(case.tensors.get(k))) for k, v in actual.items()]
    else:
        act = load_case_tensors(actual)
    passed, text = _native.check_case(case.op, case.meta, case._wire(), act, atol, rtol, ulps, mode, padded_q == "compare")
    return Report(passed, text)


def load_case_tensors(source: Union[str, os.PathLike, bytes]):
    data = source if isinstance(source, (bytes, bytearray)) else open(source, "rb").read()
    return _native.tensors_from_bytes(bytes(data))


def _kind_like(a: Optional[np.ndarray]) -> Optional[str]:
    """A 16-bit integer array compared with a case tensor is read as that tensor's dtype."""
    if a is None:
        return None
    if a.dtype.name == "float16":
        return "f16"
    return None


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode: expected one of {', '.join(_MODES)}, found {mode!r}")


# ----------------------------------------------------------------------------------------------
# Formats


def quantize(x: np.ndarray, format: str, global_scale: Optional[float] = None):
    """Quantizes a ``[rows, K]`` matrix: ``(codes, scales_5d, tensor_scale)``.

    ``codes`` is packed FP4 ``uint8 [rows, K/2]`` (element ``2j`` in the low nibble of byte ``j``)
    or E4M3 ``uint8 [rows, K]``; ``scales_5d`` is ``uint8 [ceil(rows/128), ceil(ceil(K/V)/4), 32, 4,
    4]``; ``tensor_scale`` multiplies the dequantized values (NVFP4: ``1 / global_scale``, by
    default NVIDIA's ``448·6 / amax``)."""
    if format not in _FORMATS:
        raise ValueError(f"format: expected one of {', '.join(_FORMATS)}, found {format!r}")
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if x.ndim != 2:
        raise ValueError(f"`x`: expected a [rows, K] matrix, found shape {x.shape}")
    rows, k = x.shape
    codes, scales, shape5, ts = _native.quantize(x.reshape(-1), rows, k, format, global_scale)
    cols = k // 2 if format != "mxfp8" else k
    return codes.reshape(rows, cols), scales.reshape(shape5), ts


def dequantize(codes: np.ndarray, scales: np.ndarray, format: str, tensor_scale: float = 1.0, k: Optional[int] = None):
    """The float32 ``[rows, K]`` values of quantized data (``tensor_scale · dec(code) · dec(scale)``)."""
    codes = np.ascontiguousarray(np.asarray(codes).view(np.uint8))
    rows = codes.shape[0]
    if k is None:
        k = codes.shape[1] * (2 if format != "mxfp8" else 1)
    sc = np.ascontiguousarray(np.asarray(scales).view(np.uint8)).reshape(-1)
    return _native.dequantize(codes.reshape(-1), sc, rows, k, format, tensor_scale).reshape(rows, k)


def scale_index(row: int, kb: int) -> Tuple[int, int, int, int, int]:
    """The 5-D coordinate of the scale of ``row``, k-block ``kb``:
    ``(row // 128, kb // 4, row % 32, (row % 128) // 32, kb % 4)``."""
    return (row // 128, kb // 4, row % 32, (row % 128) // 32, kb % 4)


def scale_offset(row: int, kb: int, k_blocks: int) -> int:
    """The flat byte offset of that scale in a tensor with ``k_blocks`` blocks per row."""
    return _native.scale_offset(row, kb, k_blocks)


def isa() -> str:
    """The instruction set the fast paths use on this CPU."""
    return _native.isa()


# ----------------------------------------------------------------------------------------------
# Operations (MAX's argument names), on the caller's memory


def qkv_fp4_ragged(
    hidden_state, input_scale, input_row_offsets, weight, weight_scale, kv_blocks, cache_lengths,
    kv_lookup_table, layer_idx: int, tensor_sf: float, *, kv_scales=None, format: Optional[str] = None,
    q_dim: Optional[int] = None,
    output_dtype: Optional[str] = None, rope: Optional[Mapping[str, Any]] = None, mode: str = "exact",
    threads: Optional[int] = None, out=None,
):
    """MAX's ``fused_qkv_matmul_kv_cache_paged_ragged_scale_float4``: returns Q ``[M, q_dim]``
    (bf16 unless ``output_dtype``/``out`` say otherwise) and writes K/V into ``kv_blocks``.

    ``weight`` is the ``[N, K/2]`` (FP4) or ``[N, K]`` (MXFP8) codes with ``weight_scale``, or a
    :class:`PackedWeight` (then ``weight_scale=None``). A raw weight with ``mode="fast"`` is packed
    on **every call** (a server packs once with :func:`pack_weight`). ``format`` defaults to the
    packed weight's, else ``"nvfp4"``. ``q_dim`` defaults to ``N − 2·num_kv_heads·head_size``.
    ``rope={"freqs_cis": [rows, rope_dim], "interleaved": False, "q_head_size": …,
    "position_ids": …, "math": "max"}`` rotates Q and the new K in the epilogue (``math``:
    ``"max"`` or ``"f32"``, as ``rope_math`` in :func:`rope_ragged`).

    A bias (``qkv_ragged``) is added as MAX adds it: to the product rounded to the destination's
    dtype, the sum rounded again."""
    return _native.qkv_fp4_ragged(
        hidden_state, input_scale, input_row_offsets, weight, weight_scale, kv_blocks, cache_lengths,
        kv_lookup_table, layer_idx, tensor_sf, format=format, q_dim=q_dim, output_dtype=output_dtype, rope=rope,
        kv_scales=kv_scales, mode=mode, threads=threads, out=out,
    )


def qkv_fp8_ragged(
    hidden_state, input_scale, input_row_offsets, weight, weight_scale, kv_blocks, cache_lengths, kv_lookup_table,
    layer_idx: int, *, kv_scales=None, bias=None, q_dim: Optional[int] = None, output_dtype: Optional[str] = None,
    rope: Optional[Mapping[str, Any]] = None, mode: str = "exact", threads: Optional[int] = None, out=None,
):
    """MAX's FP8 W8A8 fused QKV (``_fused_qkv_ragged_matmul_scaled_float8``, op
    ``mo.fused_qkv_matmul.ragged.paged.scale[.bias]``): E4M3 ``hidden_state [M, K]`` and
    ``weight [N, K]`` (uint8 codes or ``float8_e4m3fn``; or a :class:`PackedWeight` packed with
    ``format="fp8"``), float32 scales whose shapes give the granularity as MAX infers it:
    ``[1, 1]`` both (per tensor); ``input_scale [1, M]`` and ``weight_scale [N, 1]`` (per
    channel); ``[ceil(K/128), M]`` and ``[ceil(N/128), ceil(K/128)]`` (128-blocks). Returns Q
    ``[M, q_dim]`` (bf16 unless ``output_dtype``/``out`` say otherwise) and writes K/V into
    ``kv_blocks``.

    As MAX: the sum is rounded to the output dtype, multiplied there by
    ``r(r(input_scale) · r(weight_scale))`` (tensor, channel), ``bias [N]`` is added there, and K/V
    take that value cast to the cache's dtype. ``rope`` as in :func:`qkv_fp4_ragged`."""
    return _native.qkv_fp8_ragged(
        hidden_state, input_scale, input_row_offsets, weight, weight_scale, kv_blocks, cache_lengths,
        kv_lookup_table, layer_idx, bias=bias, q_dim=q_dim, output_dtype=output_dtype, rope=rope,
        kv_scales=kv_scales, mode=mode,
        threads=threads, out=out,
    )


def qkv_ragged(
    hidden_state, input_row_offsets, weight, kv_blocks, cache_lengths, kv_lookup_table, layer_idx: int, *,
    kv_scales=None,
    bias=None, q_dim: Optional[int] = None, output_dtype: Optional[str] = None,
    rope: Optional[Mapping[str, Any]] = None, mode: str = "exact", threads: Optional[int] = None, out=None,
):
    """MAX's ``fused_qkv_matmul_kv_cache_paged_ragged`` (``_bias`` with ``bias``): bf16/f16/f32
    ``hidden_state [M, K]`` and ``weight [N, K]`` (or a :class:`PackedWeight`) of one dtype;
    returns Q ``[M, q_dim]`` in ``hidden_state``'s dtype unless ``output_dtype``/``out`` say
    otherwise. A raw weight with ``mode="fast"`` is packed on **every call** (use
    :func:`pack_weight` once). ``rope`` as in :func:`qkv_fp4_ragged`."""
    return _native.qkv_ragged(
        hidden_state, input_row_offsets, weight, kv_blocks, cache_lengths, kv_lookup_table, layer_idx,
        bias=bias, q_dim=q_dim, output_dtype=output_dtype, rope=rope, kv_scales=kv_scales, mode=mode, threads=threads,
        out=out,
    )


def qkv_bshd(
    hidden_state, weight, kv_blocks, cache_lengths, kv_lookup_table, valid_lengths, layer_idx: int, *,
    kv_scales=None,
    q_dim: Optional[int] = None, output_dtype: Optional[str] = None, rope: Optional[Mapping[str, Any]] = None,
    mode: str = "exact", threads: Optional[int] = None, out=None,
):
    """MAX's ``fused_qkv_matmul_kv_cache_bshd_paged``: padded ``hidden_state [batch, seq, K]``;
    Q ``[batch, seq, q_dim]`` for every position, K/V for ``t < valid_lengths[b]``. ``weight`` as
    in :func:`qkv_ragged`; ``rope`` rotates whole heads of rows ``t < valid_lengths[b]``."""
    return _native.qkv_bshd(
        hidden_state, weight, kv_blocks, cache_lengths, kv_lookup_table, valid_lengths, layer_idx,
        q_dim=q_dim, output_dtype=output_dtype, rope=rope, kv_scales=kv_scales, mode=mode, threads=threads, out=out,
    )


def rope_bshd(
    q_proj, freqs_cis, kv_blocks, cache_lengths, kv_lookup_table, valid_lengths, layer_idx: int, *, kv_scales=None,
    interleaved: bool = True, rope_math: str = "max", output=None, mode: str = "exact",
    threads: Optional[int] = None, out=None,
):
    """MAX's ``fused_qk_rope_bshd_paged``: rotates ``q_proj [batch, seq, heads, D]`` into the
    returned output and the new K inside ``kv_blocks``. Padded rows (``t ≥ valid_lengths[b]``) of
    the output are not written: they keep ``out``'s contents (zeros in a new array). ``output``
    (the earlier spelling) gives those contents without being written itself. ``freqs_cis`` has
    ``q_proj``'s dtype. ``rope_math``: ``"max"`` (MAX's rounding sequence in the freqs dtype, MAX's
    RoPE bit for bit) or ``"f32"`` (f32 math, one rounding per value); every ``mode`` gives the
    same bits."""
    if out is None and output is not None:
        out = output.clone() if hasattr(output, "clone") else np.array(output, copy=True)
    return _native.rope_bshd(
        q_proj, freqs_cis, kv_blocks, cache_lengths, kv_lookup_table, valid_lengths, layer_idx,
        interleaved=interleaved, rope_math=rope_math, kv_scales=kv_scales, mode=mode, threads=threads, out=out,
    )


def rope_ragged(
    q_proj, input_row_offsets, freqs_cis, kv_blocks, cache_lengths, kv_lookup_table, layer_idx: int, *, kv_scales=None,
    interleaved: bool = True, position_ids=None, rope_math: str = "max", mode: str = "exact",
    threads: Optional[int] = None, out=None,
):
    """MAX's ``fused_qk_rope_ragged``: ``q_proj [M, heads, Dq]``, ``freqs_cis [rows, rope_dim]``
    (f32 or another float dtype; ``rope_dim`` < the head size rotates part of each head), optional
    ``position_ids [M]``; returns the rotated Q. ``interleaved`` defaults to MAX's ``True``;
    ``rope_math`` as in :func:`rope_bshd`."""
    return _native.rope_ragged(
        q_proj, input_row_offsets, freqs_cis, kv_blocks, cache_lengths, kv_lookup_table, layer_idx,
        interleaved=interleaved, position_ids=position_ids, rope_math=rope_math, kv_scales=kv_scales, mode=mode, threads=threads,
        out=out,
    )


def kv_store_ragged(
    values, input_row_offsets, kv_blocks, cache_lengths, kv_lookup_table, layer_idx: int, *, kv_scales=None, cache: str = "k",
    mode: str = "exact", threads: Optional[int] = None,
) -> None:
    """MAX's ``kv_cache_store_ragged``: stores ``values [M, kv_heads, D]`` as K (or V, ``cache="v"``)
    at ``cache_lengths[b] + t``."""
    _native.kv_store_ragged(
        values, input_row_offsets, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, cache=cache, kv_scales=kv_scales, mode=mode,
        threads=threads,
    )


def kv_store_bshd(
    values, kv_blocks, cache_lengths, kv_lookup_table, valid_lengths, layer_idx: int, *, kv_scales=None, cache: str = "k",
    mode: str = "exact", threads: Optional[int] = None,
) -> None:
    """MAX's ``kv_cache_store_padded``: stores ``values [batch, seq, kv_heads, D]`` for
    ``t < valid_lengths[b]``."""
    _native.kv_store_bshd(
        values, kv_blocks, cache_lengths, kv_lookup_table, valid_lengths, layer_idx, cache=cache, kv_scales=kv_scales, mode=mode,
        threads=threads,
    )


def as_array(x) -> np.ndarray:
    """A numpy view of an array-like's memory (a torch CPU tensor, ``bfloat16`` included, through
    DLPack; a buffer); a copy where it is strided. A numpy array is returned as is."""
    return _native.as_array(x)


from ._check import OpReport, TensorCheck, check_op  # noqa: E402  (uses the functions above)
