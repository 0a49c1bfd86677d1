//! Arguments from Python, borrowed where they lie: numpy arrays, any object with `__dlpack__`
//! (torch CPU tensors, `torch.bfloat16` included, without a torch dependency) and objects with
//! the buffer protocol (through `numpy.asarray`, which wraps them without a copy).
//!
//! An [`Arg`] is a C-contiguous, aligned run of elements of one [`Dt`]: the caller's memory where
//! the object is one, else (a strided or misaligned input) a private copy; an argument that is
//! written (`kv_blocks`, `out`) is never copied, and its object must be C-contiguous and writeable.
//! The object (or the DLPack capsule) is held for as long as the `Arg` lives, so the memory
//! stays valid; [`crate::inflight`] keeps concurrent calls from writing memory another call uses.

use numpy::npyffi::{self, NPY_ARRAY_WRITEABLE};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyDict};

use crate::inflight::Span;
use crate::mem::{Loaded, Pod};
use std::borrow::Cow;
use std::ffi::c_void;
use std::sync::Mutex;

/// An element type as Python spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dt {
    Bool,
    I8,
    U8,
    I16,
    U16,
    I32,
    U32,
    I64,
    U64,
    F16,
    Bf16,
    F32,
    F64,
    /// `float8_e4m3fn` (ml_dtypes, DLPack).
    E4m3,
    /// `float8_e8m0fnu` (ml_dtypes, DLPack).
    E8m0,
    /// Anything else (complex, strings, objects, other FP8 flavours), by name.
    Other(&'static str),
}

impl Dt {
    /// Bytes per element (`Other`: 0, never read).
    pub fn size(self) -> usize {
        match self {
            Dt::Bool | Dt::I8 | Dt::U8 | Dt::E4m3 | Dt::E8m0 => 1,
            Dt::I16 | Dt::U16 | Dt::F16 | Dt::Bf16 => 2,
            Dt::I32 | Dt::U32 | Dt::F32 => 4,
            Dt::I64 | Dt::U64 | Dt::F64 => 8,
            Dt::Other(_) => 0,
        }
    }

    /// numpy's name.
    pub fn name(self) -> &'static str {
        match self {
            Dt::Bool => "bool",
            Dt::I8 => "int8",
            Dt::U8 => "uint8",
            Dt::I16 => "int16",
            Dt::U16 => "uint16",
            Dt::I32 => "int32",
            Dt::U32 => "uint32",
            Dt::I64 => "int64",
            Dt::U64 => "uint64",
            Dt::F16 => "float16",
            Dt::Bf16 => "bfloat16",
            Dt::F32 => "float32",
            Dt::F64 => "float64",
            Dt::E4m3 => "float8_e4m3fn",
            Dt::E8m0 => "float8_e8m0fnu",
            Dt::Other(n) => n,
        }
    }

    fn is_int(self) -> bool {
        matches!(self, Dt::I8 | Dt::U8 | Dt::I16 | Dt::U16 | Dt::I32 | Dt::U32 | Dt::I64 | Dt::U64)
    }
}

/// One array argument, as found: its element type, shape and where its memory lies. Nothing of
/// the memory is read until a call holds its [claim](crate::inflight) on it ([`crate::mem`]).
pub struct Arg<'py> {
    /// Private, and never moved out: a `&Desc` borrowed from a live `Arg` is the proof
    /// [`crate::mem`] relies on that the memory is alive.
    d: Desc,
    /// The caller's object (a numpy array, the array `numpy.asarray` made of a buffer, or a
    /// DLPack capsule): while it lives, so does the memory.
    _keep: Option<Bound<'py, PyAny>>,
}

impl Arg<'_> {
    /// The description (borrowed: it lives only inside its `Arg`).
    pub fn d(&self) -> &Desc {
        &self.d
    }
}

impl std::ops::Deref for Arg<'_> {
    type Target = Desc;
    fn deref(&self) -> &Desc {
        &self.d
    }
}

