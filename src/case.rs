//! Case files: one call of one operation in a safetensors file, named as MAX names the arguments,
//! so GPU-kernel developers can dump their kernel's inputs and outputs from Python and get a
//! trusted answer ([`Case::run`]) and a verdict ([`compare`]).
//!
//! Format (a public promise; see the README's "Check your GPU kernel"):
//! * `__metadata__`: `op` (`qkv_fp4_ragged`, `qkv_ragged`, `qkv_bshd`, `rope_bshd`, `rope_ragged`,
//!   `kv_store_ragged`, `kv_store_bshd`); `layer_idx`; for `qkv_fp4_ragged` `format` (`nvfp4`,
//!   `mxfp4`, `mxfp8`) and `tensor_sf` (decimal); for RoPE `interleaved` (`true`/`false`); for the
//!   KV stores `cache` (`k` or `v`, default `k`), the stored values being `hidden_state`.
//! * Tensors, where the op uses them: `hidden_state`, `input_row_offsets` (U32), `weight`,
//!   `input_scale`, `weight_scale` (5-D), `bias`, `kv_blocks` (rank 6), `cache_lengths` (U32),
//!   `kv_lookup_table` (U32 `[batch, cols]`), `valid_lengths` (U32), `q_proj`, `freqs_cis`,
//!   `position_ids` (U32), `output` (the pre-allocated output; its shape gives q_dim; rows the op
//!   does not write keep their contents).
//! * Dtypes: packed FP4 as U8 `[rows, K/2]` or F4 `[rows, K]`; E4M3 as F8_E4M3 or U8; E8M0 as
//!   F8_E8M0 or U8; BF16, F16, F32 (and F8_E4M3 for `kv_blocks`); U32 for indices.
//!
//! Every problem is a one-line [`CaseError`] naming the tensor, the expected and the found
//! shape or dtype; nothing panics on malformed files.

use crate::cache::{CacheShape, KvSel, KvWrite, PageTable, PagedKvCacheMut, SlotPlan};
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

