//! The RoPE kernels, written once over [`Lanes`]: AVX2 (8 f32 lanes) and AVX-512 (16) in
//! `x86::rope`, NEON (4) in `neon::rope`. Each level's entry points are `#[target_feature]`
//! functions that instantiate a generic body here with the level's `Lanes`; the bodies are
//! `#[inline(always)]` (and hold no closures, which would not inherit the entry point's
//! features), so every `Lanes` method — itself a `#[target_feature]` function of that level —
//! inlines into the entry point. Every kernel computes the oracle's operations lane by lane
//! (there is no summation: a lane's result depends only on its own pair), so every level is
//! bit-identical to the portable versions in [`crate::simd::rope`] and to the oracle.
//!
//! Interleaved pairs `(x0, x1)` sit in adjacent lanes. x86 ([`inter`]): with `X0 = (x0, x0)`
//! and `X1 = (x1, x1)` (`moveldup`/`movehdup`), `t = X1 · (s, c)` and
//! `y = fma(X0, (c, s), (−t_even, t_odd))` give `y0 = fma(x0, c, −(x1·s))` and
//! `y1 = fma(x0, s, x1·c)`; NEON splits them by its de-interleaving loads instead
//! ([`Lanes::LD2`]). bf16 pairs of either pairing are split into even and odd lanes by a shift
//! and a mask ([`Lanes::split_bf16`]) and joined by integer rounding ([`Lanes::join_bf16`]).
//! Half-split pairs are two vectors `x0 = x[i..]`, `x1 = x[i + h..]` with `c`, `s` vectors.
//! `MaxCompat` rounds after each operation ([`Lanes::round`]).

use crate::simd::rope::{RopeRow, Round, pair};

/// Element types the head kernels load and store directly.
pub(crate) const BF16: u8 = 0;
pub(crate) const F16: u8 = 1;
pub(crate) const F32: u8 = 2;

/// The methods of a level's [`Lanes`], each a `#[target_feature]` function of that level marked
/// `#[inline]` (so that each inlines into the level's entry points): `level_fns!("features"; fn …)`.
macro_rules! level_fns {
    ($feat:literal; $(unsafe fn $name:ident $(<$(const $c:ident: $ct:ty),+>)? ($($arg:ident: $t:ty),*) -> $ret:ty $body:block)*) => {
        $(
            #[target_feature(enable = $feat)]
            #[inline]
            unsafe fn $name $(<$(const $c: $ct),+>)? ($($arg: $t),*) -> $ret $body
        )*
    };
}
pub(in crate::simd) use level_fns;

/// Prefetches the `bytes` at `p` into L1 (`prefetcht0`, one per 64 bytes; a hint: it reads and
/// writes nothing, and an address outside the output, past the last head, is harmless). The
/// token kernels call it on the next Q head's output before rotating a Q head: the output rows
/// are written without being read, and each of their stores that missed L1 waited for its line
/// (Q rotates out of place; K, read before it is written, needs none). A line prefetched this
/// way arrives unshared, so the store needs no further request. Measured with the data in L2
/// (AMD Zen 5, one core, binaries alternated three or four times): 64 Qwen-shaped bf16 tokens
/// 2.12–2.22 → 2.01–2.07 µs, 512 tokens 19.7–20.1 → 19.3–19.8 µs, 64 Llama-shaped 11.2–11.5 →
/// 11.0–11.3 µs; no change beyond the noise on calls out of L2 (512 and 4096 Llama-shaped
/// tokens). `prefetchw` (by `asm!`) measured the same; two heads ahead, or four lines ahead of
/// the head being stored, no better; prefetching the next head's input as well, no better. The
/// AVX2 token kernel does not: forced on the same core, 2.4× slower per head, it measured no
/// change (64 Qwen-shaped tokens 4.87–4.92 µs either way).
#[inline(always)]
fn prefetch_out<S: Lanes>(p: *mut u8, bytes: usize) {
    let mut at = 0;
    while at < bytes {
        S::prefetch(p.wrapping_add(at).cast_const());
        at += 64;
    }
}