/// An argument's description: plain numbers, so it crosses into the code that runs without the
/// GIL (the object that owns the memory stays behind, alive, in its [`Arg`]). Only an `Arg` holds
/// one (it is not `Clone`), so a `&Desc` proves the memory it describes is alive: the fact
/// [`crate::mem`] builds on.
#[derive(Debug)]
pub struct Desc {
    /// The argument's name, for messages.
    pub name: &'static str,
    pub dt: Dt,
    pub shape: Vec<usize>,
    /// The caller's memory may be written (checked true for an `Arg` made with `write`).
    pub writable: bool,
    /// First element.
    pub(crate) addr: usize,
    pub(crate) len: usize,
    /// Byte strides when the memory is not C-contiguous and aligned: [`crate::mem`] then gathers a
    /// copy (never for an argument made with `write`).
    pub(crate) strides: Option<Vec<isize>>,
}

/// An error that names the argument (`TypeError`: wrong kind of object or dtype).
pub fn type_err(name: &str, msg: impl std::fmt::Display) -> PyErr {
    PyTypeError::new_err(format!("`{name}`: {msg}"))
}

/// An error that names the argument (`ValueError`: shape, layout, values).
pub fn value_err(name: &str, msg: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("`{name}`: {msg}"))
}

pub fn shape_str(s: &[usize]) -> String {
    format!("({})", s.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

impl<'py> Arg<'py> {
    /// Describes `obj` (see the module docs). `write`: the call writes it in place, so it must be
    /// the caller's C-contiguous, aligned, writeable memory.
    pub fn new(obj: &Bound<'py, PyAny>, name: &'static str, write: bool) -> PyResult<Self> {
        if let Ok(a) = obj.cast::<PyUntypedArray>() {
            return Self::from_numpy(a, name, write);
        }
        if obj.hasattr(pyo3::intern!(obj.py(), "__dlpack__"))? {
            return Self::from_dlpack(obj, name, write);
        }
        // The buffer protocol (memoryview, bytearray, array.array) and sequences: numpy wraps
        // a buffer without a copy, and turns a list into an array (int64/float64: checked by
        // the argument's role).
        let np = numpy_module(obj.py())?;
        let a = np
            .call_method1(pyo3::intern!(obj.py(), "asarray"), (obj,))
            .map_err(|e| type_err(name, format!("expected an array, a tensor or a buffer ({e})")))?;
        let a = a.cast_into::<PyUntypedArray>().map_err(|_| type_err(name, "numpy.asarray did not give an array"))?;
        Self::from_numpy(&a, name, write)
    }

    fn from_numpy(a: &Bound<'py, PyUntypedArray>, name: &'static str, write: bool) -> PyResult<Self> {
        let descr = a.dtype();
        let dt = dt_of_descr(&descr)?;
        if descr.is_native_byteorder() == Some(false) {
            return Err(type_err(name, format!("{} in non-native byte order", dt.name())));
        }
        let shape = a.shape().to_vec();
        // SAFETY: `as_array_ptr` points to the live PyArrayObject behind `a`; two fields are read.
        let (data, flags) = unsafe {
            let p = &*a.as_array_ptr();
            (p.fields.data as usize, p.fields.flags)
        };
        let writable = flags & NPY_ARRAY_WRITEABLE != 0;
        let strides = a.strides().to_vec();
        Self::finish(name, dt, shape, data, a.is_c_contiguous(), strides, writable, write, a.as_any())
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        name: &'static str,
        dt: Dt,
        shape: Vec<usize>,
        data: usize,
        contiguous: bool,
        strides: Vec<isize>,
        writable: bool,
        write: bool,
        keep: &Bound<'py, PyAny>,
    ) -> PyResult<Self> {
        let size = dt.size();
        if let Dt::Other(n) = dt {
            return Err(type_err(name, format!("unsupported dtype {n}")));
        }
        if write && !contiguous {
            return Err(value_err(name, "must be C-contiguous: it is written in place"));
        }
        if write && !writable {
            return Err(value_err(name, "is read-only: it is written in place"));
        }
        let len =
            shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| value_err(name, "too large"))?;
        if len == 0 {
            // Nothing to read: an aligned dangling address (slices need one).
            let d = Desc { name, dt, shape, writable, addr: size, len, strides: None };
            return Ok(Arg { d, _keep: None });
        }
        let aligned = data.is_multiple_of(size);
        if write && !aligned {
            return Err(value_err(name, "is not aligned to its element size: it is written in place"));
        }
        let strides = if contiguous && aligned { None } else { Some(strides) };
        Ok(Arg { d: Desc { name, dt, shape, writable, addr: data, len, strides }, _keep: Some(keep.clone()) })
    }

    fn from_dlpack(obj: &Bound<'py, PyAny>, name: &'static str, write: bool) -> PyResult<Self> {
        let py = obj.py();
        // The device first: exporting a CUDA tensor may synchronise a stream.
        if let Ok(dev) = obj.call_method0(pyo3::intern!(py, "__dlpack_device__")) {
            let (kind, id): (i32, i32) =
                dev.extract().map_err(|_| type_err(name, "__dlpack_device__ did not return (type, id)"))?;
            if kind != DL_CPU {
                return Err(value_err(
                    name,
                    format!(
                        "is on device {}:{id}; the kernels run on the CPU (move it with .cpu())",
                        device_name(kind)
                    ),
                ));
            }
        }
        let kwargs = PyDict::new(py);
        kwargs.set_item("max_version", (1, 0))?;
        let capsule = match obj.call_method(pyo3::intern!(py, "__dlpack__"), (), Some(&kwargs)) {
            Ok(c) => c,
            // A producer of DLPack < 1.0 takes no `max_version`.
            Err(e) if e.is_instance_of::<PyTypeError>(py) => obj
                .call_method0(pyo3::intern!(py, "__dlpack__"))
                .map_err(|e| type_err(name, format!("__dlpack__ failed: {e}")))?,
            Err(e) => return Err(type_err(name, format!("__dlpack__ failed: {e}"))),
        };
        let cap = capsule.cast::<PyCapsule>().map_err(|_| type_err(name, "__dlpack__ did not return a capsule"))?;
        let cname = cap.name()?.map(|n| {
            // SAFETY: the capsule's name is a NUL-terminated string owned by the capsule, alive here.
            unsafe { n.as_cstr() }.to_owned()
        });
        let (tensor, read_only): (*const DLTensor, bool) = match cname.as_deref() {
            Some(n) if n == c"dltensor_versioned" => {
                let p = cap.pointer_checked(Some(c"dltensor_versioned"))?.as_ptr() as *const DLManagedTensorVersioned;
                // SAFETY: a capsule of this name holds a DLManagedTensorVersioned (DLPack ≥ 1.0),
                // alive until the capsule's destructor runs (the Arg holds the capsule).
                let m = unsafe { &*p };
                if m.version.major != 1 {
                    let v = format!("DLPack {}.{} (this reads 1.x)", m.version.major, m.version.minor);
                    return Err(type_err(name, v));
                }
                (&m.dl_tensor, m.flags & DLPACK_FLAG_READ_ONLY != 0)
            }
            Some(n) if n == c"dltensor" => {
                let p = cap.pointer_checked(Some(c"dltensor"))?.as_ptr() as *const DLManagedTensor;
                // SAFETY: a capsule named "dltensor" holds a DLManagedTensor, alive while the Arg
                // holds the unconsumed capsule (whose destructor calls the deleter).
                (unsafe { &raw const (*p).dl_tensor }, false)
            }
            other => return Err(type_err(name, format!("__dlpack__ returned a capsule named {other:?}"))),
        };
        // SAFETY: `tensor` points into the live managed tensor (above).
        let t = unsafe { &*tensor };
        if t.device.device_type != DL_CPU {
            return Err(value_err(
                name,
                format!("is on device {}; the kernels run on the CPU", device_name(t.device.device_type)),
            ));
        }
        if t.dtype.lanes != 1 {
            return Err(type_err(name, format!("vector dtype with {} lanes", t.dtype.lanes)));
        }
        let dt = dt_of_dlpack(t.dtype.code, t.dtype.bits);
        let ndim = usize::try_from(t.ndim).map_err(|_| type_err(name, "negative ndim"))?;
        // SAFETY: DLPack's shape (and strides, when not null) hold `ndim` int64 values that
        // live as long as the managed tensor.
        let dims = if ndim == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(t.shape, ndim) } };
        let shape: Vec<usize> = dims
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<_, _>>()
            .map_err(|_| type_err(name, "negative dimension"))?;
        let size = dt.size() as isize;
        let strides: Vec<isize> = if t.strides.is_null() || ndim == 0 {
            c_strides(&shape, size)
        } else {
            // SAFETY: as `shape` above.
            unsafe { std::slice::from_raw_parts(t.strides, ndim) }.iter().map(|&s| s as isize * size).collect()
        };
        let contiguous = is_c_contiguous(&shape, &strides, size);
        let data = (t.data as usize).wrapping_add(t.byte_offset as usize);
        Self::finish(name, dt, shape, data, contiguous, strides, !read_only, write, cap.as_any())
    }
}

