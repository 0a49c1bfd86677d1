//! RoPE on NEON: the level's [`Lanes`] (4 f32 lanes) — the vector operations the kernels of
//! [`crate::simd::rope_lanes`] are written with — and its entry points; bf16/f16 ↔ f32
//! conversions. Interleaved f16 and f32 pairs are split and joined by `ld2`/`st2`
//! ([`Lanes::LD2`]). f16 conversions are issued by `asm!` (`fcvtl`, `fcvtn`: Rust's NEON f16
//! types are not stable).

use crate::simd::rope::{RopeRow, Round};
pub(crate) use crate::simd::rope_lanes::{BF16, F16, F32};
use crate::simd::rope_lanes::{Forms, Lanes, heads_any, level_fns, rotate, token};
use std::arch::aarch64::*;

/// The level's [`Forms`]: 32, 16 and 64 over 4 lanes vectors.
type FormsNeon = Forms<float32x4_t, 8, 4, 16>;

/// `v` rounded to bf16 as `half` does (nearest even, NaN made quiet), kept in f32 (low 16 bits 0).
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

/// `v` rounded as `r` says: bf16 by [`round_bf16`], f16 by a round trip through f16 (`fcvtn`,
/// `fcvtl`: nearest even, subnormals kept, overflow to infinity, as `half`).
#[target_feature(enable = "neon")]
#[inline]
fn round(v: float32x4_t, r: Round) -> float32x4_t {
    match r {
        Round::None => v,
        Round::Bf16 => round_bf16(v),
        Round::F16 => widen_f16_4(narrow_f16_4(v)),
    }
}

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

/// Four f16 (bits) widened to f32 by `fcvtl` (exact).
#[target_feature(enable = "neon")]
#[inline]
fn widen_f16_4(v: uint16x4_t) -> float32x4_t {
    let o: float32x4_t;
    // SAFETY: as in `widen_f16`.
    unsafe {
        std::arch::asm!(
            "fcvtl {o:v}.4s, {v:v}.4h",
            v = in(vreg) v,
            o = out(vreg) o,
            options(pure, nomem, nostack),
        );
    }
    o
}

/// Four f32 rounded to f16 by `fcvtn`, as [`narrow_f16`] rounds.
#[target_feature(enable = "neon")]
#[inline]
fn narrow_f16_4(v: float32x4_t) -> uint16x4_t {
    let o: uint16x4_t;
    // SAFETY: as in `narrow_f16`.
    unsafe {
        std::arch::asm!(
            "fcvtn {o:v}.4h, {v:v}.4s",
            v = in(vreg) v,
            o = out(vreg) o,
            options(pure, nomem, nostack),
        );
    }
    o
}

/// Four bf16 (bits) widened to f32 (exact: the bits shifted into the high half).
#[target_feature(enable = "neon")]
#[inline]
fn widen_bf16_4(v: uint16x4_t) -> float32x4_t {
    vreinterpretq_f32_u32(vshll_n_u16::<16>(v))
}

/// Four f32 rounded to bf16 as `half` does ([`round_bf16`], then the high halves).
#[target_feature(enable = "neon")]
#[inline]
fn narrow_bf16_4(v: float32x4_t) -> uint16x4_t {
    vshrn_n_u32::<16>(vreinterpretq_u32_f32(round_bf16(v)))
}

/// Four elements of kind `K` at `p`, widened exactly.
///
/// # Safety
/// NEON must be available; 4 readable elements of kind `K` at `p`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn load4<const K: u8>(p: *const u8) -> float32x4_t {
    // SAFETY: the caller guarantees 4 elements at p.
    unsafe {
        match K {
            BF16 => widen_bf16_4(vld1_u16(p.cast())),
            F16 => widen_f16_4(vld1_u16(p.cast())),
            _ => vld1q_f32(p.cast()),
        }
    }
}

/// Four values stored as elements of kind `K` at `p`, each rounded once (nearest even).
///
/// # Safety
/// NEON must be available; room for 4 elements of kind `K` at `p`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn store4<const K: u8>(p: *mut u8, v: float32x4_t) {
    // SAFETY: the caller guarantees room for 4 elements at p.
    unsafe {
        match K {
            BF16 => vst1_u16(p.cast(), narrow_bf16_4(v)),
            F16 => vst1_u16(p.cast(), narrow_f16_4(v)),
            _ => vst1q_f32(p.cast(), v),
        }
    }
}

