//! The operations called directly on the caller's arrays: no case file, no copy of the weight,
//! the activations or the cache. Each function describes its arguments with the GIL held
//! (dtypes, shapes, where the memory lies: [`Arg`]), checks what Python alone knows (ranks,
//! dtypes, `out`, overlaps between a written argument and the others), then releases the GIL,
//! claims the memory ([`crate::inflight`]), makes slices and calls the crate, which validates
//! everything before it writes: on any error nothing was written. Slices are made only through
//! [`crate::mem`], which holds the facts that make them sound.

use crate::array::{Arg, Desc, Float, bytes_of, float_of, indices, shape_str, type_err, value_err, zeros};
use crate::mem::{Call, Held, Pod};
use crate::packed::{Packed, PackedWeight, quantized_dims};
use crate::pools;
use paged_qkv::fast::{self, QkvBshdPackedArgs, QkvFp4PackedArgs, QkvFp8PackedArgs, QkvRaggedPackedArgs};
use paged_qkv::ops::{Freqs, QkvRope};
use paged_qkv::{
    Accumulation, BlockFormat, CacheShape, E4M3, Exec, Fp8Scales, KvScales, KvScalesMut, KvSel, KvStoreBshdArgs,
    KvStoreRaggedArgs, KvWrite, PageTable, PagedKvCacheMut, QkvBshdArgs, QkvFp4Args, QkvFp8Args, QkvRaggedArgs,
    QuantizedRef, RopeBshdArgs, RopeMath, RopeRaggedArgs, bf16, f16, reference,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Mutex;
use std::time::Instant;

/// How an operation computes (`mode=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The oracle, exact accumulation; RoPE in f32.
    Exact,
    /// The oracle, MAX's order; RoPE in MAX's rounding sequence.
    Sequential,
    /// The SIMD kernels.
    Fast,
}

impl Mode {
    fn acc(self) -> Accumulation {
        if self == Mode::Sequential { Accumulation::Sequential } else { Accumulation::Exact }
    }
}

pub fn mode_of(m: &str) -> PyResult<Mode> {
    match m {
        "exact" => Ok(Mode::Exact),
        "sequential" => Ok(Mode::Sequential),
        "fast" => Ok(Mode::Fast),
        _ => Err(PyValueError::new_err(format!("mode: expected 'exact', 'sequential' or 'fast', found {m:?}"))),
    }
}

/// `rope_math=` / the `rope` dict's `math`: `"max"` (MAX's rounding sequence in the freqs dtype,
/// MAX's RoPE bit for bit: the default) or `"f32"` (f32 math, one rounding per value).
pub fn rope_math_of(m: &str, arg: &str) -> PyResult<RopeMath> {
    match m {
        "max" => Ok(RopeMath::MaxCompat),
        "f32" => Ok(RopeMath::F32),
        _ => Err(PyValueError::new_err(format!("{arg}: expected 'max' or 'f32', found {m:?}"))),
    }
}

pub fn format_of(f: &str) -> PyResult<BlockFormat> {
    BlockFormat::from_name(f)
        .ok_or_else(|| PyValueError::new_err(format!("format: expected 'nvfp4', 'mxfp4' or 'mxfp8', found {f:?}")))
}

/// A crate error (it names the argument) as a `ValueError`.
pub fn fail(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Per-call times (seconds) of the last call made with `repeat > 1`, measured around the crate's
/// call without the GIL: what the same call costs from Rust (for `python/bench.py`).
static LAST_TIMES: Mutex<Vec<f64>> = Mutex::new(Vec::new());

/// The per-call times of the last call with `repeat > 1` (benchmark support).
#[pyfunction]
pub fn last_times() -> Vec<f64> {
    LAST_TIMES.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Releases the GIL, claims the call's memory, and runs `f` (`repeat` times, timing each) on
/// the team of `threads`, with a fresh [`Held`] per pass to make its slices.
pub fn run<'a, R: Send>(
    py: Python<'_>,
    call: &Call<'a>,
    threads: Option<usize>,
    repeat: usize,
    f: impl Fn(Exec, &Held<'_, 'a>) -> PyResult<R> + Send + Sync,
) -> PyResult<R> {
    let exec = pools::exec(threads)?;
    if repeat == 0 {
        return Err(PyValueError::new_err("repeat: must be at least 1"));
    }
    call.claimed(py, |c| {
        let mut once = || f(exec, &c.held());
        if repeat == 1 {
            return once();
        }
        let mut times = Vec::with_capacity(repeat);
        let mut last = None;
        for _ in 0..repeat {
            let t = Instant::now();
            last = Some(once()?);
            times.push(t.elapsed().as_secs_f64());
        }
        *LAST_TIMES.lock().unwrap_or_else(|e| e.into_inner()) = times;
        Ok(last.expect("repeat ≥ 1"))
    })
}

/// `kv_blocks`, `cache_lengths`, `kv_lookup_table`, `layer_idx`.
struct CacheIn<'py> {
    kv: Arg<'py>,
    kvf: Float,
    shape: CacheShape,
    lens: Arg<'py>,
    lookup: Arg<'py>,
    cols: usize,
    layer: usize,
    /// A quantized cache's `kv_scales` and its granularity (`head_size / kv_scales.shape[5]`).
    scales: Option<(Arg<'py>, usize)>,
}

impl<'py> CacheIn<'py> {
    fn new(
        kv_blocks: &Bound<'py, PyAny>,
        cache_lengths: &Bound<'py, PyAny>,
        kv_lookup_table: &Bound<'py, PyAny>,
        layer: usize,
        kv_scales: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        let kv = Arg::new(kv_blocks, "kv_blocks", true)?;
        let kvf = float_of(&kv, true)?;
        let dims = kv.rank(6, "[num_blocks, kv_dim, num_layers, page_size, num_kv_heads, head_size]")?;
        let shape = CacheShape::from_dims(dims).map_err(fail)?;
        let scales = match kv_scales {
            None => None,
            Some(obj) => Some(quantized_scales(obj, &kv, kvf, shape)?),
        };
        let lens = Arg::new(cache_lengths, "cache_lengths", false)?;
        let batch = lens.rank(1, "[batch]")?[0];
        let lookup = Arg::new(kv_lookup_table, "kv_lookup_table", false)?;
        let ls = lookup.rank(2, "[batch, pages]")?;
        if ls[0] != batch {
            return Err(value_err(
                "kv_lookup_table",
                format!("expected [batch = {batch}, pages] (batch from cache_lengths), found {}", shape_str(ls)),
            ));
        }
        let cols = ls[1];
        Ok(CacheIn { kv, kvf, shape, lens, lookup, cols, layer, scales })
    }

    fn descs(&self) -> Vec<(&Desc, bool)> {
        let mut d = vec![(self.kv.d(), true), (self.lens.d(), false), (self.lookup.d(), false)];
        if let Some((s, _)) = &self.scales {
            d.push((s.d(), true));
        }
        d
    }
}

/// `kv_scales` of a quantized cache: float32 `[num_blocks, kv_dim, num_layers, page_size,
/// num_kv_heads, head_size / g]` (the cache's first five dimensions) on a float8_e4m3fn (or uint8)
/// cache; `g`, the granularity, from its last dimension.
fn quantized_scales<'py>(
    obj: &Bound<'py, PyAny>,
    kv: &Arg<'py>,
    kvf: Float,
    shape: CacheShape,
) -> PyResult<(Arg<'py>, usize)> {
    let s = Arg::new(obj, "kv_scales", true)?;
    if kvf != Float::E4m3 {
        return Err(type_err(
            "kv_scales",
            format!("scales quantize a float8_e4m3fn (or uint8) cache; kv_blocks is {}", kv.d().dt.name()),
        ));
    }
    if float_of(s.d(), false)? != Float::F32 {
        return Err(type_err("kv_scales", format!("expected dtype float32, found {}", s.d().dt.name())));
    }
    let d = s.rank(6, "[num_blocks, kv_dim, num_layers, page_size, num_kv_heads, head_size / granularity]")?;
    let g = KvScales::granularity_of(shape, d).map_err(fail)?;
    Ok((s, g))
}

