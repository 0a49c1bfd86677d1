//! `PackedWeight`: a fused Q|K|V weight packed once for the fast kernels, accepted by every QKV
//! operation in place of `weight` (and `weight_scale`).

use crate::array::{Arg, Desc, Dt, Float, bytes_of, float_of, shape_str, value_err};
use crate::direct::{fail, format_of, run};
use crate::mem::Call;
use numpy::{IntoPyArray, PyArrayMethods};
use paged_qkv::formats::scale_layout::ScaleLayout;
use paged_qkv::formats::{BlockFormat, QuantizedRef};
use paged_qkv::{PackedFp8Weights, PackedPlainWeights, PackedWeights, bf16, f16};
use pyo3::prelude::*;

/// The packed data.
pub enum Packed {
    Block(PackedWeights),
    /// FP8 W8A8 (E4M3 codes; the scales come with each call).
    Fp8(PackedFp8Weights),
    F32(PackedPlainWeights<f32>),
    Bf16(PackedPlainWeights<bf16>),
    F16(PackedPlainWeights<f16>),
}

/// A fused Q|K|V weight packed once (at load time) for the fast kernels: pass it as ``weight``
/// to ``qkv_fp4_ragged`` (without ``weight_scale``), ``qkv_ragged`` or ``qkv_bshd``. It holds its
/// own copy of the weight in the kernels' layout (about the weight's bytes), so the original
/// array may be dropped. ``mode="exact"``/``"sequential"`` with a packed weight unpack it first
/// (the packing is lossless).
#[pyclass(frozen, module = "paged_qkv", name = "PackedWeight")]
pub struct PackedWeight {
    pub inner: Packed,
}

impl PackedWeight {
    pub fn kind(&self) -> &'static str {
        match &self.inner {
            Packed::Block(w) => w.format().name(),
            Packed::Fp8(_) => "fp8",
            Packed::F32(_) => "float32",
            Packed::Bf16(_) => "bfloat16",
            Packed::F16(_) => "float16",
        }
    }
    fn dims(&self) -> (usize, usize) {
        match &self.inner {
            Packed::Block(w) => (w.rows(), w.k()),
            Packed::Fp8(w) => (w.rows(), w.k()),
            Packed::F32(w) => (w.rows(), w.k()),
            Packed::Bf16(w) => (w.rows(), w.k()),
            Packed::F16(w) => (w.rows(), w.k()),
        }
    }
}

#[pymethods]
impl PackedWeight {
    /// ``"nvfp4"``, ``"mxfp4"``, ``"mxfp8"``, ``"fp8"``, ``"bfloat16"``, ``"float16"`` or ``"float32"``.
    #[getter]
    fn format(&self) -> &'static str {
        self.kind()
    }
    /// ``(N, K)``: the weight's rows (Q | K | V columns of the output) and ``hidden_size``.
    #[getter]
    fn shape(&self) -> (usize, usize) {
        self.dims()
    }
    /// Bytes held.
    #[getter]
    fn nbytes(&self) -> usize {
        match &self.inner {
            Packed::Block(w) => w.size_bytes(),
            Packed::Fp8(w) => w.size_bytes(),
            Packed::F32(w) => w.size_bytes(),
            Packed::Bf16(w) => w.size_bytes(),
            Packed::F16(w) => w.size_bytes(),
        }
    }
    /// The weight it was packed from, as new arrays: ``(codes, scales_5d)`` for a block format
    /// (uint8), ``(weight, None)`` for bf16/f16/f32 (bf16 as ``ml_dtypes.bfloat16`` or uint16).
    fn unpack<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
        let (n, k) = self.dims();
        Ok(match &self.inner {
            Packed::Block(w) => {
                let q = py.detach(|| w.to_quantized());
                let cols = q.format().row_bytes(k);
                let shape = ScaleLayout::for_operand(n, k, q.format().vector_size()).shape();
                let (data, scales, _) = q.into_parts();
                let data = data.into_pyarray(py).reshape([n, cols])?.into_any();
                (data, Some(scales.into_pyarray(py).reshape(shape)?.into_any()))
            }
            Packed::Fp8(w) => (py.detach(|| w.to_vec()).into_pyarray(py).reshape([n, k])?.into_any(), None),
            Packed::F32(w) => (py.detach(|| w.to_vec()).into_pyarray(py).reshape([n, k])?.into_any(), None),
            Packed::Bf16(w) => {
                (bits_array(py, Float::Bf16, py.detach(|| w.to_vec()).iter().map(|x| x.to_bits()), n, k)?, None)
            }
            Packed::F16(w) => {
                (bits_array(py, Float::F16, py.detach(|| w.to_vec()).iter().map(|x| x.to_bits()), n, k)?, None)
            }
        })
    }
    fn __repr__(&self) -> String {
        let (n, k) = self.dims();
        format!("PackedWeight(format={:?}, shape=({n}, {k}), nbytes={})", self.kind(), self.nbytes())
    }
}