/// Stores the even `e` and odd `o` lanes as 8 bf16 at `p` (`e0, o0, e1, o1, …`), each rounded
/// to nearest even on 16-bit lanes: `h` holds every value's truncated bf16 (the high halves,
/// interleaved by `trn2`) and `l` the bits rounding drops (`trn1`), and a value rounds up when
/// `l | (h & 1) > 0x8000`; rounding up the largest finite value gives infinity, as `half` does.
/// Six operations per eight values. It does not quiet NaNs: a NaN given to it must have zero low
/// 16 bits (it then has `l = 0` and is never rounded up), which the kernels' values do (bf16
/// inputs widen with zero low bits, the forms' NaNs are the default NaN, AArch64 arithmetic
/// returns an operand's NaN quieted or the default NaN, and [`round`] leaves zero low bits). So
/// the bits equal `half`'s conversion there.
///
/// # Safety
/// NEON must be available; 16 writable bytes at `p`; NaNs in `e`, `o` as above.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn join_bf16(p: *mut u8, e: float32x4_t, o: float32x4_t) {
    let (a, b) = (vreinterpretq_u16_f32(e), vreinterpretq_u16_f32(o));
    // Little-endian: each f32 lane is its low u16 then its high u16.
    let (l, h) = (vtrn1q_u16(a, b), vtrn2q_u16(a, b));
    let t = vorrq_u16(l, vandq_u16(h, vdupq_n_u16(1)));
    // `up` is all ones (−1) where the value rounds up.
    let up = vcgtq_u16(t, vdupq_n_u16(0x8000));
    // SAFETY: the caller guarantees 16 bytes at p.
    unsafe { vst1q_u16(p.cast(), vsubq_u16(h, up)) }
}

/// [`Forms`] of the 64 freqs (`c0, s0, c1, s1, …`) of kind `KF` at `p`: `c`, `s` de-interleaved
/// by the loads (`ld2`), widened exactly, NaN made the default NaN where `canon` (as
/// [`RopeRow::fill`] does); `d` per 8-pair bf16 step by `uzp1`/`uzp2` (the even and the odd pairs'
/// `c`, `s`: `RopeRow::fill`'s `cd`, `sd` layout); `f` the freqs themselves.
///
/// # Safety
/// NEON must be available; 64 readable elements of kind `KF` at `p`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn chunk_forms<const KF: u8>(p: *const u8, canon: bool) -> FormsNeon {
    let canon = |v: float32x4_t| if canon { default_nan(v) } else { v };
    // SAFETY: NEON is enabled here, as `forms_zero` requires.
    let mut k = unsafe { <Neon as Lanes>::forms_zero() };
    if KF == F32 {
        for j in 0..8 {
            // SAFETY: elements 8 j .. 8 j + 8 of the 64 at p.
            let v = unsafe { vld2q_f32(p.add(32 * j).cast()) };
            (k.c[j], k.s[j]) = (canon(v.0), canon(v.1));
        }
    } else {
        for j in 0..4 {
            // SAFETY: elements 16 j .. 16 j + 16 of the 64 at p.
            let v = unsafe { vld2q_u16(p.add(32 * j).cast()) };
            let widen = |h: uint16x4_t| canon(if KF == BF16 { widen_bf16_4(h) } else { widen_f16_4(h) });
            (k.c[2 * j], k.c[2 * j + 1]) = (widen(vget_low_u16(v.0)), widen(vget_high_u16(v.0)));
            (k.s[2 * j], k.s[2 * j + 1]) = (widen(vget_low_u16(v.1)), widen(vget_high_u16(v.1)));
        }
    }
    for j in 0..4 {
        let (c, s) = ((k.c[2 * j], k.c[2 * j + 1]), (k.s[2 * j], k.s[2 * j + 1]));
        k.d[j] = [vuzp1q_f32(c.0, c.1), vuzp2q_f32(c.0, c.1), vuzp1q_f32(s.0, s.1), vuzp2q_f32(s.0, s.1)];
    }
    let size = if KF == F32 { 4 } else { 2 };
    for j in 0..16 {
        // SAFETY: elements 4 j .. 4 j + 4 of the 64 at p.
        k.f[j] = canon(unsafe { load4::<KF>(p.add(4 * j * size)) });
    }
    k
}