/// The operations a case can describe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`reference::qkv_fp4_ragged`].
    QkvFp4Ragged,
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
    pub const ALL: [Op; 7] = [
        Op::QkvFp4Ragged,
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

/// A QKV case's RoPE tensors: the table, its width (`rope_dim`), the position ids.
type CaseRope = (OwnedFreqs, usize, Option<Vec<u32>>);

/// A decoded `freqs_cis` table.
enum OwnedFreqs {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
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

impl Case {
    /// Parses a safetensors file (no tensor is interpreted yet beyond its header).
    pub fn from_bytes(bytes: &[u8]) -> Result<Case> {
        let tensors = load_tensors(bytes)?;
        let (_, header) =
            SafeTensors::read_metadata(bytes).map_err(|e| CaseError(format!("not a valid safetensors file: {e}")))?;
        let meta: BTreeMap<String, String> = header.metadata().clone().unwrap_or_default().into_iter().collect();
        let op_name = meta.get("op").ok_or_else(|| CaseError("`__metadata__`: missing `op`".into()))?;
        let op = Op::from_name(op_name).ok_or_else(|| {
            CaseError(format!(
                "`__metadata__.op`: expected one of {}, found `{op_name}`",
                Op::ALL.map(Op::name).join(", ")
            ))
        })?;
        Ok(Case { op, meta, tensors })
    }

    /// Serialises to safetensors bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut meta = self.meta.clone();
        meta.insert("op".into(), self.op.name().into());
        save_tensors(&self.tensors, Some(meta))
    }

    /// The tensor `name`, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| CaseError(format!("`{name}`: missing tensor (op {})", self.op.name())))
    }

    fn meta_str(&self, key: &str) -> Result<&str> {
        self.meta
            .get(key)
            .map(|s| s.as_str())
            .ok_or_else(|| CaseError(format!("`__metadata__`: missing `{key}` (op {})", self.op.name())))
    }

    fn meta_parse<T: std::str::FromStr>(&self, key: &str, what: &str) -> Result<T> {
        let s = self.meta_str(key)?;
        s.trim().parse().map_err(|_| CaseError(format!("`__metadata__.{key}`: expected {what}, found `{s}`")))
    }

    fn layer(&self) -> Result<usize> {
        self.meta_parse("layer_idx", "an unsigned integer")
    }

    fn interleaved(&self) -> Result<bool> {
        self.meta_parse("interleaved", "`true` or `false`")
    }

    /// Whether [`run`](Self::run) in `mode` uses a fast path.
    pub fn runs_fast(&self, mode: Mode) -> bool {
        mode == Mode::Fast && self.op.has_fast_path()
    }

    /// The block format of a `qkv_fp4_ragged` case.
    pub fn format(&self) -> Result<BlockFormat> {
        let s = self.meta_str("format")?;
        BlockFormat::from_name(s)
            .ok_or_else(|| CaseError(format!("`__metadata__.format`: expected nvfp4, mxfp4 or mxfp8, found `{s}`")))
    }

    /// A U32 tensor of exactly `shape`, or of rank 1 (any length) when `shape` is `None`.
    fn u32s(&self, name: &str, shape: Option<&[usize]>) -> Result<Vec<u32>> {
        let t = self.tensor(name)?;
        if t.dtype != Dtype::U32 {
            return err(format!("`{name}`: expected dtype U32, found {}", t.dtype));
        }
        match shape {
            Some(s) if t.shape != s => {
                return err(format!("`{name}`: expected shape {}, found {}", dims(s), dims(&t.shape)));
            }
            None if t.shape.len() != 1 => {
                return err(format!("`{name}`: expected rank 1, found shape {}", dims(&t.shape)));
            }
            _ => {}
        }
        Ok(t.data.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// A float tensor decoded as `T`, which must be its dtype.
    fn typed<T: Element>(&self, name: &str) -> Result<Vec<T>> {
        let t = self.tensor(name)?;
        if elem_dtype(t.dtype) != Some(T::DTYPE) {
            return err(format!("`{name}`: expected dtype {}, found {}", st_dtype(T::DTYPE), t.dtype));
        }
        Ok(decode(&t.data))
    }

    /// A float tensor's dtype and shape, checked to be `rank`-dimensional (if given).
    fn float_info(&self, name: &str, rank: Option<usize>) -> Result<(DType, &[usize])> {
        let t = self.tensor(name)?;
        let d = elem_dtype(t.dtype).ok_or_else(|| {
            CaseError(format!("`{name}`: expected dtype BF16, F16, F32 or F8_E4M3, found {}", t.dtype))
        })?;
        if let Some(r) = rank
            && t.shape.len() != r
        {
            return err(format!("`{name}`: expected rank {r}, found shape {}", dims(&t.shape)));
        }
        Ok((d, &t.shape))
    }

    fn floats_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        Ok(match elem_dtype(t.dtype) {
            Some(DType::F32) => decode::<f32>(&t.data),
            Some(DType::BF16) => decode::<bf16>(&t.data).iter().map(|v| v.to_f32()).collect(),
            Some(DType::F16) => decode::<f16>(&t.data).iter().map(|v| v.to_f32()).collect(),
            Some(DType::F8E4M3) => decode::<E4M3>(&t.data).iter().map(|v| v.to_f32()).collect(),
            None => return err(format!("`{name}`: expected dtype BF16, F16 or F32, found {}", t.dtype)),
        })
    }

    fn expect_shape(&self, name: &str, want: &[usize]) -> Result<()> {
        let t = self.tensor(name)?;
        if t.shape == want {
            Ok(())
        } else {
            err(format!("`{name}`: expected shape {}, found {}", dims(want), dims(&t.shape)))
        }
    }

    fn cache_shape(&self) -> Result<(CacheShape, DType)> {
        let (d, shape) = self.float_info("kv_blocks", Some(6))?;
        let s = CacheShape::from_dims(shape).map_err(|e| CaseError(e.to_string()))?;
        Ok((s, d))
    }

    fn page_table_parts(&self) -> Result<(Vec<u32>, usize, Vec<u32>)> {
        let lens = self.u32s("cache_lengths", None)?;
        let t = self.tensor("kv_lookup_table")?;
        if t.shape.len() != 2 || t.shape[0] != lens.len() {
            return err(format!(
                "`kv_lookup_table`: expected shape [{}, cols] (batch from cache_lengths), found {}",
                lens.len(),
                dims(&t.shape)
            ));
        }
        let cols = t.shape[1];
        Ok((self.u32s("kv_lookup_table", Some(&[lens.len(), cols]))?, cols, lens))
    }

    /// A block-scaled operand: data (U8 packed, F4 or F8_E4M3) and 5-D scales (U8, F8_E4M3 or F8_E8M0).
    fn quantized(&self, data: &str, scales: &str, format: BlockFormat) -> Result<(usize, usize)> {
        let t = self.tensor(data)?;
        if t.shape.len() != 2 {
            return err(format!("`{data}`: expected rank 2, found shape {}", dims(&t.shape)));
        }
        let (rows, k) = match (format.is_fp4(), t.dtype) {
            (true, Dtype::U8) => (t.shape[0], 2 * t.shape[1]),
            (true, Dtype::F4) => (t.shape[0], t.shape[1]),
            (false, Dtype::U8 | Dtype::F8E4M3) => (t.shape[0], t.shape[1]),
            (true, d) => {
                return err(format!(
                    "`{data}`: expected dtype U8 ([rows, K/2]) or F4 for {}, found {d}",
                    format.name()
                ));
            }
            (false, d) => return err(format!("`{data}`: expected dtype F8_E4M3 or U8 for mxfp8, found {d}")),
        };
        let s = self.tensor(scales)?;
        let ok_dtype = match format {
            BlockFormat::Nvfp4 => matches!(s.dtype, Dtype::U8 | Dtype::F8E4M3),
            _ => matches!(s.dtype, Dtype::U8 | Dtype::F8E8M0),
        };
        if !ok_dtype {
            let want = if format == BlockFormat::Nvfp4 { "F8_E4M3 or U8" } else { "F8_E8M0 or U8" };
            return err(format!("`{scales}`: expected dtype {want} for {}, found {:?}", format.name(), s.dtype));
        }
        let want = ScaleLayout::for_operand(rows, k, format.vector_size()).shape();
        if s.shape != want {
            return err(format!(
                "`{scales}`: expected 5-D shape {} for {rows} rows and K = {k}, found {}",
                dims(&want),
                dims(&s.shape)
            ));
        }
        Ok((rows, k))
    }

    /// Runs the case; returns the new `output` (None for the KV stores) and `kv_blocks`.
    pub fn run(&self, mode: Mode, exec: Exec) -> Result<(Option<Tensor>, Tensor)> {
        let (shape, cdt) = self.cache_shape()?;
        let (lookup, cols, lens) = self.page_table_parts()?;
        let table = PageTable::new(&lookup, cols, &lens)?;
        let layer = self.layer()?;
        let kv_t = self.tensor("kv_blocks")?;
        let out_t = if self.op.has_output() { Some(self.tensor("output")?) } else { None };
        let odt = match out_t {
            Some(_) => self.float_info("output", None)?.0,
            None => DType::F32,
        };
        if odt == DType::F8E4M3 {
            return err("`output`: expected dtype BF16, F16 or F32, found F8_E4M3");
        }
        macro_rules! go {
            ($o:ty, $c:ty) => {{
                let mut out: Vec<$o> = out_t.map(|t| decode::<$o>(&t.data)).unwrap_or_default();
                let mut cache: Vec<$c> = decode::<$c>(&kv_t.data);
                {
                    let view = PagedKvCacheMut::new(shape, &mut cache)?;
                    let mut kv = KvWrite::new(view, table, layer);
                    self.dispatch::<$o, $c>(&mut out, &mut kv, mode, exec)?;
                }
                let o = out_t.map(|t| Tensor::from_elements(t.shape.clone(), &out));
                Ok((o, Tensor::from_elements(kv_t.shape.clone(), &cache)))
            }};
        }
        match (odt, cdt) {
            (DType::F32, DType::F32) => go!(f32, f32),
            (DType::F32, DType::BF16) => go!(f32, bf16),
            (DType::F32, DType::F16) => go!(f32, f16),
            (DType::F32, DType::F8E4M3) => go!(f32, E4M3),
            (DType::BF16, DType::F32) => go!(bf16, f32),
            (DType::BF16, DType::BF16) => go!(bf16, bf16),
            (DType::BF16, DType::F16) => go!(bf16, f16),
            (DType::BF16, DType::F8E4M3) => go!(bf16, E4M3),
            (DType::F16, DType::F32) => go!(f16, f32),
            (DType::F16, DType::BF16) => go!(f16, bf16),
            (DType::F16, DType::F16) => go!(f16, f16),
            (DType::F16, DType::F8E4M3) => go!(f16, E4M3),
            (o, _) => err(format!("`output`: unsupported dtype {}", o.name())),
        }
    }

    fn acc(mode: Mode) -> Accumulation {
        if mode == Mode::Sequential { Accumulation::Sequential } else { Accumulation::Exact }
    }

    /// The RoPE math: metadata `rope_math` (`max`: MAX's rounding sequence, the default; `f32`).
    pub fn rope_math(&self) -> Result<RopeMath> {
        match self.meta.get("rope_math").map(|s| s.as_str()) {
            None | Some("max") => Ok(RopeMath::MaxCompat),
            Some("f32") => Ok(RopeMath::F32),
            Some(other) => err(format!("`__metadata__.rope_math`: expected `max` or `f32`, found `{other}`")),
        }
    }

    fn dispatch<O: Element, C: Element>(
        &self,
        out: &mut [O],
        kv: &mut KvWrite<'_, C>,
        mode: Mode,
        exec: Exec,
    ) -> Result<()> {
        match self.op {
            Op::QkvFp4Ragged => {
                let format = self.format()?;
                let tensor_sf: f32 = self.meta_parse("tensor_sf", "a decimal number")?;
                let (m, k) = self.quantized("hidden_state", "input_scale", format)?;
                let (n, wk) = self.quantized("weight", "weight_scale", format)?;
                if k != wk {
                    return err(format!("`weight`: expected K = {k} (from hidden_state), found K = {wk}"));
                }
                let offsets = self.u32s("input_row_offsets", None)?;
                let (_, oshape) = self.float_info("output", Some(2))?;
                if oshape[0] != m {
                    return err(format!("`output`: expected shape [{m}, q_dim], found {}", dims(oshape)));
                }
                let a = QuantizedRef::new(
                    format,
                    m,
                    k,
                    &self.tensor("hidden_state")?.data,
                    &self.tensor("input_scale")?.data,
                )?;
                let w =
                    QuantizedRef::new(format, n, k, &self.tensor("weight")?.data, &self.tensor("weight_scale")?.data)?;
                let freqs = self.qkv_freqs()?;
                let args = ops::QkvFp4Args {
                    hidden_state: a,
                    input_row_offsets: &offsets,
                    weight: w,
                    tensor_sf,
                    q_dim: oshape[1],
                    rope: self.qkv_rope(&freqs, kv.cache.shape().head_size())?,
                };
                match mode {
                    Mode::Fast => fast::qkv_fp4_ragged(&args, out, kv, exec)?,
                    _ => reference::qkv_fp4_ragged(&args, out, kv, Self::acc(mode))?,
                }
            }
            Op::QkvRagged | Op::QkvBshd => {
                let (xd, _) = self.float_info("hidden_state", None)?;
                match xd {
                    DType::F32 => self.qkv_plain::<f32, O, C>(out, kv, mode, exec)?,
                    DType::BF16 => self.qkv_plain::<bf16, O, C>(out, kv, mode, exec)?,
                    DType::F16 => self.qkv_plain::<f16, O, C>(out, kv, mode, exec)?,
                    DType::F8E4M3 => self.qkv_plain::<E4M3, O, C>(out, kv, mode, exec)?,
                }
            }
            Op::RopeBshd => {
                let (qd, qs) = self.float_info("q_proj", Some(4))?;
                let (od, os) = self.float_info("output", Some(4))?;
                let (fd, fs) = self.float_info("freqs_cis", Some(2))?;
                let hd = kv.cache.shape().head_size();
                if qs[3] != hd {
                    return err(format!(
                        "`q_proj`: expected shape [batch, seq_len, heads, {hd}] (the cache's head size), found {}",
                        dims(qs)
                    ));
                }
                if fs[1] != hd {
                    return err(format!(
                        "`freqs_cis`: expected shape [rows, {hd}] (the cache's head size), found {}",
                        dims(fs)
                    ));
                }
                if od != qd || fd != qd || os != qs {
                    return err(format!(
                        "`output`/`freqs_cis`: expected the dtype and shape of q_proj ({}, {}), found output {} {}, freqs_cis {}",
                        qd.name(),
                        dims(qs),
                        od.name(),
                        dims(os),
                        fd.name()
                    ));
                }
                let valid = self.u32s("valid_lengths", Some(&[qs[0]]))?;
                let q: Vec<O> = decode(&self.tensor("q_proj")?.data);
                let f: Vec<O> = decode(&self.tensor("freqs_cis")?.data);
                let Some(freqs) = ops::Freqs::of(&f) else {
                    return err("`freqs_cis`: expected dtype BF16, F16 or F32, found F8_E4M3");
                };
                let args = ops::RopeBshdArgs::new(&q, (qs[0], qs[1], qs[2]), freqs, &valid, self.interleaved()?);
                match mode {
                    Mode::Fast => fast::rope_bshd(&args, out, kv, self.rope_math()?, exec)?,
                    _ => reference::rope_bshd(&args, out, kv, self.rope_math()?)?,
                }
            }
            Op::RopeRagged => {
                let (qd, qs) = self.float_info("q_proj", Some(3))?;
                let (od, os) = self.float_info("output", Some(3))?;
                if od != qd || os != qs {
                    return err(format!(
                        "`output`: expected {} {}, found {} {}",
                        qd.name(),
                        dims(qs),
                        od.name(),
                        dims(os)
                    ));
                }
                let (fd, fs) = self.float_info("freqs_cis", Some(2))?;
                let offsets = self.u32s("input_row_offsets", None)?;
                let ids = if self.tensors.contains_key("position_ids") {
                    Some(self.u32s("position_ids", Some(&[qs[0]]))?)
                } else {
                    None
                };
                let q: Vec<O> = decode(&self.tensor("q_proj")?.data);
                let ft = &self.tensor("freqs_cis")?.data;
                macro_rules! with_f {
                    ($f:ty) => {{
                        let f: Vec<$f> = decode(ft);
                        let args = ops::RopeRaggedArgs {
                            position_ids: ids.as_deref(),
                            ..ops::RopeRaggedArgs::new(&q, &offsets, (qs[1], qs[2]), &f, fs[1], self.interleaved()?)
                        };
                        match mode {
                            Mode::Fast => fast::rope_ragged(&args, out, kv, self.rope_math()?, exec)?,
                            _ => reference::rope_ragged(&args, out, kv, self.rope_math()?)?,
                        }
                    }};
                }
                match fd {
                    DType::F32 => with_f!(f32),
                    DType::BF16 => with_f!(bf16),
                    DType::F16 => with_f!(f16),
                    DType::F8E4M3 => return err("`freqs_cis`: expected dtype BF16, F16 or F32, found F8_E4M3"),
                }
            }
            Op::KvStoreRagged | Op::KvStoreBshd => {
                let which = match self.meta.get("cache").map(|s| s.as_str()) {
                    None | Some("k") => KvSel::K,
                    Some("v") => KvSel::V,
                    Some(s) => return err(format!("`__metadata__.cache`: expected `k` or `v`, found `{s}`")),
                };
                let values = self.floats_f32("hidden_state")?;
                let shape = kv.cache.shape();
                let (hkv, hd) = (shape.num_kv_heads(), shape.head_size());
                let rank = if self.op == Op::KvStoreRagged { 3 } else { 4 };
                let (_, xs) = self.float_info("hidden_state", Some(rank))?;
                if xs[rank - 2..] != [hkv, hd] {
                    return err(format!(
                        "`hidden_state`: expected shape [{}, {hkv}, {hd}] (the cache's heads), found {}",
                        if rank == 3 { "M" } else { "batch, seq_len" },
                        dims(xs)
                    ));
                }
                if self.op == Op::KvStoreRagged {
                    let offsets = self.u32s("input_row_offsets", None)?;
                    let args = ops::KvStoreRaggedArgs { values: &values, input_row_offsets: &offsets, which };
                    match mode {
                        Mode::Fast => fast::kv_store_ragged(&args, kv, exec)?,
                        _ => reference::kv_store_ragged(&args, kv)?,
                    }
                } else {
                    let valid = self.u32s("valid_lengths", Some(&[xs[0]]))?;
                    let args = ops::KvStoreBshdArgs {
                        values: &values,
                        batch: xs[0],
                        seq_len: xs[1],
                        valid_lengths: &valid,
                        which,
                    };
                    match mode {
                        Mode::Fast => fast::kv_store_bshd(&args, kv, exec)?,
                        _ => reference::kv_store_bshd(&args, kv)?,
                    }
                }
            }
        }
        Ok(())
    }

    /// A QKV case's optional fused RoPE table: the `freqs_cis` tensor (f32, bf16 or f16,
    /// `[rows, rope_dim]`), with `position_ids` for the ragged ops.
    fn qkv_freqs(&self) -> Result<Option<CaseRope>> {
        if !self.tensors.contains_key("freqs_cis") {
            return Ok(None);
        }
        let (fd, fs) = self.float_info("freqs_cis", Some(2))?;
        let rd = fs[1];
        let data = &self.tensor("freqs_cis")?.data;
        let f = match fd {
            DType::F32 => OwnedFreqs::F32(decode(data)),
            DType::BF16 => OwnedFreqs::Bf16(decode(data)),
            DType::F16 => OwnedFreqs::F16(decode(data)),
            DType::F8E4M3 => return err("`freqs_cis`: expected dtype BF16, F16 or F32, found F8_E4M3"),
        };
        let ids = if self.tensors.contains_key("position_ids") { Some(self.u32s("position_ids", None)?) } else { None };
        Ok(Some((f, rd, ids)))
    }

    /// The fused RoPE of a QKV case that has a `freqs_cis` tensor: metadata `interleaved`
    /// (default `false`), `q_head_size` (default: the cache's head size) and `rope_math` (as for
    /// the RoPE ops: [`rope_math`](Self::rope_math)).
    fn qkv_rope<'f>(&self, freqs: &'f Option<CaseRope>, head: usize) -> Result<Option<ops::QkvRope<'f>>> {
        let Some((f, rope_dim, ids)) = freqs else { return Ok(None) };
        let interleaved = if self.meta.contains_key("interleaved") { self.interleaved()? } else { false };
        let q_head_size = if self.meta.contains_key("q_head_size") {
            self.meta_parse("q_head_size", "an unsigned integer")?
        } else {
            head
        };
        Ok(Some(ops::QkvRope {
            freqs_cis: match f {
                OwnedFreqs::F32(v) => ops::Freqs::F32(v),
                OwnedFreqs::Bf16(v) => ops::Freqs::Bf16(v),
                OwnedFreqs::F16(v) => ops::Freqs::F16(v),
            },
            q_head_size,
            rope_dim: *rope_dim,
            interleaved,
            position_ids: ids.as_deref(),
            math: self.rope_math()?,
        }))
    }

    /// `qkv_ragged` / `qkv_bshd` with activations, weight and bias of one dtype `T` (as MAX).
    fn qkv_plain<T: Element, O: Element, C: Element>(
        &self,
        out: &mut [O],
        kv: &mut KvWrite<'_, C>,
        mode: Mode,
        exec: Exec,
    ) -> Result<()> {
        let ragged = self.op == Op::QkvRagged;
        let rank = if ragged { 2 } else { 3 };
        let (_, xs) = self.float_info("hidden_state", Some(rank))?;
        let k = xs[rank - 1];
        let x: Vec<T> = self.typed("hidden_state")?;
        let w: Vec<T> = self.typed("weight")?;
        let (_, ws) = self.float_info("weight", Some(2))?;
        if ws[1] != k {
            return err(format!("`weight`: expected shape [N, {k}], found {}", dims(ws)));
        }
        let (_, os) = self.float_info("output", Some(rank))?;
        if os[..rank - 1] != xs[..rank - 1] {
            let lead: Vec<String> = xs[..rank - 1].iter().map(|d| d.to_string()).collect();
            return err(format!("`output`: expected shape [{}, q_dim], found {}", lead.join(", "), dims(os)));
        }
        let q_dim = os[rank - 1];
        if ragged {
            let bias = if self.tensors.contains_key("bias") {
                self.expect_shape("bias", &[ws[0]])?;
                Some(self.typed::<T>("bias")?)
            } else {
                None
            };
            let offsets = self.u32s("input_row_offsets", None)?;
            let freqs = self.qkv_freqs()?;
            let args = ops::QkvRaggedArgs {
                hidden_state: &x,
                input_row_offsets: &offsets,
                weight: &w,
                hidden_size: k,
                bias: bias.as_deref(),
                q_dim,
                rope: self.qkv_rope(&freqs, kv.cache.shape().head_size())?,
            };
            match mode {
                Mode::Fast => fast::qkv_ragged(&args, out, kv, exec)?,
                _ => reference::qkv_ragged(&args, out, kv, Self::acc(mode))?,
            }
        } else {
            let valid = self.u32s("valid_lengths", Some(&[xs[0]]))?;
            let freqs = self.qkv_freqs()?;
            let args = ops::QkvBshdArgs {
                hidden_state: &x,
                batch: xs[0],
                seq_len: xs[1],
                hidden_size: k,
                weight: &w,
                valid_lengths: &valid,
                q_dim,
                rope: self.qkv_rope(&freqs, kv.cache.shape().head_size())?,
            };
            match mode {
                Mode::Fast => fast::qkv_bshd(&args, out, kv, exec)?,
                _ => reference::qkv_bshd(&args, out, kv, Self::acc(mode))?,
            }
        }
        Ok(())
    }

    /// Which elements of `output` and of `kv_blocks` the op writes and [`check`] compares, under
    /// the default policy ([`CheckOptions::default`]: the padded operations' Q rows past
    /// `valid_lengths[b]` are not compared). Meaningful for a case that [`run`](Self::run)s; on
    /// an inconsistent one it returns an error or a partial mask, never panics.
    pub fn written(&self) -> Result<(Vec<bool>, Vec<bool>)> {
        self.written_with(CheckOptions::default())
    }

    /// [`written`](Self::written) under `opts`.
    pub fn written_with(&self, opts: CheckOptions) -> Result<(Vec<bool>, Vec<bool>)> {
        let (shape, _) = self.cache_shape()?;
        let (lookup, cols, lens) = self.page_table_parts()?;
        let table = PageTable::new(&lookup, cols, &lens)?;
        let layer = self.layer()?;
        let out_len = if self.op.has_output() { self.tensor("output")?.shape.iter().product() } else { 0 };
        // The padded ops' Q rows past `valid_lengths[b]` are MAX's undefined rows (its padded RoPE
        // leaves them unwritten): compared only when asked (semantics §9).
        let padded = matches!(self.op, Op::QkvBshd | Op::RopeBshd);
        let mut out_mask = vec![!padded || opts.compare_padded_q; out_len];
        let mut cache_mask = vec![false; shape.len()];
        // Rows (b, t, writes) in the op's row order. Every count comes from a tensor whose other
        // dimensions are non-zero, so it is bounded by the bytes of the file.
        let nonzero = |name: &str, sh: &[usize], from: usize| -> Result<()> {
            if sh.len() <= from || sh[from..].contains(&0) {
                return err(format!(
                    "`{name}`: expected non-zero dimensions after the first {from}, found {}",
                    dims(sh)
                ));
            }
            Ok(())
        };
        let rows: Vec<(usize, usize, bool)> = match self.op {
            Op::QkvBshd | Op::RopeBshd | Op::KvStoreBshd => {
                let x = if self.op == Op::RopeBshd { "q_proj" } else { "hidden_state" };
                let sh = &self.tensor(x)?.shape;
                nonzero(x, sh, 2)?;
                let valid = self.u32s("valid_lengths", Some(&sh[..1]))?;
                let s = sh[1];
                valid.iter().enumerate().flat_map(|(b, &v)| (0..s).map(move |t| (b, t, t < v as usize))).collect()
            }
            _ => {
                let x = if self.op == Op::RopeRagged { "q_proj" } else { "hidden_state" };
                let sh = &self.tensor(x)?.shape;
                nonzero(x, sh, 1)?;
                let offsets = self.u32s("input_row_offsets", None)?;
                ops::ragged_rows(&offsets, sh[0])?.iter().map(|&(b, t)| (b, t, true)).collect()
            }
        };
        if matches!(self.op, Op::QkvFp4Ragged | Op::QkvRagged | Op::QkvBshd) {
            nonzero("weight", &self.tensor("weight")?.shape, 1)?;
        }
        let plan = SlotPlan::build(&table, &shape, layer, &rows)?;
        let hd = shape.head_size();
        let row_len = if out_len > 0 { out_len / rows.len().max(1) } else { 0 };
        for (r, slot) in plan.rows.iter().enumerate() {
            if padded
                && slot.is_some()
                && let Some(m) = out_mask.get_mut(r * row_len..(r + 1) * row_len)
            {
                m.iter_mut().for_each(|x| *x = true);
            }
            let Some(slot) = slot else { continue };
            // Out-of-range coordinates (an inconsistent file not yet run) are skipped, not indexed.
            let mut mark = |kv: usize, h: usize, d: usize| {
                if kv < shape.kv_dim() && h < shape.num_kv_heads() && d < hd {
                    cache_mask[shape.index(slot.block, kv, layer, slot.offset, h, d)] = true;
                }
            };
            match self.op {
                Op::QkvFp4Ragged | Op::QkvRagged | Op::QkvBshd => {
                    let n = self.weight_rows()?;
                    let q_dim = self.tensor("output")?.shape.last().copied().unwrap_or(0);
                    for j in 0..n.saturating_sub(q_dim) {
                        let (kv, h, d) = shape.kv_column(j);
                        mark(kv as usize, h, d)
                    }
                }
                Op::RopeBshd | Op::RopeRagged => {
                    let rd = if self.op == Op::RopeRagged {
                        self.tensor("freqs_cis")?.shape.get(1).copied().unwrap_or(0)
                    } else {
                        hd
                    };
                    let interleaved = self.interleaved()?;
                    for h in 0..shape.num_kv_heads() {
                        for d in 0..rd.min(hd) {
                            mark(0, h, if interleaved { (hd + d).saturating_sub(rd) } else { d });
                        }
                    }
                }
                Op::KvStoreRagged | Op::KvStoreBshd => {
                    let kv = if self.meta.get("cache").map(|s| s.as_str()) == Some("v") { 1 } else { 0 };
                    for h in 0..shape.num_kv_heads() {
                        for d in 0..hd {
                            mark(kv, h, d);
                        }
                    }
                }
            }
        }
        Ok((out_mask, cache_mask))
    }

    fn weight_rows(&self) -> Result<usize> {
        Ok(self.tensor("weight")?.shape.first().copied().unwrap_or(0))
    }

    /// Names an element of `output` for reports: `(token t, head h, dim d)` or `((b, s), head, dim)`
    /// (`#i` when the case's shapes cannot name it).
    pub fn name_output(&self, i: usize) -> String {
        let fallback = || format!("#{i}");
        let Ok(t) = self.tensor("output") else { return fallback() };
        let hd = self.cache_shape().map(|(s, _)| s.head_size()).unwrap_or(1);
        let div = |a: usize, b: usize| a.checked_div(b);
        let named = match (self.op, t.shape.as_slice()) {
            (Op::RopeBshd, &[_, s, h, d]) => h.checked_mul(d).and_then(|hd2| {
                let (bs, rest) = (div(i, hd2)?, i % hd2);
                Some(format!("((b {}, s {}), head {}, dim {})", div(bs, s)?, bs % s, div(rest, d)?, rest % d))
            }),
            (Op::RopeRagged, &[_, h, d]) => h
                .checked_mul(d)
                .and_then(|hd2| Some(format!("(token {}, head {}, dim {})", div(i, hd2)?, div(i, d)? % h, i % d))),
            (Op::QkvBshd, &[_, s, q]) => (|| {
                let (bs, c) = (div(i, q)?, i % q);
                Some(format!("((b {}, s {}), head {}, dim {})", div(bs, s)?, bs % s, c / hd, c % hd))
            })(),
            (_, &[_, q]) => div(i, q).map(|t| format!("(token {t}, head {}, dim {})", (i % q) / hd, (i % q) % hd)),
            _ => None,
        };
        named.unwrap_or_else(fallback)
    }

    /// Names an element of `kv_blocks`: `(layer, K/V, block, slot, head, dim)`.
    pub fn name_cache(&self, i: usize) -> String {
        match self.cache_shape() {
            Ok((s, _)) => {
                let [b, kv, l, sl, h, d] = s.coords(i);
                format!("(layer {l}, {}, block {b}, slot {sl}, head {h}, dim {d})", if kv == 0 { "K" } else { "V" })
            }
            Err(_) => format!("#{i}"),
        }
    }
}