/// The forms of one 32-pair chunk of a freqs row, in registers (`C = 32 / L`, `D = 16 / L`,
/// `F = 64 / L` vectors: each level's [`Lanes::Forms`] has its own sizes, so that no level
/// carries vectors it does not use): `c`, `s` of pairs `L·j .. L·j + L` (`s` negated by the
/// kernels: see [`rot`]); per bf16
/// half-split step `j` (each covers `2L` pairs), `d[j] = [ce, co, se, so]`, the `cd`, `sd` values
/// of its even and odd pairs ([`RopeRow::fill`]'s per-32-pair de-interleaving); and `f`, the 64
/// freqs themselves (`c0, s0, c1, s1, …`: the interleaved kernels' `f` form), `L` per vector;
/// `fsw`, `f` with each (c, s) pair swapped (exact), where the token kernels need it.
#[derive(Clone, Copy)]
pub(in crate::simd) struct Forms<V, const C: usize, const D: usize, const F: usize> {
    pub c: [V; C],
    pub s: [V; C],
    pub d: [[V; 4]; D],
    pub f: [V; F],
    pub fsw: [V; F],
}

/// Access to a level's [`Forms`] from the generic kernels (by reference: no vector passes by
/// value through these functions, which have no target features).
pub(in crate::simd) trait FormsOf<V>: Copy {
    fn c(&self) -> &[V];
    fn s(&self) -> &[V];
    fn d(&self) -> &[[V; 4]];
    fn f(&self) -> &[V];
    fn fsw(&self) -> &[V];
    fn s_mut(&mut self) -> &mut [V];
    fn d_mut(&mut self) -> &mut [[V; 4]];
    fn fsw_mut(&mut self) -> &mut [V];
}

impl<V: Copy, const C: usize, const D: usize, const F: usize> FormsOf<V> for Forms<V, C, D, F> {
    #[inline(always)]
    fn c(&self) -> &[V] {
        &self.c
    }
    #[inline(always)]
    fn s(&self) -> &[V] {
        &self.s
    }
    #[inline(always)]
    fn d(&self) -> &[[V; 4]] {
        &self.d
    }
    #[inline(always)]
    fn f(&self) -> &[V] {
        &self.f
    }
    #[inline(always)]
    fn fsw(&self) -> &[V] {
        &self.fsw
    }
    #[inline(always)]
    fn s_mut(&mut self) -> &mut [V] {
        &mut self.s
    }
    #[inline(always)]
    fn d_mut(&mut self) -> &mut [[V; 4]] {
        &mut self.d
    }
    #[inline(always)]
    fn fsw_mut(&mut self) -> &mut [V] {
        &mut self.fsw
    }
}

/// The vector operations the kernels are written with, one implementation per level (x86:
/// `Avx2`, `Avx512`; AArch64: `Neon`).
///
/// # Safety
/// Every method requires its level's features (AVX2, FMA, F16C for `Avx2`; AVX-512 F and BW as
/// well for `Avx512`; NEON for `Neon`); pointer arguments as each says.
pub(super) trait Lanes {
    /// A vector of `L` f32.
    type V: Copy;
    /// What a run of bf16 joins records for a later check (AVX-512's `vcvtne2ps2bf16` joins;
    /// nothing on AVX2).
    type Acc: Copy;
    /// The level's [`Forms`] (`Forms<V, 32 / L, 16 / L, 64 / L>`).
    type Forms: FormsOf<Self::V>;
    /// f32 lanes per vector.
    const L: usize;
    /// Whether the token kernels prefetch the next Q head's output ([`prefetch_out`]).
    const PREFETCH_OUT: bool;
    /// Whether interleaved f16 and f32 pairs are split and joined by the level's de-interleaving
    /// loads and stores ([`load2`](Self::load2), [`store2`](Self::store2): NEON's `ld2`/`st2`),
    /// rotated as half-split ones; else by [`inter`] on adjacent lanes (x86).
    const LD2: bool;