/// The NEON level's [`Lanes`]: 4 lanes; interleaved f16 and f32 pairs split by `ld2` and joined
/// by `st2`; no output prefetch.
struct Neon;

impl Lanes for Neon {
    type V = float32x4_t;
    type Acc = ();
    type Forms = FormsNeon;
    const L: usize = 4;
    const PREFETCH_OUT: bool = false;
    const LD2: bool = true;

    level_fns! { "neon";
        unsafe fn loadu(p: *const f32) -> float32x4_t {
            // SAFETY: the caller guarantees 4 f32 at p.
            unsafe { vld1q_f32(p) }
        }
        unsafe fn load<const K: u8>(p: *const u8) -> float32x4_t {
            // SAFETY: the caller guarantees 4 elements of kind K at p.
            unsafe { load4::<K>(p) }
        }
        unsafe fn store<const K: u8>(p: *mut u8, v: float32x4_t) -> () {
            // SAFETY: the caller guarantees room for 4 elements of kind K at p.
            unsafe { store4::<K>(p, v) }
        }
        unsafe fn round(v: float32x4_t, r: Round) -> float32x4_t { round(v, r) }
        unsafe fn mul(a: float32x4_t, b: float32x4_t) -> float32x4_t { vmulq_f32(a, b) }
        unsafe fn fmadd(a: float32x4_t, b: float32x4_t, c: float32x4_t) -> float32x4_t { vfmaq_f32(c, a, b) }
        unsafe fn fnmadd(a: float32x4_t, b: float32x4_t, c: float32x4_t) -> float32x4_t { vfmsq_f32(c, a, b) }
        unsafe fn neg(v: float32x4_t) -> float32x4_t { vnegq_f32(v) }
        unsafe fn neg_even(v: float32x4_t) -> float32x4_t {
            let sign = vreinterpretq_u32_u64(vdupq_n_u64(0x8000_0000));
            vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(v), sign))
        }
        unsafe fn dup_even(v: float32x4_t) -> float32x4_t { vtrn1q_f32(v, v) }
        unsafe fn dup_odd(v: float32x4_t) -> float32x4_t { vtrn2q_f32(v, v) }
        unsafe fn swap_pairs(v: float32x4_t) -> float32x4_t { vrev64q_f32(v) }
        unsafe fn split_bf16(p: *const u8, r: Round) -> (float32x4_t, float32x4_t) {
            // SAFETY: the caller guarantees 16 bytes at p.
            let u = unsafe { vld1q_u32(p.cast()) };
            let e = vreinterpretq_f32_u32(vshlq_n_u32::<16>(u));
            let o = vreinterpretq_f32_u32(vandq_u32(u, vdupq_n_u32(0xFFFF_0000)));
            (round(e, r), round(o, r))
        }
        unsafe fn join_bf16<const CVT: bool, const ACC: bool>(p: *mut u8, e: float32x4_t, o: float32x4_t, _acc: &mut ()) -> () {
            // SAFETY: the caller guarantees 16 bytes at p and NaNs as `join_bf16` needs.
            unsafe { join_bf16(p, e, o) }
        }
        unsafe fn acc_new() -> () {}
        unsafe fn acc_hit(_acc: ()) -> bool { false }
        unsafe fn forms_zero() -> FormsNeon {
            let z = vdupq_n_f32(0.0);
            Forms { c: [z; 8], s: [z; 8], d: [[z; 4]; 4], f: [z; 16], fsw: [z; 16] }
        }
        unsafe fn forms<const KF: u8>(p: *const u8, canon: bool) -> FormsNeon {
            // SAFETY: the caller guarantees 64 elements of kind KF at p.
            unsafe { chunk_forms::<KF>(p, canon) }
        }
        unsafe fn load2<const K: u8>(p: *const u8) -> (float32x4_t, float32x4_t) {
            // SAFETY: the caller guarantees 8 elements of kind K at p.
            unsafe {
                match K {
                    F32 => {
                        let v = vld2q_f32(p.cast());
                        (v.0, v.1)
                    }
                    BF16 => {
                        let v = vld2_u16(p.cast());
                        (widen_bf16_4(v.0), widen_bf16_4(v.1))
                    }
                    _ => {
                        let v = vld2_u16(p.cast());
                        (widen_f16_4(v.0), widen_f16_4(v.1))
                    }
                }
            }
        }
        unsafe fn store2<const K: u8>(p: *mut u8, y0: float32x4_t, y1: float32x4_t) -> () {
            // SAFETY: the caller guarantees room for 8 elements of kind K at p.
            unsafe {
                match K {
                    F32 => vst2q_f32(p.cast(), float32x4x2_t(y0, y1)),
                    BF16 => vst2_u16(p.cast(), uint16x4x2_t(narrow_bf16_4(y0), narrow_bf16_4(y1))),
                    _ => vst2_u16(p.cast(), uint16x4x2_t(narrow_f16_4(y0), narrow_f16_4(y1))),
                }
            }
        }
    }

    #[inline(always)]
    fn prefetch(_p: *const u8) {}
}

