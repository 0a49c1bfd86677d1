//! The native half of the `paged_qkv` Python package.
//!
//! * `direct`: every operation on the caller's arrays (numpy, `__dlpack__`, buffers), borrowed
//!   without a copy, `kv_blocks` written in place, the GIL released while the kernel runs;
//!   `packed`: weights packed once (`PackedWeight`).
//! * The case-file layer (this file): the same code paths as the `paged-qkv` command line, for
//!   `load_case`, `check` and `make_case`. Tensors cross as `(name, dtype, shape, uint8 array)`.
//!
//! Every error is a `TypeError` or `ValueError` naming the argument, raised before anything is
//! written.
//!
//! Unsafe code here is the bridge to Python's memory: reading numpy's and DLPack's structs
//! (`array`), and making slices of the caller's arrays, which happens only in `mem` (a safe API:
//! a call's arguments are checked not to overlap where one is written, claimed against other
//! calls while the GIL is released, and each written one handed out once).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod array;
mod direct;
mod inflight;
mod mem;
mod packed;
mod pools;

use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use paged_qkv::Isa;
use paged_qkv::case::{self, Case, Dtype, Mode, Op, Tensor, Tolerance};
use paged_qkv::formats::scale_layout::ScaleLayout;
use paged_qkv::formats::{BlockFormat, QuantizedRef, quantize as q};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::collections::BTreeMap;

/// A tensor as it crosses into Python.
type Wire<'py> = (String, String, Vec<usize>, Bound<'py, PyArray1<u8>>);
/// A tensor as it comes from Python.
type WireIn<'py> = (String, String, Vec<usize>, PyReadonlyArray1<'py, u8>);

fn err(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn tensors_in(tensors: Vec<WireIn<'_>>) -> PyResult<BTreeMap<String, Tensor>> {
    tensors
        .into_iter()
        .map(|(name, dtype, shape, data)| {
            let dtype = Dtype::from_name(&dtype).ok_or_else(|| err(format!("`{name}`: unknown dtype {dtype}")))?;
            let data = data.as_slice().map_err(|_| err(format!("`{name}`: not contiguous")))?.to_vec();
            Ok((name, Tensor { dtype, shape, data }))
        })
        .collect()
}

fn tensors_out<'py>(py: Python<'py>, t: impl IntoIterator<Item = (String, Tensor)>) -> Vec<Wire<'py>> {
    t.into_iter().map(|(name, t)| (name, t.dtype.name(), t.shape, t.data.into_pyarray(py))).collect()
}

fn case_in(op: &str, meta: BTreeMap<String, String>, tensors: Vec<WireIn<'_>>) -> PyResult<Case> {
    let op = Op::from_name(op)
        .ok_or_else(|| err(format!("op: expected one of {}, found `{op}`", Op::ALL.map(Op::name).join(", "))))?;
    Ok(Case { op, meta, tensors: tensors_in(tensors)? })
}

fn mode(m: &str) -> PyResult<Mode> {
    match m {
        "exact" => Ok(Mode::Exact),
        "sequential" => Ok(Mode::Sequential),
        "fast" => Ok(Mode::Fast),
        _ => Err(err(format!("mode: expected exact, sequential or fast, found `{m}`"))),
    }
}

fn format(f: &str) -> PyResult<BlockFormat> {
    BlockFormat::from_name(f).ok_or_else(|| err(format!("format: expected nvfp4, mxfp4 or mxfp8, found `{f}`")))
}

/// Runs a case: `[(name, dtype, shape, bytes)]` for `output` (if the op has one), `kv_blocks` and
/// (a quantized cache) `kv_scales`.
#[pyfunction]
#[pyo3(signature = (op, meta, tensors, mode_name, threads=None))]
fn run_case<'py>(
    py: Python<'py>,
    op: &str,
    meta: BTreeMap<String, String>,
    tensors: Vec<WireIn<'py>>,
    mode_name: &str,
    threads: Option<usize>,
) -> PyResult<Vec<Wire<'py>>> {
    let c = case_in(op, meta, tensors)?;
    let m = mode(mode_name)?;
    let exec = pools::exec(threads)?;
    let all = py.detach(|| c.run_all(m, exec).map_err(|e| e.to_string())).map_err(err)?;
    Ok(tensors_out(py, all))
}