    /// `L` f32 at `p`.
    unsafe fn loadu(p: *const f32) -> Self::V;
    /// `L` elements of kind `K` at `p`, widened exactly.
    unsafe fn load<const K: u8>(p: *const u8) -> Self::V;
    /// `L` elements of kind `K` at `p`, each rounded once (round to nearest even).
    unsafe fn store<const K: u8>(p: *mut u8, v: Self::V);
    unsafe fn round(v: Self::V, r: Round) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// `a · b + c`, one rounding.
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `c − a · b`, one rounding.
    unsafe fn fnmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// `−v` (exact).
    unsafe fn neg(v: Self::V) -> Self::V;
    /// `−v` in the even lanes, `v` in the odd ones (exact).
    unsafe fn neg_even(v: Self::V) -> Self::V;
    /// Each even lane duplicated into the odd lane after it (`moveldup`).
    unsafe fn dup_even(v: Self::V) -> Self::V;
    /// Each odd lane duplicated into the even lane before it (`movehdup`).
    unsafe fn dup_odd(v: Self::V) -> Self::V;
    /// The two lanes of each pair swapped (exact).
    unsafe fn swap_pairs(v: Self::V) -> Self::V;
    /// The even and odd bf16 elements of `2L` at `p`, widened (exact), rounded as `r` says.
    unsafe fn split_bf16(p: *const u8, r: Round) -> (Self::V, Self::V);
    /// Stores the even `e` and odd `o` lanes as `2L` bf16 at `p`, each rounded once; `CVT` and
    /// `ACC` as AVX-512's `join_bf16_with` (ignored where the level has no such join).
    unsafe fn join_bf16<const CVT: bool, const ACC: bool>(p: *mut u8, e: Self::V, o: Self::V, acc: &mut Self::Acc);
    /// An empty record.
    unsafe fn acc_new() -> Self::Acc;
    /// Whether a recorded join stored a ±0 word (the joins must then be redone).
    unsafe fn acc_hit(acc: Self::Acc) -> bool;
    /// The [`Forms`] of the 64 freqs of kind `KF` at `p`: widened exactly, NaN made the default
    /// NaN where `canon`, de-interleaved as [`RopeRow::fill`] does (`s` not negated; `fsw` may be
    /// left unset).
    unsafe fn forms<const KF: u8>(p: *const u8, canon: bool) -> Self::Forms;
    /// Forms of all zeros (a value to overwrite).
    unsafe fn forms_zero() -> Self::Forms;
    /// The interleaved pairs of `2L` elements of kind `K` at `p` split: `(x0, x1)`, widened
    /// exactly ([`LD2`](Self::LD2) levels only).
    unsafe fn load2<const K: u8>(p: *const u8) -> (Self::V, Self::V);
    /// [`load2`](Self::load2)'s inverse: `y0`, `y1` interleaved into `2L` elements of kind `K`
    /// at `p`, each rounded once ([`LD2`](Self::LD2) levels only).
    unsafe fn store2<const K: u8>(p: *mut u8, y0: Self::V, y1: Self::V);
    /// A prefetch hint for the line at `p` (any address: it reads and writes nothing). Each
    /// impl marks it `#[inline(always)]`: without, it stayed a call per line in the AVX-512
    /// token kernels (measured: 64 Qwen-shaped bf16 tokens 2.1 → 4.2 µs, Zen 5).
    fn prefetch(p: *const u8);
}

/// Element size in bytes of a kind.
const fn size(kind: u8) -> usize {
    if kind == F32 { 4 } else { 2 }
}

/// One rotation step on pairs with `c` and `ns = −s`: the oracle's operations, rounded after
/// each as `r` says. With `−s` given, no negation is left in the step: `x1 · (−s)` is the
/// oracle's `−t1` exactly (a product's sign is its factors', and rounding to nearest even, in f32
/// and to bf16 or f16, is symmetric), so `y0 = fma(x0, c, −t1)` is one FMA, and
/// `y1 = t2 − x0 · (−s)` (one `fnmadd`/`fmls`) is `fma(x0, s, t2)`: the same exact value rounded
/// once. (A NaN's sign may differ: outside the bit-exact promise.) The kernels negate their
/// forms once per token where they hold them in registers, else as they load them.
#[inline(always)]
unsafe fn rot<S: Lanes>(x0: S::V, x1: S::V, c: S::V, ns: S::V, r: Round) -> (S::V, S::V) {
    // SAFETY: register operations of the caller's level.
    unsafe {
        let t1n = S::round(S::mul(x1, ns), r);
        let y0 = S::round(S::fmadd(x0, c, t1n), r);
        let t2 = S::round(S::mul(x1, c), r);
        let y1 = S::round(S::fnmadd(x0, ns, t2), r);
        (y0, y1)
    }
}

