//! RoPE rotation on NEON f32 lanes, bit-identical to the portable version in
//! [`crate::simd::rope`] (the same operations lane by lane; see the x86 module for the interleaved
//! trick). `MaxCompat` with f16 freqs rounds through `half` pair by pair (Rust's NEON f16
//! conversions are not stable).

use crate::simd::rope::{RopeRow, Round, pair, rotate_scalar};
use std::arch::aarch64::*;

#[target_feature(enable = "neon")]
#[inline]
fn round_bf16(v: float32x4_t) -> float32x4_t {
    let x = vreinterpretq_u32_f32(v);
    let lsb = vandq_u32(vshrq_n_u32::<16>(x), vdupq_n_u32(1));
    let rne = vaddq_u32(vaddq_u32(x, vdupq_n_u32(0x7FFF)), lsb);
    let quiet = vorrq_u32(x, vdupq_n_u32(0x0040_0000));
    let nan = vmvnq_u32(vceqq_f32(v, v));
    vreinterpretq_f32_u32(vandq_u32(vbslq_u32(nan, quiet, rne), vdupq_n_u32(0xFFFF_0000)))
}

#[target_feature(enable = "neon")]
#[inline]
fn round(v: float32x4_t, r: Round) -> float32x4_t {
    if r == Round::Bf16 { round_bf16(v) } else { v }
}