/// A `[n, k]` array of 16-bit floats from their bits.
fn bits_array<'py>(
    py: Python<'py>,
    f: Float,
    bits: impl Iterator<Item = u16>,
    n: usize,
    k: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let a = bits.collect::<Vec<u16>>().into_pyarray(py).reshape([n, k])?;
    a.call_method1("view", (crate::array::descr_of(py, f)?,))
}

/// Rows and K of a block-scaled operand (`codes [rows, K/2]` packed E2M1 or `[rows, K]` E4M3,
/// scales in the 5-D layout or flat), with the errors named after the arguments.
pub fn quantized_dims(codes: &Desc, scales: &Desc, format: BlockFormat) -> PyResult<(usize, usize)> {
    bytes_of(codes, "codes")?;
    let s = codes.rank(2, if format.is_fp4() { "[rows, K/2] packed E2M1 codes" } else { "[rows, K] E4M3 codes" })?;
    let (rows, k) = if format.is_fp4() { (s[0], 2 * s[1]) } else { (s[0], s[1]) };
    bytes_of(scales, "block scales")?;
    let layout = ScaleLayout::for_operand(rows, k, format.vector_size());
    let want = layout.shape();
    if scales.shape != want && scales.shape != [layout.len()] {
        let msg = format!(
            "expected the 5-D shape {} (or {} bytes, flat) for {rows} rows and K = {k} ({}), found {}",
            shape_str(&want),
            layout.len(),
            format.name(),
            shape_str(&scales.shape)
        );
        return Err(value_err(scales.name, msg));
    }
    Ok((rows, k))
}

/// `pack_weight(weight, weight_scale=None, *, format=None, threads=None)`.
#[pyfunction]
#[pyo3(signature = (weight, weight_scale=None, *, format=None, threads=None))]
pub fn pack_weight(
    py: Python<'_>,
    weight: &Bound<'_, PyAny>,
    weight_scale: Option<&Bound<'_, PyAny>>,
    format: Option<&str>,
    threads: Option<usize>,
) -> PyResult<PackedWeight> {
    let w = Arg::new(weight, "weight", false)?;
    if format == Some("fp8") {
        // FP8 W8A8: the E4M3 codes alone (per-tensor, channel or block scales come with each call).
        if weight_scale.is_some_and(|s| !s.is_none()) {
            return Err(value_err(
                "weight_scale",
                "must be None for format fp8 (the scales are passed with each call)",
            ));
        }
        bytes_of(&w, "E4M3 codes")?;
        let k = w.rank(2, "a [N, K] weight of E4M3 codes")?[1];
        let call = Call::new(vec![(w.d(), false)])?;
        let d = w.d();
        let inner = run(py, &call, threads, 1, |_, h| {
            Ok(Packed::Fp8(PackedFp8Weights::new(h.read(d).bytes(), k).map_err(fail)?))
        })?;
        return Ok(PackedWeight { inner });
    }
    let Some(scale_obj) = weight_scale else {
        if let Some(f) = format
            && BlockFormat::from_name(f).is_some()
        {
            return Err(value_err("weight_scale", format!("required for format {f}")));
        }
        let fl = float_of(&w, false)?;
        if let Some(f) = format
            && Float::from_name(f) != Some(fl)
        {
            return Err(value_err("format", format!("{f} given for a {} weight", fl.name())));
        }
        let s = w.rank(2, "a [N, K] weight")?.to_vec();
        let (_n, k) = (s[0], s[1]);
        let call = Call::new(vec![(w.d(), false)])?;
        let d = w.d();
        let inner = run(py, &call, threads, 1, |_, h| {
            let m = h.read(d);
            Ok(match fl {
                Float::F32 => Packed::F32(PackedPlainWeights::new(m.slice::<f32>(), k).map_err(fail)?),
                Float::Bf16 => Packed::Bf16(PackedPlainWeights::new(m.slice::<bf16>(), k).map_err(fail)?),
                Float::F16 => Packed::F16(PackedPlainWeights::new(m.slice::<f16>(), k).map_err(fail)?),
                Float::E4m3 => unreachable!("float_of(_, false) is never E4M3"),
            })
        })?;
        return Ok(PackedWeight { inner });
    };
    let s = Arg::new(scale_obj, "weight_scale", false)?;
    let format = match format {
        Some(f) => format_of(f)?,
        None if w.dt == Dt::E4m3 => BlockFormat::Mxfp8,
        None => BlockFormat::Nvfp4,
    };
    let (n, k) = quantized_dims(&w, &s, format)?;
    let call = Call::new(vec![(w.d(), false), (s.d(), false)])?;
    let (wd, sd) = (w.d(), s.d());
    let inner = run(py, &call, threads, 1, |_, h| {
        let (wm, sm) = (h.read(wd), h.read(sd));
        let q = QuantizedRef::new(format, n, k, wm.bytes(), sm.bytes()).map_err(fail)?;
        Ok(Packed::Block(PackedWeights::new(q)))
    })?;
    Ok(PackedWeight { inner })
}