/// One interleaved step on `L` elements (`L/2` pairs) already loaded: `t = X1 · fsw`, then
/// `fma(X0, f, (−t_even, t_odd))`, rounded as `r` says.
#[inline(always)]
unsafe fn inter<S: Lanes>(v: S::V, f: S::V, fsw: S::V, r: Round) -> S::V {
    // SAFETY: register operations of the caller's level.
    unsafe {
        let (x0, x1) = (S::dup_even(v), S::dup_odd(v));
        let t = S::neg_even(S::round(S::mul(x1, fsw), r));
        S::round(S::fmadd(x0, f, t), r)
    }
}

/// `RopeRow` rotation of an f32 buffer (`rotate_avx512`, `rotate_avx2`, `rotate_neon`).
///
/// # Safety
/// The level's features; `row` holds the forms of `x.len()` rotary dims.
#[inline(always)]
pub(in crate::simd) unsafe fn rotate<S: Lanes>(x: &mut [f32], row: &RopeRow<'_>, interleaved: bool, r: Round) {
    let (rd, l) = (x.len(), S::L);
    let xp = x.as_mut_ptr();
    if interleaved && S::LD2 {
        let mut i = 0;
        while i + 2 * l <= rd {
            // SAFETY: elements i .. i + 2L of x (rd long), pairs i/2 .. i/2 + L of c, s (rd/2).
            unsafe {
                let (x0, x1) = S::load2::<F32>(xp.add(i).cast());
                let c = S::loadu(row.c.as_ptr().add(i / 2));
                let ns = S::neg(S::loadu(row.s.as_ptr().add(i / 2)));
                let (y0, y1) = rot::<S>(S::round(x0, r), S::round(x1, r), c, ns, r);
                S::store2::<F32>(xp.add(i).cast(), y0, y1);
            }
            i += 2 * l;
        }
        for p in i / 2..rd / 2 {
            let (y0, y1) = pair(x[2 * p], x[2 * p + 1], row.c[p], row.s[p], r);
            x[2 * p] = y0;
            x[2 * p + 1] = y1;
        }
    } else if interleaved {
        let mut i = 0;
        while i + l <= rd {
            // SAFETY: lanes i .. i + L of x, f and fsw (all rd long).
            unsafe {
                let v = S::round(S::loadu(xp.add(i)), r);
                let y = inter::<S>(v, S::loadu(row.f.as_ptr().add(i)), S::loadu(row.fsw.as_ptr().add(i)), r);
                S::store::<F32>(xp.add(i).cast(), y);
            }
            i += l;
        }
        for p in i / 2..rd / 2 {
            let (y0, y1) = pair(x[2 * p], x[2 * p + 1], row.c[p], row.s[p], r);
            x[2 * p] = y0;
            x[2 * p + 1] = y1;
        }
    } else {
        let h = rd / 2;
        let mut i = 0;
        while i + l <= h {
            // SAFETY: lanes i .. i + L of the halves (h long) and of c, s (h long).
            unsafe {
                let x0 = S::round(S::loadu(xp.add(i)), r);
                let x1 = S::round(S::loadu(xp.add(h + i)), r);
                let (c, ns) = (S::loadu(row.c.as_ptr().add(i)), S::neg(S::loadu(row.s.as_ptr().add(i))));
                let (y0, y1) = rot::<S>(x0, x1, c, ns, r);
                S::store::<F32>(xp.add(i).cast(), y0);
                S::store::<F32>(xp.add(h + i).cast(), y1);
            }
            i += l;
        }
        for p in i..h {
            let (y0, y1) = pair(x[p], x[p + h], row.c[p], row.s[p], r);
            x[p] = y0;
            x[p + h] = y1;
        }
    }
}