/// # Safety
/// NEON must be available; `row` holds the forms of `x.len()` rotary dims.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn rotate_neon(x: &mut [f32], row: &RopeRow<'_>, interleaved: bool, r: Round) {
    if r == Round::F16 {
        return rotate_scalar(x, row, interleaved, r);
    }
    let rd = x.len();
    let xp = x.as_mut_ptr();
    if interleaved {
        let sign = vreinterpretq_u32_u64(vdupq_n_u64(0x8000_0000));
        let mut i = 0;
        while i + 4 <= rd {
            // SAFETY: lanes i .. i + 4 of x, f and fsw (all rd long).
            unsafe {
                let v = round(vld1q_f32(xp.add(i)), r);
                let (x0, x1) = (vtrn1q_f32(v, v), vtrn2q_f32(v, v));
                let t = round(vmulq_f32(x1, vld1q_f32(row.fsw.as_ptr().add(i))), r);
                let t = vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(t), sign));
                let y = round(vfmaq_f32(t, x0, vld1q_f32(row.f.as_ptr().add(i))), r);
                vst1q_f32(xp.add(i), y);
            }
            i += 4;
        }
        for p in i / 2..rd / 2 {
            let (y0, y1) = pair(x[2 * p], x[2 * p + 1], row.c[p], row.s[p], r);
            x[2 * p] = y0;
            x[2 * p + 1] = y1;
        }
    } else {
        let h = rd / 2;
        let mut i = 0;
        while i + 4 <= h {
            // SAFETY: lanes i .. i + 4 of the halves and of c, s (h long).
            unsafe {
                let x0 = round(vld1q_f32(xp.add(i)), r);
                let x1 = round(vld1q_f32(xp.add(h + i)), r);
                let (c, s) = (vld1q_f32(row.c.as_ptr().add(i)), vld1q_f32(row.s.as_ptr().add(i)));
                let t1 = round(vmulq_f32(x1, s), r);
                let y0 = round(vfmaq_f32(vnegq_f32(t1), x0, c), r);
                let t2 = round(vmulq_f32(x1, c), r);
                let y1 = round(vfmaq_f32(t2, x0, s), r);
                vst1q_f32(xp.add(i), y0);
                vst1q_f32(xp.add(h + i), y1);
            }
            i += 4;
        }
        for p in i..h {
            let (y0, y1) = pair(x[p], x[p + h], row.c[p], row.s[p], r);
            x[p] = y0;
            x[p + h] = y1;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Whole heads: load bf16 or f32, rotate, store, with no intermediate buffer (the f32 buffer path
// widened and narrowed bf16 one element at a time).

/// Element kinds [`heads_neon`] loads and stores (the x86 kernels' numbering).
pub(crate) const BF16: u8 = 0;
pub(crate) const F16: u8 = 1;
pub(crate) const F32: u8 = 2;

/// The low / high four f16 (bits) of `v` widened to f32 by `fcvtl`/`fcvtl2` (exact; issued by
/// `asm!` because Rust's NEON f16 types are not stable).
#[target_feature(enable = "neon")]
#[inline]
fn widen_f16(v: uint16x8_t) -> (float32x4_t, float32x4_t) {
    let (lo, hi): (float32x4_t, float32x4_t);
    // SAFETY: register-only conversions of base AArch64 SIMD (NEON, enabled here); they read and
    // write no memory or stack. Not `preserves_flags`: a signalling NaN input sets FPSR.IOC, and
    // FPSR is one of the flags that option promises to leave alone.
    unsafe {
        std::arch::asm!(
            "fcvtl {lo:v}.4s, {v:v}.4h",
            "fcvtl2 {hi:v}.4s, {v:v}.8h",
            v = in(vreg) v,
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            options(pure, nomem, nostack),
        );
    }
    (lo, hi)
}

/// Eight f32 (`lo`, then `hi`) rounded to f16 by `fcvtn`/`fcvtn2`: to nearest even (the FPCR's
/// default mode, which nothing here changes), subnormals kept (FPCR.FZ is clear), overflow to
/// infinity — `half`'s conversion, NaN payloads aside (outside the bit-exact promise).
#[target_feature(enable = "neon")]
#[inline]
fn narrow_f16(lo: float32x4_t, hi: float32x4_t) -> uint16x8_t {
    let v: uint16x8_t;
    // SAFETY: as in `widen_f16` (the narrowing also sets FPSR's overflow, underflow and inexact
    // flags: not `preserves_flags`).
    unsafe {
        std::arch::asm!(
            "fcvtn {v:v}.4h, {lo:v}.4s",
            "fcvtn2 {v:v}.8h, {hi:v}.4s",
            lo = in(vreg) lo,
            hi = in(vreg) hi,
            v = out(vreg) v,
            options(pure, nomem, nostack),
        );
    }
    v
}

/// The low / high four bf16 of `v` widened to f32 (exact: the bits shifted into the high half).
#[target_feature(enable = "neon")]
#[inline]
fn widen_bf16(v: uint16x8_t) -> (float32x4_t, float32x4_t) {
    (vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(v))), vreinterpretq_f32_u32(vshll_high_n_u16::<16>(v)))
}

/// Eight f32 (`lo`, then `hi`) rounded to bf16 as `half` does (nearest even, NaN made quiet):
/// [`round_bf16`] leaves each value's bf16 in its high half, which the narrowing shifts take.
#[target_feature(enable = "neon")]
#[inline]
fn narrow_bf16(lo: float32x4_t, hi: float32x4_t) -> uint16x8_t {
    let (a, b) = (vreinterpretq_u32_f32(round_bf16(lo)), vreinterpretq_u32_f32(round_bf16(hi)));
    vshrn_high_n_u32::<16>(vshrn_n_u32::<16>(a), b)
}

/// Eight f32 (`lo`, then `hi`) rounded to bf16 as [`narrow_bf16`] does, on 16-bit lanes (the x86
/// `join_bf16`'s method): `h` holds every value's truncated bf16 and `l` the bits rounding drops,
/// and a value rounds up when `l | (h & 1) > 0x8000`; rounding up the largest finite value gives
/// infinity, as `half` does. Six operations per eight values where [`narrow_bf16`] takes twenty
/// (its NaN quieting and masks). It does not quiet NaNs: a NaN given to it must have zero low
/// 16 bits (it then has `l = 0` and is never rounded up), which [`heads_neon`]'s values do (bf16
/// inputs widen with zero low bits, `RopeRow::fill` makes NaN freqs the default NaN, AArch64
/// arithmetic returns an operand's NaN quieted or the default NaN, and [`round_bf16`] leaves
/// zero low bits). So the bits equal [`narrow_bf16`]'s there.
#[target_feature(enable = "neon")]
#[inline]
fn join_bf16(lo: float32x4_t, hi: float32x4_t) -> uint16x8_t {
    let (a, b) = (vreinterpretq_u16_f32(lo), vreinterpretq_u16_f32(hi));
    // Little-endian: each f32 lane is its low u16 then its high u16.
    let (l, h) = (vuzp1q_u16(a, b), vuzp2q_u16(a, b));
    let t = vorrq_u16(l, vandq_u16(h, vdupq_n_u16(1)));
    // `up` is all ones (−1) where the value rounds up.
    let up = vcgtq_u16(t, vdupq_n_u16(0x8000));
    vsubq_u16(h, up)
}

/// `dst[i] = f32(src[i])` for bf16 (`bf16`) or f16 bits, eight at a time (the rest one by one,
/// through `half`): exact either way.
///
/// # Safety
/// NEON must be available; `src` points at `dst.len()` readable u16.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn widen16(src: *const u16, dst: &mut [f32], bf16: bool) {
    let n = dst.len();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 u16 at src + i and 8 f32 at dst + i are in bounds (i + 8 ≤ n).
        unsafe {
            let v = vld1q_u16(src.add(i));
            let (lo, hi) = if bf16 { widen_bf16(v) } else { widen_f16(v) };
            vst1q_f32(dst.as_mut_ptr().add(i), lo);
            vst1q_f32(dst.as_mut_ptr().add(i + 4), hi);
        }
        i += 8;
    }
    // SAFETY: the caller's contract, from element i on.
    unsafe { super::super::rope::widen16_tail(src, dst, i, bf16) }
}