impl<'py> Arg<'py> {
    /// A numpy array of the same memory (a view that keeps the source alive; bf16 and FP8 as
    /// ml_dtypes types where installed, else their bits as uint16 / uint8), or of a copy where
    /// the source is strided.
    pub fn into_numpy(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let descr = match self.dt {
            Dt::F32 => descr_of(py, Float::F32)?,
            Dt::F16 => descr_of(py, Float::F16)?,
            Dt::Bf16 => descr_of(py, Float::Bf16)?,
            Dt::E4m3 => descr_of(py, Float::E4m3)?,
            d => numpy_module(py)?.getattr("dtype")?.call1((d.name(),))?.cast_into::<numpy::PyArrayDescr>()?,
        };
        let mut dims: Vec<npyffi::npy_intp> = self.shape.iter().map(|&d| d as npyffi::npy_intp).collect();
        let (Some(keep), None) = (&self._keep, &self.strides) else {
            // Empty, or strided: a fresh array, filled from the source under a claim.
            let a = zeros_descr(py, descr, &self.shape)?;
            let dst = Arg::new(a.as_any(), "copy", true)?;
            let call = crate::mem::Call::new(vec![(&self.d, false), (&dst.d, true)])?;
            call.claimed(py, |c| {
                let h = c.held();
                let (from, mut to) = (h.read(&self.d), h.write(&dst.d));
                to.bytes_mut().copy_from_slice(from.bytes());
            });
            return Ok(a.into_any());
        };
        let flags = npyffi::NPY_ARRAY_C_CONTIGUOUS
            | npyffi::NPY_ARRAY_ALIGNED
            | if self.writable { NPY_ARRAY_WRITEABLE } else { 0 };
        // SAFETY: a new array over `len` elements of `descr` at `addr` (the source's live, C
        // contiguous, aligned memory), whose base is set to the object that owns that memory
        // (SetBaseObject steals the new reference), so the memory outlives the array.
        unsafe {
            let api = &npyffi::PY_ARRAY_API;
            let ptr = api.PyArray_NewFromDescr(
                py,
                npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
                descr.into_dtype_ptr(),
                dims.len() as std::os::raw::c_int,
                dims.as_mut_ptr(),
                std::ptr::null_mut(),
                self.addr as *mut c_void,
                flags,
                std::ptr::null_mut(),
            );
            let arr = Bound::from_owned_ptr_or_err(py, ptr)?;
            if api.PyArray_SetBaseObject(py, ptr as *mut npyffi::PyArrayObject, keep.clone().into_ptr()) != 0 {
                return Err(PyErr::fetch(py));
            }
            Ok(arr)
        }
    }
}