/// One half-split bf16 step of `2L` pairs at pair `i` with the forms in registers
/// (`[ce, co, nse, nso]`, the even and odd pairs' `cd` and negated `sd` values): both halves
/// (`hh` apart) of a head from `from` into `base`.
///
/// # Safety
/// The level's features (and AVX-512 BF16 when `CVT`); `i + 2L ≤ hh`; both halves readable at
/// `from` and writable at `base` (the same head or non-overlapping).
#[inline(always)]
unsafe fn half_step_bf16<S: Lanes, const CVT: bool, const ACC: bool>(
    (from, base): (*const u8, *mut u8),
    hh: usize,
    i: usize,
    f: [S::V; 4],
    r: Round,
    acc: &mut S::Acc,
) {
    let [ce, co, nse, nso] = f;
    // SAFETY: the caller's contract covers every address below.
    unsafe {
        let (x0e, x0o) = S::split_bf16(from.add(i * 2), r);
        let (x1e, x1o) = S::split_bf16(from.add((hh + i) * 2), r);
        let (y0e, y1e) = rot::<S>(x0e, x1e, ce, nse, r);
        let (y0o, y1o) = rot::<S>(x0o, x1o, co, nso, r);
        S::join_bf16::<CVT, ACC>(base.add(i * 2), y0e, y0o, acc);
        S::join_bf16::<CVT, ACC>(base.add((hh + i) * 2), y1e, y1o, acc);
    }
}

/// [`half_step_bf16`] with its forms read from `cd`, `sd` (`hh` values each, de-interleaved per
/// 32 pairs: the step's even pairs at `i / 32 · 32 + i % 32 / 2`, its odd ones 16 further).
///
/// # Safety
/// As [`half_step_bf16`]; the 32-pair chunk of `i` lies within `hh`.
#[inline(always)]
unsafe fn half_step_bf16_mem<S: Lanes, const CVT: bool>(
    fb: (*const u8, *mut u8),
    hh: usize,
    i: usize,
    (cd, sd): (*const f32, *const f32),
    r: Round,
) {
    let (ev, od) = (i / 32 * 32 + i % 32 / 2, i / 32 * 32 + 16 + i % 32 / 2);
    // SAFETY: the caller's contract covers every address below (od + L ≤ hh).
    unsafe {
        let f =
            [S::loadu(cd.add(ev)), S::loadu(cd.add(od)), S::neg(S::loadu(sd.add(ev))), S::neg(S::loadu(sd.add(od)))];
        half_step_bf16::<S, CVT, false>(fb, hh, i, f, r, &mut S::acc_new());
    }
}

/// One half-split step of `L` pairs of kind `K` at pair `i`, with the forms `c`, `ns = −s` of
/// those pairs.
///
/// # Safety
/// The level's features; `i + L ≤ hh`; both halves readable at `from` and writable at `base`.
#[inline(always)]
unsafe fn half_step<S: Lanes, const K: u8>(
    (from, base): (*const u8, *mut u8),
    hh: usize,
    i: usize,
    c: S::V,
    ns: S::V,
    r: Round,
) {
    let sz = size(K);
    // SAFETY: the caller's contract covers every address below.
    unsafe {
        let x0 = S::round(S::load::<K>(from.add(i * sz)), r);
        let x1 = S::round(S::load::<K>(from.add((hh + i) * sz)), r);
        let (y0, y1) = rot::<S>(x0, x1, c, ns, r);
        S::store::<K>(base.add(i * sz), y0);
        S::store::<K>(base.add((hh + i) * sz), y1);
    }
}