/// `dst[i] = bf16/f16(src[i])` (nearest even, as `half`; NaN payloads aside for f16), eight at a
/// time, the rest one by one through `half`.
///
/// # Safety
/// NEON must be available; `dst` points at `src.len()` writable u16.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn narrow16(src: &[f32], dst: *mut u16, bf16: bool) {
    let n = src.len();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 f32 at src + i and 8 u16 at dst + i are in bounds (i + 8 ≤ n).
        unsafe {
            let (lo, hi) = (vld1q_f32(src.as_ptr().add(i)), vld1q_f32(src.as_ptr().add(i + 4)));
            vst1q_u16(dst.add(i), if bf16 { narrow_bf16(lo, hi) } else { narrow_f16(lo, hi) });
        }
        i += 8;
    }
    // SAFETY: the caller's contract, from element i on.
    unsafe { super::super::rope::narrow16_tail(src, dst, i, bf16) }
}

/// `dst[i] = src[i]` for bf16 (`bf16`) or f16 bits, a NaN made quiet (its quiet bit set), eight
/// at a time: the x86 `copy16`.
///
/// # Safety
/// NEON must be available; `src` points at `n` readable u16 and `dst` at `n` writable u16.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn copy16(src: *const u16, dst: *mut u16, n: usize, bf16: bool) {
    let (inf, quiet) = if bf16 { (0x7F80, 0x0040) } else { (0x7C00, 0x0200) };
    let (abs, inf, quiet) = (vdupq_n_u16(0x7FFF), vdupq_n_u16(inf), vdupq_n_u16(quiet));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 u16 at src + i and at dst + i are in bounds (i + 8 ≤ n).
        unsafe {
            let v = vld1q_u16(src.add(i));
            let nan = vcgtq_u16(vandq_u16(v, abs), inf);
            vst1q_u16(dst.add(i), vorrq_u16(v, vandq_u16(nan, quiet)));
        }
        i += 8;
    }
    // SAFETY: the caller's contract, from element i on.
    unsafe { super::super::rope::copy16_tail(src, dst, n, i, bf16) }
}

/// Four pairs `(x0, x1)` with `c` and `ns = −s`: the oracle's operations (`rotate_neon`'s
/// half-split step), rounded after each as `r` says. With `−s` given, no negation is left in the
/// step: `x1 · (−s)` is the oracle's `−t1` exactly (a product's sign is its factors' and rounding
/// to nearest even, in f32 and to bf16, is symmetric), so `y0 = fma(x0, c, −t1)` is one `fmla`,
/// and `y1 = t2 − x0 · (−s)`, one `fmls`, is `fma(x0, s, t2)` (the same exact sum, rounded once).
/// Two `fneg` fewer in each step of eight pairs (of 30 instructions, bf16 half-split, as
/// compiled); the token kernel negates its forms once per token.
#[target_feature(enable = "neon")]
#[inline]
fn rot4(x0: float32x4_t, x1: float32x4_t, c: float32x4_t, ns: float32x4_t, r: Round) -> (float32x4_t, float32x4_t) {
    let t1n = round(vmulq_f32(x1, ns), r);
    let y0 = round(vfmaq_f32(t1n, x0, c), r);
    let t2 = round(vmulq_f32(x1, c), r);
    let y1 = round(vfmsq_f32(t2, x0, ns), r);
    (y0, y1)
}

