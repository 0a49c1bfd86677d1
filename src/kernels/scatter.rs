//! Parallel writes into the output and the cache: tasks of one call write disjoint elements
//! (disjoint (row, column) tiles; the validated slot plan gives every row its own cache slot),
//! which safe Rust cannot express for scattered cache slots. The unsafe is contained here.
#![allow(unsafe_code)]

use std::marker::PhantomData;

/// A slice that several threads write at disjoint indices.
pub(crate) struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _life: PhantomData<&'a mut [T]>,
}

// SAFETY: SharedMut only hands out writes of `T: Send` values at indices the caller promises
// are accessed by one thread each (see `slice_mut`); it never reads itself.
unsafe impl<T: Send> Send for SharedMut<'_, T> {}
// SAFETY: as above; `&SharedMut` permits only `slice_mut`.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    pub fn new(slice: &'a mut [T]) -> Self {
        SharedMut { ptr: slice.as_mut_ptr(), len: slice.len(), _life: PhantomData }
    }

    /// The elements `i .. i + len` as one thread's mutable slice. Bounds are checked (a bug
    /// panics, never reaches out of bounds).
    ///
    /// # Safety
    /// While the returned slice lives, nothing else may read or write those indices: ranges
    /// handed out at the same time (to any thread) must be disjoint.
    #[inline]
    #[allow(clippy::mut_from_ref)] // the disjointness is the caller's obligation, as above
    pub unsafe fn slice_mut(&self, i: usize, len: usize) -> &mut [T] {
        assert!(i <= self.len && len <= self.len - i, "slot range {i}+{len} out of bounds ({})", self.len);
        // SAFETY: in bounds (checked above) of a slice exclusively borrowed for 'a (which
        // outlives `&self`); the caller guarantees no other access to these indices meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i), len) }
    }
}
