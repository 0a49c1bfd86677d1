//! RoPE on f32 lanes, and the element conversions around it, behind one dispatch. The portable
//! versions here define the arithmetic; every SIMD version computes the same operations in the same
//! order (there is no summation: a lane's result depends only on its own pair), so every ISA is
//! bit-identical to them and to the oracle's `rope_pair`.

use super::{Isa, IsaToken};
use crate::DType;
use crate::element::Element;
use std::any::TypeId;

/// The rounding `MaxCompat` applies after each operation (to the freqs dtype); `F32` math rounds
/// nothing until the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Round {
    None,
    Bf16,
    F16,
}

impl Round {
    /// The rounding of `MaxCompat` math with freqs of type `F`.
    pub fn of<F: Element>() -> Round {
        match F::DTYPE {
            DType::BF16 => Round::Bf16,
            DType::F16 => Round::F16,
            // E4M3 freqs are rejected by validation; f32 rounds nothing.
            _ => Round::None,
        }
    }

    #[inline(always)]
    pub fn apply(self, v: f32) -> f32 {
        match self {
            Round::None => v,
            Round::Bf16 => half::bf16::from_f32(v).to_f32(),
            Round::F16 => half::f16::from_f32(v).to_f32(),
        }
    }
}

/// One position's rotation: the freqs row widened to f32, in the forms the kernels of one pairing
/// read (the other pairing's forms are empty).
pub(crate) struct RopeRow<'a> {
    /// Interleaved only: `c0, s0, c1, s1, …` (`rope_dim` values).
    pub f: &'a [f32],
    /// Interleaved only: `s0, c0, s1, c1, …`.
    pub fsw: &'a [f32],
    /// `c0, c1, …` (`rope_dim / 2`).
    pub c: &'a [f32],
    /// `s0, s1, …`.
    pub s: &'a [f32],
    /// Half-split only: `c` de-interleaved per 32 pairs: for each whole 32-pair chunk at `b`,
    /// `c[b], c[b+2], …, c[b+30], c[b+1], c[b+3], …` (what the bf16 kernel's even / odd lanes
    /// read); the rest as `c`.
    pub cd: &'a [f32],
    /// Half-split only: `s`, de-interleaved as `cd`.
    pub sd: &'a [f32],
}

impl RopeRow<'_> {
    /// f32 values the forms of a `rope_dim`-wide row take (either pairing).
    pub const fn len(rd: usize) -> usize {
        3 * rd
    }

    /// Fills the forms of `row` (`rope_dim` values of the freqs table) that the kernels of the
    /// pairing read into `buf` ([`len`](Self::len) f32: `c`, `s`, then `f`, `fsw` when
    /// `interleaved`, else `cd`, `sd`). Measured: filling all six forms per token was a quarter of
    /// a Qwen-shaped bf16 RoPE call; these loops have no index arithmetic and vectorise.
    pub fn fill<F: Element>(row: &[F], buf: &mut [f32], interleaved: bool) {
        let (rd, h) = (row.len(), row.len() / 2);
        let (c, rest) = buf.split_at_mut(h);
        let (s, rest) = rest.split_at_mut(h);
        // A NaN becomes the default quiet NaN, whose low 16 bits are 0 like every other NaN the
        // kernels meet (bf16 inputs widen with zero low bits; x86 arithmetic returns an operand's
        // NaN or the default one): the AVX-512 bf16 store relies on it. Results stay NaN where
        // the oracle's are; NaN sign and payload are outside the bit-exact promise.
        let canon = |v: f32| if v.is_nan() { f32::NAN } else { v };
        for ((p, c), s) in row.chunks_exact(2).zip(c.iter_mut()).zip(s.iter_mut()) {
            *c = canon(p[0].to_f32());
            *s = canon(p[1].to_f32());
        }
        let (c, s) = (&*c, &*s);
        if interleaved {
            let (f, fsw) = rest[..2 * rd].split_at_mut(rd);
            for (((f, w), &ci), &si) in f.chunks_exact_mut(2).zip(fsw.chunks_exact_mut(2)).zip(c).zip(s) {
                f[0] = ci;
                f[1] = si;
                w[0] = si;
                w[1] = ci;
            }
        } else {
            let (cd, sd) = rest[..rd].split_at_mut(h);
            let whole = h / 32 * 32;
            // Per 32 pairs (64 freqs `c, s, c, s, …`): the even pairs' c and s, then the odd ones'.
            let chunks = c[..whole].chunks_exact(32).zip(s[..whole].chunks_exact(32));
            for ((cc, sc), (cdc, sdc)) in
                chunks.zip(cd[..whole].chunks_exact_mut(32).zip(sd[..whole].chunks_exact_mut(32)))
            {
                let (ce, co) = cdc.split_at_mut(16);
                let (se, so) = sdc.split_at_mut(16);
                for j in 0..16 {
                    ce[j] = cc[2 * j];
                    co[j] = cc[2 * j + 1];
                    se[j] = sc[2 * j];
                    so[j] = sc[2 * j + 1];
                }
            }
            cd[whole..].copy_from_slice(&c[whole..]);
            sd[whole..].copy_from_slice(&s[whole..]);
        }
    }

    /// [`fill`](Self::fill) through `token`'s ISA where it has a version (AVX-512: half-split rows
    /// of whole 32-pair chunks, after widening the row into the part of `buf` the half-split
    /// forms leave free); the same values.
    pub fn fill_with<F: Element>(token: IsaToken, row: &[F], buf: &mut [f32], interleaved: bool) {
        let (rd, h) = (row.len(), row.len() / 2);
        #[cfg(target_arch = "x86_64")]
        if matches!(token.0, Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx2) && !interleaved && h > 0 && h.is_multiple_of(32)
        {
            let (forms, rest) = buf.split_at_mut(2 * rd);
            let widened: &[f32] = if F::DTYPE == DType::F32 {
                // An f32 row is read where it is (its copy into `rest` was 3 % of a Qwen-shaped
                // call: one `memcpy` per token).
                // SAFETY: `Element` is sealed and only `f32` has the dtype F32, so `row` is `rd`
                // f32 values.
                unsafe { std::slice::from_raw_parts(row.as_ptr().cast::<f32>(), rd) }
            } else {
                let scratch = &mut rest[..rd];
                widen(token, row, scratch);
                scratch
            };
            let (c, forms) = forms.split_at_mut(h);
            let (s, forms) = forms.split_at_mut(h);
            let (cd, sd) = forms.split_at_mut(h);
            // SAFETY: the token proves AVX-512 F (AVX2 for `Avx2`) was detected; c, s, cd and sd
            // are h long, h is a multiple of 32 and `widened` holds the 2h freqs as f32.
            unsafe {
                if token.0 == Isa::Avx2 {
                    super::x86::rope::fill_half_avx2(widened, c, s, cd, sd)
                } else {
                    super::x86::rope::fill_half_avx512(widened, c, s, cd, sd)
                }
            };
            return;
        }
        let _ = (token, rd, h);
        Self::fill(row, buf, interleaved)
    }

    /// The forms in `buf` as filled by [`fill`](Self::fill) for the same pairing.
    pub fn view(buf: &[f32], rd: usize, interleaved: bool) -> RopeRow<'_> {
        let h = rd / 2;
        let (c, s) = (&buf[..h], &buf[h..rd]);
        let empty: &[f32] = &[];
        if interleaved {
            RopeRow { f: &buf[rd..2 * rd], fsw: &buf[2 * rd..3 * rd], c, s, cd: empty, sd: empty }
        } else {
            RopeRow { f: empty, fsw: empty, c, s, cd: &buf[rd..rd + h], sd: &buf[rd + h..2 * rd] }
        }
    }
}