/// One step of [`heads_neon`]: pairs `p .. p + 8` (bf16, f16; `c`, `ns` their forms `c` and `−s`,
/// four pairs per vector) or `p .. p + 4` (f32; the first vector of each) of a head's rotary region (`hh`
/// pairs) from `from` into `base`: half-split, elements `p ..` of each half; `INTER`, elements
/// `2p ..` (split and joined by `ld2` / `st2`). The oracle's operations lane by lane.
///
/// # Safety
/// NEON must be available; the step's elements readable at `from` and writable at `base` (the
/// same head or non-overlapping), `p + 8` (f32: `p + 4`) ≤ `hh`; `r` is not `F16`; NaNs in `c`,
/// `ns` have zero low 16 bits (for bf16, see [`join_bf16`]).
#[target_feature(enable = "neon")]
#[inline]
unsafe fn step_neon<const K: u8, const INTER: bool>(
    from: *const u8,
    base: *mut u8,
    hh: usize,
    p: usize,
    c: [float32x4_t; 2],
    ns: [float32x4_t; 2],
    r: Round,
) {
    // SAFETY: the caller's contract covers every address below.
    unsafe {
        if K != F32 {
            let (a, b) = if INTER {
                let v = vld2q_u16(from.add(4 * p).cast());
                (v.0, v.1)
            } else {
                (vld1q_u16(from.add(2 * p).cast()), vld1q_u16(from.add(2 * (hh + p)).cast()))
            };
            let widen = if K == BF16 { widen_bf16 } else { widen_f16 };
            let ((a0, a1), (b0, b1)) = (widen(a), widen(b));
            let (y0l, y1l) = rot4(round(a0, r), round(b0, r), c[0], ns[0], r);
            let (y0h, y1h) = rot4(round(a1, r), round(b1, r), c[1], ns[1], r);
            // `join_bf16`: its NaN precondition holds (see there).
            let narrow = if K == BF16 { join_bf16 } else { narrow_f16 };
            let (y0, y1) = (narrow(y0l, y0h), narrow(y1l, y1h));
            if INTER {
                vst2q_u16(base.add(4 * p).cast(), uint16x8x2_t(y0, y1));
            } else {
                vst1q_u16(base.add(2 * p).cast(), y0);
                vst1q_u16(base.add(2 * (hh + p)).cast(), y1);
            }
        } else {
            let (x0, x1) = if INTER {
                let v = vld2q_f32(from.add(8 * p).cast());
                (v.0, v.1)
            } else {
                (vld1q_f32(from.add(4 * p).cast()), vld1q_f32(from.add(4 * (hh + p)).cast()))
            };
            let (y0, y1) = rot4(round(x0, r), round(x1, r), c[0], ns[0], r);
            if INTER {
                vst2q_f32(base.add(8 * p).cast(), float32x4x2_t(y0, y1));
            } else {
                vst1q_f32(base.add(4 * p).cast(), y0);
                vst1q_f32(base.add(4 * (hh + p)).cast(), y1);
            }
        }
    }
}