/// The verdict of a kernel's results against the reference: what `paged-qkv check` prints.
#[derive(Debug, Clone)]
pub struct Report {
    /// Every compared element within tolerance and no corruption.
    pub passed: bool,
    /// The report: per tensor the elements compared, the largest errors and where, the ULP
    /// histogram, the worst positions named, corruption; then the verdict.
    pub text: String,
    /// The numbers behind it, per tensor (`output`, `kv_blocks`).
    pub tensors: Vec<(String, TensorReport)>,
}

/// What [`check_with`] compares beyond the elements every check compares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CheckOptions {
    /// Compare the padded operations' Q rows past `valid_lengths[b]` (`qkv_bshd`, `rope_bshd`),
    /// which MAX leaves undefined; by default they are not compared.
    pub compare_padded_q: bool,
}

impl CheckOptions {
    /// The default policy.
    pub fn new() -> Self {
        Self::default()
    }
    /// With [`compare_padded_q`](Self::compare_padded_q) set.
    pub fn with_compare_padded_q(self, compare_padded_q: bool) -> Self {
        CheckOptions { compare_padded_q }
    }
}

/// Checks a kernel's `actual` results (`output` unless the op has none, and `kv_blocks`) against
/// the reference run of `case` in `mode`, under the default [`CheckOptions`]. Errors: a malformed
/// case, a missing or mismatched tensor.
pub fn check(case: &Case, actual: &BTreeMap<String, Tensor>, tol: Tolerance, mode: Mode) -> Result<Report> {
    check_with(case, actual, tol, mode, CheckOptions::default())
}