/// One pair, as the oracle computes it (`F32`: `t1 = x1·s`, `y0 = fma(x0, c, −t1)`,
/// `t2 = x1·c`, `y1 = fma(x0, s, t2)`; `MaxCompat`: the same with a rounding after each step and
/// on the inputs).
#[inline(always)]
pub(crate) fn pair(x0: f32, x1: f32, c: f32, s: f32, r: Round) -> (f32, f32) {
    let (x0, x1) = (r.apply(x0), r.apply(x1));
    let t1 = r.apply(x1 * s);
    let y0 = r.apply(x0.mul_add(c, -t1));
    let t2 = r.apply(x1 * c);
    let y1 = r.apply(x0.mul_add(s, t2));
    (y0, y1)
}

/// Portable rotation of the rotary region `x` (`rope_dim` values) in place.
pub(crate) fn rotate_scalar(x: &mut [f32], row: &RopeRow<'_>, interleaved: bool, r: Round) {
    let h = x.len() / 2;
    for i in 0..h {
        let (j0, j1) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + h) };
        let (y0, y1) = pair(x[j0], x[j1], row.c[i], row.s[i], r);
        x[j0] = y0;
        x[j1] = y1;
    }
}

/// Rotates the rotary region `x` (`rope_dim` values, even) of one head in place: pairs
/// `(2i, 2i+1)` when `interleaved`, else `(i, i + rope_dim/2)`, pair `i` with `(row.c[i], row.s[i])`.
pub(crate) fn rotate(token: IsaToken, x: &mut [f32], row: &RopeRow<'_>, interleaved: bool, r: Round) {
    let rd = x.len();
    assert!(rd.is_multiple_of(2) && row.c.len() == rd / 2 && row.s.len() == rd / 2);
    assert!(!interleaved || (row.f.len() == rd && row.fsw.len() == rd));
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 F (with BW: Avx512 and up) was detected; the asserts
        // above prove the lengths the kernel's loads rely on.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { super::x86::rope::rotate_avx512(x, row, interleaved, r) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX2, FMA and F16C were detected; lengths as above.
        Isa::Avx2 => unsafe { super::x86::rope::rotate_avx2(x, row, interleaved, r) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the token proves NEON was detected; lengths as above.
        Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm => unsafe {
            super::neon::rope::rotate_neon(x, row, interleaved, r)
        },
        _ => rotate_scalar(x, row, interleaved, r),
    }
}

/// `dst[j] = f32(src[j])` for `j` from `from` on, bf16 (`bf16`) or f16 bits, through `half`: the
/// SIMD `widen16` kernels' tail.
///
/// # Safety
/// `src` points at `dst.len()` readable u16.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) unsafe fn widen16_tail(src: *const u16, dst: &mut [f32], from: usize, bf16: bool) {
    for (j, d) in dst.iter_mut().enumerate().skip(from) {
        // SAFETY: j < dst.len().
        let b = unsafe { *src.add(j) };
        *d = if bf16 { half::bf16::from_bits(b).to_f32() } else { half::f16::from_bits(b).to_f32() };
    }
}