/// Rotates the rotary region of `heads` heads of `d` elements of kind `K` (bf16, f16 or f32) from
/// `src` into `x` (`src == x`: in place; the other dims of `x` are not touched), in `F32` math or
/// with bf16 rounding (`r` is not `F16`). Interleaved pairs are split and joined by the
/// de-interleaving loads and stores (`ld2`/`st2`), so both pairings run the same four-lane
/// rotation on contiguous `c`, `s` forms: the oracle's operations lane by lane, so the same bits.
/// Returns the pairs per head done (whole steps of 8 pairs for bf16 and f16, 4 for f32); the caller
/// rotates the rest. `INTER`: interleaved pairs (a parameter, the pairing was a branch in every
/// step: three of the half-split bf16 step's 35 instructions).
///
/// # Safety
/// NEON must be available; `src` and `x` each hold `heads · d` elements of kind `K` (2 bytes for
/// bf16 and f16, 4 for f32) and either are the same pointer or do not overlap; `row.c` and `row.s` hold
/// `rd / 2` values (`rd` even, ≤ `d`).
#[target_feature(enable = "neon")]
pub(crate) unsafe fn heads_neon<const K: u8, const INTER: bool>(
    src: *const u8,
    x: *mut u8,
    heads: usize,
    d: usize,
    rd: usize,
    row: &RopeRow<'_>,
    r: Round,
) -> usize {
    let interleaved = INTER;
    debug_assert!(r != Round::F16 && row.c.len() == rd / 2 && row.s.len() == rd / 2);
    let size = if K == F32 { 4 } else { 2 };
    let at = if interleaved { d - rd } else { 0 };
    let hh = rd / 2;
    let step = if K == F32 { 4 } else { 8 };
    let done = hh / step * step;
    let (c, s) = (row.c.as_ptr(), row.s.as_ptr());
    for h in 0..heads {
        let (base, from) = (x.wrapping_add((h * d + at) * size), src.wrapping_add((h * d + at) * size));
        for p in (0..done).step_by(step) {
            // SAFETY: pairs p .. p + step (≤ hh) of the head's rotary region, as `step_neon`
            // needs; values p .. p + step of c and s (hh long; f32 reads only the first vector).
            unsafe {
                let load = |f: *const f32| {
                    let hi = if K == F32 { vdupq_n_f32(0.0) } else { vld1q_f32(f.add(p + 4)) };
                    [vld1q_f32(f.add(p)), hi]
                };
                let ([c0, c1], [s0, s1]) = (load(c), load(s));
                step_neon::<K, INTER>(from, base, hh, p, [c0, c1], [vnegq_f32(s0), vnegq_f32(s1)], r);
            }
        }
    }
    done
}

/// The forms of one 32-pair chunk of a freqs row in registers: `c` and `−s` (as [`rot4`] takes
/// them) of pairs `4 j .. 4 j + 4` in vector `j` of each — [`RopeRow::fill`]'s `c` and `s`
/// values for the chunk, `s` negated.
#[derive(Clone, Copy)]
struct Chunk {
    c: [float32x4_t; 8],
    ns: [float32x4_t; 8],
}

/// Every NaN lane of `v` made the default NaN (`f32::NAN`, as [`RopeRow::fill`] does), the others
/// kept.
#[target_feature(enable = "neon")]
#[inline]
fn default_nan(v: float32x4_t) -> float32x4_t {
    vbslq_f32(vceqq_f32(v, v), v, vdupq_n_f32(f32::NAN))
}

/// [`Chunk`] of the 64 freqs (`c0, s0, c1, s1, …`) of kind `KF` at `p`: de-interleaved by the
/// loads (`ld2`), widened exactly, NaN made the default NaN, `s` negated (a NaN's sign flips:
/// NaN sign and payload are outside the bit-exact promise, and its low bits stay zero).
///
/// # Safety
/// NEON must be available; 64 readable elements of kind `KF` at `p`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn chunk<const KF: u8>(p: *const u8) -> Chunk {
    let zero = vdupq_n_f32(0.0);
    let mut k = Chunk { c: [zero; 8], ns: [zero; 8] };
    if KF == F32 {
        for j in 0..8 {
            // SAFETY: elements 8 j .. 8 j + 8 of the 64 at p.
            let v = unsafe { vld2q_f32(p.add(32 * j).cast()) };
            (k.c[j], k.ns[j]) = (default_nan(v.0), vnegq_f32(default_nan(v.1)));
        }
    } else {
        let widen = if KF == BF16 { widen_bf16 } else { widen_f16 };
        for j in 0..4 {
            // SAFETY: elements 16 j .. 16 j + 16 of the 64 at p.
            let v = unsafe { vld2q_u16(p.add(32 * j).cast()) };
            let ((c0, c1), (s0, s1)) = (widen(v.0), widen(v.1));
            (k.c[2 * j], k.c[2 * j + 1]) = (default_nan(c0), default_nan(c1));
            (k.ns[2 * j], k.ns[2 * j + 1]) = (vnegq_f32(default_nan(s0)), vnegq_f32(default_nan(s1)));
        }
    }
    k
}