/// The cache descriptions that cross into the call.
#[derive(Clone, Copy)]
struct CacheD<'a> {
    kv: &'a Desc,
    lens: &'a Desc,
    lookup: &'a Desc,
    shape: CacheShape,
    cols: usize,
    layer: usize,
    scales: Option<(&'a Desc, usize)>,
}

impl<'a> CacheD<'a> {
    fn of(c: &'a CacheIn<'_>) -> Self {
        let scales = c.scales.as_ref().map(|(s, g)| (s.d(), *g));
        CacheD {
            kv: c.kv.d(),
            lens: c.lens.d(),
            lookup: c.lookup.d(),
            shape: c.shape,
            cols: c.cols,
            layer: c.layer,
            scales,
        }
    }
}

/// Runs `f` with the cache as a [`KvWrite`] of `C`.
fn with_kv<C: Pod + paged_qkv::Element, R>(
    c: CacheD<'_>,
    h: &Held<'_, '_>,
    f: impl FnOnce(&mut KvWrite<'_, C>) -> PyResult<R>,
) -> PyResult<R> {
    let (lens, lookup, mut kv) = (h.read(c.lens), h.read(c.lookup), h.write(c.kv));
    let (lens, lookup) = (indices(&lens)?, indices(&lookup)?);
    let view = PagedKvCacheMut::new(c.shape, kv.slice_mut::<C>()).map_err(fail)?;
    let table = PageTable::new(&lookup, c.cols, &lens).map_err(fail)?;
    let mut sm = c.scales.map(|(d, _)| h.write(d));
    let mut kv = KvWrite::new(view, table, c.layer);
    if let (Some(m), Some((_, g))) = (&mut sm, c.scales) {
        kv = kv.with_scales(KvScalesMut::new(c.shape, g, m.slice_mut::<f32>()).map_err(fail)?);
    }
    f(&mut kv)
}

macro_rules! with_cache_type {
    ($f:expr, $c:ident => $body:expr) => {
        match $f {
            Float::F32 => {
                type $c = f32;
                $body
            }
            Float::Bf16 => {
                type $c = bf16;
                $body
            }
            Float::F16 => {
                type $c = f16;
                $body
            }
            Float::E4m3 => {
                type $c = E4M3;
                $body
            }
        }
    };
}

macro_rules! with_float_type {
    ($f:expr, $t:ident => $body:expr) => {
        match $f {
            Float::F32 => {
                type $t = f32;
                $body
            }
            Float::Bf16 => {
                type $t = bf16;
                $body
            }
            Float::F16 => {
                type $t = f16;
                $body
            }
            Float::E4m3 => unreachable!("checked: not an E4M3 tensor"),
        }
    };
}

/// The returned output: the caller's `out`, or a new zeroed numpy array.
struct OutIn<'py> {
    arg: Arg<'py>,
    of: Float,
    obj: Bound<'py, PyAny>,
}

impl<'py> OutIn<'py> {
    /// `out` (checked: a bf16/f16/f32 array of `shape`, writeable, contiguous; its dtype equal to
    /// `dtype` if one was asked) or a new array of `dtype` (else `default`).
    fn new(
        py: Python<'py>,
        out: Option<&Bound<'py, PyAny>>,
        dtype: Option<&str>,
        default: Float,
        shape: &[usize],
    ) -> PyResult<Self> {
        let asked = match dtype {
            None => None,
            Some(d) => Some(Float::from_name(d).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "output_dtype: expected 'bfloat16', 'float16' or 'float32' (or 'bf16', 'f16', 'f32'), found {d:?}"
                ))
            })?),
        };
        match out {
            Some(o) => {
                let arg = Arg::new(o, "out", true)?;
                let of = float_of(&arg, false)?;
                if let Some(a) = asked
                    && a != of
                {
                    return Err(value_err("out", format!("has dtype {} but output_dtype is {}", of.name(), a.name())));
                }
                arg.expect_shape(shape)?;
                Ok(OutIn { arg, of, obj: o.clone() })
            }
            None => {
                let of = asked.unwrap_or(default);
                let a = zeros(py, of, shape)?;
                let arg = Arg::new(a.as_any(), "out", true)?;
                Ok(OutIn { arg, of, obj: a.into_any() })
            }
        }
    }
}

/// A fused RoPE (`rope={...}`), described.
struct RopeIn<'py> {
    freqs: Arg<'py>,
    ff: Float,
    rope_dim: usize,
    q_head_size: usize,
    interleaved: bool,
    ids: Option<Arg<'py>>,
    math: RopeMath,
}

/// A fused RoPE's descriptions inside the call.
#[derive(Clone, Copy)]
struct RopeD<'a> {
    freqs: &'a Desc,
    ff: Float,
    rope_dim: usize,
    q_head_size: usize,
    interleaved: bool,
    ids: Option<&'a Desc>,
    math: RopeMath,
}

impl<'py> RopeIn<'py> {
    /// `{"freqs_cis": [rows, rope_dim], "interleaved": False, "q_head_size": head, "position_ids": None,
    /// "math": "max"}`.
    fn new(d: &Bound<'py, PyAny>, head: usize, ragged: bool) -> PyResult<Self> {
        let d = d.cast::<PyDict>().map_err(|_| type_err("rope", "expected a dict with `freqs_cis`"))?;
        for k in d.keys() {
            let k: String = k.extract()?;
            if !matches!(k.as_str(), "freqs_cis" | "interleaved" | "q_head_size" | "position_ids" | "math") {
                return Err(value_err(
                    "rope",
                    format!("unknown key {k:?} (expected freqs_cis, interleaved, q_head_size, position_ids, math)"),
                ));
            }
        }
        let f = d.get_item("freqs_cis")?.ok_or_else(|| value_err("rope", "missing `freqs_cis`"))?;
        let freqs = Arg::new(&f, "freqs_cis", false)?;
        let ff = float_of(&freqs, false)?;
        let rope_dim = freqs.rank(2, "[rows, rope_dim] (freqs_cis)")?[1];
        let interleaved = match d.get_item("interleaved")? {
            Some(v) => v.extract().map_err(|_| type_err("rope.interleaved", "expected a bool"))?,
            None => false,
        };
        let q_head_size = match d.get_item("q_head_size")? {
            Some(v) => v.extract().map_err(|_| type_err("rope.q_head_size", "expected a positive int"))?,
            None => head,
        };
        let ids = match d.get_item("position_ids")? {
            Some(v) if !v.is_none() => {
                if !ragged {
                    return Err(value_err("position_ids", "the padded (BSHD) operations take no position_ids"));
                }
                let a = Arg::new(&v, "position_ids", false)?;
                a.rank(1, "[M] (position_ids)")?;
                Some(a)
            }
            _ => None,
        };
        let math = match d.get_item("math")? {
            Some(v) => {
                let m: String = v.extract().map_err(|_| type_err("rope.math", "expected 'max' or 'f32'"))?;
                rope_math_of(&m, "rope.math")?
            }
            None => RopeMath::MaxCompat,
        };
        Ok(RopeIn { freqs, ff, rope_dim, q_head_size, interleaved, ids, math })
    }