/// `dst[j] = bf16/f16(src[j])` for `j` from `from` on, through `half`: the SIMD `narrow16`
/// kernels' tail.
///
/// # Safety
/// `dst` points at `src.len()` writable u16.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) unsafe fn narrow16_tail(src: &[f32], dst: *mut u16, from: usize, bf16: bool) {
    for (j, s) in src.iter().enumerate().skip(from) {
        let b = if bf16 { half::bf16::from_f32(*s).to_bits() } else { half::f16::from_f32(*s).to_bits() };
        // SAFETY: j < src.len().
        unsafe { *dst.add(j) = b };
    }
}

/// `dst[j] = src[j]` for `j` in `from .. n`, a NaN made quiet through `half` (the oracle's
/// conversion): the SIMD `copy16` kernels' tail.
///
/// # Safety
/// `src` points at `n` readable u16 and `dst` at `n` writable u16.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) unsafe fn copy16_tail(src: *const u16, dst: *mut u16, n: usize, from: usize, bf16: bool) {
    for j in from..n {
        // SAFETY: j < n.
        unsafe {
            let b = *src.add(j);
            *dst.add(j) = if bf16 {
                half::bf16::from_f32(half::bf16::from_bits(b).to_f32()).to_bits()
            } else {
                half::f16::from_f32(half::f16::from_bits(b).to_f32()).to_bits()
            };
        }
    }
}

/// `s` as a slice of `B` where `A` is `B` (the same type, by `TypeId`).
pub(crate) fn same_type<A: 'static, B: 'static>(s: &[A]) -> Option<&[B]> {
    // SAFETY: A and B are one type, so the slice is `s.len()` values of B at the same address.
    (TypeId::of::<A>() == TypeId::of::<B>()).then(|| unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) })
}

/// [`same_type`] for a mutable slice.
pub(crate) fn same_type_mut<A: 'static, B: 'static>(s: &mut [A]) -> Option<&mut [B]> {
    // SAFETY: as in `same_type`; the returned borrow takes over `s`'s.
    (TypeId::of::<A>() == TypeId::of::<B>())
        .then(|| unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), s.len()) })
}

/// `dst[i] = C::from_f32(src[i].to_f32())`: the oracle's KV-store conversion (round once to the
/// cache's type), the same bits, without the f32 round trip where it is not needed: within one
/// 16-bit type a copy that quiets NaNs (`copy16`), within f32 a copy, from f32 [`narrow`], into
/// f32 [`widen`]; otherwise (between bf16 and f16, and E4M3) through `buf`. Measured: see docs/performance.md
/// ("KV stores").
pub(crate) fn convert<T: Element, C: Element>(token: IsaToken, src: &[T], dst: &mut [C], buf: &mut Vec<f32>) {
    assert_eq!(src.len(), dst.len());
    if let Some(s) = same_type::<T, C>(src) {
        match C::DTYPE {
            DType::F32 => return dst.copy_from_slice(s),
            DType::BF16 | DType::F16 => return copy16(token, s, dst),
            DType::F8E4M3 => {}
        }
    }
    if let Some(s) = same_type::<T, f32>(src) {
        return narrow(token, s, dst);
    }
    if let Some(d) = same_type_mut::<C, f32>(dst) {
        return widen(token, src, d);
    }
    buf.resize(src.len(), 0.0);
    widen(token, src, buf);
    narrow(token, buf, dst);
}