impl Desc {
    /// The bytes the call touches, `[start, end)` (empty for an empty argument): for a strided
    /// argument, from its lowest to its highest element.
    pub fn span(&self, write: bool) -> Span {
        let size = self.dt.size();
        let (mut lo, mut hi) = (self.addr as isize, self.addr as isize + size as isize);
        if self.len == 0 {
            return Span { start: 0, end: 0, write };
        }
        match &self.strides {
            None => hi = self.addr as isize + (self.len * size) as isize,
            Some(st) => {
                for (&n, &s) in self.shape.iter().zip(st) {
                    let reach = (n as isize - 1) * s;
                    if reach < 0 { lo += reach } else { hi += reach }
                }
            }
        }
        Span { start: lo as usize, end: hi as usize, write }
    }

    /// Checks the rank.
    pub fn rank(&self, r: usize, what: &str) -> PyResult<&[usize]> {
        if self.shape.len() != r {
            return Err(value_err(self.name, format!("expected {what}, found shape {}", shape_str(&self.shape))));
        }
        Ok(&self.shape)
    }

    /// Checks the exact shape.
    pub fn expect_shape(&self, want: &[usize]) -> PyResult<()> {
        if self.shape != want {
            return Err(value_err(
                self.name,
                format!("expected shape {}, found {}", shape_str(want), shape_str(&self.shape)),
            ));
        }
        Ok(())
    }
}