/// The general heads kernel (`heads_avx512`, `heads_avx2`, `heads_neon`): the rotary region of `heads` heads
/// of `d` elements of kind `K` from `src` into `x`, pairing and rounding decided at run time.
/// Returns the pairs per head left to the caller (a tail shorter than a vector).
///
/// # Safety
/// As `heads_avx512`, with the level's features.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(in crate::simd) unsafe fn heads_any<S: Lanes, const K: u8>(
    src: *const u8,
    x: *mut u8,
    heads: usize,
    d: usize,
    rd: usize,
    row: &RopeRow<'_>,
    interleaved: bool,
    r: Round,
) -> usize {
    let (sz, l) = (size(K), S::L);
    let at = if interleaved { d - rd } else { 0 };
    let hh = rd / 2;
    let done = if interleaved { rd / l * l } else { hh / l * l };
    // bf16: 2L elements per step split into even / odd lanes by a shift and a mask, and stored by
    // the level's join: no widening or narrowing instruction (those were port-5 bound on x86).
    // Half-split steps read `cd`, `sd`, de-interleaved per 32 pairs, so they cover whole chunks
    // of 32. Interleaved f16 and f32 on an `LD2` level: 2L elements per step, split and joined
    // by its loads and stores. What remains of the region (less than a step) goes by `inter`.
    let start = match K {
        BF16 if interleaved => rd / (2 * l) * (2 * l),
        BF16 => hh / 32 * 32,
        _ if interleaved && S::LD2 => rd / (2 * l) * (2 * l),
        _ => 0,
    };
    // One pass over the heads, the pairing decided outside it (a head of Qwen's 64 dims is a
    // single step: per-head overhead counts).
    for h in 0..heads {
        let (base, from) = (x.wrapping_add((h * d + at) * sz), src.wrapping_add((h * d + at) * sz));
        if interleaved {
            for i in (0..start).step_by(2 * l) {
                // SAFETY: elements i .. i + 2L of the region (rd long), pairs i/2 .. i/2 + L of
                // c and s (rd/2 long); `load2`/`store2` only on an `LD2` level.
                unsafe {
                    let (x0, x1) = if K == BF16 {
                        S::split_bf16(from.add(i * 2), r)
                    } else {
                        let (x0, x1) = S::load2::<K>(from.add(i * sz));
                        (S::round(x0, r), S::round(x1, r))
                    };
                    let c = S::loadu(row.c.as_ptr().add(i / 2));
                    let ns = S::neg(S::loadu(row.s.as_ptr().add(i / 2)));
                    let (y0, y1) = rot::<S>(x0, x1, c, ns, r);
                    if K == BF16 {
                        S::join_bf16::<false, false>(base.add(i * 2), y0, y1, &mut S::acc_new());
                    } else {
                        S::store2::<K>(base.add(i * sz), y0, y1);
                    }
                }
            }
            for i in (start..done).step_by(l) {
                // SAFETY: elements i .. i + L of the region; f and fsw are rd long.
                unsafe {
                    let v = S::round(S::load::<K>(from.add(i * sz)), r);
                    let y = inter::<S>(v, S::loadu(row.f.as_ptr().add(i)), S::loadu(row.fsw.as_ptr().add(i)), r);
                    S::store::<K>(base.add(i * sz), y);
                }
            }
        } else {
            let (cd, sd) = (row.cd.as_ptr(), row.sd.as_ptr());
            for i in (0..start).step_by(2 * l) {
                // SAFETY: elements i .. i + 2L of both halves (hh long, i + 2L ≤ start ≤ hh,
                // start a multiple of 32, so the step's 32-pair chunk of cd and sd is whole).
                unsafe { half_step_bf16_mem::<S, false>((from, base), hh, i, (cd, sd), r) };
            }
            for i in (start..done).step_by(l) {
                // SAFETY: elements i .. i + L of both halves (hh long); c, s are hh long.
                unsafe {
                    let (c, ns) = (S::loadu(row.c.as_ptr().add(i)), S::neg(S::loadu(row.s.as_ptr().add(i))));
                    half_step::<S, K>((from, base), hh, i, c, ns, r);
                }
            }
        }
    }
    if interleaved { done / 2 } else { done }
}

/// The general kernel's commonest cases on their own (`heads_half_avx512`, `heads_half_avx2`;
/// NEON goes by [`heads_any`]):
/// half-split pairs, `F32` math, a rotary half of whole vectors (`x86::rope::half_fast_path`). The same
/// operations as [`heads_any`], so the same bits.
///
/// # Safety
/// As `heads_half_avx512`, with the level's features (and AVX-512 BF16 when `CVT`).
#[inline(always)]
#[cfg_attr(target_arch = "aarch64", allow(dead_code))] // (NEON: HalfRows is x86-only)
pub(in crate::simd) unsafe fn heads_half<S: Lanes, const K: u8, const CVT: bool>(
    src: *const u8,
    x: *mut u8,
    heads: usize,
    d: usize,
    hh: usize,
    row: &RopeRow<'_>,
) {
    let sz = size(K);
    let step = if K == BF16 { 2 * S::L } else { S::L };
    debug_assert!(hh.is_multiple_of(if K == BF16 { 32 } else { 16 }) && 2 * hh <= d);
    debug_assert!(row.c.len() == hh && row.s.len() == hh && row.cd.len() == hh && row.sd.len() == hh);
    let (c, s, cd, sd) = (row.c.as_ptr(), row.s.as_ptr(), row.cd.as_ptr(), row.sd.as_ptr());
    for h in 0..heads {
        let fb = (src.wrapping_add(h * d * sz), x.wrapping_add(h * d * sz));
        let mut i = 0;
        while i < hh {
            // SAFETY: elements i .. i + step of both halves of head h (i + step ≤ hh, hh + hh ≤
            // d); for bf16 the 32-pair chunk of i lies within hh (a multiple of 32); the forms
            // are hh long each.
            unsafe {
                if K == BF16 {
                    half_step_bf16_mem::<S, CVT>(fb, hh, i, (cd, sd), Round::None);
                } else {
                    half_step::<S, K>(fb, hh, i, S::loadu(c.add(i)), S::neg(S::loadu(s.add(i))), Round::None);
                }
            }
            i += step;
        }
    }
}

