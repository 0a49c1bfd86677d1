//! x86-64 kernels: AVX2 and AVX-512 (see the parent module for the arithmetic they share).

pub(super) mod fp4;
pub(super) mod fp8;
pub(super) mod plain;
pub(super) mod quant;
pub(super) mod rope;

/// A `prefetcht0` of the line holding `p`: a hint with no memory access semantics, so `p` may
/// lie anywhere (it never faults and is never dereferenced; callers form it by `wrapping_add`).
#[inline(always)]
fn prefetch_t0(p: *const u8) {
    // SAFETY: `_mm_prefetch` reads and writes no memory; SSE is part of x86-64.
    unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast()) }
}

/// The first [`fp4::PREFETCH`] bytes of each weight stream a decode kernel is about to read side
/// by side. Inside the loop each stream is prefetched that far ahead, so without this a call's
/// streams start on demand misses; one group at a time, the previous group's run-ahead covers the
/// next one's start (groups lie end to end), which four streams side by side do not have
/// (measured, Qwen2.5-0.5B NVFP4 decode from DRAM, one Zen 5 core: the four-group kernel took
/// 30–32 µs against the one-group kernel's 28–29; with this 28–29).
#[inline(always)]
fn prefetch_starts<const N: usize>(streams: [&[u8]; N]) {
    for w in streams {
        for off in (0..fp4::PREFETCH).step_by(64) {
            prefetch_t0(w.as_ptr().wrapping_add(off));
        }
    }
}