/// A float tensor's element type, as the kernels take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Float {
    F32,
    Bf16,
    F16,
    E4m3,
}

impl Float {
    /// The Python name of this type.
    pub fn name(self) -> &'static str {
        match self {
            Float::F32 => "float32",
            Float::Bf16 => "bfloat16",
            Float::F16 => "float16",
            Float::E4m3 => "float8_e4m3fn",
        }
    }
    /// Parses `output_dtype` (`bf16`, `bfloat16`, `f16`, `float16`, `f32`, `float32`).
    pub fn from_name(s: &str) -> Option<Float> {
        match s {
            "bf16" | "bfloat16" => Some(Float::Bf16),
            "f16" | "float16" | "half" => Some(Float::F16),
            "f32" | "float32" | "float" => Some(Float::F32),
            _ => None,
        }
    }
}

/// The float type of a bf16/f16/f32 argument (16-bit integers are bf16 bits, as documented).
/// `fp8`: an 8-bit array is E4M3 (a KV cache); else it is an error.
pub fn float_of(a: &Desc, fp8: bool) -> PyResult<Float> {
    Ok(match a.dt {
        Dt::F32 => Float::F32,
        Dt::F16 => Float::F16,
        Dt::Bf16 | Dt::I16 | Dt::U16 => Float::Bf16,
        Dt::E4m3 | Dt::U8 | Dt::I8 if fp8 => Float::E4m3,
        d => {
            let want = if fp8 {
                "float32, float16, bfloat16 (or 16-bit integer bits) or float8_e4m3fn (or uint8 bits)"
            } else {
                "float32, float16 or bfloat16 (or its bits as int16/uint16)"
            };
            return Err(type_err(a.name, format!("expected dtype {want}, found {}", d.name())));
        }
    })
}

/// Bytes: an array of uint8 / int8 / FP8 codes or scales (the element type is only a view).
pub fn bytes_of(a: &Desc, what: &str) -> PyResult<()> {
    match a.dt {
        Dt::U8 | Dt::I8 | Dt::E4m3 | Dt::E8m0 => Ok(()),
        d => Err(type_err(a.name, format!("expected {what} as uint8 (or an 8-bit view), found dtype {}", d.name()))),
    }
}

/// An index array as `u32`: uint32 borrowed; int32 borrowed once no value is negative; every
/// other integer type converted after checking that each value fits in `[0, 2³²)`.
pub fn indices<'l>(a: &'l Loaded<'_>) -> PyResult<Cow<'l, [u32]>> {
    let bad = |v: i128| value_err(a.name, format!("index {v} does not fit uint32 (0 ≤ value < 2³²)"));
    fn conv<T: Pod + Into<i128>>(s: &[T], bad: impl Fn(i128) -> PyErr) -> PyResult<Cow<'static, [u32]>> {
        let mut out = Vec::with_capacity(s.len());
        for &v in s {
            let v: i128 = v.into();
            out.push(u32::try_from(v).map_err(|_| bad(v))?);
        }
        Ok(Cow::Owned(out))
    }
    match a.dt {
        Dt::U32 => Ok(Cow::Borrowed(a.slice::<u32>())),
        Dt::I32 => {
            if let Some(&v) = a.slice::<i32>().iter().find(|&&v| v < 0) {
                return Err(bad(v as i128));
            }
            // Non-negative i32 and u32 share their bits.
            Ok(Cow::Borrowed(a.slice::<u32>()))
        }
        Dt::I8 => conv(a.slice::<i8>(), bad),
        Dt::U8 => conv(a.slice::<u8>(), bad),
        Dt::I16 => conv(a.slice::<i16>(), bad),
        Dt::U16 => conv(a.slice::<u16>(), bad),
        Dt::I64 => conv(a.slice::<i64>(), bad),
        Dt::U64 => conv(a.slice::<u64>(), bad),
        d => {
            debug_assert!(!d.is_int());
            Err(type_err(a.name, format!("expected an integer dtype (indices), found {}", d.name())))
        }
    }
}