    fn d(&self) -> RopeD<'_> {
        RopeD {
            freqs: self.freqs.d(),
            ff: self.ff,
            rope_dim: self.rope_dim,
            q_head_size: self.q_head_size,
            interleaved: self.interleaved,
            ids: self.ids.as_ref().map(|a| a.d()),
            math: self.math,
        }
    }

    fn push<'a>(&'a self, v: &mut Vec<(&'a Desc, bool)>) {
        v.push((self.freqs.d(), false));
        if let Some(a) = &self.ids {
            v.push((a.d(), false));
        }
    }
}

/// Runs `f` with the fused RoPE argument (`None` without one).
fn with_rope<R>(
    r: Option<RopeD<'_>>,
    h: &Held<'_, '_>,
    f: impl FnOnce(Option<QkvRope<'_>>) -> PyResult<R>,
) -> PyResult<R> {
    let Some(r) = r else { return f(None) };
    let fm = h.read(r.freqs);
    let idm = r.ids.map(|d| h.read(d));
    let ids = idm.as_ref().map(indices).transpose()?;
    let freqs_cis = match r.ff {
        Float::F32 => Freqs::F32(fm.slice()),
        Float::Bf16 => Freqs::Bf16(fm.slice()),
        Float::F16 => Freqs::F16(fm.slice()),
        Float::E4m3 => unreachable!("float_of(_, false)"),
    };
    f(Some(
        QkvRope::new(freqs_cis, r.q_head_size, r.rope_dim, r.interleaved)
            .maybe_position_ids(ids.as_deref())
            .with_math(r.math),
    ))
}

/// `q_dim`: given, or `out`'s last dimension, or what the cache leaves of N (MHA:
/// `N − 2·kv_heads·head_size`; MLA: `N − head_size`).
fn q_dim_of(q_dim: Option<usize>, out: Option<&Bound<'_, PyAny>>, n: usize, shape: &CacheShape) -> PyResult<usize> {
    let kv_cols = if shape.is_mla() { shape.head_size() } else { 2 * shape.kv_width() };
    let from_out = match out {
        Some(o) => {
            let s: Vec<usize> = o.getattr("shape")?.extract()?;
            s.last().copied()
        }
        None => None,
    };
    match (q_dim, from_out) {
        (Some(q), Some(o)) if q != o => Err(value_err("out", format!("has {o} columns but q_dim is {q}"))),
        (Some(q), _) | (None, Some(q)) => Ok(q),
        (None, None) => n.checked_sub(kv_cols).ok_or_else(|| {
            value_err("weight", format!("has {n} rows, fewer than the cache's K/V columns ({kv_cols})"))
        }),
    }
}

/// A bf16/f16/f32 weight: the array, or a [`PackedWeight`] of the same type.
enum PlainW<'py> {
    Raw(Arg<'py>),
    Packed(Bound<'py, PackedWeight>),
}

impl<'py> PlainW<'py> {
    /// The weight (`[N, k]` of `xt`) and N.
    fn new(w: &Bound<'py, PyAny>, xt: Float, k: usize) -> PyResult<(Self, usize)> {
        if let Ok(p) = w.cast::<PackedWeight>() {
            let (n, pk, pf) = match &p.get().inner {
                Packed::F32(w) => (w.rows(), w.k(), Float::F32),
                Packed::Bf16(w) => (w.rows(), w.k(), Float::Bf16),
                Packed::F16(w) => (w.rows(), w.k(), Float::F16),
                Packed::Block(w) => {
                    return Err(type_err(
                        "weight",
                        format!("a PackedWeight of {} (use qkv_fp4_ragged)", w.format().name()),
                    ));
                }
                Packed::Fp8(_) => return Err(type_err("weight", "a PackedWeight of fp8 (use qkv_fp8_ragged)")),
            };
            if pf != xt || pk != k {
                return Err(value_err(
                    "weight",
                    format!(
                        "a PackedWeight of {} [{n}, {pk}] with hidden_state of {} and K = {k}",
                        pf.name(),
                        xt.name()
                    ),
                ));
            }
            return Ok((PlainW::Packed(p.clone()), n));
        }
        let a = Arg::new(w, "weight", false)?;
        let wt = float_of(&a, false)?;
        if wt != xt {
            return Err(type_err("weight", format!("dtype {} differs from hidden_state's {}", wt.name(), xt.name())));
        }
        let s = a.rank(2, "[N, K] (weight)")?;
        if s[1] != k {
            return Err(value_err(
                "weight",
                format!("expected [N, K = {k}] (K from hidden_state), found {}", shape_str(s)),
            ));
        }
        let n = s[0];
        Ok((PlainW::Raw(a), n))
    }
}

/// The weight inside the call.
#[derive(Clone, Copy)]
enum PlainWD<'a> {
    Raw(&'a Desc),
    Packed(&'a PackedWeight),
}

impl<'py> PlainW<'py> {
    fn d(&self) -> PlainWD<'_> {
        match self {
            PlainW::Raw(a) => PlainWD::Raw(a.d()),
            PlainW::Packed(p) => PlainWD::Packed(p.get()),
        }
    }
}

/// A packed plain weight of `T` (the caller checked the type).
trait PackedOf: paged_qkv::Element + Pod {
    fn packed(p: &PackedWeight) -> &paged_qkv::PackedPlainWeights<Self>;
}
macro_rules! packed_of {
    ($t:ty, $v:ident) => {
        impl PackedOf for $t {
            fn packed(p: &PackedWeight) -> &paged_qkv::PackedPlainWeights<$t> {
                match &p.inner {
                    Packed::$v(w) => w,
                    _ => unreachable!("PlainW::new checked the packed type"),
                }
            }
        }
    };
}
packed_of!(f32, F32);
packed_of!(bf16, Bf16);
packed_of!(f16, F16);

/// MAX's `fused_qkv_matmul_kv_cache_paged_ragged[_bias]` (see the Python docstring).
#[pyfunction]
#[pyo3(signature = (hidden_state, input_row_offsets, weight, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, *, bias=None, q_dim=None, output_dtype=None, rope=None, mode="exact", threads=None, out=None, repeat=1, kv_scales=None))]
#[allow(clippy::too_many_arguments)]
pub fn qkv_ragged<'py>(
    py: Python<'py>,
    hidden_state: &Bound<'py, PyAny>,
    input_row_offsets: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    kv_blocks: &Bound<'py, PyAny>,
    cache_lengths: &Bound<'py, PyAny>,
    kv_lookup_table: &Bound<'py, PyAny>,
    layer_idx: usize,
    bias: Option<&Bound<'py, PyAny>>,
    q_dim: Option<usize>,
    output_dtype: Option<&str>,
    rope: Option<&Bound<'py, PyAny>>,
    mode: &str,
    threads: Option<usize>,
    out: Option<&Bound<'py, PyAny>>,
    repeat: usize,
    kv_scales: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let mode = mode_of(mode)?;
    let c = CacheIn::new(kv_blocks, cache_lengths, kv_lookup_table, layer_idx, kv_scales)?;
    let x = Arg::new(hidden_state, "hidden_state", false)?;
    let xt = float_of(&x, false)?;
    let (m, k) = {
        let s = x.rank(2, "[M, K] (hidden_state)")?;
        (s[0], s[1])
    };
    let offs = Arg::new(input_row_offsets, "input_row_offsets", false)?;
    offs.rank(1, "[batch + 1] (input_row_offsets)")?;
    let (w, n) = PlainW::new(weight, xt, k)?;
    let bias = bias.filter(|b| !b.is_none()).map(|b| Arg::new(b, "bias", false)).transpose()?;
    if let Some(b) = &bias {
        let bt = float_of(b, false)?;
        if bt != xt {
            return Err(type_err("bias", format!("dtype {} differs from hidden_state's {}", bt.name(), xt.name())));
        }
        b.expect_shape(&[n])?;
    }
    let q_dim = q_dim_of(q_dim, out, n, &c.shape)?;
    let o = OutIn::new(py, out, output_dtype, xt, &[m, q_dim])?;
    let rope = rope.filter(|r| !r.is_none()).map(|r| RopeIn::new(r, c.shape.head_size(), true)).transpose()?;
    let mut descs: Vec<(&Desc, bool)> = c.descs().to_vec();
    descs.extend([(x.d(), false), (offs.d(), false), (o.arg.d(), true)]);
    if let PlainW::Raw(a) = &w {
        descs.push((a.d(), false));
    }
    if let Some(b) = &bias {
        descs.push((b.d(), false));
    }
    if let Some(r) = &rope {
        r.push(&mut descs);
    }
    let call = Call::new(descs)?;
    let (cd, xd, od, offd, wd) = (CacheD::of(&c), x.d(), o.arg.d(), offs.d(), w.d());
    let (bd, rd) = (bias.as_ref().map(|b| b.d()), rope.as_ref().map(|r| r.d()));
    let (of, kvf) = (o.of, c.kvf);
    run(py, &call, threads, repeat, |exec, h| {
        with_float_type!(xt, T => with_float_type!(of, O => with_cache_type!(kvf, C => {
            plain_ragged::<T, O, C>(h, cd, xd, offd, wd, bd, od, rd, (k, q_dim), mode, exec)
        })))
    })?;
    Ok(o.obj)
}

#[allow(clippy::too_many_arguments)]
fn plain_ragged<T: PackedOf, O: Pod + paged_qkv::Element, C: Pod + paged_qkv::Element>(
    h: &Held<'_, '_>,
    c: CacheD<'_>,
    x: &Desc,
    offs: &Desc,
    w: PlainWD<'_>,
    bias: Option<&Desc>,
    out: &Desc,
    rope: Option<RopeD<'_>>,
    (k, q_dim): (usize, usize),
    mode: Mode,
    exec: Exec,
) -> PyResult<()> {
    let (xm, mut om, offm) = (h.read(x), h.write(out), h.read(offs));
    let bm = bias.map(|b| h.read(b));
    let (xs, bs, outs) = (xm.slice::<T>(), bm.as_ref().map(|b| b.slice::<T>()), om.slice_mut::<O>());
    let offsets = indices(&offm)?;
    with_kv::<C, _>(c, h, |kv| {
        with_rope(rope, h, |rope| {
            match (w, mode) {
                (PlainWD::Packed(p), Mode::Fast) => {
                    let args =
                        QkvRaggedPackedArgs::new(xs, &offsets, T::packed(p), q_dim).maybe_bias(bs).maybe_rope(rope);
                    fast::qkv_ragged_packed(&args, outs, kv, exec)
                }
                (w, mode) => {
                    let (wm, unpacked);
                    let ws: &[T] = match w {
                        PlainWD::Raw(d) => {
                            wm = h.read(d);
                            wm.slice()
                        }
                        PlainWD::Packed(p) => {
                            unpacked = T::packed(p).to_vec();
                            &unpacked
                        }
                    };
                    let args = QkvRaggedArgs::new(xs, &offsets, ws, k, q_dim).maybe_bias(bs).maybe_rope(rope);
                    match mode {
                        Mode::Fast => fast::qkv_ragged(&args, outs, kv, exec),
                        _ => reference::qkv_ragged(&args, outs, kv, mode.acc()),
                    }
                }
            }
            .map_err(fail)
        })
    })
}

/// MAX's `fused_qkv_matmul_kv_cache_bshd_paged` (see the Python docstring).
#[pyfunction]
#[pyo3(signature = (hidden_state, weight, kv_blocks, cache_lengths, kv_lookup_table, valid_lengths, layer_idx, *, q_dim=None, output_dtype=None, rope=None, mode="exact", threads=None, out=None, repeat=1, kv_scales=None))]
#[allow(clippy::too_many_arguments)]
pub fn qkv_bshd<'py>(
    py: Python<'py>,
    hidden_state: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    kv_blocks: &Bound<'py, PyAny>,
    cache_lengths: &Bound<'py, PyAny>,
    kv_lookup_table: &Bound<'py, PyAny>,
    valid_lengths: &Bound<'py, PyAny>,
    layer_idx: usize,
    q_dim: Option<usize>,
    output_dtype: Option<&str>,
    rope: Option<&Bound<'py, PyAny>>,
    mode: &str,
    threads: Option<usize>,
    out: Option<&Bound<'py, PyAny>>,
    repeat: usize,
    kv_scales: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let mode = mode_of(mode)?;
    let c = CacheIn::new(kv_blocks, cache_lengths, kv_lookup_table, layer_idx, kv_scales)?;
    let x = Arg::new(hidden_state, "hidden_state", false)?;
    let xt = float_of(&x, false)?;
    let (b, s, k) = {
        let s = x.rank(3, "[batch, seq_len, K] (hidden_state)")?;
        (s[0], s[1], s[2])
    };
    let valid = Arg::new(valid_lengths, "valid_lengths", false)?;
    valid.rank(1, "[batch] (valid_lengths)")?;
    let (w, n) = PlainW::new(weight, xt, k)?;
    let q_dim = q_dim_of(q_dim, out, n, &c.shape)?;
    let o = OutIn::new(py, out, output_dtype, xt, &[b, s, q_dim])?;
    let rope = rope.filter(|r| !r.is_none()).map(|r| RopeIn::new(r, c.shape.head_size(), false)).transpose()?;
    let mut descs: Vec<(&Desc, bool)> = c.descs().to_vec();
    descs.extend([(x.d(), false), (valid.d(), false), (o.arg.d(), true)]);
    if let PlainW::Raw(a) = &w {
        descs.push((a.d(), false));
    }
    if let Some(r) = &rope {
        r.push(&mut descs);
    }
    let call = Call::new(descs)?;
    let (cd, xd, od, vd, wd, rd) = (CacheD::of(&c), x.d(), o.arg.d(), valid.d(), w.d(), rope.as_ref().map(|r| r.d()));
    let (of, kvf) = (o.of, c.kvf);
    run(py, &call, threads, repeat, |exec, h| {
        with_float_type!(xt, T => with_float_type!(of, O => with_cache_type!(kvf, C => {
            plain_bshd::<T, O, C>(h, cd, xd, vd, wd, od, rd, (b, s, k, q_dim), mode, exec)
        })))
    })?;
    Ok(o.obj)
}