/// The token kernels' heads: `heads` heads of `64 N` dims of kind `K` from `src` into `x` in
/// `F32` math, half-split or interleaved (`INTER`), with the forms of the `N` 32-pair chunks in
/// registers. Out of place (the Q heads), the next head's output is prefetched where the level
/// does.
///
/// # Safety
/// The level's features (and AVX-512 BF16 when `CVT`); `src` and `x` each hold `heads · 64 N`
/// elements of kind `K` and either are the same pointer or do not overlap.
#[inline(always)]
unsafe fn heads_regs<S: Lanes, const K: u8, const N: usize, const CVT: bool, const ACC: bool, const INTER: bool>(
    src: *const u8,
    x: *mut u8,
    heads: usize,
    forms: &[S::Forms; N],
    acc: &mut S::Acc,
) {
    let (sz, l, d) = (size(K), S::L, 64 * N);
    let hh = d / 2;
    let out_of_place = src != x.cast_const();
    for h in 0..heads {
        let (from, base) = (src.wrapping_add(h * d * sz), x.wrapping_add(h * d * sz));
        if S::PREFETCH_OUT && out_of_place {
            prefetch_out::<S>(base.wrapping_add(d * sz), d * sz);
        }
        for (b, f) in forms.iter().enumerate() {
            // SAFETY: every step below stays within head h's 64 N elements: half-split pairs
            // 32 b .. 32 b + 32 of both halves (32 b + 32 ≤ hh), interleaved elements 64 b ..
            // 64 b + 64 (≤ d).
            unsafe {
                match (INTER, K) {
                    (false, BF16) => {
                        for j in 0..16 / l {
                            let i = 32 * b + 2 * l * j;
                            half_step_bf16::<S, CVT, ACC>((from, base), hh, i, f.d()[j], Round::None, acc);
                        }
                    }
                    (false, _) => {
                        for j in 0..32 / l {
                            half_step::<S, K>((from, base), hh, 32 * b + l * j, f.c()[j], f.s()[j], Round::None);
                        }
                    }
                    (true, BF16) => {
                        for j in 0..32 / l {
                            let i = 64 * b + 2 * l * j;
                            let (x0, x1) = S::split_bf16(from.add(i * 2), Round::None);
                            let (y0, y1) = rot::<S>(x0, x1, f.c()[j], f.s()[j], Round::None);
                            S::join_bf16::<CVT, ACC>(base.add(i * 2), y0, y1, acc);
                        }
                    }
                    (true, _) if S::LD2 => {
                        for j in 0..32 / l {
                            let i = 64 * b + 2 * l * j;
                            let (x0, x1) = S::load2::<K>(from.add(i * sz));
                            let (y0, y1) = rot::<S>(x0, x1, f.c()[j], f.s()[j], Round::None);
                            S::store2::<K>(base.add(i * sz), y0, y1);
                        }
                    }
                    (true, _) => {
                        for j in 0..64 / l {
                            let i = 64 * b + l * j;
                            let y = inter::<S>(S::load::<K>(from.add(i * sz)), f.f()[j], f.fsw()[j], Round::None);
                            S::store::<K>(base.add(i * sz), y);
                        }
                    }
                }
            }
        }
    }
}