/// `dst[i] = T::from_f32(src[i].to_f32())` for a 16-bit type `T`: a copy, NaNs made quiet.
fn copy16<T: Element>(token: IsaToken, src: &[T], dst: &mut [T]) {
    // The 16-bit casts below rest on this (`Element` is sealed: its bf16/f16 are 2-byte types).
    assert!(src.len() == dst.len() && matches!(T::DTYPE, DType::BF16 | DType::F16) && size_of::<T>() == 2);
    let (from, to, n, bf16) =
        (src.as_ptr().cast::<u16>(), dst.as_mut_ptr().cast::<u16>(), src.len(), T::DTYPE == DType::BF16);
    #[cfg(target_arch = "x86_64")]
    if matches!(token.0, Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16) {
        // SAFETY: the token proves AVX2 was detected (and AVX-512 F and BW for the AVX-512
        // levels); T is a 16-bit type (asserted), so `src` and `dst` are n u16 values each.
        unsafe {
            if token.0 == Isa::Avx2 {
                super::x86::rope::copy16(from, to, n, bf16)
            } else {
                super::x86::rope::copy16_avx512(from, to, n, bf16)
            }
        };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if matches!(token.0, Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm) {
        // SAFETY: the token proves NEON was detected; T is a 16-bit type (asserted), so `src` and
        // `dst` are n u16 values each.
        unsafe { super::neon::rope::copy16(from, to, n, bf16) };
        return;
    }
    let _ = (token, from, to, n, bf16);
    for (d, s) in dst.iter_mut().zip(src) {
        *d = T::from_f32(s.to_f32());
    }
}

/// `dst[i] = src[i].to_f32()` (exact).
pub(crate) fn widen<T: Element>(token: IsaToken, src: &[T], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if matches!(token.0, Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16) && matches!(T::DTYPE, DType::BF16 | DType::F16) {
        assert_eq!(size_of::<T>(), 2); // the cast's premise (a sealed 16-bit Element)
        // SAFETY: the token proves AVX2 and F16C were detected; T is a 16-bit type (checked), so
        // `src` is `src.len()` u16 values; the lengths are equal (asserted).
        unsafe { super::x86::rope::widen16(src.as_ptr().cast(), dst, T::DTYPE == DType::BF16) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if matches!(token.0, Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm) && matches!(T::DTYPE, DType::BF16 | DType::F16) {
        assert_eq!(size_of::<T>(), 2); // the cast's premise (a sealed 16-bit Element)
        // SAFETY: the token proves NEON was detected; T is a 16-bit type (checked), so `src` is
        // `src.len()` u16 values; the lengths are equal (asserted).
        unsafe { super::neon::rope::widen16(src.as_ptr().cast(), dst, T::DTYPE == DType::BF16) };
        return;
    }
    let _ = token;
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// `dst[i] = T::from_f32(src[i])` (round to nearest even; the conversions of `Element`).
pub(crate) fn narrow<T: Element>(token: IsaToken, src: &[f32], dst: &mut [T]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if matches!(token.0, Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16) && matches!(T::DTYPE, DType::BF16 | DType::F16) {
        assert_eq!(size_of::<T>(), 2); // the cast's premise (a sealed 16-bit Element)
        let (d, bf16) = (dst.as_mut_ptr().cast(), T::DTYPE == DType::BF16);
        // SAFETY: the token proves AVX2, FMA and F16C were detected (and AVX-512 F and BW for
        // the AVX-512 levels); T is a 16-bit type (checked), so `dst` is `dst.len()` u16 values;
        // the lengths are equal (asserted).
        unsafe {
            match token.0 {
                Isa::Avx2 => super::x86::rope::narrow16(src, d, bf16),
                _ => super::x86::rope::narrow16_avx512(src, d, bf16),
            }
        };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if matches!(token.0, Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm) && matches!(T::DTYPE, DType::BF16 | DType::F16) {
        assert_eq!(size_of::<T>(), 2); // the cast's premise (a sealed 16-bit Element)
        // SAFETY: the token proves NEON was detected; T is a 16-bit type (checked), so `dst` is
        // `dst.len()` u16 values; the lengths are equal (asserted).
        unsafe { super::neon::rope::narrow16(src, dst.as_mut_ptr().cast(), T::DTYPE == DType::BF16) };
        return;
    }
    let _ = token;
    for (d, s) in dst.iter_mut().zip(src) {
        *d = T::from_f32(*s);
    }
}

/// Rotates the rotary region of each of `heads` consecutive heads of `d` elements of `x` in place
/// (interleaved: the last `rope_dim` dims of a head, else the first). AVX-512 and AVX2 load and
/// store bf16/f16/f32 directly; other ISAs and E4M3 go through `buf` (≥ `rope_dim` f32) with
/// [`widen`], [`rotate`] and [`narrow`]; the same operations either way.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rotate_heads<T: Element>(
    token: IsaToken,
    x: &mut [T],
    heads: (usize, usize),
    row: &RopeRow<'_>,
    interleaved: bool,
    r: Round,
    buf: &mut [f32],
) {
    rotate_heads_from(token, None, x, heads, row, interleaved, r, buf)
}

/// [`rotate_heads`] reading from `src` (the same layout as `x`) when given: `x` receives the
/// rotated heads, their other dims copied from `src` — one pass over the bytes instead of a copy
/// and an in-place pass.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rotate_heads_from<T: Element>(
    token: IsaToken,
    src: Option<&[T]>,
    x: &mut [T],
    (heads, d): (usize, usize),
    row: &RopeRow<'_>,
    interleaved: bool,
    r: Round,
    buf: &mut [f32],
) {
    let rd = 2 * row.c.len();
    assert!(rd <= d && x.len() >= heads * d && buf.len() >= rd && row.s.len() == rd / 2);
    if interleaved {
        assert!(row.f.len() == rd && row.fsw.len() == rd);
    } else {
        assert!(row.cd.len() == rd / 2 && row.sd.len() == rd / 2);
    }
    assert!(src.is_none_or(|s| s.len() >= heads * d));
    let at = if interleaved { d - rd } else { 0 };
    #[cfg(target_arch = "x86_64")]
    if matches!(token.0, Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx2) && T::DTYPE != DType::F8E4M3 {
        use super::x86::rope::{BF16, F16, F32, heads_avx2, heads_avx512};
        copy_outside(src, x, (heads, d), at, rd);
        let p = x.as_mut_ptr().cast::<u8>();
        let from = src.map_or(p.cast_const(), |s| s.as_ptr().cast::<u8>());
        let kind = x86_kind::<T>();
        if half_kernel::<T>(token, interleaved, r, rd / 2).is_some() {
            // SAFETY: the token proves AVX-512 F and BW (AVX2, FMA and F16C for `Avx2`); x (and
            // src, a distinct borrow when given, so not overlapping) holds heads · d elements of
            // T, whose kind (and so size) is `kind`; `half_fast_path` checked the pairing, the
            // math and that the rotary half (rd ≤ d) is whole vectors; the asserts above prove
            // the lengths of the half-split forms in `row`.
            unsafe { heads_half_x86(token, kind, from, p, heads, d, rd / 2, row) };
            return;
        }
        // SAFETY: the token proves AVX-512 F and BW (AVX2, FMA and F16C for `Avx2`); x (and
        // src, a distinct borrow when given, so not overlapping) holds heads · d elements of T,
        // whose kind (and so size) `kind` names; the asserts above prove the lengths of
        // `row`.
        let done = unsafe {
            match (token.0 == Isa::Avx2, kind) {
                (false, BF16) => heads_avx512::<BF16>(from, p, heads, d, rd, row, interleaved, r),
                (false, F16) => heads_avx512::<F16>(from, p, heads, d, rd, row, interleaved, r),
                (false, _) => heads_avx512::<F32>(from, p, heads, d, rd, row, interleaved, r),
                (true, BF16) => heads_avx2::<BF16>(from, p, heads, d, rd, row, interleaved, r),
                (true, F16) => heads_avx2::<F16>(from, p, heads, d, rd, row, interleaved, r),
                (true, _) => heads_avx2::<F32>(from, p, heads, d, rd, row, interleaved, r),
            }
        };
        tail_pairs(src, x, (heads, d), at, done, row, interleaved, r);
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if let Some(kind) = neon_kind::<T>(token) {
        use super::neon::rope::{BF16, F16, F32, heads_neon};
        copy_outside(src, x, (heads, d), at, rd);
        let p = x.as_mut_ptr().cast::<u8>();
        let from = src.map_or(p.cast_const(), |s| s.as_ptr().cast::<u8>());
        // SAFETY: the token proves NEON; x (and src, a distinct borrow when given, so not
        // overlapping) holds heads · d elements of T, whose kind (and so size) `kind` names
        // (`neon_kind`); the asserts above prove the lengths of `row`.
        let done = unsafe {
            match kind {
                BF16 => heads_neon::<BF16>(from, p, heads, d, rd, row, interleaved, r),
                F16 => heads_neon::<F16>(from, p, heads, d, rd, row, interleaved, r),
                _ => heads_neon::<F32>(from, p, heads, d, rd, row, interleaved, r),
            }
        };
        tail_pairs(src, x, (heads, d), at, done, row, interleaved, r);
        return;
    }
    if let Some(s) = src {
        x[..heads * d].copy_from_slice(&s[..heads * d]);
    }
    for h in 0..heads {
        let region = &mut x[h * d + at..h * d + at + rd];
        let b = &mut buf[..rd];
        widen(token, region, b);
        rotate(token, b, row, interleaved, r);
        narrow(token, b, region);
    }
}

/// Copies each head's dims outside its rotary region (`at .. at + rd`) from `src`, when given,
/// into `x`: the head kernels write only the rotary region.
fn copy_outside<T: Element>(src: Option<&[T]>, x: &mut [T], (heads, d): (usize, usize), at: usize, rd: usize) {
    if let Some(s) = src
        && rd < d
    {
        for h in 0..heads {
            let (r0, r1) = (h * d + at, h * d + at + rd);
            x[h * d..r0].copy_from_slice(&s[h * d..r0]);
            x[r1..(h + 1) * d].copy_from_slice(&s[r1..(h + 1) * d]);
        }
    }
}

/// The pairs `done ..` of each head's rotary region that a head kernel left (fewer than a
/// vector), one at a time: the oracle's operations, read from `src` when given, else in place.
#[allow(clippy::too_many_arguments)]
fn tail_pairs<T: Element>(
    src: Option<&[T]>,
    x: &mut [T],
    (heads, d): (usize, usize),
    at: usize,
    done: usize,
    row: &RopeRow<'_>,
    interleaved: bool,
    r: Round,
) {
    let rd = 2 * row.c.len();
    if done == rd / 2 {
        return; // (a head of whole vectors: no per-head slicing for nothing)
    }
    for h in 0..heads {
        let (o, head) = (h * d + at, &mut x[h * d + at..h * d + at + rd]);
        for i in done..rd / 2 {
            let (j0, j1) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + rd / 2) };
            let (x0, x1) = match src {
                Some(s) => (s[o + j0].to_f32(), s[o + j1].to_f32()),
                None => (head[j0].to_f32(), head[j1].to_f32()),
            };
            let (y0, y1) = pair(x0, x1, row.c[i], row.s[i], r);
            head[j0] = T::from_f32(y0);
            head[j1] = T::from_f32(y1);
        }
    }
}

/// The NEON head kernel's element kind of `T` where `heads_neon` takes it: a NEON level, bf16,
/// f16 or f32 elements (E4M3 elements go through the f32 buffer).
#[cfg(target_arch = "aarch64")]
fn neon_kind<T: Element>(token: IsaToken) -> Option<u8> {
    use super::neon::rope::{BF16, F16, F32};
    let neon = matches!(token.0, Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm);
    match T::DTYPE {
        DType::BF16 if neon => Some(BF16),
        DType::F16 if neon => Some(F16),
        DType::F32 if neon => Some(F32),
        _ => None,
    }
}

/// The x86 head kernels' element kind of `T` (E4M3, which they do not load, excluded by callers).
#[cfg(target_arch = "x86_64")]
fn x86_kind<T: Element>() -> u8 {
    use super::x86::rope::{BF16, F16, F32};
    match T::DTYPE {
        DType::BF16 => BF16,
        DType::F16 => F16,
        _ => F32,
    }
}

/// `T`'s kind ([`x86_kind`]) when `token`'s half-split `F32` head kernel takes heads of `T` with
/// a rotary half of `hh` pairs (an x86 level, not E4M3, `half_fast_path`), else `None`.
#[cfg(target_arch = "x86_64")]
fn half_kernel<T: Element>(token: IsaToken, interleaved: bool, r: Round, hh: usize) -> Option<u8> {
    let x86 = matches!(token.0, Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx2) && T::DTYPE != DType::F8E4M3;
    let kind = x86_kind::<T>();
    (x86 && super::x86::rope::half_fast_path(kind, interleaved, r, hh)).then_some(kind)
}

/// The half-split `F32` head kernel of `token`'s x86 level (`heads_half_avx2` or
/// `heads_half_avx512`) for elements of `kind`.
///
/// # Safety
/// `token` is `Avx2`, `Avx512` or `Avx512Bf16` (so detected; `Avx512Bf16` stores bf16 heads by
/// `vcvtne2ps2bf16`, the same bits); the kernel's contract holds for
/// elements of `kind` (`x86_kind`): `src`, `x` hold `heads · d` of them (the same pointer or not
/// overlapping), `super::x86::rope::half_fast_path` holds for `hh` and `2 · hh ≤ d`, `row`
/// holds the half-split forms of `hh` pairs.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn heads_half_x86(
    token: IsaToken,
    kind: u8,
    src: *const u8,
    x: *mut u8,
    heads: usize,
    d: usize,
    hh: usize,
    row: &RopeRow<'_>,
) {
    use super::x86::rope::{BF16, F16, F32, heads_half_avx2, heads_half_avx512};
    // SAFETY: the caller's contract is each kernel's (AVX2, FMA and F16C for `Avx2`, AVX-512 F
    // and BW for the others, plus BF16 for `Avx512Bf16`, detected as the token proves).
    unsafe {
        match (token.0, kind) {
            (Isa::Avx512Bf16, BF16) => heads_half_avx512::<BF16, true>(src, x, heads, d, hh, row),
            (Isa::Avx2, BF16) => heads_half_avx2::<BF16>(src, x, heads, d, hh, row),
            (Isa::Avx2, F16) => heads_half_avx2::<F16>(src, x, heads, d, hh, row),
            (Isa::Avx2, _) => heads_half_avx2::<F32>(src, x, heads, d, hh, row),
            (_, BF16) => heads_half_avx512::<BF16, false>(src, x, heads, d, hh, row),
            (_, F16) => heads_half_avx512::<F16, false>(src, x, heads, d, hh, row),
            (_, _) => heads_half_avx512::<F32, false>(src, x, heads, d, hh, row),
        }
    }
}

/// The standalone RoPE's commonest case, decided once per call instead of per token: half-split
/// pairs, `F32` math, whole heads rotated (`rope_dim` = both head sizes) and a rotary half of
/// whole vectors, on an x86 level whose half-split head kernels take both element types. Per
/// token it fills the forms and runs the two head kernels — what [`rotate_heads_from`] and
/// [`rotate_heads`] do after their checks, so the same operations and bits. Measured (Intel Xeon Emerald Rapids, a driver
/// alternating the two versions call by call, medians of 1900 calls): 1–3 % faster in each of
/// ten cases (bf16 Qwen 64 / 512 and Llama 64 / 512 tokens, f32 Qwen 512; one and two threads),
/// e.g. 512 Qwen-shaped bf16 tokens on one core 72.8 → 70.7 µs. perf had put the per-token code
/// outside the kernels at a fifth of the samples; most of that was waiting on the kernels' data.
/// On AVX-512, heads of 64 or 128 dims go to one token kernel instead (`TokenFn`: the
/// forms in registers, no buffer): AMD Zen 5, one core, 512 Qwen-shaped bf16 tokens ~37 → 29 µs,
/// 512 Llama-shaped 155–161 → 103–106 µs (docs/performance.md, "RoPE on Zen 5").
pub(crate) struct HalfRows<T, C> {
    token: IsaToken,
    /// The x86 kinds of the Q and the cache elements (`new` makes none elsewhere).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    kinds: (u8, u8),
    /// Pairs per head (`rope_dim / 2`), Q heads, K heads.
    hh: usize,
    hq: usize,
    hk: usize,
    /// The element types the kinds were checked for.
    types: std::marker::PhantomData<fn(&T, &C)>,
}

impl<T: Element, C: Element> HalfRows<T, C> {
    /// The prepared path for Q heads of `T` and cache heads of `C`, or `None` where the general
    /// per-token path ([`rotate_heads_from`], [`rotate_heads`]) must run.
    pub fn new(
        token: IsaToken,
        interleaved: bool,
        r: Round,
        rd: usize,
        (hq, dq): (usize, usize),
        (hk, dk): (usize, usize),
    ) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            let hh = rd / 2;
            if let (Some(kq), Some(kk)) =
                (half_kernel::<T>(token, interleaved, r, hh), half_kernel::<C>(token, interleaved, r, hh))
                && rd == dq
                && rd == dk
            {
                return Some(HalfRows { token, kinds: (kq, kk), hh, hq, hk, types: std::marker::PhantomData });
            }
        }
        let _ = (token, interleaved, r, rd, hq, dq, hk, dk);
        None
    }

    /// f32 values of the per-token buffer [`row`](Self::row) takes.
    pub fn buf_len(&self) -> usize {
        RopeRow::len(2 * self.hh)
    }

    /// One token: the freqs row `freqs` (`rope_dim` values) into `buf`, its Q heads from `q` into
    /// `out` and its K heads in place in `k`. (Where [`TokenFn::new`] gives a kernel, that
    /// kernel computes the same without the buffer: the caller picks it once per call.)
    pub fn row<F: Element>(&self, freqs: &[F], q: &[T], out: &mut [T], k: &mut [C], buf: &mut [f32]) {
        let rd = 2 * self.hh;
        assert!(freqs.len() == rd && buf.len() >= RopeRow::len(rd));
        assert!(q.len() >= self.hq * rd && out.len() >= self.hq * rd && k.len() >= self.hk * rd);
        RopeRow::fill_with(self.token, freqs, buf, false);
        #[cfg(target_arch = "x86_64")]
        {
            let row = RopeRow::view(buf, rd, false);
            // SAFETY: `new` checked, through `half_kernel`, that the token is an x86 level whose
            // half-split kernels take both kinds with this rotary half, and that the heads are
            // whole rotary regions (2 · hh = d); `q`, `out` hold hq · d elements of T and `k`
            // hk · d of C (asserted; the kinds are T's and C's, the struct's types), `q` and
            // `out` are distinct borrows and `k` is rotated in place; `row` holds the half-split
            // forms of hh pairs.
            unsafe {
                let (kq, kk) = self.kinds;
                let (hh, kp) = (self.hh, k.as_mut_ptr().cast::<u8>());
                heads_half_x86(self.token, kq, q.as_ptr().cast(), out.as_mut_ptr().cast(), self.hq, rd, hh, &row);
                heads_half_x86(self.token, kk, kp.cast_const(), kp, self.hk, rd, hh, &row);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("HalfRows::new returns None off x86: {:?}", (q.len(), out.len(), k.len()))
    }
}

/// The token kernels' signature (`token_avx512`, `token_avx2`, `token_neon`: `freqs, q, out,
/// hq, k, hk, tokens, k_stride`).
type TokenKernel = unsafe fn(*const u8, *const u8, *mut u8, usize, *mut u8, usize, usize, usize);

/// A token kernel chosen by [`TokenFn::new`] for Q heads of `T`, cache heads of `C` and
/// freqs of `F`: only `new` makes one, after checking that the kernel's ISA is available
/// and that it takes these element types, this head size and these head counts.
pub(crate) struct TokenFn<T, C, F> {
    #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
    f: TokenKernel,
    hq: usize,
    hk: usize,
    /// Rotary dims (the head size).
    rd: usize,
    types: std::marker::PhantomData<fn(&T, &C, &F)>,
}

impl<T: Element, C: Element, F: Element> TokenFn<T, C, F> {
    /// The token kernel of a call's shape, where one applies: AVX-512, AVX2 or NEON, `F32` math,
    /// whole heads (`rope_dim` equal to both head sizes) of 64 or 128 dims, Q and cache of one
    /// type, freqs f32 or of that type; either pairing (`token_avx512`, `token_avx2`,
    /// `token_neon`). The forms stay in registers (AVX2, and NEON with 128-dim heads: partly on
    /// the stack) for all of the token's heads instead of going
    /// through a per-token buffer, and the call's rows skip the general path's checks and
    /// dispatch. The same operations, so the same bits. Measured: see
    /// docs/performance.md ("RoPE on Zen 5", "Token kernels for both pairings").
    pub fn new(
        token: IsaToken,
        interleaved: bool,
        r: Round,
        rd: usize,
        (hq, dq): (usize, usize),
        (hk, dk): (usize, usize),
    ) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            use super::x86::rope::{BF16, F16, F32, token_avx2, token_avx512};
            if !matches!(token.0, Isa::Avx512 | Isa::Avx512Bf16 | Isa::Avx2)
                || r != Round::None
                || rd != dq
                || rd != dk
                || [T::DTYPE, C::DTYPE, F::DTYPE].contains(&DType::F8E4M3)
            {
                return None;
            }
            let n = rd / 64;
            if n * 64 != rd {
                return None;
            }
            // bf16 heads stored by `vcvtne2ps2bf16` where the token proves AVX-512 BF16 (the
            // same bits; `join_bf16_cvt`).
            let cvt = token.0 == Isa::Avx512Bf16;
            let avx2 = token.0 == Isa::Avx2;
            macro_rules! pick {
                ($kq:ident, $kk:ident, $kf:ident, $cvt:literal) => {
                    match (interleaved, n) {
                        (false, 1) if avx2 => token_avx2::<$kq, $kk, $kf, 1, false> as TokenKernel,
                        (false, 2) if avx2 => token_avx2::<$kq, $kk, $kf, 2, false> as TokenKernel,
                        (true, 1) if avx2 => token_avx2::<$kq, $kk, $kf, 1, true> as TokenKernel,
                        (true, 2) if avx2 => token_avx2::<$kq, $kk, $kf, 2, true> as TokenKernel,
                        (false, 1) => token_avx512::<$kq, $kk, $kf, 1, $cvt, false> as TokenKernel,
                        (false, 2) => token_avx512::<$kq, $kk, $kf, 2, $cvt, false> as TokenKernel,
                        (true, 1) => token_avx512::<$kq, $kk, $kf, 1, $cvt, true> as TokenKernel,
                        (true, 2) => token_avx512::<$kq, $kk, $kf, 2, $cvt, true> as TokenKernel,
                        _ => return None,
                    }
                };
                ($kq:ident, $kk:ident, $kf:ident) => {
                    pick!($kq, $kk, $kf, false)
                };
            }
            let f = match ((x86_kind::<T>(), x86_kind::<C>()), x86_kind::<F>()) {
                ((BF16, BF16), F32) if cvt => pick!(BF16, BF16, F32, true),
                ((BF16, BF16), BF16) if cvt => pick!(BF16, BF16, BF16, true),
                ((BF16, BF16), F32) => pick!(BF16, BF16, F32),
                ((BF16, BF16), BF16) => pick!(BF16, BF16, BF16),
                ((F16, F16), F32) => pick!(F16, F16, F32),
                ((F16, F16), F16) => pick!(F16, F16, F16),
                ((F32, F32), F32) => pick!(F32, F32, F32),
                _ => return None,
            };
            Some(TokenFn { f, hq, hk, rd, types: std::marker::PhantomData })
        }
        #[cfg(target_arch = "aarch64")]
        {
            use super::neon::rope::{BF16, F16, F32, token_neon};
            let n = rd / 64;
            if r != Round::None || rd != dq || rd != dk || n * 64 != rd {
                return None;
            }
            macro_rules! pick {
                ($kq:ident, $kk:ident, $kf:ident) => {
                    match (interleaved, n) {
                        (false, 1) => token_neon::<$kq, $kk, $kf, 1, false> as TokenKernel,
                        (false, 2) => token_neon::<$kq, $kk, $kf, 2, false> as TokenKernel,
                        (true, 1) => token_neon::<$kq, $kk, $kf, 1, true> as TokenKernel,
                        (true, 2) => token_neon::<$kq, $kk, $kf, 2, true> as TokenKernel,
                        _ => return None,
                    }
                };
            }
            // `neon_kind` is `None` off NEON and for E4M3.
            let f = match ((neon_kind::<T>(token)?, neon_kind::<C>(token)?), neon_kind::<F>(token)?) {
                ((BF16, BF16), F32) => pick!(BF16, BF16, F32),
                ((BF16, BF16), BF16) => pick!(BF16, BF16, BF16),
                ((F16, F16), F32) => pick!(F16, F16, F32),
                ((F16, F16), F16) => pick!(F16, F16, F16),
                ((F32, F32), F32) => pick!(F32, F32, F32),
                _ => return None,
            };
            Some(TokenFn { f, hq, hk, rd, types: std::marker::PhantomData })
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            let _ = (token, interleaved, r, rd, hq, dq, hk, dk);
            None
        }
    }

    /// A run of `tokens` consecutive tokens, each as [`HalfRows::row`]: token `t` takes the
    /// freqs row `t` of `freqs`, its Q heads from row `t` of `q` into row `t` of `out`, and its
    /// K heads in place from element `t · k_stride` of `k`. A run pays the call and the
    /// kernel's setup once (measured: docs/performance.md, "RoPE runs and per-sequence slots").
    #[inline]
    pub fn run(&self, freqs: &[F], q: &[T], out: &mut [T], k: &mut [C], tokens: usize, k_stride: usize) {
        let (rd, qw, kw) = (self.rd, self.hq * self.rd, self.hk * self.rd);
        assert!(
            freqs.len() == tokens * rd
                && q.len() >= tokens * qw
                && out.len() >= tokens * qw
                && k_stride >= kw
                && (tokens == 0 || k.len() >= (tokens - 1) * k_stride + kw)
        );
        // SAFETY: `new` made `f` only where the token proves the kernel's ISA (AVX2, FMA and
        // F16C for `token_avx2`; AVX-512 F and BW for `token_avx512`, and BF16 for its `CVT`
        // kernels, which it picks only for `Avx512Bf16`; NEON for `token_neon`) and the kernel
        // takes F (freqs: a row of
        // rd = 64 N elements per token, asserted), T (q and out: hq · 64 N per token, asserted;
        // distinct borrows) and C (k: hk · 64 N from `t · k_stride` per token, asserted, rotated
        // in place, `k_stride ≥ hk · 64 N`), the kinds being these types' (the struct's type
        // parameters).
        unsafe {
            (self.f)(
                freqs.as_ptr().cast(),
                q.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                self.hq,
                k.as_mut_ptr().cast(),
                self.hk,
                tokens,
                k_stride,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `fill_with` (SIMD where the ISA has it) writes exactly `fill`'s forms, NaN payloads and
    /// infinities included, for f32 and bf16 rows of whole 32-pair chunks and of other sizes.
    #[test]
    fn fill_with_equals_fill_on_every_isa() {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let value = |i: usize| match i % 37 {
            5 => f32::from_bits(0x7FA0_0001), // a signalling NaN with a payload
            11 => f32::NEG_INFINITY,
            17 => f32::from_bits(0xFFC0_1234),
            _ => (i as f32 * 0.7).sin() * 3.0,
        };
        for isa in Isa::available() {
            let token = IsaToken::new(Some(isa)).unwrap();
            for rd in [2usize, 32, 64, 96, 128, 192, 256] {
                let f32_row: Vec<f32> = (0..rd).map(value).collect();
                let bf16_row: Vec<half::bf16> = f32_row.iter().map(|&v| half::bf16::from_f32(v)).collect();
                for interleaved in [false, true] {
                    let mut want = vec![-1.0f32; RopeRow::len(rd)];
                    let mut got = want.clone();
                    let check = |want: &[f32], got: &[f32]| {
                        let (w, g) = (RopeRow::view(want, rd, interleaved), RopeRow::view(got, rd, interleaved));
                        for (x, y) in [(w.c, g.c), (w.s, g.s), (w.cd, g.cd), (w.sd, g.sd), (w.f, g.f), (w.fsw, g.fsw)] {
                            assert_eq!(bits(x), bits(y), "{isa:?} rd {rd} interleaved {interleaved}");
                        }
                    };
                    RopeRow::fill(&f32_row, &mut want, interleaved);
                    RopeRow::fill_with(token, &f32_row, &mut got, interleaved);
                    check(&want, &got);
                    RopeRow::fill(&bf16_row, &mut want, interleaved);
                    RopeRow::fill_with(token, &bf16_row, &mut got, interleaved);
                    check(&want, &got);
                }
            }
        }
    }
}