/// [`check`] under `opts`.
pub fn check_with(
    case: &Case,
    actual: &BTreeMap<String, Tensor>,
    tol: Tolerance,
    mode: Mode,
    opts: CheckOptions,
) -> Result<Report> {
    use std::fmt::Write as _;
    let (ref_out, ref_kv) = case.run(mode, Exec::default())?;
    let (out_mask, kv_mask) = case.written_with(opts)?;
    let mut text = String::new();
    let mut passed = true;
    let mut tensors = Vec::new();
    let _ = writeln!(
        text,
        "paged-qkv check: op {}, reference mode {:?}, tolerance atol {} rtol {} ulps {}",
        case.op.name(),
        mode,
        tol.atol,
        tol.rtol,
        tol.ulps
    );
    if matches!(case.op, Op::QkvBshd | Op::RopeBshd) {
        let how = if opts.compare_padded_q { "compared" } else { "not compared" };
        let _ = writeln!(text, "padded Q rows (t >= valid_lengths[b]): {how}");
    }
    let missing = |name: &str| CaseError(format!("`{name}`: missing tensor in the actual results"));
    // (name, actual, reference, the mask of what the op writes, the input tensor for the rest)
    type Pair<'a> = (&'static str, &'a Tensor, Tensor, &'a [bool], Option<&'a Tensor>);
    let mut pairs: Vec<Pair<'_>> = Vec::new();
    if let Some(ro) = ref_out {
        pairs.push(("output", actual.get("output").ok_or_else(|| missing("output"))?, ro, &out_mask, None));
    }
    let got = actual.get("kv_blocks").ok_or_else(|| missing("kv_blocks"))?;
    pairs.push(("kv_blocks", got, ref_kv, &kv_mask, Some(case.tensor("kv_blocks")?)));
    for (name, got, want, mask, input) in pairs {
        let r = compare(name, got, &want, mask, input, tol)?;
        let namer = |i: usize| if name == "output" { case.name_output(i) } else { case.name_cache(i) };
        let _ = writeln!(text, "{name}: {} elements compared ({})", r.compared, got.dtype);
        let at = |(v, i): (f64, usize)| if v > 0.0 { format!("{v:.3e} at {}", namer(i)) } else { "0".into() };
        let _ = writeln!(text, "  max abs error {}", at(r.max_abs));
        let _ = writeln!(text, "  max rel error {}", at(r.max_rel));
        let mut h = String::new();
        let mut lo = 0;
        for (i, &b) in ULP_BUCKETS.iter().enumerate() {
            let label = if b == lo { format!("{b}") } else { format!("{lo}-{b}") };
            h += &format!("{label}: {}  ", r.ulp_hist[i]);
            lo = b + 1;
        }
        h += &format!(">{}: {}  NaN mismatch: {}", ULP_BUCKETS[6], r.ulp_hist[7], r.ulp_hist[8]);
        let _ = writeln!(text, "  ULP histogram  {h}");
        let _ = writeln!(text, "  outside tolerance: {}", r.failures);
        for &(i, g, w, u) in &r.worst {
            let u = if u == u64::MAX { "NaN".into() } else { u.to_string() };
            let _ = writeln!(text, "    {} actual {g:e}, reference {w:e}, {u} ulp", namer(i));
        }
        if !r.corrupted.is_empty() {
            let _ = writeln!(
                text,
                "  CORRUPTION: {} elements outside the written slots changed, e.g. {}",
                r.corrupted.len(),
                namer(r.corrupted[0])
            );
        }
        passed &= r.failures == 0 && r.corrupted.is_empty();
        tensors.push((name.to_string(), r));
    }
    let _ = write!(text, "verdict: {}", if passed { "PASS" } else { "FAIL" });
    Ok(Report { passed, text, tensors })
}

