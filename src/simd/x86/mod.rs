//! x86-64 kernels: AVX2 and AVX-512 (see the parent module for the arithmetic they share).

pub(super) mod fp4;
pub(super) mod fp8;
pub(super) mod plain;
pub(super) mod rope;

/// A `prefetcht0` of the line holding `p`: a hint with no memory access semantics, so `p` may
/// lie anywhere (it never faults and is never dereferenced; callers form it by `wrapping_add`).
#[inline(always)]
fn prefetch_t0(p: *const u8) {
    // SAFETY: `_mm_prefetch` reads and writes no memory; SSE is part of x86-64.
    unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast()) }
}