#[allow(clippy::too_many_arguments)]
fn plain_bshd<T: PackedOf, O: Pod + paged_qkv::Element, C: Pod + paged_qkv::Element>(
    h: &Held<'_, '_>,
    c: CacheD<'_>,
    x: &Desc,
    valid: &Desc,
    w: PlainWD<'_>,
    out: &Desc,
    rope: Option<RopeD<'_>>,
    (batch, seq_len, k, q_dim): (usize, usize, usize, usize),
    mode: Mode,
    exec: Exec,
) -> PyResult<()> {
    let (xm, mut om, vm) = (h.read(x), h.write(out), h.read(valid));
    let (xs, outs) = (xm.slice::<T>(), om.slice_mut::<O>());
    let valid = indices(&vm)?;
    with_kv::<C, _>(c, h, |kv| {
        with_rope(rope, h, |rope| {
            match (w, mode) {
                (PlainWD::Packed(p), Mode::Fast) => {
                    let args =
                        QkvBshdPackedArgs::new(xs, (batch, seq_len), T::packed(p), &valid, q_dim).maybe_rope(rope);
                    fast::qkv_bshd_packed(&args, outs, kv, exec)
                }
                (w, mode) => {
                    let (wm, unpacked);
                    let ws: &[T] = match w {
                        PlainWD::Raw(d) => {
                            wm = h.read(d);
                            wm.slice()
                        }
                        PlainWD::Packed(p) => {
                            unpacked = T::packed(p).to_vec();
                            &unpacked
                        }
                    };
                    let args = QkvBshdArgs::new(xs, (batch, seq_len, k), ws, &valid, q_dim).maybe_rope(rope);
                    match mode {
                        Mode::Fast => fast::qkv_bshd(&args, outs, kv, exec),
                        _ => reference::qkv_bshd(&args, outs, kv, mode.acc()),
                    }
                }
            }
            .map_err(fail)
        })
    })
}