/// `check`: `(passed, report text)` — the report `paged-qkv check` prints.
#[pyfunction]
#[pyo3(signature = (op, meta, tensors, actual, atol, rtol, ulps, mode_name, compare_padded_q=false))]
#[allow(clippy::too_many_arguments)]
fn check_case(
    py: Python<'_>,
    op: &str,
    meta: BTreeMap<String, String>,
    tensors: Vec<WireIn<'_>>,
    actual: Vec<WireIn<'_>>,
    atol: f64,
    rtol: f64,
    ulps: u64,
    mode_name: &str,
    compare_padded_q: bool,
) -> PyResult<(bool, String)> {
    let c = case_in(op, meta, tensors)?;
    let actual = tensors_in(actual)?;
    let m = mode(mode_name)?;
    let opts = case::CheckOptions::new().with_compare_padded_q(compare_padded_q);
    let tol = Tolerance { atol, rtol, ulps };
    let report = py.detach(|| case::check_with(&c, &actual, tol, m, opts)).map_err(err)?;
    Ok((report.passed, report.text))
}

/// A case's safetensors bytes (FP8 and scales as U8).
#[pyfunction]
fn case_to_bytes<'py>(
    py: Python<'py>,
    op: &str,
    meta: BTreeMap<String, String>,
    tensors: Vec<WireIn<'py>>,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let b = case_in(op, meta, tensors)?.to_bytes().map_err(err)?;
    Ok(pyo3::types::PyBytes::new(py, &b))
}

/// `(op, metadata, tensors)` of a case file.
#[pyfunction]
fn case_from_bytes<'py>(py: Python<'py>, data: &[u8]) -> PyResult<(String, BTreeMap<String, String>, Vec<Wire<'py>>)> {
    let c = Case::from_bytes(data).map_err(err)?;
    let mut meta = c.meta;
    meta.remove("op");
    Ok((c.op.name().into(), meta, tensors_out(py, c.tensors)))
}

/// The tensors of any safetensors file (a kernel's results).
#[pyfunction]
fn tensors_from_bytes<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Vec<Wire<'py>>> {
    Ok(tensors_out(py, case::load_tensors(data).map_err(err)?))
}

/// A random case, as `paged-qkv make-case` writes it.
#[pyfunction]
#[pyo3(signature = (op, model, batch, seed, fmt, granularity="tensor", kv_quant=None))]
#[allow(clippy::too_many_arguments)]
fn make_case<'py>(
    py: Python<'py>,
    op: &str,
    model: &str,
    batch: usize,
    seed: u64,
    fmt: &str,
    granularity: &str,
    kv_quant: Option<usize>,
) -> PyResult<(String, BTreeMap<String, String>, Vec<Wire<'py>>)> {
    let o = Op::from_name(op).ok_or_else(|| err(format!("op: unknown `{op}`")))?;
    let m = case::model(model)
        .ok_or_else(|| err(format!("model: expected llama3-8b, qwen2.5-0.5b or tiny, found `{model}`")))?;
    let g = paged_qkv::Fp8Granularity::from_name(granularity)
        .ok_or_else(|| err(format!("granularity: expected tensor, channel or block, found `{granularity}`")))?;
    let opts = case::MakeOptions::new().with_kv_quant(kv_quant);
    let c = if o == Op::QkvFp8Ragged {
        case::make_fp8(m, batch, seed, g, opts).map_err(err)?
    } else {
        case::make_with(o, m, batch, seed, format(fmt)?, opts).map_err(err)?
    };
    Ok((c.op.name().into(), c.meta, tensors_out(py, c.tensors)))
}

/// `(codes, scales, 5-D shape, tensor_scale)` of a `[rows, k]` f32 matrix.
#[pyfunction]
#[allow(clippy::type_complexity)]
#[pyo3(signature = (x, rows, k, fmt, global_scale=None))]
fn quantize<'py>(
    py: Python<'py>,
    x: PyReadonlyArray1<'py, f32>,
    rows: usize,
    k: usize,
    fmt: &str,
    global_scale: Option<f32>,
) -> PyResult<(Bound<'py, PyArray1<u8>>, Bound<'py, PyArray1<u8>>, [usize; 5], f32)> {
    let f = format(fmt)?;
    let x = x.as_slice().map_err(|_| err("`x`: not contiguous"))?;
    let g = global_scale.unwrap_or_else(|| q::nvfp4_global_scale(q::amax(x)));
    let m = py.detach(|| q::quantize(f, x, rows, k, g)).map_err(err)?;
    let shape = ScaleLayout::for_operand(rows, k, f.vector_size()).shape();
    let ts = m.tensor_scale();
    let (data, scales, _) = m.into_parts();
    Ok((data.into_pyarray(py), scales.into_pyarray(py), shape, ts))
}