// ---------------------------------------------------------------------------------------------
// The entry points: the NEON instances of the kernels in `rope_lanes`.

/// Rotates an f32 buffer by its `RopeRow` forms (`rotate_avx2` on NEON).
///
/// # Safety
/// NEON must be available; `row` holds the forms of `x.len()` rotary dims (`c`, `s`:
/// `x.len() / 2`; `f`, `fsw`: `x.len()` when `interleaved`).
#[target_feature(enable = "neon")]
pub(crate) unsafe fn rotate_neon(x: &mut [f32], row: &RopeRow<'_>, interleaved: bool, r: Round) {
    // SAFETY: the caller's contract is `rotate`'s, on this level.
    unsafe { rotate::<Neon>(x, row, interleaved, r) }
}

/// Rotates the rotary region of `heads` heads of `d` elements of kind `K` from `src` into `x`
/// (`src == x`: in place; the other dims of `x` are not touched), the x86 `heads_avx2` on NEON.
/// Returns the number of pairs per head done; the caller rotates the rest (a tail shorter than a
/// vector).
///
/// # Safety
/// NEON must be available; `src` and `x` each hold `heads · d` elements of kind `K` (2 bytes for
/// bf16 and f16, 4 for f32) and either are the same pointer or do not overlap; `row` holds the
/// forms of `rd` rotary dims for the pairing (`rd` even, ≤ `d`).
#[target_feature(enable = "neon")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn heads_neon<const K: u8>(
    src: *const u8,
    x: *mut u8,
    heads: usize,
    d: usize,
    rd: usize,
    row: &RopeRow<'_>,
    interleaved: bool,
    r: Round,
) -> usize {
    // SAFETY: the caller's contract is `heads_any`'s, on this level.
    unsafe { heads_any::<Neon, K>(src, x, heads, d, rd, row, interleaved, r) }
}

/// One run of tokens of the standalone RoPE with whole heads of `64 N` dims in `F32` math (the
/// x86 `token_avx2` on NEON): the freqs row of kind `KF` read once per token into registers (for
/// `N = 2` the compiler keeps what the 32 registers allow and the rest on the stack), the Q
/// heads (kind `KQ`) from `q` into `out`, the K heads (kind `KK`) in place at `k`, half-split
/// or (`INTER`) interleaved pairs.
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
    // SAFETY: the caller's contract is `token`'s, on this level.
    unsafe { token::<Neon, KQ, KK, KF, N, false, INTER>(freqs, (q, out, hq), (k, hk), tokens, k_stride) }
}

/// Every NaN lane of `v` made the default NaN (`f32::NAN`, as [`RopeRow::fill`] does), the others
/// kept.
#[target_feature(enable = "neon")]
#[inline]
fn default_nan(v: float32x4_t) -> float32x4_t {
    vbslq_f32(vceqq_f32(v, v), v, vdupq_n_f32(f32::NAN))
}
