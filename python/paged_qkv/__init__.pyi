"""Type stubs of the public ``paged_qkv`` API (see the module docstring for the conventions)."""

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, TypedDict, Union

import numpy as np
import numpy.typing as npt

__version__: str

#: Anything the operations take as an array: a numpy array, an object with ``__dlpack__`` (a torch
#: CPU tensor), a buffer-protocol object, or (for indices) a sequence of ints.
ArrayLike = Any
Mode = str  # "exact" | "sequential" | "fast"

class RopeArgs(TypedDict, total=False):
    """The ``rope=`` argument of the fused QKV operations (``freqs_cis`` required)."""

    freqs_cis: ArrayLike
    interleaved: bool
    q_head_size: int
    position_ids: Optional[ArrayLike]
    math: str  # "max" (default) or "f32"

class PackedWeight:
    """A fused Q|K|V weight packed once for the fast kernels (see :func:`pack_weight`)."""

    @property
    def format(self) -> str: ...
    @property
    def shape(self) -> Tuple[int, int]: ...
    @property
    def nbytes(self) -> int: ...
    def unpack(self) -> Tuple[np.ndarray, Optional[np.ndarray]]: ...

def pack_weight(
    weight: ArrayLike,
    weight_scale: Optional[ArrayLike] = None,
    *,
    format: Optional[str] = None,
    threads: Optional[int] = None,
) -> PackedWeight: ...
def qkv_fp4_ragged(
    hidden_state: ArrayLike,
    input_scale: ArrayLike,
    input_row_offsets: ArrayLike,
    weight: Union[ArrayLike, PackedWeight],
    weight_scale: Optional[ArrayLike],
    kv_blocks: ArrayLike,
    cache_lengths: ArrayLike,
    kv_lookup_table: ArrayLike,
    layer_idx: int,
    tensor_sf: float,
    *,
    kv_scales: Optional[ArrayLike] = None,
    format: Optional[str] = None,
    q_dim: Optional[int] = None,
    output_dtype: Optional[str] = None,
    rope: Optional[RopeArgs] = None,
    mode: Mode = "exact",
    threads: Optional[int] = None,
    out: Optional[ArrayLike] = None,
) -> Any: ...
def qkv_fp8_ragged(
    hidden_state: ArrayLike,
    input_scale: ArrayLike,
    input_row_offsets: ArrayLike,
    weight: Union[ArrayLike, PackedWeight],
    weight_scale: ArrayLike,
    kv_blocks: ArrayLike,
    cache_lengths: ArrayLike,
    kv_lookup_table: ArrayLike,
    layer_idx: int,
    *,
    kv_scales: Optional[ArrayLike] = None,
    bias: Optional[ArrayLike] = None,
    q_dim: Optional[int] = None,
    output_dtype: Optional[str] = None,
    rope: Optional[RopeArgs] = None,
    mode: Mode = "exact",
    threads: Optional[int] = None,
    out: Optional[ArrayLike] = None,
) -> Any: ...
def qkv_ragged(
    hidden_state: ArrayLike,
    input_row_offsets: ArrayLike,
    weight: Union[ArrayLike, PackedWeight],
    kv_blocks: ArrayLike,
    cache_lengths: ArrayLike,
    kv_lookup_table: ArrayLike,
    layer_idx: int,
    *,
    kv_scales: Optional[ArrayLike] = None,
    bias: Optional[ArrayLike] = None,
    q_dim: Optional[int] = None,
    output_dtype: Optional[str] = None,
    rope: Optional[RopeArgs] = None,
    mode: Mode = "exact",
    threads: Optional[int] = None,
    out: Optional[ArrayLike] = None,
) -> Any: ...
def qkv_bshd(
    hidden_state: ArrayLike,
    weight: Union[ArrayLike, PackedWeight],
    kv_blocks: ArrayLike,
    cache_lengths: ArrayLike,
    kv_lookup_table: ArrayLike,
    valid_lengths: ArrayLike,
    layer_idx: int,
    *,
    kv_scales: Optional[ArrayLike] = None,
    q_dim: Optional[int] = None,
    output_dtype: Optional[str] = None,
    rope: Optional[RopeArgs] = None,
    mode: Mode = "exact",
    threads: Optional[int] = None,
    out: Optional[ArrayLike] = None,
) -> Any: ...
def rope_bshd(
    q_proj: ArrayLike,
    freqs_cis: ArrayLike,
    kv_blocks: ArrayLike,
    cache_lengths: ArrayLike,
    kv_lookup_table: ArrayLike,
    valid_lengths: ArrayLike,
    layer_idx: int,
    *,
    kv_scales: Optional[ArrayLike] = None,
    interleaved: bool = True,
    rope_math: str = "max",
    output: Optional[ArrayLike] = None,
    mode: Mode = "exact",
    threads: Optional[int] = None,
    out: Optional[ArrayLike] = None,
) -> Any: ...
def rope_ragged(
    q_proj: ArrayLike,
    input_row_offsets: ArrayLike,
    freqs_cis: ArrayLike,
    kv_blocks: ArrayLike,
    cache_lengths: ArrayLike,
    kv_lookup_table: ArrayLike,
    layer_idx: int,
    *,
    kv_scales: Optional[ArrayLike] = None,
    interleaved: bool = True,
    position_ids: Optional[ArrayLike] = None,
    rope_math: str = "max",
    mode: Mode = "exact",
    threads: Optional[int] = None,
    out: Optional[ArrayLike] = None,
) -> Any: ...
def kv_store_ragged(
    values: ArrayLike,
    input_row_offsets: ArrayLike,
    kv_blocks: ArrayLike,
    cache_lengths: ArrayLike,
    kv_lookup_table: ArrayLike,
    layer_idx: int,
    *,
    kv_scales: Optional[ArrayLike] = None,
    cache: str = "k",
    mode: Mode = "exact",
    threads: Optional[int] = None,
) -> None: ...
def kv_store_bshd(
    values: ArrayLike,
    kv_blocks: ArrayLike,
    cache_lengths: ArrayLike,
    kv_lookup_table: ArrayLike,
    valid_lengths: ArrayLike,
    layer_idx: int,
    *,
    kv_scales: Optional[ArrayLike] = None,
    cache: str = "k",
    mode: Mode = "exact",
    threads: Optional[int] = None,
) -> None: ...
def as_array(x: ArrayLike) -> np.ndarray: ...

