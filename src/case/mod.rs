//! Case files: one call of one operation in a safetensors file, named as MAX names the arguments,
//! so GPU-kernel developers can dump their kernel's inputs and outputs from Python and get a
//! trusted answer ([`Case::run`]) and a verdict ([`compare`]).
//!
//! Format (a public promise; see the README's "Check your GPU kernel"):
//! * `__metadata__`: `op` (`qkv_fp4_ragged`, `qkv_fp8_ragged`, `qkv_ragged`, `qkv_bshd`,
//!   `rope_bshd`, `rope_ragged`, `kv_store_ragged`, `kv_store_bshd`); `layer_idx`; for
//!   `qkv_fp4_ragged` `format` (`nvfp4`, `mxfp4`, `mxfp8`) and `tensor_sf` (decimal); for RoPE
//!   `interleaved` (`true`/`false`); for the KV stores `cache` (`k` or `v`, default `k`), the
//!   stored values being `hidden_state`.
//! * Tensors, where the op uses them: `hidden_state`, `input_row_offsets` (U32), `weight`,
//!   `input_scale`, `weight_scale` (5-D for `qkv_fp4_ragged`; f32 for `qkv_fp8_ragged`, their
//!   shapes giving the granularity as MAX infers it: `[1, 1]` per tensor, `[1, M]` and `[N, 1]` per
//!   channel, `[ceil(K/128), M]` and `[ceil(N/128), ceil(K/128)]` per block), `bias`, `kv_blocks` (rank 6), `cache_lengths` (U32),
//!   `kv_lookup_table` (U32 `[batch, cols]`), `valid_lengths` (U32), `q_proj`, `freqs_cis`,
//!   `position_ids` (U32), `output` (the pre-allocated output; its shape gives q_dim; rows the op
//!   does not write keep their contents).
//! * A quantized cache (semantics §3.1): `kv_blocks` of E4M3 codes (U8 or F8_E4M3) and `kv_scales`, F32
//!   `[num_blocks, kv_dim, num_layers, page_size, num_kv_heads, head_size / g]` (the granularity
//!   `g` from its last dimension); both are written by the op, returned by `run` and compared by
//!   `check`, which judges the cache by its values, code × scale (`kv_values` in the report).
//! * Dtypes: packed FP4 as U8 `[rows, K/2]` or F4 `[rows, K]`; E4M3 as F8_E4M3 or U8; E8M0 as
//!   F8_E8M0 or U8; BF16, F16, F32 for values (`kv_blocks` also F8_E4M3, or U8 codes with
//!   `kv_scales`); U32 for indices.
//!
//! Every problem is a one-line [`CaseError`] naming the tensor, the expected and the found
//! shape or dtype; nothing panics on malformed files.
//!
//! The code: the types here; reading a file in `read`, running it in `run`, checking a kernel's
//! results in `check`, making cases in `make`.

use crate::cache::{CacheShape, KvScalesMut, KvSel, KvWrite, PageTable, PagedKvCacheMut, SlotPlan};
use crate::element::{DType, Element};
use crate::fast::{self, Exec, Par};
use crate::formats::fp8::E4M3;
use crate::formats::scale_layout::ScaleLayout;
use crate::formats::{BlockFormat, QuantizedRef};
use crate::ops::{self, Accumulation, RopeMath};
use crate::reference;
use half::{bf16, f16};
use safetensors::{Dtype as St, SafeTensors, tensor::TensorView};
use std::collections::BTreeMap;
use std::fmt;

mod check;
mod make;
mod read;
mod run;

pub use crate::ops::freqs_cis;
pub use check::{
    CheckOptions, Report, TensorReport, Tolerance, ULP_BUCKETS, check, check_with, compare, compare_values,
};
pub use make::{MODELS, MakeOptions, ModelShape, make, make_fp8, make_with, model, normal};
pub use read::{load_tensors, save_tensors};
pub use run::exec;

/// A malformed or inconsistent case, in one line.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseError(pub String);

impl fmt::Display for CaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CaseError {}

impl From<crate::Error> for CaseError {
    fn from(e: crate::Error) -> Self {
        CaseError(e.to_string())
    }
}

type Result<T> = std::result::Result<T, CaseError>;

fn err<T>(msg: impl Into<String>) -> Result<T> {
    Err(CaseError(msg.into()))
}

/// The operations a case can describe (more may come: the enum is non-exhaustive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// [`reference::qkv_fp4_ragged`].
    QkvFp4Ragged,
    /// [`reference::qkv_fp8_ragged`].
    QkvFp8Ragged,
    /// [`reference::qkv_ragged`].
    QkvRagged,
    /// [`reference::qkv_bshd`].
    QkvBshd,
    /// [`reference::rope_bshd`].
    RopeBshd,
    /// [`reference::rope_ragged`].
    RopeRagged,
    /// [`reference::kv_store_ragged`].
    KvStoreRagged,
    /// [`reference::kv_store_bshd`].
    KvStoreBshd,
}

