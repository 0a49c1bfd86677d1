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

/// Where a one-row decode kernel's software prefetches go when they run past the end of its
/// streams: G streams (the groups of one call, each `len` bytes) that lie end to end at an even
/// stride, as the packed weights and their scales lay groups out, are followed by the next call's
/// G groups, which the caller runs next (groups in order). A prefetch `off` bytes into stream j
/// (`off ≥ len`) then goes to byte `off − len` of the next call's stream j (G strides on from
/// stream j's start), so the next call's streams start in cache instead of on demand misses.
/// Other layouts keep the plain address (past the end: the next group, which is harmless).
#[derive(Clone, Copy)]
pub(super) struct RunOn {
    len: usize,
    skip: usize,
}

impl RunOn {
    pub(super) fn new<const G: usize>(streams: [&[u8]; G]) -> Self {
        let len = streams[0].len();
        let s0 = streams[0].as_ptr() as usize;
        // The stride, where the streams ascend (descending or overlapping ones keep 0).
        let st = streams.get(1).and_then(|s| (s.as_ptr() as usize).checked_sub(s0)).unwrap_or(0);
        let at = |j: usize| j.checked_mul(st).and_then(|d| s0.checked_add(d));
        let even = G > 1
            && st >= len
            && streams.iter().enumerate().all(|(j, s)| s.len() == len && at(j) == Some(s.as_ptr() as usize));
        // Byte `off − len` of the next call's stream j: G strides on from stream j's start.
        let skip = G.checked_mul(st).filter(|_| even).map_or(0, |d| d - len);
        RunOn { len, skip }
    }

    /// The address a prefetch `off` bytes into the stream that starts at `base` goes to.
    #[inline(always)]
    fn target(self, base: *const u8, off: usize) -> *const u8 {
        base.wrapping_add(off + if off >= self.len { self.skip } else { 0 })
    }

    /// Prefetches (T0) the line `off` bytes into the stream that starts at `base`.
    #[inline(always)]
    pub(super) fn prefetch(self, base: *const u8, off: usize) {
        prefetch_t0(self.target(base, off));
    }
}

/// Bytes ahead that the AVX2 one-row MXFP8 kernel prefetches a group's block scales (16 blocks: a
/// group's scales are 16 bytes a block), one line every four blocks.
pub(super) const SCALES_AHEAD: usize = 256;

/// The first [`fp4::PREFETCH`] bytes of each weight stream a decode kernel is about to read side
/// by side. Inside the loop each stream is prefetched that far ahead, so without this a call's
/// streams start on demand misses; one group at a time, the previous group's run-ahead covers the
/// next one's start (groups lie end to end), which four streams side by side do not have
/// (measured, Qwen2.5-0.5B NVFP4 decode from DRAM, one Zen 5 core: the four-group kernel took
/// 30–32 µs against the one-group kernel's 28–29; with this 28–29).
#[inline(always)]
fn prefetch_starts<const N: usize>(streams: [&[u8]; N]) {
    prefetch_heads(streams, fp4::PREFETCH);
}

/// The first `bytes` of each stream (T0): [`prefetch_starts`] for any head length.
#[inline(always)]
fn prefetch_heads<const N: usize>(streams: [&[u8]; N], bytes: usize) {
    for w in streams {
        for off in (0..bytes).step_by(64) {
            prefetch_t0(w.as_ptr().wrapping_add(off));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RunOn;

    /// Past the end of a call's streams, a prefetch goes into the next call's stream of the same
    /// index where the groups lie end to end (or at an even stride), and nowhere new otherwise.
    #[test]
    fn run_on_targets_the_next_calls_stream() {
        let buf = vec![0u8; 8 * 100];
        let base = buf.as_ptr();
        let g = |i: usize, len: usize| &buf[i * 100..i * 100 + len];
        for len in [100, 60] {
            let r = RunOn::new([g(0, len), g(1, len), g(2, len), g(3, len)]);
            for j in 0..4 {
                let s = g(j, len).as_ptr();
                assert_eq!(r.target(s, 10), s.wrapping_add(10));
                assert_eq!(r.target(s, len - 1), s.wrapping_add(len - 1));
                // `len + 5` into stream j: 5 bytes past its end, so byte 5 of the next call's
                // stream j (group j + 4).
                assert_eq!(r.target(s, len + 5), base.wrapping_add((j + 4) * 100 + 5));
                assert_eq!(r.target(s, len + 70), base.wrapping_add((j + 4) * 100 + 70));
            }
        }
        // Uneven strides or lengths, or one stream: the plain address.
        for r in [
            RunOn::new([g(0, 100), g(1, 100), g(3, 100), g(4, 100)]),
            RunOn::new([g(0, 100), g(1, 90), g(2, 100), g(3, 100)]),
            RunOn::new([g(1, 100), g(0, 100), g(2, 100), g(3, 100)]),
            RunOn::new([g(0, 100)]),
        ] {
            assert_eq!(r.target(base, 105), base.wrapping_add(105));
        }
    }
}