/// Comparison tolerances: an element passes when `|x − ref| ≤ atol + rtol · |ref|` **or** it is
/// within `ulps` units in the last place of its dtype (NaN matches NaN only).
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
    /// ULPs in the tensor's own dtype.
    pub ulps: u64,
}

/// ULP histogram buckets (upper bounds; the last is "more").
pub const ULP_BUCKETS: [u64; 7] = [0, 1, 2, 4, 8, 16, 256];

/// The comparison of one tensor.
#[derive(Debug, Clone, Default)]
pub struct TensorReport {
    /// Elements compared.
    pub compared: usize,
    /// Largest |x − ref| and where.
    pub max_abs: (f64, usize),
    /// Largest |x − ref| / |ref| and where.
    pub max_rel: (f64, usize),
    /// Counts per ULP bucket ([`ULP_BUCKETS`], then "more"), then NaN mismatches.
    pub ulp_hist: [usize; 9],
    /// Elements outside the tolerance.
    pub failures: usize,
    /// The worst elements: (index, got, reference, ulps).
    pub worst: Vec<(usize, f64, f64, u64)>,
    /// Elements the op does not write that differ from the case's input (`kv_blocks` only).
    pub corrupted: Vec<usize>,
}

fn ordered(bits: u32, width_bits: u32) -> i64 {
    let sign = 1u32 << (width_bits - 1);
    if bits & sign != 0 { -((bits & !sign) as i64) } else { bits as i64 }
}

