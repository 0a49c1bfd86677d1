//! The one place where slices of the caller's memory are made.
//!
//! A slice of an argument is sound when (1) the memory is alive for the slice's lifetime, (2) no
//! `&mut` to any of its bytes exists meanwhile (for a `&mut`: no other reference at all), (3) every
//! bit pattern is a value of the element type, and (4) the address is aligned. Here:
//!
//! 1. A [`Call`] borrows its arguments' [`Desc`]s, and a `Desc` lives only inside the [`Arg`]
//!    that holds the object owning the memory (it is not `Clone`): the memory outlives the call.
//! 2. [`Call::new`] refuses a written argument that shares a byte with any other argument;
//!    [`Call::claimed`] holds an [`inflight`] claim on all of them while the work runs (no other
//!    call writes what this one reads, or touches what it writes); and [`Held`] hands each
//!    written argument out once per [`Held`], of which one exists at a time.
//! 3. Slices are of [`Pod`] types only (sealed: integers, `f32`, `bf16`, `f16`, `E4M3`).
//! 4. [`Arg`] checked the alignment to the element size, or the data is a gathered copy in
//!    8-byte-aligned storage; the element size is checked against the dtype's.
//!
//! What this cannot stop: Python code that writes an array while a call reads or writes it (as
//! with every numpy extension that releases the GIL); the values are then unspecified.
//!
//! [`Arg`]: crate::array::Arg

use crate::array::{Desc, Dt, value_err};
use crate::inflight::{self, Claim, Span};
use pyo3::prelude::*;
use std::marker::PhantomData;
use std::sync::Mutex;

mod sealed {
    pub trait Sealed {}
    macro_rules! sealed {
        ($($t:ty),*) => { $(impl Sealed for $t {})* };
    }
    sealed!(u8, i8, u16, i16, u32, i32, u64, i64, f32, paged_qkv::bf16, paged_qkv::f16, paged_qkv::E4M3);
}

/// An element type every bit pattern of which is a value, with its size as its alignment.
pub trait Pod: sealed::Sealed + Copy + Send + Sync + 'static {}
impl<T: sealed::Sealed + Copy + Send + Sync + 'static> Pod for T {}

/// A call's arguments (`(description, written)`), checked to be slice-able side by side.
pub struct Call<'a> {
    args: Vec<(&'a Desc, bool)>,
}

impl<'a> Call<'a> {
    /// Errors when a written argument shares memory with any other argument of the call (the
    /// message names both), or when a written argument would be a copy.
    pub fn new(args: Vec<(&'a Desc, bool)>) -> PyResult<Self> {
        for (i, (a, aw)) in args.iter().enumerate() {
            if *aw && (a.strides.is_some() || (a.len > 0 && !a.writable)) {
                return Err(value_err(a.name, "must be the caller's C-contiguous, writeable memory"));
            }
            for (b, bw) in &args[i + 1..] {
                if (*aw || *bw) && a.span(true).conflicts_with(&b.span(true)) {
                    let (w, o) = if *aw { (a, b) } else { (b, a) };
                    return Err(value_err(
                        w.name,
                        format!(
                            "shares memory with `{}`: an argument written in place must not overlap another",
                            o.name
                        ),
                    ));
                }
            }
        }
        Ok(Call { args })
    }

    /// Releases the GIL, claims the arguments' memory (waiting while another call holds a
    /// conflicting claim) and runs `f`, which makes its slices through [`Claimed::held`].
    pub fn claimed<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Claimed<'_, 'a>) -> R + Send) -> R {
        let spans: Vec<Span> = self.args.iter().map(|(d, w)| d.span(*w)).collect();
        py.detach(move || {
            let mut c = Claimed { call: self, _claim: inflight::claim(&spans) };
            f(&mut c)
        })
    }
}

/// A call whose memory is claimed; it lends one [`Held`] at a time.
pub struct Claimed<'c, 'a> {
    call: &'c Call<'a>,
    _claim: Claim,
}

impl<'c, 'a> Claimed<'c, 'a> {
    /// The token that makes slices (one at a time: it borrows the claim exclusively).
    pub fn held(&mut self) -> Held<'_, 'a> {
        Held { call: self.call, taken: Mutex::new(vec![false; self.call.args.len()]) }
    }
}

/// Makes the slices of one pass over a claimed call: each read argument as often as wanted,
/// each written argument once.
pub struct Held<'h, 'a> {
    call: &'h Call<'a>,
    taken: Mutex<Vec<bool>>,
}

