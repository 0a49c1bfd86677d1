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
// are written by one thread each (see `write_slice`); it never reads.
unsafe impl<T: Send> Send for SharedMut<'_, T> {}
// SAFETY: as above; `&SharedMut` permits only `write_slice`.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    pub fn new(slice: &'a mut [T]) -> Self {
        SharedMut { ptr: slice.as_mut_ptr(), len: slice.len(), _life: PhantomData }
    }

    /// Writes `v` at `i .. i + v.len()`. Bounds are checked (a bug panics, never writes out of
    /// bounds).
    ///
    /// # Safety
    /// No other thread may read or write those indices during the lifetime of this `SharedMut`.
    #[inline]
    pub unsafe fn write_slice(&self, i: usize, v: &[T])
    where
        T: Copy,
    {
        assert!(i <= self.len && v.len() <= self.len - i, "scatter range {i}+{} out of bounds ({})", v.len(), self.len);
        // SAFETY: in bounds (checked above), the slice is exclusively borrowed for 'a, `v` is a
        // distinct borrow (it cannot alias the exclusive one), and the caller guarantees no
        // concurrent access to these indices.
        unsafe { self.ptr.add(i).copy_from_nonoverlapping(v.as_ptr(), v.len()) }
    }
}