fn numpy_module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static NP: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    Ok(NP.get_or_try_init(py, || py.import("numpy").map(Bound::unbind))?.bind(py))
}

/// numpy's user-defined dtypes (ml_dtypes) by type number, once named.
static USER_DTYPES: Mutex<Vec<(i32, Dt)>> = Mutex::new(Vec::new());

fn dt_of_descr(d: &Bound<'_, numpy::PyArrayDescr>) -> PyResult<Dt> {
    let size = d.itemsize();
    Ok(match (d.kind(), size) {
        (b'b', 1) => Dt::Bool,
        (b'i', 1) => Dt::I8,
        (b'i', 2) => Dt::I16,
        (b'i', 4) => Dt::I32,
        (b'i', 8) => Dt::I64,
        (b'u', 1) => Dt::U8,
        (b'u', 2) => Dt::U16,
        (b'u', 4) => Dt::U32,
        (b'u', 8) => Dt::U64,
        (b'f', 2) => Dt::F16,
        (b'f', 4) => Dt::F32,
        (b'f', 8) => Dt::F64,
        (b'V', _) if !d.has_fields() && !d.has_subarray() => {
            let num = d.num();
            if let Some(&(_, dt)) = USER_DTYPES.lock().unwrap().iter().find(|(n, _)| *n == num) {
                return Ok(dt);
            }
            let name: String = d.typeobj().name()?.extract()?;
            let dt = match name.as_str() {
                "bfloat16" => Dt::Bf16,
                "float8_e4m3fn" => Dt::E4m3,
                "float8_e8m0fnu" => Dt::E8m0,
                _ => Dt::Other(leak_name(name)),
            };
            USER_DTYPES.lock().unwrap().push((num, dt));
            dt
        }
        (b'c', _) => Dt::Other("complex"),
        (b'O', _) => Dt::Other("object"),
        (b'U' | b'S', _) => Dt::Other("str"),
        (b'f', _) => Dt::Other("longdouble"),
        _ => Dt::Other("structured or unknown"),
    })
}

/// A dtype name kept for the process (user dtypes are few and registered once).
fn leak_name(name: String) -> &'static str {
    static NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut names = NAMES.lock().unwrap();
    if let Some(n) = names.iter().find(|n| **n == name) {
        return n;
    }
    let n: &'static str = Box::leak(name.into_boxed_str());
    names.push(n);
    n
}

fn dt_of_dlpack(code: u8, bits: u8) -> Dt {
    match (code, bits) {
        (0, 8) => Dt::I8,
        (0, 16) => Dt::I16,
        (0, 32) => Dt::I32,
        (0, 64) => Dt::I64,
        (1, 8) => Dt::U8,
        (1, 16) => Dt::U16,
        (1, 32) => Dt::U32,
        (1, 64) => Dt::U64,
        (2, 16) => Dt::F16,
        (2, 32) => Dt::F32,
        (2, 64) => Dt::F64,
        (4, 16) => Dt::Bf16,
        (6, 8) => Dt::Bool,
        (10, 8) => Dt::E4m3,
        (14, 8) => Dt::E8m0,
        (5, _) => Dt::Other("complex"),
        _ => Dt::Other("an unsupported DLPack dtype"),
    }
}

fn c_strides(shape: &[usize], size: isize) -> Vec<isize> {
    let mut s = vec![0isize; shape.len()];
    let mut acc = size;
    for d in (0..shape.len()).rev() {
        s[d] = acc;
        acc *= shape[d].max(1) as isize;
    }
    s
}