/// The [`Forms`] of a freqs row's `N` 32-pair chunks (chunk `b`'s 64 freqs of kind `KF` at
/// element `64 b`), `s` and the `d` forms' `sd` values negated (as [`rot`] takes them), with
/// `fsw` where `swap`. A plain loop, not `array::from_fn` or `map`: a
/// closure here does not inherit the entry point's target features, so the level's methods
/// inside it were calls (measured: 64 Qwen-shaped bf16 tokens 2.05 → 2.45 µs on AVX-512, Zen 5).
///
/// # Safety
/// The level's features; `64 N` elements of kind `KF` at `freqs`.
#[inline(always)]
unsafe fn row_forms<S: Lanes, const KF: u8, const N: usize>(
    freqs: *const u8,
    canon: bool,
    swap: bool,
) -> [S::Forms; N] {
    // SAFETY: register operations of the caller's level.
    let mut forms = [unsafe { S::forms_zero() }; N];
    for (b, f) in forms.iter_mut().enumerate() {
        // SAFETY: chunk b's 64 freqs lie within the caller's 64 N.
        *f = unsafe { S::forms::<KF>(freqs.add(64 * b * size(KF)), canon) };
        for j in 0..32 / S::L {
            let v = f.s()[j];
            // SAFETY: a register operation of the caller's level.
            f.s_mut()[j] = unsafe { S::neg(v) };
        }
        for j in 0..16 / S::L {
            let [_, _, se, so] = f.d()[j];
            // SAFETY: register operations of the caller's level.
            let (nse, nso) = unsafe { (S::neg(se), S::neg(so)) };
            (f.d_mut()[j][2], f.d_mut()[j][3]) = (nse, nso);
        }
        if swap {
            for j in 0..64 / S::L {
                let v = f.f()[j];
                // SAFETY: a register operation of the caller's level.
                f.fsw_mut()[j] = unsafe { S::swap_pairs(v) };
            }
        }
    }
    forms
}

/// The token kernels (`token_avx512`, `token_avx2`, `token_neon`): `tokens` consecutive tokens, each one's
/// freqs row read once into registers, its Q heads from `q` into `out` and its K heads in place
/// at `k` (see `token_avx512` for `CVT` and the contract).
///
/// # Safety
/// As `token_avx512`, with the level's features (and AVX-512 BF16 when `CVT`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(in crate::simd) unsafe fn token<
    S: Lanes,
    const KQ: u8,
    const KK: u8,
    const KF: u8,
    const N: usize,
    const CVT: bool,
    const INTER: bool,
>(
    freqs: *const u8,
    (q, out, hq): (*const u8, *mut u8, usize),
    (k, hk): (*mut u8, usize),
    tokens: usize,
    k_stride: usize,
) {
    let (fsize, qrow, krow) = (size(KF), hq * 64 * N * size(KQ), k_stride * size(KK));
    // `fsw` (f16 and f32, interleaved, without `LD2`) only where a kernel reads it.
    let swap = INTER && !S::LD2 && (KQ != BF16 || KK != BF16);
    for t in 0..tokens {
        // SAFETY: token t's freqs, Q, output and K rows as the contract says (chunk b's 64 freqs
        // at 64 b of the row's 64 N, b < N).
        unsafe {
            let (freqs, q, out, k) =
                (freqs.add(t * 64 * N * fsize), q.add(t * qrow), out.add(t * qrow), k.add(t * krow));
            let forms = row_forms::<S, KF, N>(freqs, !CVT, swap);
            // The Q heads (rotated out of place, so `q` still holds their inputs) by the
            // conversion with its ±0 words recorded in `acc`; where any came out ±0 (a flushed
            // subnormal, or a true zero), all of the token's Q heads again by the integer join,
            // from the canonical forms it needs. The K heads, rotated in place, check each
            // vector. Without `CVT`, `acc` is not touched.
            let mut acc = S::acc_new();
            heads_regs::<S, KQ, N, CVT, true, INTER>(q, out, hq, &forms, &mut acc);
            if CVT && S::acc_hit(acc) {
                let forms = row_forms::<S, KF, N>(freqs, true, swap);
                heads_regs::<S, KQ, N, false, false, INTER>(q, out, hq, &forms, &mut acc);
            }
            heads_regs::<S, KK, N, CVT, false, INTER>(k, k, hk, &forms, &mut acc);
        }
    }
}