fn to_f64s(t: &Tensor) -> Result<(Vec<f64>, Vec<u32>, u32)> {
    let d = elem_dtype(t.dtype).ok_or_else(|| CaseError(format!("unsupported dtype {}", t.dtype)))?;
    let (vals, bits): (Vec<f64>, Vec<u32>) = match d {
        DType::F32 => decode::<f32>(&t.data).iter().map(|v| (v.to_f32() as f64, v.to_bits())).unzip(),
        DType::BF16 => decode::<bf16>(&t.data).iter().map(|v| (v.to_f32() as f64, Element::to_bits(*v))).unzip(),
        DType::F16 => decode::<f16>(&t.data).iter().map(|v| (v.to_f32() as f64, Element::to_bits(*v))).unzip(),
        DType::F8E4M3 => decode::<E4M3>(&t.data).iter().map(|v| (v.to_f32() as f64, Element::to_bits(*v))).unzip(),
    };
    Ok((vals, bits, 8 * d.size() as u32))
}

/// Compares `got` against the reference `want` at the `mask`ed elements; elements outside the
/// mask are checked against `input` (when given) for corruption.
pub fn compare(
    name: &str,
    got: &Tensor,
    want: &Tensor,
    mask: &[bool],
    input: Option<&Tensor>,
    tol: Tolerance,
) -> Result<TensorReport> {
    if got.dtype != want.dtype || got.shape != want.shape {
        return err(format!(
            "actual `{name}`: expected {} {}, found {} {}",
            want.dtype,
            dims(&want.shape),
            got.dtype,
            dims(&got.shape)
        ));
    }
    let (g, gb, w) = to_f64s(got)?;
    let (r, rb, _) = to_f64s(want)?;
    let inp = input.map(to_f64s).transpose()?;
    let mut rep = TensorReport::default();
    let mut worst = Vec::new();
    for i in 0..g.len() {
        if !mask.get(i).copied().unwrap_or(false) {
            if let Some((_, ib, _)) = &inp
                && ib[i] != gb[i]
            {
                rep.corrupted.push(i);
            }
            continue;
        }
        rep.compared += 1;
        let (x, y) = (g[i], r[i]);
        let ulps = if x.is_nan() || y.is_nan() {
            if x.is_nan() && y.is_nan() { 0 } else { u64::MAX }
        } else {
            (ordered(gb[i], w) - ordered(rb[i], w)).unsigned_abs()
        };
        let abs = if ulps == 0 {
            0.0
        } else if ulps == u64::MAX {
            f64::INFINITY
        } else {
            (x - y).abs()
        };
        let rel = if y != 0.0 {
            abs / y.abs()
        } else if abs == 0.0 {
            0.0
        } else {
            f64::INFINITY
        };
        if abs > rep.max_abs.0 {
            rep.max_abs = (abs, i);
        }
        if rel > rep.max_rel.0 {
            rep.max_rel = (rel, i);
        }
        let bucket = if ulps == u64::MAX { 8 } else { ULP_BUCKETS.iter().position(|&b| ulps <= b).unwrap_or(7) };
        rep.ulp_hist[bucket] += 1;
        let ok = ulps != u64::MAX && (abs <= tol.atol + tol.rtol * y.abs() || ulps <= tol.ulps);
        if !ok {
            rep.failures += 1;
        }
        if ulps > 0 {
            worst.push((i, x, y, ulps));
        }
    }
    worst.sort_by(|a, b| b.3.cmp(&a.3).then(a.0.cmp(&b.0)));
    worst.truncate(10);
    rep.worst = worst;
    Ok(rep)
}