/// A block-scaled weight: codes and scales, or a [`PackedWeight`] of a block format.
enum BlockW<'py> {
    Raw(Box<(Arg<'py>, Arg<'py>)>),
    Packed(Bound<'py, PackedWeight>),
}

/// MAX's `fused_qkv_matmul_kv_cache_paged_ragged_scale_float4` (see the Python docstring).
#[pyfunction]
#[pyo3(signature = (hidden_state, input_scale, input_row_offsets, weight, weight_scale, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, tensor_sf, *, format=None, q_dim=None, output_dtype=None, rope=None, mode="exact", threads=None, out=None, repeat=1, kv_scales=None))]
#[allow(clippy::too_many_arguments)]
pub fn qkv_fp4_ragged<'py>(
    py: Python<'py>,
    hidden_state: &Bound<'py, PyAny>,
    input_scale: &Bound<'py, PyAny>,
    input_row_offsets: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    weight_scale: Option<&Bound<'py, PyAny>>,
    kv_blocks: &Bound<'py, PyAny>,
    cache_lengths: &Bound<'py, PyAny>,
    kv_lookup_table: &Bound<'py, PyAny>,
    layer_idx: usize,
    tensor_sf: f32,
    format: Option<&str>,
    q_dim: Option<usize>,
    output_dtype: Option<&str>,
    rope: Option<&Bound<'py, PyAny>>,
    mode: &str,
    threads: Option<usize>,
    out: Option<&Bound<'py, PyAny>>,
    repeat: usize,
    kv_scales: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let mode = mode_of(mode)?;
    let c = CacheIn::new(kv_blocks, cache_lengths, kv_lookup_table, layer_idx, kv_scales)?;
    let weight_scale = weight_scale.filter(|s| !s.is_none());
    let (w, format) = if let Ok(p) = weight.cast::<PackedWeight>() {
        let Packed::Block(pw) = &p.get().inner else {
            let op = if matches!(p.get().inner, Packed::Fp8(_)) { "qkv_fp8_ragged" } else { "qkv_ragged or qkv_bshd" };
            return Err(type_err("weight", format!("a PackedWeight of {} (use {op})", p.get().kind())));
        };
        if weight_scale.is_some() {
            return Err(value_err("weight_scale", "must be None with a PackedWeight (it holds the scales)"));
        }
        let f = match format {
            Some(f) if format_of(f)? != pw.format() => {
                return Err(value_err("format", format!("{f} given for a PackedWeight of {}", pw.format().name())));
            }
            _ => pw.format(),
        };
        (BlockW::Packed(p.clone()), f)
    } else {
        let f = format.map(format_of).transpose()?.unwrap_or(BlockFormat::Nvfp4);
        let ws = weight_scale.ok_or_else(|| value_err("weight_scale", "required with a raw weight"))?;
        (BlockW::Raw(Box::new((Arg::new(weight, "weight", false)?, Arg::new(ws, "weight_scale", false)?))), f)
    };
    let x = Arg::new(hidden_state, "hidden_state", false)?;
    let xs = Arg::new(input_scale, "input_scale", false)?;
    let (m, k) = quantized_dims(&x, &xs, format)?;
    let (n, wk) = match &w {
        BlockW::Raw(r) => quantized_dims(&r.0, &r.1, format)?,
        BlockW::Packed(p) => match &p.get().inner {
            Packed::Block(pw) => (pw.rows(), pw.k()),
            _ => unreachable!("checked above"),
        },
    };
    if wk != k {
        return Err(value_err("weight", format!("has K = {wk}, hidden_state has K = {k}")));
    }
    let offs = Arg::new(input_row_offsets, "input_row_offsets", false)?;
    offs.rank(1, "[batch + 1] (input_row_offsets)")?;
    let q_dim = q_dim_of(q_dim, out, n, &c.shape)?;
    let o = OutIn::new(py, out, output_dtype, Float::Bf16, &[m, q_dim])?;
    let rope = rope.filter(|r| !r.is_none()).map(|r| RopeIn::new(r, c.shape.head_size(), true)).transpose()?;
    let mut descs: Vec<(&Desc, bool)> = c.descs().to_vec();
    descs.extend([(x.d(), false), (xs.d(), false), (offs.d(), false), (o.arg.d(), true)]);
    if let BlockW::Raw(r) = &w {
        descs.extend([(r.0.d(), false), (r.1.d(), false)]);
    }
    if let Some(r) = &rope {
        r.push(&mut descs);
    }
    let call = Call::new(descs)?;
    let (cd, xd, xsd, od, offd, rd) =
        (CacheD::of(&c), x.d(), xs.d(), o.arg.d(), offs.d(), rope.as_ref().map(|r| r.d()));
    let wd: Result<(&Desc, &Desc), &PackedWeight> = match &w {
        BlockW::Raw(r) => Ok((r.0.d(), r.1.d())),
        BlockW::Packed(p) => Err(p.get()),
    };
    let (of, kvf) = (o.of, c.kvf);
    run(py, &call, threads, repeat, |exec, h| {
        with_float_type!(of, O => with_cache_type!(kvf, C => {
            block_ragged::<O, C>(h, cd, (xd, xsd), offd, wd, od, rd, (format, m, n, k, q_dim, tensor_sf), mode, exec)
        }))
    })?;
    Ok(o.obj)
}