impl<'h> Held<'h, '_> {
    fn index(&self, d: &Desc, write: bool) -> usize {
        let i = self.call.args.iter().position(|(a, w)| std::ptr::eq(*a, d) && *w == write);
        i.unwrap_or_else(|| {
            panic!("`{}` is not a {} argument of this call", d.name, if write { "written" } else { "read" })
        })
    }

    /// A read argument's elements: the caller's memory where it is C-contiguous and aligned,
    /// else a copy gathered now, under the claim.
    pub fn read(&self, d: &Desc) -> Loaded<'h> {
        self.index(d, false);
        let size = d.dt.size();
        let Some(strides) = &d.strides else {
            return Loaded { name: d.name, dt: d.dt, addr: d.addr, len: d.len, _copy: Vec::new(), _h: PhantomData };
        };
        let mut buf = vec![0u64; (d.len * size).div_ceil(8)];
        let dst = buf.as_mut_ptr() as *mut u8;
        let mut idx = vec![0usize; d.shape.len()];
        for i in 0..d.len {
            let off: isize = idx.iter().zip(strides).map(|(&j, &s)| j as isize * s).sum();
            // SAFETY: `addr + off` is element `idx` of the caller's array, alive (1) and written
            // by no one during the claim (2) (its shape and strides are numpy's or DLPack's own);
            // `dst` has room for `len · size` bytes and is a fresh buffer.
            unsafe { std::ptr::copy_nonoverlapping((d.addr as isize + off) as *const u8, dst.add(i * size), size) };
            for k in (0..d.shape.len()).rev() {
                idx[k] += 1;
                if idx[k] < d.shape[k] {
                    break;
                }
                idx[k] = 0;
            }
        }
        let addr = buf.as_ptr() as usize;
        Loaded { name: d.name, dt: d.dt, addr, len: d.len, _copy: buf, _h: PhantomData }
    }

    /// A written argument's elements, exclusively (once per `Held`).
    pub fn write(&self, d: &Desc) -> LoadedMut<'h> {
        let i = self.index(d, true);
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        assert!(!taken[i], "`{}` was already handed out", d.name);
        taken[i] = true;
        LoadedMut { name: d.name, dt: d.dt, addr: d.addr, len: d.len, _h: PhantomData }
    }
}

fn check_type<T: Pod>(name: &str, dt: Dt, addr: usize) {
    assert_eq!(std::mem::size_of::<T>(), dt.size(), "`{name}`: element size");
    assert!(addr.is_multiple_of(std::mem::align_of::<T>()), "`{name}`: alignment");
}

/// A read argument's elements, C-contiguous and aligned.
pub struct Loaded<'h> {
    pub name: &'static str,
    pub dt: Dt,
    addr: usize,
    len: usize,
    _copy: Vec<u64>,
    _h: PhantomData<&'h ()>,
}

impl Loaded<'_> {
    /// The elements as `T` (of the dtype's size: the caller picks T from `dt`).
    pub fn slice<T: Pod>(&self) -> &[T] {
        check_type::<T>(self.name, self.dt, self.addr);
        // SAFETY: facts 1–4 of the module docs: the memory (the caller's, or `_copy`, which lives
        // as long as `self`) is alive while `self` is borrowed, nothing writes it meanwhile, T is
        // Pod, and the address is aligned for T (checked above; an empty argument's address is a
        // non-null aligned dangling one).
        unsafe { std::slice::from_raw_parts(self.addr as *const T, self.len) }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: as in `slice`; bytes have no alignment or validity requirement.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len * self.dt.size()) }
    }
}

/// A written argument's elements: the caller's writeable, C-contiguous, aligned memory.
pub struct LoadedMut<'h> {
    pub name: &'static str,
    pub dt: Dt,
    addr: usize,
    len: usize,
    _h: PhantomData<&'h ()>,
}

impl LoadedMut<'_> {
    /// The elements as `T` (of the dtype's size).
    pub fn slice_mut<T: Pod>(&mut self) -> &mut [T] {
        check_type::<T>(self.name, self.dt, self.addr);
        // SAFETY: facts 1–4 of the module docs; exclusivity: no other argument of the call
        // overlaps this one, no other call touches it during the claim, and this is the only
        // `LoadedMut` of it (`Held::write`), borrowed mutably here.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.len) }
    }

    /// The bytes.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `slice_mut`; bytes have no alignment or validity requirement.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len * self.dt.size()) }
    }
}