class Case:
    op: str
    tensors: Dict[str, np.ndarray]
    meta: Dict[str, str]
    def __init__(self, op: str, tensors: Mapping[str, np.ndarray], meta: Optional[Mapping[str, Any]] = None) -> None: ...
    def to_bytes(self) -> bytes: ...
    def run(self, mode: Mode = "exact", threads: Optional[int] = None) -> Dict[str, np.ndarray]: ...

def load_case(source: Union[str, os.PathLike, bytes]) -> Case: ...
def save_case(path: Union[str, os.PathLike], case: Case) -> None: ...
def make_case(
    op: str,
    model: str = "tiny",
    batch: int = 3,
    seed: int = 0,
    format: str = "nvfp4",
    granularity: str = "tensor",
    kv_quant: Optional[int] = None,
) -> Case: ...

class Report:
    passed: bool
    text: str
    def __init__(self, passed: bool, text: str) -> None: ...
    def assert_ok(self) -> None: ...
    def __bool__(self) -> bool: ...

def check(
    case: Union[Case, str, os.PathLike, bytes],
    actual: Union[Mapping[str, np.ndarray], str, os.PathLike, bytes],
    ulps: int = 2,
    atol: float = 0.0,
    rtol: float = 0.0,
    mode: Mode = "exact",
    padded_q: str = "ignore",
) -> Report: ...

class TensorCheck:
    name: str
    dtype: str
    compared: int
    failures: int
    max_ulp: int
    max_abs: float
    max_rel: float
    ulp_histogram: Dict[str, int]
    index: npt.NDArray[np.int64]
    actual: npt.NDArray[np.float64]
    reference: npt.NDArray[np.float64]
    ulps: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    corrupted: int
    corrupted_index: npt.NDArray[np.int64]
    @property
    def passed(self) -> bool: ...

class OpReport:
    op: str
    mode: str
    passed: bool
    tensors: Dict[str, TensorCheck]
    hints: List[str]
    text: str
    def assert_ok(self) -> None: ...
    def __bool__(self) -> bool: ...

def check_op(
    op: Union[str, Callable[..., Any]],
    inputs: Mapping[str, Any],
    actual: Mapping[str, Any],
    *,
    ulps: int = 2,
    atol: float = 0.0,
    rtol: float = 0.0,
    mode: Mode = "exact",
    padded_q: str = "ignore",
    max_failures: int = 1000,
) -> OpReport: ...
def quantize(
    x: ArrayLike, format: str, global_scale: Optional[float] = None
) -> Tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], float]: ...
def dequantize(
    codes: ArrayLike, scales: ArrayLike, format: str, tensor_scale: float = 1.0, k: Optional[int] = None
) -> npt.NDArray[np.float32]: ...
def scale_index(row: int, kb: int) -> Tuple[int, int, int, int, int]: ...
def scale_offset(row: int, kb: int, k_blocks: int) -> int: ...
def isa() -> str: ...