#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn block_ragged<O: Pod + paged_qkv::Element, C: Pod + paged_qkv::Element>(
    h: &Held<'_, '_>,
    c: CacheD<'_>,
    (x, xs): (&Desc, &Desc),
    offs: &Desc,
    w: Result<(&Desc, &Desc), &PackedWeight>,
    out: &Desc,
    rope: Option<RopeD<'_>>,
    (format, m, n, k, q_dim, tensor_sf): (BlockFormat, usize, usize, usize, usize, f32),
    mode: Mode,
    exec: Exec,
) -> PyResult<()> {
    let (xm, xsm, mut om, offm) = (h.read(x), h.read(xs), h.write(out), h.read(offs));
    let a = QuantizedRef::new(format, m, k, xm.bytes(), xsm.bytes()).map_err(fail)?;
    let outs = om.slice_mut::<O>();
    let offsets = indices(&offm)?;
    with_kv::<C, _>(c, h, |kv| {
        with_rope(rope, h, |rope| {
            let packed = match w {
                Err(p) => match &p.inner {
                    Packed::Block(pw) => Some(pw),
                    _ => unreachable!("checked by the caller"),
                },
                Ok(_) => None,
            };
            match (packed, mode) {
                (Some(pw), Mode::Fast) => {
                    let args = QkvFp4PackedArgs::new(a, &offsets, pw, q_dim).maybe_rope(rope).with_tensor_sf(tensor_sf);
                    fast::qkv_fp4_ragged_packed(&args, outs, kv, exec)
                }
                (packed, mode) => {
                    let (wm, sm, unpacked);
                    let weight = match (packed, w) {
                        (Some(pw), _) => {
                            unpacked = pw.to_quantized();
                            unpacked.as_ref()
                        }
                        (None, Ok((wd, sd))) => {
                            (wm, sm) = (h.read(wd), h.read(sd));
                            QuantizedRef::new(format, n, k, wm.bytes(), sm.bytes()).map_err(fail)?
                        }
                        (None, Err(_)) => unreachable!("a packed weight is Some"),
                    };
                    let args = QkvFp4Args::new(a, &offsets, weight, q_dim).with_tensor_sf(tensor_sf).maybe_rope(rope);
                    match mode {
                        Mode::Fast => fast::qkv_fp4_ragged(&args, outs, kv, exec),
                        _ => reference::qkv_fp4_ragged(&args, outs, kv, mode.acc()),
                    }
                }
            }
            .map_err(fail)
        })
    })
}

/// An FP8 W8A8 weight: E4M3 codes, or a [`PackedWeight`] of format `fp8`.
enum Fp8W<'py> {
    Raw(Arg<'py>),
    Packed(Bound<'py, PackedWeight>),
}

/// MAX's `_fused_qkv_ragged_matmul_scaled_float8` (see the Python docstring).
#[pyfunction]
#[pyo3(signature = (hidden_state, input_scale, input_row_offsets, weight, weight_scale, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, *, bias=None, q_dim=None, output_dtype=None, rope=None, mode="exact", threads=None, out=None, repeat=1, kv_scales=None))]
#[allow(clippy::too_many_arguments)]
pub fn qkv_fp8_ragged<'py>(
    py: Python<'py>,
    hidden_state: &Bound<'py, PyAny>,
    input_scale: &Bound<'py, PyAny>,
    input_row_offsets: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    weight_scale: &Bound<'py, PyAny>,
    kv_blocks: &Bound<'py, PyAny>,
    cache_lengths: &Bound<'py, PyAny>,
    kv_lookup_table: &Bound<'py, PyAny>,
    layer_idx: usize,
    bias: Option<&Bound<'py, PyAny>>,
    q_dim: Option<usize>,
    output_dtype: Option<&str>,
    rope: Option<&Bound<'py, PyAny>>,
    mode: &str,
    threads: Option<usize>,
    out: Option<&Bound<'py, PyAny>>,
    repeat: usize,
    kv_scales: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let mode = mode_of(mode)?;
    let c = CacheIn::new(kv_blocks, cache_lengths, kv_lookup_table, layer_idx, kv_scales)?;
    let x = Arg::new(hidden_state, "hidden_state", false)?;
    bytes_of(&x, "E4M3 codes")?;
    let (m, k) = {
        let s = x.rank(2, "[M, K] E4M3 codes (hidden_state)")?;
        (s[0], s[1])
    };
    let (w, n, wk) = if let Ok(p) = weight.cast::<PackedWeight>() {
        let Packed::Fp8(pw) = &p.get().inner else {
            return Err(type_err("weight", format!("a PackedWeight of {} (pack with format=\"fp8\")", p.get().kind())));
        };
        let (n, wk) = (pw.rows(), pw.k());
        (Fp8W::Packed(p.clone()), n, wk)
    } else {
        let a = Arg::new(weight, "weight", false)?;
        bytes_of(&a, "E4M3 codes")?;
        let s = a.rank(2, "[N, K] E4M3 codes (weight)")?.to_vec();
        (Fp8W::Raw(a), s[0], s[1])
    };
    if wk != k {
        return Err(value_err("weight", format!("has K = {wk}, hidden_state has K = {k}")));
    }
    let (xs, ws) = (Arg::new(input_scale, "input_scale", false)?, Arg::new(weight_scale, "weight_scale", false)?);
    let (xsf, wsf) = (float_of(&xs, false)?, float_of(&ws, false)?);
    // The granularity from the shapes, as MAX infers it (checked again on the values below).
    let (ones_i, ones_w) = (vec![1f32; xs.shape.iter().product()], vec![1f32; ws.shape.iter().product()]);
    Fp8Scales::infer((&ones_i, &xs.shape), (&ones_w, &ws.shape), (m, n, k)).map_err(fail)?;
    let offs = Arg::new(input_row_offsets, "input_row_offsets", false)?;
    offs.rank(1, "[batch + 1] (input_row_offsets)")?;
    let bias = bias.filter(|b| !b.is_none()).map(|b| Arg::new(b, "bias", false)).transpose()?;
    let bt = match &bias {
        Some(b) => {
            b.expect_shape(&[n])?;
            Some(float_of(b, false)?)
        }
        None => None,
    };
    let q_dim = q_dim_of(q_dim, out, n, &c.shape)?;
    let o = OutIn::new(py, out, output_dtype, Float::Bf16, &[m, q_dim])?;
    let rope = rope.filter(|r| !r.is_none()).map(|r| RopeIn::new(r, c.shape.head_size(), true)).transpose()?;
    let mut descs: Vec<(&Desc, bool)> = c.descs().to_vec();
    descs.extend([(x.d(), false), (xs.d(), false), (ws.d(), false), (offs.d(), false), (o.arg.d(), true)]);
    if let Fp8W::Raw(a) = &w {
        descs.push((a.d(), false));
    }
    if let Some(b) = &bias {
        descs.push((b.d(), false));
    }
    if let Some(r) = &rope {
        r.push(&mut descs);
    }
    let call = Call::new(descs)?;
    let (cd, xd, od, offd, rd) = (CacheD::of(&c), x.d(), o.arg.d(), offs.d(), rope.as_ref().map(|r| r.d()));
    let sd = ((xs.d(), xsf), (ws.d(), wsf));
    let wd: Result<&Desc, &PackedWeight> = match &w {
        Fp8W::Raw(a) => Ok(a.d()),
        Fp8W::Packed(p) => Err(p.get()),
    };
    let bd = bias.as_ref().map(|b| b.d());
    let (of, kvf) = (o.of, c.kvf);
    run(py, &call, threads, repeat, |exec, h| {
        with_float_type!(bt.unwrap_or(Float::Bf16), B => with_float_type!(of, O => with_cache_type!(kvf, C => {
            fp8_ragged::<B, O, C>(h, cd, xd, sd, offd, wd, bd, od, rd, (m, n, k, q_dim), mode, exec)
        })))
    })?;
    Ok(o.obj)
}

/// A scale tensor as f32 (from f32, bf16 or f16).
fn scales_f32(h: &Held<'_, '_>, (d, f): (&Desc, Float)) -> Vec<f32> {
    let l = h.read(d);
    match f {
        Float::F32 => l.slice::<f32>().to_vec(),
        Float::Bf16 => l.slice::<bf16>().iter().map(|v| v.to_f32()).collect(),
        Float::F16 => l.slice::<f16>().iter().map(|v| v.to_f32()).collect(),
        Float::E4m3 => l.slice::<E4M3>().iter().map(|v| v.to_f32()).collect(),
    }
}