fn is_c_contiguous(shape: &[usize], strides: &[isize], size: isize) -> bool {
    let mut acc = size;
    for d in (0..shape.len()).rev() {
        if shape[d] != 1 && strides[d] != acc {
            return false;
        }
        acc *= shape[d] as isize;
    }
    true
}

const DL_CPU: i32 = 1;
const DLPACK_FLAG_READ_ONLY: u64 = 1;

fn device_name(kind: i32) -> String {
    match kind {
        1 => "cpu".into(),
        2 => "cuda".into(),
        3 => "cuda_host".into(),
        4 => "opencl".into(),
        7 => "vulkan".into(),
        8 => "metal".into(),
        10 => "rocm".into(),
        13 => "cuda_managed".into(),
        14 => "oneapi".into(),
        k => format!("type {k}"),
    }
}

// DLPack's C structs (dlpack.h, v1.x; the layout of v0.x's `DLManagedTensor` is unchanged).
// Some fields are never read here; they give the later fields their offsets.
#[allow(dead_code)]
#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}
#[allow(dead_code)]
#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}
#[allow(dead_code)]
#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}
#[allow(dead_code)]
#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}
#[allow(dead_code)]
#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}
#[allow(dead_code)]
#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// A new zeroed numpy array of a float type, C order (bf16 as `ml_dtypes.bfloat16` when ml_dtypes
/// is installed, else as uint16 bits; FP8 as `float8_e4m3fn` or uint8).
pub fn zeros<'py>(py: Python<'py>, f: Float, shape: &[usize]) -> PyResult<Bound<'py, PyUntypedArray>> {
    zeros_descr(py, descr_of(py, f)?, shape)
}

fn zeros_descr<'py>(
    py: Python<'py>,
    descr: Bound<'py, numpy::PyArrayDescr>,
    shape: &[usize],
) -> PyResult<Bound<'py, PyUntypedArray>> {
    let mut dims: Vec<npyffi::npy_intp> = shape.iter().map(|&d| d as npyffi::npy_intp).collect();
    // SAFETY: PyArray_Zeros with a valid descr (whose reference it steals: `into_dtype_ptr`
    // hands over a new one) and `dims.len()` dimensions returns a new reference or null.
    unsafe {
        let ptr = npyffi::PY_ARRAY_API.PyArray_Zeros(
            py,
            dims.len() as std::os::raw::c_int,
            dims.as_mut_ptr(),
            descr.into_dtype_ptr(),
            0,
        );
        Ok(Bound::from_owned_ptr_or_err(py, ptr)?.cast_into_unchecked())
    }
}

/// The numpy dtype of a float type (see [`zeros`]).
pub fn descr_of<'py>(py: Python<'py>, f: Float) -> PyResult<Bound<'py, numpy::PyArrayDescr>> {
    static F16: PyOnceLock<Py<numpy::PyArrayDescr>> = PyOnceLock::new();
    static BF16: PyOnceLock<Option<Py<numpy::PyArrayDescr>>> = PyOnceLock::new();
    static E4M3: PyOnceLock<Option<Py<numpy::PyArrayDescr>>> = PyOnceLock::new();
    let ml = |cell: &'static PyOnceLock<Option<Py<numpy::PyArrayDescr>>>, name: &str| {
        cell.get_or_init(py, || {
            py.import("ml_dtypes")
                .and_then(|m| m.getattr(name))
                .and_then(|t| numpy::PyArrayDescr::new(py, t))
                .ok()
                .map(Bound::unbind)
        })
        .as_ref()
        .map(|d| d.bind(py).clone())
    };
    Ok(match f {
        Float::F32 => numpy::dtype::<f32>(py),
        Float::F16 => {
            F16.get_or_try_init(py, || numpy::PyArrayDescr::new(py, "float16").map(Bound::unbind))?.bind(py).clone()
        }
        Float::Bf16 => ml(&BF16, "bfloat16").unwrap_or_else(|| numpy::dtype::<u16>(py)),
        Float::E4m3 => ml(&E4M3, "float8_e4m3fn").unwrap_or_else(|| numpy::dtype::<u8>(py)),
    })
}
