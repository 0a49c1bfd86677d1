//! Per-thread reuse of the buffers a call builds (validated slot plans, prepared activations,
//! epilogue tables), so that a server calling the packed entry points with the same shapes makes
//! no heap allocation per call in steady state (`tests/alloc.rs` counts them).
//!
//! [`Pooled<T>`] is a `Vec<T>` taken from the calling thread's free list and returned to it on
//! drop (cleared; its capacity kept). A buffer grows to the largest call it served, so a thread
//! retains at most [`KEEP`] buffers per element type, each as large as that thread's largest call
//! needed — the same memory the calls themselves used, never more.

use std::fmt;
use std::ops::{Deref, DerefMut};

/// Most free buffers a thread keeps per element type (a call takes about a dozen).
const KEEP: usize = 32;

/// An element type with a per-thread free list. Nominally `pub` (this module is private, so it
/// is the crate's alone) so that the sealed [`Element`](crate::Element) can require it: staging
/// buffers of any element type come from the pool too.
pub trait Poolable: Sized + 'static {
    /// Runs `f` on this thread's free list (`None` while the thread is being torn down).
    fn with_free<R>(f: impl FnOnce(&mut Vec<Vec<Self>>) -> R) -> Option<R>;
}

/// Gives each listed type a per-thread free list. Invoked beside each pooled type (here for
/// the primitive ones, in `cache::plan` for its slots), so that this module depends on nothing.
macro_rules! poolable {
    ($($t:ty),* $(,)?) => {$(
        impl $crate::pool::Poolable for $t {
            fn with_free<R>(f: impl FnOnce(&mut Vec<Vec<Self>>) -> R) -> Option<R> {
                thread_local! {
                    static FREE: std::cell::RefCell<Vec<Vec<$t>>> = const { std::cell::RefCell::new(Vec::new()) };
                }
                FREE.try_with(|free| f(&mut free.borrow_mut())).ok()
            }
        }
    )*};
}

pub(crate) use poolable;

poolable!(u8, i8, i32, u32, f32, bool, usize, Option<usize>, (usize, usize), (usize, usize, bool));

/// A `Vec<T>` borrowed from the thread's free list (see the module docs).
pub(crate) struct Pooled<T: Poolable>(Vec<T>);

impl<T: Poolable> Pooled<T> {
    /// An empty buffer (with the capacity a previous call left it).
    pub fn new() -> Self {
        Pooled(T::with_free(|free| free.pop()).flatten().unwrap_or_default())
    }

    /// `n` copies of `value`.
    pub fn filled(value: T, n: usize) -> Self
    where
        T: Clone,
    {
        let mut p = Self::new();
        p.0.resize(n, value);
        p
    }
}

impl<T: Poolable> Drop for Pooled<T> {
    fn drop(&mut self) {
        let mut v = std::mem::take(&mut self.0);
        if v.capacity() == 0 {
            return;
        }
        v.clear();
        T::with_free(|free| {
            if free.len() < KEEP {
                free.push(v);
            }
        });
    }
}

impl<T: Poolable> Default for Pooled<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Poolable> Deref for Pooled<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.0
    }
}

impl<T: Poolable> DerefMut for Pooled<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.0
    }
}

impl<T: Poolable> FromIterator<T> for Pooled<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut p = Self::new();
        p.0.extend(iter);
        p
    }
}

impl<T: Poolable + Clone> Clone for Pooled<T> {
    fn clone(&self) -> Self {
        let mut p = Self::new();
        p.0.extend_from_slice(&self.0);
        p
    }
}

impl<T: Poolable + fmt::Debug> fmt::Debug for Pooled<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<T: Poolable + PartialEq> PartialEq for Pooled<T> {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_cleared_with_their_capacity() {
        let mut a: Pooled<u32> = Pooled::filled(7, 1000);
        a.push(1);
        let cap = a.capacity();
        drop(a);
        let b: Pooled<u32> = Pooled::new();
        assert!(b.is_empty() && b.capacity() >= cap);
        let c: Pooled<u32> = (0..5).collect();
        assert_eq!(&c[..], &[0, 1, 2, 3, 4]);
        assert_eq!(c.clone(), c);
    }
}