/// One token of the standalone RoPE with whole heads of `64 N` dims in `F32` math, on NEON: the
/// freqs row of kind `KF` read once into registers ([`Chunk`]; for `N = 2` the compiler keeps
/// what the 32 registers allow and the rest on the stack), the Q heads (kind `KQ`) from `q` into
/// `out`, the K heads (kind `KK`) in place at `k`, half-split or (`INTER`) interleaved pairs —
/// [`heads_neon`]'s steps on the forms [`RopeRow::fill`] would have stored, so the same bits,
/// without the per-token buffer and the general path's per-row checks and dispatch. `tokens`
/// consecutive tokens in one call (a run), as the x86 token kernels take them.
///
/// # Safety
/// NEON must be available; for each token `t < tokens`: `freqs` holds `64 N` elements of kind
/// `KF` from element `64 N t`; `q` and `out` hold `hq · 64 N` elements of kind `KQ` from element
/// `hq · 64 N · t` and do not overlap; `k` holds `hk · 64 N` of kind `KK` from element
/// `k_stride · t`, and `k_stride ≥ hk · 64 N`.
#[target_feature(enable = "neon")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn token_neon<const KQ: u8, const KK: u8, const KF: u8, const N: usize, const INTER: bool>(
    freqs: *const u8,
    q: *const u8,
    out: *mut u8,
    hq: usize,
    k: *mut u8,
    hk: usize,
    tokens: usize,
    k_stride: usize,
) {
    let size = |kind: u8| if kind == F32 { 4 } else { 2 };
    let (fsize, qrow, krow) = (size(KF), hq * 64 * N * size(KQ), k_stride * size(KK));
    for t in 0..tokens {
        // SAFETY: token t's freqs, Q, output and K rows as the contract says (chunk b's 64 freqs
        // at 64 b of the row's 64 N, b < N).
        unsafe {
            let (freqs, q, out, k) =
                (freqs.add(t * 64 * N * fsize), q.add(t * qrow), out.add(t * qrow), k.add(t * krow));
            let forms: [Chunk; N] = std::array::from_fn(|b| chunk::<KF>(freqs.add(64 * b * fsize)));
            token_heads::<KQ, N, INTER>(q, out, hq, &forms);
            token_heads::<KK, N, INTER>(k, k, hk, &forms);
        }
    }
}

/// [`token_neon`]'s heads: `heads` heads of `64 N` dims of kind `K` from `src` into `x` by
/// [`step_neon`] on the chunks' forms.
///
/// # Safety
/// NEON must be available; `src` and `x` each hold `heads · 64 N` elements of kind `K` and
/// either are the same pointer or do not overlap; the forms' NaNs are the default NaN.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn token_heads<const K: u8, const N: usize, const INTER: bool>(
    src: *const u8,
    x: *mut u8,
    heads: usize,
    forms: &[Chunk; N],
) {
    let (size, hh) = (if K == F32 { 4 } else { 2 }, 32 * N);
    for h in 0..heads {
        let (from, base) = (src.wrapping_add(2 * h * hh * size), x.wrapping_add(2 * h * hh * size));
        for (b, f) in forms.iter().enumerate() {
            for j in (0..8).step_by(if K == F32 { 1 } else { 2 }) {
                let p = 32 * b + 4 * j;
                let (c, ns) =
                    if K == F32 { ([f.c[j]; 2], [f.ns[j]; 2]) } else { ([f.c[j], f.c[j + 1]], [f.ns[j], f.ns[j + 1]]) };
                // SAFETY: pairs p .. p + 8 (f32: p + 4) ≤ 32 b + 32 ≤ hh of head h (2 hh = 64 N
                // elements), within `src` and `x`; the forms' NaNs are the default NaN.
                unsafe { step_neon::<K, INTER>(from, base, hh, p, c, ns, Round::None) };
            }
        }
    }
}