#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn fp8_ragged<B: Pod + paged_qkv::Element, O: Pod + paged_qkv::Element, C: Pod + paged_qkv::Element>(
    h: &Held<'_, '_>,
    c: CacheD<'_>,
    x: &Desc,
    (xs, ws): ((&Desc, Float), (&Desc, Float)),
    offs: &Desc,
    w: Result<&Desc, &PackedWeight>,
    bias: Option<&Desc>,
    out: &Desc,
    rope: Option<RopeD<'_>>,
    (m, n, k, q_dim): (usize, usize, usize, usize),
    mode: Mode,
    exec: Exec,
) -> PyResult<()> {
    let (xm, mut om, offm) = (h.read(x), h.write(out), h.read(offs));
    let (si, sw) = (scales_f32(h, xs), scales_f32(h, ws));
    let scales = Fp8Scales::infer((&si, &xs.0.shape), (&sw, &ws.0.shape), (m, n, k)).map_err(fail)?;
    let bm = bias.map(|b| h.read(b));
    let bs = bm.as_ref().map(|b| b.slice::<B>());
    let outs = om.slice_mut::<O>();
    let offsets = indices(&offm)?;
    with_kv::<C, _>(c, h, |kv| {
        with_rope(rope, h, |rope| {
            let packed = match w {
                Err(p) => match &p.inner {
                    Packed::Fp8(pw) => Some(pw),
                    _ => unreachable!("checked by the caller"),
                },
                Ok(_) => None,
            };
            match (packed, mode) {
                (Some(pw), Mode::Fast) => {
                    let args =
                        QkvFp8PackedArgs::new(xm.bytes(), &offsets, pw, scales, q_dim).maybe_bias(bs).maybe_rope(rope);
                    fast::qkv_fp8_ragged_packed(&args, outs, kv, exec)
                }
                (packed, mode) => {
                    let (wm, unpacked);
                    let weight: &[u8] = match (packed, w) {
                        (Some(pw), _) => {
                            unpacked = pw.to_vec();
                            &unpacked
                        }
                        (None, Ok(wd)) => {
                            wm = h.read(wd);
                            wm.bytes()
                        }
                        (None, Err(_)) => unreachable!("a packed weight is Some"),
                    };
                    let args =
                        QkvFp8Args::new(xm.bytes(), &offsets, weight, k, scales, q_dim).maybe_bias(bs).maybe_rope(rope);
                    match mode {
                        Mode::Fast => fast::qkv_fp8_ragged(&args, outs, kv, exec),
                        _ => reference::qkv_fp8_ragged(&args, outs, kv, mode.acc()),
                    }
                }
            }
            .map_err(fail)
        })
    })
}

/// MAX's `fused_qk_rope_bshd_paged` (see the Python docstring). `out` holds the result; its
/// padded rows keep their contents.
#[pyfunction]
#[pyo3(signature = (q_proj, freqs_cis, kv_blocks, cache_lengths, kv_lookup_table, valid_lengths, layer_idx, *, interleaved=true, rope_math="max", mode="exact", threads=None, out=None, repeat=1, kv_scales=None))]
#[allow(clippy::too_many_arguments)]
pub fn rope_bshd<'py>(
    py: Python<'py>,
    q_proj: &Bound<'py, PyAny>,
    freqs_cis: &Bound<'py, PyAny>,
    kv_blocks: &Bound<'py, PyAny>,
    cache_lengths: &Bound<'py, PyAny>,
    kv_lookup_table: &Bound<'py, PyAny>,
    valid_lengths: &Bound<'py, PyAny>,
    layer_idx: usize,
    interleaved: bool,
    rope_math: &str,
    mode: &str,
    threads: Option<usize>,
    out: Option<&Bound<'py, PyAny>>,
    repeat: usize,
    kv_scales: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let mode = mode_of(mode)?;
    let math = rope_math_of(rope_math, "rope_math")?;
    let c = CacheIn::new(kv_blocks, cache_lengths, kv_lookup_table, layer_idx, kv_scales)?;
    let q = Arg::new(q_proj, "q_proj", false)?;
    let qt = float_of(&q, false)?;
    let qs = q.rank(4, "[batch, seq_len, heads, head_size] (q_proj)")?.to_vec();
    let d = c.shape.head_size();
    if qs[3] != d {
        return Err(value_err(
            "q_proj",
            format!("expected head_size {d} (the cache's), found shape {}", shape_str(&qs)),
        ));
    }
    let f = Arg::new(freqs_cis, "freqs_cis", false)?;
    let ft = float_of(&f, false)?;
    if ft != qt {
        return Err(type_err(
            "freqs_cis",
            format!("dtype {} differs from q_proj's {} (MAX's padded RoPE)", ft.name(), qt.name()),
        ));
    }
    let fs = f.rank(2, "[rows, head_size] (freqs_cis)")?;
    if fs[1] != d {
        return Err(value_err(
            "freqs_cis",
            format!("expected [rows, {d}] (the cache's head size), found {}", shape_str(fs)),
        ));
    }
    let valid = Arg::new(valid_lengths, "valid_lengths", false)?;
    valid.rank(1, "[batch] (valid_lengths)")?;
    let o = OutIn::new(py, out, None, qt, &qs)?;
    if o.of != qt {
        return Err(type_err("out", format!("dtype {} differs from q_proj's {}", o.of.name(), qt.name())));
    }
    let mut descs: Vec<(&Desc, bool)> = c.descs().to_vec();
    descs.extend([(q.d(), false), (f.d(), false), (valid.d(), false), (o.arg.d(), true)]);
    let call = Call::new(descs)?;
    let (cd, qd, fd, vd, od) = (CacheD::of(&c), q.d(), f.d(), valid.d(), o.arg.d());
    let kvf = c.kvf;
    run(py, &call, threads, repeat, |exec, h| {
        with_float_type!(qt, T => with_cache_type!(kvf, C => {
            let (qm, fm, vm, mut om) = (h.read(qd), h.read(fd), h.read(vd), h.write(od));
            let (qv, fv, outs) = (qm.slice::<T>(), fm.slice::<T>(), om.slice_mut::<T>());
            let valid = indices(&vm)?;
            with_kv::<C, _>(cd, h, |kv| {
                let args = RopeBshdArgs::new(qv, (qs[0], qs[1], qs[2]), fv, &valid, interleaved);
                match mode {
                    Mode::Fast => fast::rope_bshd(&args, outs, kv, math, exec),
                    _ => reference::rope_bshd(&args, outs, kv, math),
                }
                .map_err(fail)
            })
        }))
    })?;
    Ok(o.obj)
}