/// Runs `case` with `par` threads (Rayon) or sequentially.
pub fn exec(threads: Option<usize>) -> Exec {
    Exec { par: if threads == Some(1) { Par::Sequential } else { Par::Rayon }, isa: None }
}

/// Model shapes for [`make`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelShape {
    /// `llama3-8b`, `qwen2.5-0.5b` or `tiny`.
    pub name: &'static str,
    /// Hidden size (K).
    pub hidden: usize,
    /// Q heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head size.
    pub head: usize,
    /// Tokens per page.
    pub page: usize,
    /// RoPE θ.
    pub rope_theta: f64,
}

/// The models [`make`] knows.
pub const MODELS: [ModelShape; 3] = [
    ModelShape {
        name: "llama3-8b",
        hidden: 4096,
        q_heads: 32,
        kv_heads: 8,
        head: 128,
        page: 128,
        rope_theta: 500000.0,
    },
    ModelShape {
        name: "qwen2.5-0.5b",
        hidden: 896,
        q_heads: 14,
        kv_heads: 2,
        head: 64,
        page: 128,
        rope_theta: 1000000.0,
    },
    ModelShape { name: "tiny", hidden: 64, q_heads: 2, kv_heads: 1, head: 16, page: 4, rope_theta: 10000.0 },
];

/// A model by name.
pub fn model(name: &str) -> Option<ModelShape> {
    MODELS.into_iter().find(|m| m.name == name)
}

/// An approximately normal value (mean 0, variance 1) from four uniforms: bell-shaped enough for
/// activations and weights, and cheap.
pub fn normal(rng: &mut fastrand::Rng) -> f32 {
    (0..4).map(|_| rng.f32() - 0.5).sum::<f32>() * 1.732
}

pub use crate::ops::freqs_cis;

/// Options of [`make_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MakeOptions {
    /// Store E4M3 data and scales as `F8_E4M3` and E8M0 scales as `F8_E8M0` instead of `U8`.
    /// `U8` (the default) is what `safetensors.numpy` can load; the reader accepts both.
    pub f8_dtypes: bool,
}

/// Writes a realistic random case of `op` for `m` (see [`make_with`]), with FP8 bytes as U8.
pub fn make(op: Op, m: ModelShape, batch: usize, seed: u64, format: BlockFormat) -> Result<Case> {
    make_with(op, m, batch, seed, format, MakeOptions::default())
}