impl Op {
    /// All ops.
    pub const ALL: [Op; 8] = [
        Op::QkvFp4Ragged,
        Op::QkvFp8Ragged,
        Op::QkvRagged,
        Op::QkvBshd,
        Op::RopeBshd,
        Op::RopeRagged,
        Op::KvStoreRagged,
        Op::KvStoreBshd,
    ];
    /// The `op` metadata value.
    pub fn name(self) -> &'static str {
        match self {
            Op::QkvFp4Ragged => "qkv_fp4_ragged",
            Op::QkvFp8Ragged => "qkv_fp8_ragged",
            Op::QkvRagged => "qkv_ragged",
            Op::QkvBshd => "qkv_bshd",
            Op::RopeBshd => "rope_bshd",
            Op::RopeRagged => "rope_ragged",
            Op::KvStoreRagged => "kv_store_ragged",
            Op::KvStoreBshd => "kv_store_bshd",
        }
    }
    /// Parses [`name`](Self::name).
    pub fn from_name(s: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|o| o.name() == s)
    }
    /// Whether the op writes `output`.
    pub fn has_output(self) -> bool {
        !matches!(self, Op::KvStoreRagged | Op::KvStoreBshd)
    }
    /// Whether [`Mode::Fast`] runs a fast path for this op (else the reference in Exact mode).
    pub fn has_fast_path(self) -> bool {
        true
    }
}

/// How [`Case::run`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The fast path where one exists ([`Op::has_fast_path`]), else the reference in Exact mode.
    Fast,
    /// The reference, MAX's CPU order (an f32 FMA chain over k).
    Sequential,
    /// The reference, exact accumulation.
    Exact,
}

/// A tensor's element type in a case file: the safetensors dtypes, spelled as Rust names
/// (`Display` gives the file's spelling, e.g. `F8_E4M3`). This crate's own type, so that the
/// case-file API does not change with the safetensors crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[allow(missing_docs)]
pub enum Dtype {
    Bool,
    F4,
    F6E2M3,
    F6E3M2,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E8M0,
    F8E4M3Fnuz,
    F8E5M2Fnuz,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

/// Both spellings of every dtype.
const DTYPES: [(Dtype, St); 22] = [
    (Dtype::Bool, St::BOOL),
    (Dtype::F4, St::F4),
    (Dtype::F6E2M3, St::F6_E2M3),
    (Dtype::F6E3M2, St::F6_E3M2),
    (Dtype::U8, St::U8),
    (Dtype::I8, St::I8),
    (Dtype::F8E5M2, St::F8_E5M2),
    (Dtype::F8E4M3, St::F8_E4M3),
    (Dtype::F8E8M0, St::F8_E8M0),
    (Dtype::F8E4M3Fnuz, St::F8_E4M3FNUZ),
    (Dtype::F8E5M2Fnuz, St::F8_E5M2FNUZ),
    (Dtype::I16, St::I16),
    (Dtype::U16, St::U16),
    (Dtype::F16, St::F16),
    (Dtype::BF16, St::BF16),
    (Dtype::I32, St::I32),
    (Dtype::U32, St::U32),
    (Dtype::F32, St::F32),
    (Dtype::C64, St::C64),
    (Dtype::F64, St::F64),
    (Dtype::I64, St::I64),
    (Dtype::U64, St::U64),
];

impl Dtype {
    fn to_st(self) -> St {
        DTYPES.iter().find(|d| d.0 == self).map_or(St::U8, |d| d.1)
    }
    fn from_st(d: St) -> Option<Dtype> {
        DTYPES.iter().find(|x| x.1 == d).map(|x| x.0)
    }
    /// The safetensors spelling (`U8`, `F8_E4M3`, `BF16`, …).
    pub fn name(self) -> String {
        format!("{:?}", self.to_st())
    }
    /// Parses [`name`](Self::name).
    pub fn from_name(s: &str) -> Option<Dtype> {
        DTYPES.iter().map(|d| d.0).find(|d| d.name() == s)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// One tensor: dtype, shape and little-endian bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Raw bytes.
    pub data: Vec<u8>,
}

impl Tensor {
    /// A tensor of elements `T` (F32, BF16, F16 or F8_E4M3).
    pub fn from_elements<T: Element>(shape: Vec<usize>, v: &[T]) -> Tensor {
        Tensor { dtype: st_dtype(T::DTYPE), shape, data: encode(v) }
    }
    /// A U32 tensor.
    pub fn from_u32(shape: Vec<usize>, v: &[u32]) -> Tensor {
        Tensor { dtype: Dtype::U32, shape, data: v.iter().flat_map(|x| x.to_le_bytes()).collect() }
    }
    /// A byte tensor with the given dtype (U8, F8E4M3, F8E8M0).
    pub fn from_bytes(dtype: Dtype, shape: Vec<usize>, v: Vec<u8>) -> Tensor {
        Tensor { dtype, shape, data: v }
    }
}

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F8E4M3 => Dtype::F8E4M3,
    }
}

fn elem_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F16 => Some(DType::F16),
        Dtype::F8E4M3 => Some(DType::F8E4M3),
        _ => None,
    }
}

/// Decodes little-endian element bytes.
pub fn decode<T: Element>(bytes: &[u8]) -> Vec<T> {
    let w = T::DTYPE.size();
    bytes
        .chunks_exact(w)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..w].copy_from_slice(c);
            T::from_bits(u32::from_le_bytes(b))
        })
        .collect()
}

/// Encodes elements as little-endian bytes.
pub fn encode<T: Element>(v: &[T]) -> Vec<u8> {
    let w = T::DTYPE.size();
    v.iter().flat_map(|x| x.to_bits().to_le_bytes().into_iter().take(w)).collect()
}

/// A parsed case.
#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    /// The operation.
    pub op: Op,
    /// All `__metadata__` entries.
    pub meta: BTreeMap<String, String>,
    /// The tensors by name.
    pub tensors: BTreeMap<String, Tensor>,
}

fn dims(s: &[usize]) -> String {
    format!("{s:?}")
}