/// MAX's `fused_qk_rope_ragged` (see the Python docstring).
#[pyfunction]
#[pyo3(signature = (q_proj, input_row_offsets, freqs_cis, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, *, interleaved=true, position_ids=None, rope_math="max", mode="exact", threads=None, out=None, repeat=1, kv_scales=None))]
#[allow(clippy::too_many_arguments)]
pub fn rope_ragged<'py>(
    py: Python<'py>,
    q_proj: &Bound<'py, PyAny>,
    input_row_offsets: &Bound<'py, PyAny>,
    freqs_cis: &Bound<'py, PyAny>,
    kv_blocks: &Bound<'py, PyAny>,
    cache_lengths: &Bound<'py, PyAny>,
    kv_lookup_table: &Bound<'py, PyAny>,
    layer_idx: usize,
    interleaved: bool,
    position_ids: Option<&Bound<'py, PyAny>>,
    rope_math: &str,
    mode: &str,
    threads: Option<usize>,
    out: Option<&Bound<'py, PyAny>>,
    repeat: usize,
    kv_scales: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let mode = mode_of(mode)?;
    let math = rope_math_of(rope_math, "rope_math")?;
    let c = CacheIn::new(kv_blocks, cache_lengths, kv_lookup_table, layer_idx, kv_scales)?;
    let q = Arg::new(q_proj, "q_proj", false)?;
    let qt = float_of(&q, false)?;
    let qs = q.rank(3, "[M, heads, q_head_size] (q_proj)")?.to_vec();
    let offs = Arg::new(input_row_offsets, "input_row_offsets", false)?;
    offs.rank(1, "[batch + 1] (input_row_offsets)")?;
    let f = Arg::new(freqs_cis, "freqs_cis", false)?;
    let ft = float_of(&f, false)?;
    let rope_dim = f.rank(2, "[rows, rope_dim] (freqs_cis)")?[1];
    let ids = position_ids.filter(|p| !p.is_none()).map(|p| Arg::new(p, "position_ids", false)).transpose()?;
    if let Some(i) = &ids {
        i.rank(1, "[M] (position_ids)")?;
    }
    let o = OutIn::new(py, out, None, qt, &qs)?;
    if o.of != qt {
        return Err(type_err("out", format!("dtype {} differs from q_proj's {}", o.of.name(), qt.name())));
    }
    let mut descs: Vec<(&Desc, bool)> = c.descs().to_vec();
    descs.extend([(q.d(), false), (offs.d(), false), (f.d(), false), (o.arg.d(), true)]);
    if let Some(i) = &ids {
        descs.push((i.d(), false));
    }
    let call = Call::new(descs)?;
    let (cd, qd, offd, fd, od, idd) = (CacheD::of(&c), q.d(), offs.d(), f.d(), o.arg.d(), ids.as_ref().map(|i| i.d()));
    let kvf = c.kvf;
    run(py, &call, threads, repeat, |exec, h| {
        with_float_type!(qt, T => with_float_type!(ft, F => with_cache_type!(kvf, C => {
            let (qm, fm, offm, mut om) = (h.read(qd), h.read(fd), h.read(offd), h.write(od));
            let idm = idd.map(|d| h.read(d));
            let (qv, fv, outs) = (qm.slice::<T>(), fm.slice::<F>(), om.slice_mut::<T>());
            let offsets = indices(&offm)?;
            let ids = idm.as_ref().map(indices).transpose()?;
            with_kv::<C, _>(cd, h, |kv| {
                let args = RopeRaggedArgs::new(qv, &offsets, (qs[1], qs[2]), fv, rope_dim, interleaved).maybe_position_ids(ids.as_deref());
                match mode {
                    Mode::Fast => fast::rope_ragged(&args, outs, kv, math, exec),
                    _ => reference::rope_ragged(&args, outs, kv, math),
                }
                .map_err(fail)
            })
        })))
    })?;
    Ok(o.obj)
}

fn which_of(cache: &str) -> PyResult<KvSel> {
    match cache {
        "k" | "K" => Ok(KvSel::K),
        "v" | "V" => Ok(KvSel::V),
        _ => Err(PyValueError::new_err(format!("cache: expected 'k' or 'v', found {cache:?}"))),
    }
}

/// MAX's `kv_cache_store_ragged` (see the Python docstring).
#[pyfunction]
#[pyo3(signature = (values, input_row_offsets, kv_blocks, cache_lengths, kv_lookup_table, layer_idx, *, cache="k", mode="exact", threads=None, repeat=1, kv_scales=None))]
#[allow(clippy::too_many_arguments)]
pub fn kv_store_ragged<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyAny>,
    input_row_offsets: &Bound<'py, PyAny>,
    kv_blocks: &Bound<'py, PyAny>,
    cache_lengths: &Bound<'py, PyAny>,
    kv_lookup_table: &Bound<'py, PyAny>,
    layer_idx: usize,
    cache: &str,
    mode: &str,
    threads: Option<usize>,
    repeat: usize,
    kv_scales: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    let c = CacheIn::new(kv_blocks, cache_lengths, kv_lookup_table, layer_idx, kv_scales)?;
    let rows = Arg::new(input_row_offsets, "input_row_offsets", false)?;
    kv_store(py, values, rows, c, cache, mode, threads, repeat)
}

/// MAX's `kv_cache_store_padded` (see the Python docstring).
#[pyfunction]
#[pyo3(signature = (values, kv_blocks, cache_lengths, kv_lookup_table, valid_lengths, layer_idx, *, cache="k", mode="exact", threads=None, repeat=1, kv_scales=None))]
#[allow(clippy::too_many_arguments)]
pub fn kv_store_bshd<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyAny>,
    kv_blocks: &Bound<'py, PyAny>,
    cache_lengths: &Bound<'py, PyAny>,
    kv_lookup_table: &Bound<'py, PyAny>,
    valid_lengths: &Bound<'py, PyAny>,
    layer_idx: usize,
    cache: &str,
    mode: &str,
    threads: Option<usize>,
    repeat: usize,
    kv_scales: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    let c = CacheIn::new(kv_blocks, cache_lengths, kv_lookup_table, layer_idx, kv_scales)?;
    let rows = Arg::new(valid_lengths, "valid_lengths", false)?;
    kv_store(py, values, rows, c, cache, mode, threads, repeat)
}

/// Both KV stores: `rows` is `input_row_offsets` (ragged `values [M, H, D]`) or `valid_lengths`
/// (padded `values [batch, seq_len, H, D]`), told apart by its name.
#[allow(clippy::too_many_arguments)]
fn kv_store<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyAny>,
    rows: Arg<'py>,
    c: CacheIn<'py>,
    cache: &str,
    mode: &str,
    threads: Option<usize>,
    repeat: usize,
) -> PyResult<()> {
    let mode = mode_of(mode)?;
    let which = which_of(cache)?;
    let ragged = rows.name == "input_row_offsets";
    let v = Arg::new(values, "values", false)?;
    let vt = float_of(&v, false)?;
    let vs = if ragged {
        rows.rank(1, "[batch + 1] (input_row_offsets)")?;
        v.rank(3, "[M, num_kv_heads, head_size] (values)")?.to_vec()
    } else {
        rows.rank(1, "[batch] (valid_lengths)")?;
        v.rank(4, "[batch, seq_len, num_kv_heads, head_size] (values)")?.to_vec()
    };
    let mut descs: Vec<(&Desc, bool)> = c.descs().to_vec();
    descs.extend([(v.d(), false), (rows.d(), false)]);
    let call = Call::new(descs)?;
    let (cd, vd, rd, kvf) = (CacheD::of(&c), v.d(), rows.d(), c.kvf);
    run(py, &call, threads, repeat, |exec, h| {
        with_float_type!(vt, T => with_cache_type!(kvf, C => {
            let (vm, rm) = (h.read(vd), h.read(rd));
            let values = vm.slice::<T>();
            let idx = indices(&rm)?;
            with_kv::<C, _>(cd, h, |kv| {
                if ragged {
                    let args = KvStoreRaggedArgs::new(values, &idx, which);
                    match mode {
                        Mode::Fast => fast::kv_store_ragged(&args, kv, exec),
                        _ => reference::kv_store_ragged(&args, kv),
                    }
                } else {
                    let args = KvStoreBshdArgs::new(values, (vs[0], vs[1]), &idx, which);
                    match mode {
                        Mode::Fast => fast::kv_store_bshd(&args, kv, exec),
                        _ => reference::kv_store_bshd(&args, kv),
                    }
                }
                .map_err(fail)
            })
        }))
    })
}