/// The f32 values of quantized data.
#[pyfunction]
fn dequantize<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    scales: PyReadonlyArray1<'py, u8>,
    rows: usize,
    k: usize,
    fmt: &str,
    tensor_scale: f32,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let f = format(fmt)?;
    let (c, s) = (codes.as_slice().map_err(err)?, scales.as_slice().map_err(err)?);
    let r = QuantizedRef::new(f, rows, k, c, s).map_err(err)?;
    Ok(q::dequantize(r, tensor_scale).into_pyarray(py))
}

/// The flat offset of the scale of (row, kb) in the 5-D layout.
#[pyfunction]
fn scale_offset(row: usize, kb: usize, k_blocks: usize) -> PyResult<usize> {
    if kb >= k_blocks {
        return Err(err(format!("kb: expected < k_blocks {k_blocks}, found {kb}")));
    }
    Ok(ScaleLayout::new(row + 1, k_blocks).offset(row, kb))
}

/// A numpy array over an array-like's memory (torch CPU tensors through DLPack, bf16 included;
/// buffers): a view where the memory is contiguous, else a copy. A numpy array is returned as is.
#[pyfunction]
fn as_array<'py>(py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if obj.cast::<numpy::PyUntypedArray>().is_ok() {
        return Ok(obj.clone());
    }
    array::Arg::new(obj, "array", false)?.into_numpy(py)
}

/// The indices `i` along the first axis where `a[i]` and `b[i]` differ in any byte: a
/// memcmp of two caches (or any two arrays of one shape and dtype) without the GIL.
#[pyfunction]
fn differing_blocks(py: Python<'_>, a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let (x, y) = (array::Arg::new(a, "a", false)?, array::Arg::new(b, "b", false)?);
    if x.shape != y.shape || x.dt != y.dt {
        return Err(PyValueError::new_err(format!(
            "differing_blocks: {} {:?} against {} {:?}",
            x.dt.name(),
            x.shape,
            y.dt.name(),
            y.shape
        )));
    }
    let rows = x.shape.first().copied().unwrap_or(1).max(1);
    let call = mem::Call::new(vec![(x.d(), false), (y.d(), false)])?;
    let (xd, yd) = (x.d(), y.d());
    let out = call.claimed(py, |c| {
        let h = c.held();
        let (xm, ym) = (h.read(xd), h.read(yd));
        let (xs, ys) = (xm.bytes(), ym.bytes());
        let per = xs.len() / rows;
        (0..rows).filter(|&i| per > 0 && xs[i * per..(i + 1) * per] != ys[i * per..(i + 1) * per]).collect()
    });
    Ok(out)
}

/// The best ISA of this CPU.
#[pyfunction]
fn isa() -> &'static str {
    Isa::best().name()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run_case, m)?)?;
    m.add_function(wrap_pyfunction!(check_case, m)?)?;
    m.add_function(wrap_pyfunction!(case_to_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(case_from_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(tensors_from_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(make_case, m)?)?;
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(scale_offset, m)?)?;
    m.add_function(wrap_pyfunction!(isa, m)?)?;
    m.add_function(wrap_pyfunction!(direct::qkv_fp4_ragged, m)?)?;
    m.add_function(wrap_pyfunction!(direct::qkv_fp8_ragged, m)?)?;
    m.add_function(wrap_pyfunction!(direct::qkv_ragged, m)?)?;
    m.add_function(wrap_pyfunction!(direct::qkv_bshd, m)?)?;
    m.add_function(wrap_pyfunction!(direct::rope_bshd, m)?)?;
    m.add_function(wrap_pyfunction!(direct::rope_ragged, m)?)?;
    m.add_function(wrap_pyfunction!(direct::kv_store_ragged, m)?)?;
    m.add_function(wrap_pyfunction!(direct::kv_store_bshd, m)?)?;
    m.add_function(wrap_pyfunction!(direct::last_times, m)?)?;
    m.add_function(wrap_pyfunction!(as_array, m)?)?;
    m.add_function(wrap_pyfunction!(differing_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(packed::pack_weight, m)?)?;
    m.add_class::<packed::PackedWeight>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