/// Writes a realistic random case of `op` for `model`: `batch` sequences of a few new tokens
/// after random cached lengths, pages scattered over a bf16 cache of 2 layers (layer 1 written),
/// with one extra block as MAX's null-block sentinel. FP4 operands are quantized with this crate's
/// quantizers in `format`.
pub fn make_with(
    op: Op,
    m: ModelShape,
    batch: usize,
    seed: u64,
    format: BlockFormat,
    opts: MakeOptions,
) -> Result<Case> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let max_new = if m.name == "tiny" { 5 } else { 4 };
    let lens: Vec<usize> = (0..batch).map(|b| if b == 2 { 0 } else { 1 + rng.usize(..max_new) }).collect();
    let cache_lengths: Vec<u32> = (0..batch).map(|_| rng.usize(..3 * m.page) as u32).collect();
    let pages: Vec<usize> = lens.iter().zip(&cache_lengths).map(|(&l, &c)| (c as usize + l).div_ceil(m.page)).collect();
    let cols = pages.iter().copied().max().unwrap_or(0) + 1;
    let num_blocks = pages.iter().sum::<usize>() + 1;
    let mut free: Vec<u32> = (0..num_blocks as u32 - 1).collect();
    for i in (1..free.len()).rev() {
        let j = rng.usize(..i + 1);
        free.swap(i, j);
    }
    let mut lookup = vec![num_blocks as u32 - 1; batch * cols];
    let mut next = 0;
    for (b, &p) in pages.iter().enumerate() {
        for j in 0..p {
            lookup[b * cols + j] = free[next];
            next += 1;
        }
    }
    let shape = CacheShape::mha(num_blocks, 2, m.page, m.kv_heads, m.head)?;
    let kv: Vec<bf16> = (0..shape.len()).map(|_| bf16::from_f32(normal(&mut rng) * 0.5)).collect();
    let mut t = BTreeMap::new();
    t.insert("kv_blocks".to_string(), Tensor::from_elements(shape.dims().to_vec(), &kv));
    t.insert("cache_lengths".into(), Tensor::from_u32(vec![batch], &cache_lengths));
    t.insert("kv_lookup_table".into(), Tensor::from_u32(vec![batch, cols], &lookup));
    let mut meta = BTreeMap::new();
    meta.insert("layer_idx".to_string(), "1".to_string());
    let total: usize = lens.iter().sum();
    let s_max = lens.iter().copied().max().unwrap_or(0);
    let (k, q_dim, n) = (m.hidden, m.q_heads * m.head, (m.q_heads + 2 * m.kv_heads) * m.head);
    let mut offsets = vec![0u32];
    for &l in &lens {
        offsets.push(offsets[offsets.len() - 1] + l as u32);
    }
    let randv =
        |rng: &mut fastrand::Rng, n: usize, scale: f32| -> Vec<f32> { (0..n).map(|_| normal(rng) * scale).collect() };
    let bf = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
    let max_pos = lens.iter().zip(&cache_lengths).map(|(&l, &c)| c as usize + l).max().unwrap_or(0);
    match op {
        Op::QkvFp4Ragged => {
            use crate::formats::quantize::{amax, nvfp4_global_scale, quantize};
            let x = randv(&mut rng, total * k, 1.0);
            let w = randv(&mut rng, n * k, 0.05);
            let a = quantize(format, &x, total, k, nvfp4_global_scale(amax(&x)))?;
            let wq = quantize(format, &w, n, k, nvfp4_global_scale(amax(&w)))?;
            let (data_dt, scale_dt) = match (opts.f8_dtypes, format) {
                (false, _) => (Dtype::U8, Dtype::U8),
                (true, BlockFormat::Nvfp4) => (Dtype::U8, Dtype::F8E4M3),
                (true, BlockFormat::Mxfp4) => (Dtype::U8, Dtype::F8E8M0),
                (true, BlockFormat::Mxfp8) => (Dtype::F8E4M3, Dtype::F8E8M0),
            };
            let cols_of = |rows: usize| vec![rows, format.row_bytes(k)];
            let lay = |rows: usize| ScaleLayout::for_operand(rows, k, format.vector_size()).shape().to_vec();
            t.insert("hidden_state".into(), Tensor::from_bytes(data_dt, cols_of(total), a.data().to_vec()));
            t.insert("input_scale".into(), Tensor::from_bytes(scale_dt, lay(total), a.scales().to_vec()));
            t.insert("weight".into(), Tensor::from_bytes(data_dt, cols_of(n), wq.data().to_vec()));
            t.insert("weight_scale".into(), Tensor::from_bytes(scale_dt, lay(n), wq.scales().to_vec()));
            t.insert("input_row_offsets".into(), Tensor::from_u32(vec![batch + 1], &offsets));
            t.insert("output".into(), Tensor::from_elements(vec![total, q_dim], &vec![bf16::ZERO; total * q_dim]));
            meta.insert("format".into(), format.name().into());
            meta.insert("tensor_sf".into(), format!("{:e}", a.tensor_scale() * wq.tensor_scale()));
        }
        Op::QkvRagged | Op::QkvBshd => {
            let w = bf(&randv(&mut rng, n * k, 1.0 / (k as f32).sqrt()));
            t.insert("weight".into(), Tensor::from_elements(vec![n, k], &w));
            if op == Op::QkvRagged {
                let x = bf(&randv(&mut rng, total * k, 1.0));
                t.insert("hidden_state".into(), Tensor::from_elements(vec![total, k], &x));
                t.insert("bias".into(), Tensor::from_elements(vec![n], &bf(&randv(&mut rng, n, 0.1))));
                t.insert("input_row_offsets".into(), Tensor::from_u32(vec![batch + 1], &offsets));
                t.insert("output".into(), Tensor::from_elements(vec![total, q_dim], &vec![bf16::ZERO; total * q_dim]));
            } else {
                let x = bf(&randv(&mut rng, batch * s_max * k, 1.0));
                t.insert("hidden_state".into(), Tensor::from_elements(vec![batch, s_max, k], &x));
                t.insert(
                    "valid_lengths".into(),
                    Tensor::from_u32(vec![batch], &lens.iter().map(|&l| l as u32).collect::<Vec<_>>()),
                );
                let z = vec![bf16::ZERO; batch * s_max * q_dim];
                t.insert("output".into(), Tensor::from_elements(vec![batch, s_max, q_dim], &z));
            }
        }
        Op::RopeBshd | Op::RopeRagged => {
            let rows = max_pos + 1;
            let f = freqs_cis(rows, m.head, m.rope_theta);
            meta.insert("interleaved".into(), (op == Op::RopeBshd).to_string());
            if op == Op::RopeBshd {
                let q = bf(&randv(&mut rng, batch * s_max * m.q_heads * m.head, 1.0));
                let sh = vec![batch, s_max, m.q_heads, m.head];
                t.insert("q_proj".into(), Tensor::from_elements(sh.clone(), &q));
                t.insert("output".into(), Tensor::from_elements(sh, &vec![bf16::ZERO; q.len()]));
                t.insert("freqs_cis".into(), Tensor::from_elements(vec![rows, m.head], &bf(&f)));
                t.insert(
                    "valid_lengths".into(),
                    Tensor::from_u32(vec![batch], &lens.iter().map(|&l| l as u32).collect::<Vec<_>>()),
                );
            } else {
                let q = bf(&randv(&mut rng, total * m.q_heads * m.head, 1.0));
                let sh = vec![total, m.q_heads, m.head];
                t.insert("q_proj".into(), Tensor::from_elements(sh.clone(), &q));
                t.insert("output".into(), Tensor::from_elements(sh, &vec![bf16::ZERO; q.len()]));
                t.insert("freqs_cis".into(), Tensor::from_elements(vec![rows, m.head], &f));
                t.insert("input_row_offsets".into(), Tensor::from_u32(vec![batch + 1], &offsets));
            }
        }
        Op::KvStoreRagged | Op::KvStoreBshd => {
            meta.insert("cache".into(), "v".into());
            if op == Op::KvStoreRagged {
                let v = bf(&randv(&mut rng, total * m.kv_heads * m.head, 1.0));
                t.insert("hidden_state".into(), Tensor::from_elements(vec![total, m.kv_heads, m.head], &v));
                t.insert("input_row_offsets".into(), Tensor::from_u32(vec![batch + 1], &offsets));
            } else {
                let v = bf(&randv(&mut rng, batch * s_max * m.kv_heads * m.head, 1.0));
                t.insert("hidden_state".into(), Tensor::from_elements(vec![batch, s_max, m.kv_heads, m.head], &v));
                t.insert(
                    "valid_lengths".into(),
                    Tensor::from_u32(vec![batch], &lens.iter().map(|&l| l as u32).collect::<Vec<_>>()),
                );
            }
        }
    }
    Ok(Case { op, meta, tensors: t })
}

/// Reads the tensors of any safetensors file (e.g. a GPU kernel's dump), without requiring `op`.
pub fn load_tensors(bytes: &[u8]) -> Result<BTreeMap<String, Tensor>> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| CaseError(format!("not a valid safetensors file: {e}")))?;
    st.iter()
        .map(|(n, v)| {
            let dtype = Dtype::from_st(v.dtype())
                .ok_or_else(|| CaseError(format!("`{n}`: unsupported dtype {:?}", v.dtype())))?;
            Ok((n.to_string(), Tensor { dtype, shape: v.shape().to_vec(), data: v.data().to_vec() }))
        })
        .collect()
}

/// Serialises named tensors (e.g. `run`'s result) with optional metadata.
pub fn save_tensors(tensors: &BTreeMap<String, Tensor>, meta: Option<BTreeMap<String, String>>) -> Result<Vec<u8>> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, t)| {
            TensorView::new(t.dtype.to_st(), t.shape.clone(), &t.data)
                .map(|v| (n.clone(), v))
                .map_err(|e| CaseError(format!("`{n}`: {e}")))
        })
        .collect::<Result<_>>()?;
    safetensors::serialize(views, meta.map(|m| m.into_iter().collect()))
        .map_err(|e| CaseError(format!("serialising: {e}")))
}
