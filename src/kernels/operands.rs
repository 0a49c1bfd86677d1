//! Kernel families as the scheduler and the epilogue see them: packed operands that compute
//! accumulator tiles through `crate::simd`, turn an accumulator into the value to round, and
//! compute any element exactly.
//!
//! **The exact path.** The fast order cannot be trusted where an intermediate leaves f32's range:
//! a block term that overflows makes the accumulator ∞ or NaN although the true value may be
//! finite (the oracle's answer can be 0), and an MX scale product below 2^-126 would be flushed.
//! Such elements — any whose fast value is not finite, whose MX scale exponents could underflow,
//! or that meet a NaN scale — are recomputed exactly (integer or fixed-point accumulation, one
//! rounding), so they equal the oracle's `Exact` mode. The condition depends only on the
//! accumulator's bits and the operands, which every ISA shares, so results stay bit-identical
//! across ISAs. Ordinary inputs never take this path; adversarial ones pay the oracle's cost for
//! the elements that do.

// Index loops mirror the packed layout's formulas; iterator chains would hide them.
#![allow(clippy::needless_range_loop)]

use super::pack::{Fp4Acts, PackedPlainWeights, PackedWeights, PlainActs};
use crate::element::{DType, Element, bf16_through, biased, biased_exact};
use crate::exact::{ExactSum, f32_parts};
use crate::formats::BlockFormat;
use crate::formats::fp4::E2M1_DOUBLED;
use crate::formats::fp8::e4m3_to_units;
use crate::simd::fp4::E8M0_ACT_BIAS;
use crate::simd::fp4::Fp4Rows;
use crate::simd::fp8::E8M0_FP8_ACT_BIAS;
use crate::simd::fp8::Fp8Rows;
use crate::simd::plain::PackedRows;
use crate::simd::rope::{narrow, widen};
use crate::simd::{GROUP, IsaToken, MR, ROW_GROUPS};

/// One task's rows and columns.
pub(crate) struct Tile<'a> {
    /// The rows (indices into the call's rows).
    pub rows: &'a [usize],
    /// They are entries `i0 ..` of a row set: all rows, or the K/V rows when `kv` (a family that
    /// packs its rows per set finds them there).
    pub kv: bool,
    pub i0: usize,
    /// Panel columns `c0 .. c1` (multiples of 16).
    pub c0: usize,
    pub c1: usize,
}

/// A kernel family's packed operands.
pub(crate) trait Operands: Sync {
    /// Rows per task tile.
    const MC: usize;
    /// Rows per task tile on `token`'s ISA (at most `MAX_MC` of the scheduler).
    fn mc(&self, _token: IsaToken) -> usize {
        Self::MC
    }
    /// Accumulators of the tile's rows × columns into `buf[i · (c1 − c0) + (c − c0)]`.
    fn tile(&self, token: IsaToken, t: &Tile<'_>, buf: &mut [f32]);
    /// The value to round to `to` (the destination's element type) for `(row, col)` from its
    /// accumulator, or `None` when the exact path must decide it.
    fn value(&self, row: usize, col: usize, acc: f32, to: DType) -> Option<f32>;
    /// The values to round to `to` for columns `c ..` of `row` from their accumulators `accs` into
    /// `out` (as long), when every one of them takes the fast path (`value` is `Some` for each,
    /// and equal to what is written); `false` when any needs the exact path (`out` then
    /// unspecified). The epilogue's bulk path: families override it with loops that vectorise.
    fn values(&self, row: usize, c: usize, accs: &[f32], out: &mut [f32], to: DType) -> bool {
        for (j, (&a, o)) in accs.iter().zip(out.iter_mut()).enumerate() {
            match self.value(row, c + j, a, to) {
                Some(v) => *o = v,
                None => return false,
            }
        }
        true
    }
    /// The exact value of `(row, col)` for a destination of type `to`, rounded to odd in f64 (one
    /// more rounding to `to` is the correctly rounded result).
    fn exact(&self, row: usize, col: usize, to: DType) -> f64;
}

/// Block-scaled operands: `value = tensor_sf · Σ …`.
pub(crate) struct Fp4Operands<'a> {
    pub w: &'a PackedWeights,
    pub a: &'a Fp4Acts,
    pub tensor_sf: f32,
}

impl Fp4Operands<'_> {
    /// Whether an E8M0 scale product of (row, col) could leave f32's normal range at the low end
    /// (the kernels flush it to 0): the smallest exponent sum reaches the bottom of the field.
    fn may_underflow(&self, row: usize, col: usize) -> bool {
        self.may_underflow_from(row, self.w.min_scale[col])
    }

    /// [`may_underflow`](Self::may_underflow) for any column whose smallest weight scale is
    /// `min_w` (the epilogue's bulk path passes the smallest of a range).
    fn may_underflow_from(&self, row: usize, min_w: u8) -> bool {
        let bias = match self.w.format {
            BlockFormat::Nvfp4 => return false,
            BlockFormat::Mxfp4 => E8M0_ACT_BIAS,
            BlockFormat::Mxfp8 => E8M0_FP8_ACT_BIAS,
        };
        min_w as i32 + self.a.min_scale[row] as i32 - bias <= 0
    }
}

thread_local! {
    /// Each worker's decoded MXFP8 weights (`crate::simd::fp8_decode`), kept between calls.
    static FP8_DECODED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Fp4Operands<'_> {
    /// The decode kernel of the weight's format on groups `g0 .. g0 + ROW_GROUPS` for R rows
    /// (prepared as `r4` or `r8`, whichever the format has), into `out[r]`.
    fn row_call<const R: usize>(
        &self,
        token: IsaToken,
        g0: usize,
        r4: &Option<Fp4Rows<'_>>,
        r8: &Option<Fp8Rows<'_>>,
        out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
    ) {
        if let Some(r) = r4 {
            let gs = std::array::from_fn(|i| self.w.fp4_group(g0 + i));
            crate::simd::fp4_row(token, &gs, r, out);
        } else if let Some(r) = r8 {
            let gs = std::array::from_fn(|i| self.w.fp8_group(g0 + i));
            crate::simd::fp8_row(token, &gs, r, out);
        }
    }

    /// MXFP8 tiles of at least two row chunks, through `crate::simd::fp8_tiled` (weights decoded
    /// once per tile, not once per row chunk). Measured on the Llama-3-8B shape at M = 512,
    /// 1 thread, Intel Xeon: 68 → 100 GFLOP/s; AVX2 on AMD Zen 3: 22–28 → 37–63 GFLOP/s
    /// (docs/performance.md). Groups `g0 .. g1` of the tile's rows, row i's sums into
    /// `buf[i · width + at ..]` (a few-row kernel may have taken the tile's first groups).
    fn fp8_tiled(
        &self,
        token: IsaToken,
        rows: &[usize],
        (g0, g1): (usize, usize),
        buf: &mut [f32],
        width: usize,
        at: usize,
    ) {
        let mr = crate::simd::fp4_mr(token);
        let n = rows.len().div_ceil(mr);
        assert!(n <= MAX_CHUNKS, "a tile of {} rows", rows.len());
        let chunk = |i: usize| {
            let i = i.min(n - 1);
            self.a.fp8_rows(&rows[i * mr..((i + 1) * mr).min(rows.len())])
        };
        let chunks: [_; MAX_CHUNKS] = std::array::from_fn(chunk);
        FP8_DECODED.with_borrow_mut(|wd| {
            let group = |i: usize| self.w.fp8_group(g0 + i);
            crate::simd::fp8_tiled(token, g1 - g0, group, &chunks[..n], &mut buf[at..], width, wd);
        });
    }
}

/// Most row chunks of one FP4-family tile (`mc` rows in chunks of `fp4_mr` on the tiled kernel).
pub(crate) const MAX_CHUNKS: usize = 16;

/// An exact scale `(mantissa, exponent)`, or `None` for a NaN scale.
fn exact_scale(format: BlockFormat, byte: u8) -> Option<(i128, i32)> {
    match format {
        BlockFormat::Nvfp4 => e4m3_to_units(byte & 0x7F).map(|u| (u as i128, -9)),
        _ if byte == 0xFF => None,
        _ => Some((1, byte as i32 - 127)),
    }
}

impl Operands for Fp4Operands<'_> {
    const MC: usize = 64;

    /// MXFP8 on the tiled kernel: [`MAX_CHUNKS`] row chunks (128 rows on AVX-512, 64 on AVX2), so
    /// each decoded weight slice serves as many rows as a tile holds (measured at M = 512 on one
    /// thread, Intel Xeon: 110 → 116 GFLOP/s with 128 rows instead of 64; FP4 unchanged by it).
    fn mc(&self, token: IsaToken) -> usize {
        if self.w.format == BlockFormat::Mxfp8 && crate::simd::fp8_decodes(token) {
            MAX_CHUNKS * crate::simd::fp4_mr(token)
        } else {
            Self::MC
        }
    }

    fn tile(&self, token: IsaToken, t: &Tile<'_>, buf: &mut [f32]) {
        let (rows, c0, c1) = (t.rows, t.c0, t.c1);
        let width = c1 - c0;
        let mut tile = [[0f32; GROUP]; MR];
        let mr = crate::simd::fp4_mr(token);
        let (mut g0, g1) = (c0 / GROUP, c1 / GROUP);
        if rows.len() <= crate::simd::row_rows(token) {
            // Decode (one row, or two on AVX-512): several groups per call, for independent
            // accumulator chains, each weight vector decoded once for the rows.
            let fp4 = self.w.format.is_fp4();
            let (r4, r8) = (fp4.then(|| self.a.fp4_rows(rows)), (!fp4).then(|| self.a.fp8_rows(rows)));
            let (row0, row1) = buf.split_at_mut(if rows.len() == 2 { width } else { buf.len() });
            while g0 + ROW_GROUPS <= g1 {
                // The kernels write straight into the tile (no copy through a local array).
                let at = g0 * GROUP - c0;
                if rows.len() == 2 {
                    self.row_call(token, g0, &r4, &r8, [four_groups(row0, at), four_groups(row1, at)]);
                } else {
                    self.row_call(token, g0, &r4, &r8, [four_groups(row0, at)]);
                }
                g0 += ROW_GROUPS;
            }
        }
        let weight = if self.w.format.is_fp4() { FewWeight::Fp4 } else { FewWeight::Fp8 };
        if few_fits(token, rows.len(), self.w.format.vector_size(), weight) {
            // A few rows (a decode step's batch): each weight vector decoded once for up to four.
            while g0 + ROW_GROUPS <= g1 {
                let at = g0 * GROUP - c0;
                if self.w.format.is_fp4() {
                    let gs = std::array::from_fn(|i| self.w.fp4_group(g0 + i));
                    few_chunks(&Fp4Few { token, gs: &gs, a: self.a }, rows, buf, width, at);
                } else {
                    let gs = std::array::from_fn(|i| self.w.fp8_group(g0 + i));
                    let kernel = Fp8Few { token, weight, gs: &gs, a: self.a, outer: |_: &[usize]| None };
                    few_chunks(&kernel, rows, buf, width, at);
                }
                g0 += ROW_GROUPS;
            }
        }
        if !self.w.format.is_fp4() && rows.len() >= 2 * mr && crate::simd::fp8_decodes(token) && g0 < g1 {
            return self.fp8_tiled(token, rows, (g0, g1), buf, width, g0 * GROUP - c0);
        }
        for g in g0..g1 {
            let group = self.w.format.is_fp4().then(|| self.w.fp4_group(g));
            for (ci, chunk) in rows.chunks(mr).enumerate() {
                match &group {
                    Some(gr) => crate::simd::fp4_group(token, gr, &self.a.fp4_rows(chunk), &mut tile),
                    None => crate::simd::fp8_group(token, &self.w.fp8_group(g), &self.a.fp8_rows(chunk), &mut tile),
                }
                for (i, t) in tile.iter().enumerate().take(chunk.len()) {
                    let off = (ci * mr + i) * width + g * GROUP - c0;
                    buf[off..off + GROUP].copy_from_slice(t);
                }
            }
        }
    }

    #[inline]
    fn value(&self, row: usize, col: usize, acc: f32, _to: DType) -> Option<f32> {
        if self.a.nan_row[row] || self.w.nan_col[col] || self.may_underflow(row, col) {
            return None;
        }
        let v = acc * self.tensor_sf;
        v.is_finite().then_some(v)
    }

    fn values(&self, row: usize, c: usize, accs: &[f32], out: &mut [f32], _to: DType) -> bool {
        let cols = c..c + accs.len();
        // `value`'s conditions over the whole range: no NaN row or column, no possible
        // underflow (the smallest weight scale of the range decides), every value finite.
        if self.a.nan_row[row] || self.w.nan_col[cols.clone()].iter().fold(false, |x, &y| x | y) {
            return false;
        }
        if self.w.format != BlockFormat::Nvfp4 {
            let min = self.w.min_scale[cols].iter().fold(u8::MAX, |x, &y| x.min(y));
            if self.may_underflow_from(row, min) {
                return false;
            }
        }
        let mut finite = true;
        for (o, &a) in out.iter_mut().zip(accs) {
            *o = a * self.tensor_sf;
            finite &= o.is_finite();
        }
        finite
    }

    fn exact(&self, row: usize, col: usize, _to: DType) -> f64 {
        let (w, a, f) = (self.w, self.a, self.w.format);
        let (v, k) = (f.vector_size(), w.k);
        let (tm, te) = f32_parts(self.tensor_sf);
        let mut acc = ExactSum::new();
        for b in 0..w.kb {
            let (Some((sa, ea)), Some((sb, eb))) =
                (exact_scale(f, a.raw_scale(row, b)), exact_scale(f, w.raw_scale(col, b)))
            else {
                return f64::NAN;
            };
            let range = b * v..((b + 1) * v).min(k);
            if f.is_fp4() {
                // Doubled E2M1 on both sides: value = isum · 2^-2.
                let isum: i128 =
                    range.map(|kk| a.a2(row, kk) as i128 * E2M1_DOUBLED[w.fp4_code(col, kk) as usize] as i128).sum();
                acc.add(isum * sa * sb * tm as i128, -2 + ea + eb + te);
            } else {
                let mut isum = 0i128;
                for kk in range {
                    let (Some(x), Some(y)) =
                        (e4m3_to_units_f32(a.af[row * a.kp + kk]), e4m3_to_units(w.fp8_byte(col, kk)))
                    else {
                        return f64::NAN;
                    };
                    isum += x as i128 * y as i128;
                }
                acc.add(isum * sa * sb * tm as i128, -18 + ea + eb + te);
            }
        }
        acc.to_f64_round_odd()
    }
}

/// An E4M3 value decoded to f32 back to its units of 2^-9 (`None` for NaN).
fn e4m3_to_units_f32(x: f32) -> Option<i32> {
    if x.is_nan() {
        return None;
    }
    if x == 0.0 {
        return Some(0);
    }
    let (m, e) = f32_parts(x);
    // Every E4M3 value is an integer multiple of 2^-9 below 2^9: exact.
    Some(if e + 9 >= 0 { (m << (e + 9)) as i32 } else { (m >> -(e + 9)) as i32 })
}

/// bf16/f16/f32 operands: `value = Σ a·w (+ bias)`.
pub(crate) struct PlainOperands<'a, T> {
    pub w: &'a PackedPlainWeights<T>,
    pub a: &'a PlainActs,
    pub bias: Option<&'a [T]>,
    /// For the bias step's rounding to f16 (F16C / NEON conversions, as the epilogue's).
    pub token: IsaToken,
}

/// Row tile of the bf16/f16/f32 kernels: a multiple of every micro-kernel's row count (12, 6, 4).
const PLAIN_MC: usize = 96;

impl<T: Element> Operands for PlainOperands<'_, T> {
    const MC: usize = PLAIN_MC;

    fn tile(&self, token: IsaToken, t: &Tile<'_>, buf: &mut [f32]) {
        let (rows, kv, i0, c0, c1) = (t.rows, t.kv, t.i0, t.c0, t.c1);
        let (g0, g1) = (c0 / GROUP, c1 / GROUP);
        let width = c1 - c0;
        let out = &mut buf[..rows.len() * width];
        let set = self.a.rows(kv);
        debug_assert_eq!(i0 % set.mr, 0);
        let skip = (i0 / set.mr) * set.block_len();
        let a = PackedRows { f: set.f.get(skip..).unwrap_or(&[]), p: set.p.get(skip..).unwrap_or(&[]), ..set };
        // k-blocks of `plain_kc` pairs: the block of W (32 KiB for two bf16 groups) stays in L1/L2 and the
        // rows' block in L2 while every micro-tile of the task uses them; the accumulators
        // continue through `out`, so the chain (the canonical order) is the same. A decode uses
        // each weight once: one k-block, so each group is one sequential stream (on Zen 4, k-blocks
        // here made bf16 decode from DRAM 1.7× a plain read instead of 1.3×); so do the few rows
        // of `plain_stream_rows`.
        let pairs = self.w.pairs;
        let whole = rows.len() <= crate::simd::plain_stream_rows(token, self.w.kind);
        let kc = if whole { pairs.max(1) } else { crate::simd::plain_kc(token) };
        for (bi, p0) in (0..pairs).step_by(kc).enumerate() {
            let p1 = (p0 + kc).min(pairs);
            let panel = self.w.panel(g0, g1, p0, p1);
            crate::simd::plain_panel(token, &panel, &a, p0, rows.len(), out, width, bi > 0);
        }
    }

    #[inline]
    fn value(&self, _row: usize, col: usize, acc: f32, to: DType) -> Option<f32> {
        let v = match self.bias {
            Some(b) => biased(to, acc, b[col].to_f32()),
            None => acc,
        };
        v.is_finite().then_some(v)
    }

    fn values(&self, _row: usize, c: usize, accs: &[f32], out: &mut [f32], to: DType) -> bool {
        let mut finite = true;
        match self.bias {
            // MAX's bias step (`biased`), one loop per destination type so that each vectorises.
            Some(b) => {
                let b = &b[c..c + accs.len()];
                finite = match to {
                    DType::BF16 => add_bias(out, accs, b, bf16_through),
                    DType::F16 => {
                        // Through f16 and back by the ISA's conversions (`narrow` is
                        // `f16::from_f32` lane by lane, `widen` exact): `half`'s per value was
                        // 1.5× a Qwen-shaped M = 512 call with f16 output on Zen 5.
                        let mut h = [half::f16::ZERO; 256];
                        for ((o, a), bb) in out.chunks_mut(256).zip(accs.chunks(256)).zip(b.chunks(256)) {
                            let h = &mut h[..a.len()];
                            narrow(self.token, a, h);
                            widen(self.token, h, o);
                            for (o, bv) in o.iter_mut().zip(bb) {
                                *o += bv.to_f32();
                                finite &= o.is_finite();
                            }
                        }
                        finite
                    }
                    DType::F32 | DType::F8E4M3 => add_bias(out, accs, b, |x| x),
                };
            }
            None => {
                for (o, &a) in out.iter_mut().zip(accs) {
                    *o = a;
                    finite &= a.is_finite();
                }
            }
        }
        finite
    }

    fn exact(&self, row: usize, col: usize, to: DType) -> f64 {
        let mut acc = ExactSum::new();
        for k in 0..self.w.k {
            acc.add_product_f32(self.a.get(row, k), self.w.get(col, k));
        }
        match self.bias {
            None => acc.to_f64_round_odd(),
            Some(b) => {
                let b = b[col].to_f32();
                let v = acc.clone().to_f64_round_odd();
                biased_exact(to, v, b, || {
                    acc.add_f32(b);
                    acc.to_f64_round_odd()
                })
            }
        }
    }
}

/// `out = through(acc) + bias` element by element; whether every result is finite. Generic over
/// `through` so that each destination type's loop is compiled (and vectorised) on its own.
#[inline(always)]
fn add_bias<T: Element>(out: &mut [f32], accs: &[f32], bias: &[T], through: impl Fn(f32) -> f32) -> bool {
    let mut finite = true;
    for ((o, &a), b) in out.iter_mut().zip(accs).zip(bias) {
        *o = through(a) + b.to_f32();
        finite &= o.is_finite();
    }
    finite
}

/// The [`ROW_GROUPS`] groups of one tile row starting at `at`, as the one-row kernels take them
/// (they write straight into the tile: no copy through a local array).
pub(crate) fn four_groups(row: &mut [f32], at: usize) -> &mut [[f32; GROUP]; ROW_GROUPS] {
    row[at..at + ROW_GROUPS * GROUP].as_chunks_mut::<GROUP>().0.try_into().expect("ROW_GROUPS groups")
}

/// Which weights a few-row kernel runs, for [`few_fits`]: each stops at its own row count.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum FewWeight {
    /// NVFP4 / MXFP4: up to four of the group kernel's chunks.
    Fp4,
    /// MXFP8, FP8 W8A8 per tensor or per channel: up to two of the tiled kernel's chunks.
    Fp8,
    /// FP8 W8A8 with 128 × 128 block scales: up to three of the tiled kernel's chunks (its tiled
    /// kernel also pays a pass over the partial sums per 128-block).
    Fp8Block,
}

/// Whether [`few_chunks`] runs `n` rows of a `weight` with blocks of `v` on `token`'s ISA: more
/// rows than the decode kernels take, and up to the limit of [`FewWeight`]. Measured on
/// Llama-3-8B decode steps, AMD Zen 3 (docs/performance.md), time against the kernel it
/// replaces: FP4 at 8 rows 0.81–0.94×, at 12 and 16 rows 0.75–0.96×; MXFP8 at 8 rows ~0.86×;
/// FP8 128-block at 8 rows ~0.70×, at 12 rows 0.82–0.95× (at 16 rows 1.13× on one thread); but
/// MXFP8 and FP8 per tensor at 12 and 16 rows no faster or slower (1.03–1.17×).
pub(crate) fn few_fits(token: IsaToken, n: usize, v: usize, weight: FewWeight) -> bool {
    let (few, mr) = (crate::simd::few_rows(token), crate::simd::fp4_mr(token));
    let chunks = match weight {
        FewWeight::Fp4 => 4,
        FewWeight::Fp8Block => 3,
        FewWeight::Fp8 => 2,
    };
    few >= 2 && n > crate::simd::row_rows(token) && n <= chunks * mr && v <= 32
}

/// A few-row kernel ([`crate::simd::fp8_few`], [`crate::simd::fp4_few`]) on the four groups of
/// one call, for [`few_chunks`].
pub(crate) trait FewKernel {
    /// The ISA the kernel runs on.
    fn token(&self) -> IsaToken;
    /// Whether it runs `n` rows ([`few_fits`] for its weight's format).
    fn fits(&self, n: usize) -> bool;
    /// The kernel on the R rows `chunk`, into `out[r]`; `false` where the ISA has none.
    fn run<const R: usize>(&self, chunk: &[usize], out: [&mut [[f32; GROUP]; ROW_GROUPS]; R]) -> bool;
}

/// The MXFP8 / FP8 W8A8 few-row kernel on groups `gs`, with `outer(chunk)`'s span scales
/// (`weight`: [`FewWeight::Fp8Block`] where it gives them).
pub(crate) struct Fp8Few<'a, 'g, F> {
    pub token: IsaToken,
    pub weight: FewWeight,
    pub gs: &'a [crate::simd::fp8::Fp8Group<'g>; ROW_GROUPS],
    pub a: &'a Fp4Acts,
    pub outer: F,
}

impl<'o, F: Fn(&[usize]) -> Option<crate::simd::fp8::Outer<'o>>> FewKernel for Fp8Few<'_, '_, F> {
    fn token(&self) -> IsaToken {
        self.token
    }
    fn fits(&self, n: usize) -> bool {
        few_fits(self.token, n, self.gs[0].v, self.weight)
    }
    fn run<const R: usize>(&self, chunk: &[usize], out: [&mut [[f32; GROUP]; ROW_GROUPS]; R]) -> bool {
        crate::simd::fp8_few::<R>(self.token, self.gs, &self.a.fp8_rows(chunk), (self.outer)(chunk).as_ref(), out)
    }
}

/// The NVFP4 / MXFP4 few-row kernel on groups `gs`.
pub(crate) struct Fp4Few<'a, 'g> {
    pub token: IsaToken,
    pub gs: &'a [crate::simd::fp4::Fp4Group<'g>; ROW_GROUPS],
    pub a: &'a Fp4Acts,
}

impl FewKernel for Fp4Few<'_, '_> {
    fn token(&self) -> IsaToken {
        self.token
    }
    fn fits(&self, n: usize) -> bool {
        few_fits(self.token, n, self.gs[0].pairs * 8, FewWeight::Fp4)
    }
    fn run<const R: usize>(&self, chunk: &[usize], out: [&mut [[f32; GROUP]; ROW_GROUPS]; R]) -> bool {
        crate::simd::fp4_few::<R>(self.token, self.gs, &self.a.fp4_rows(chunk), out)
    }
}

/// A few-row kernel on `rows` (where [`few_fits`]), in balanced chunks of at most
/// [`crate::simd::few_rows`] rows (5 → 3 + 2, 7 → 4 + 3, 9 → 3 + 3 + 3, 13 → 4 + 3 + 3 + 3; a
/// later chunk reads the groups again from L2): row i's sums into `buf[i · width + at ..]`, the
/// four groups' 64 columns.
pub(crate) fn few_chunks<K: FewKernel>(kernel: &K, rows: &[usize], buf: &mut [f32], width: usize, at: usize) {
    // Up front: the FP8 block path adds into `buf`, so a kernel refusing half-way would corrupt it.
    assert!(kernel.fits(rows.len()));
    // c chunks of n / c rows, the first n mod c of them one more: at least 2 rows each, since
    // n ≥ 2 and c = ⌈n / 4⌉ give n ≥ 2c (`rows.chunks(⌈n / c⌉)` left 13 as 4 + 4 + 4 + 1).
    let n = rows.len();
    let c = n.div_ceil(crate::simd::few_rows(kernel.token()));
    let mut lines = buf.chunks_mut(width);
    let mut first = 0;
    for i in 0..c {
        let chunk = &rows[first..first + n / c + usize::from(i < n % c)];
        first += chunk.len();
        let mut next = || four_groups(lines.next().expect("a row of the tile"), at);
        let done = match chunk.len() {
            2 => kernel.run::<2>(chunk, [next(), next()]),
            3 => kernel.run::<3>(chunk, [next(), next(), next()]),
            4 => kernel.run::<4>(chunk, [next(), next(), next(), next()]),
            n => unreachable!("a chunk of {n} rows"), // c = ⌈n / 4⌉ chunks of n ≥ 2 rows: 2 to 4
        };
        assert!(done, "few_fits promised the kernel");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::QuantizedMatrix;
    use crate::formats::quantize::{amax, nvfp4_global_scale, quantize};
    use crate::formats::scale_layout::ScaleLayout;
    use crate::kernels::team::Team;
    use crate::simd::fp4::group_scalar;
    use crate::simd::{Isa, few_rows, fp4_group_v, fp4_mr, fp4_row_v, fp8_few_v, fp8_row_v, row_rows};

    /// The AVX-512 FP4 kernels with and without the VBMI nibble decode (the public tests reach
    /// only the one the CPU selects): bit for bit the scalar kernel, for the group kernel at
    /// every row count and the decode kernel on one and two rows, NVFP4 and MXFP4, with every
    /// E2M1 code present.
    #[test]
    fn avx512_fp4_kernels_with_and_without_vbmi_equal_the_scalar_kernel() {
        let Ok(token) = IsaToken::new(Some(Isa::Avx512)) else {
            eprintln!("AVX-512 VNNI not available: nothing to compare");
            return;
        };
        let scalar = IsaToken::new(Some(Isa::Scalar)).unwrap();
        let (n, k, m) = (ROW_GROUPS * GROUP, 224, 8);
        let x = |i: usize, s: f32| ((i as f32) * s).sin() * (1.0 + (i % 7) as f32);
        let wf: Vec<f32> = (0..n * k).map(|i| x(i, 0.37)).collect();
        let af: Vec<f32> = (0..m * k).map(|i| x(i, 0.91)).collect();
        for format in [BlockFormat::Nvfp4, BlockFormat::Mxfp4] {
            let wq = quantize(format, &wf, n, k, nvfp4_global_scale(amax(&wf))).unwrap();
            let aq = quantize(format, &af, m, k, nvfp4_global_scale(amax(&af))).unwrap();
            let codes: std::collections::HashSet<u8> = wq.data().iter().flat_map(|b| [b & 15, b >> 4]).collect();
            assert_eq!(codes.len(), 16, "every E2M1 code in the weights");
            let (w, a) = (PackedWeights::new(wq.as_ref()), Fp4Acts::prepare(aq.as_ref(), token, Team::One));
            let rows: Vec<usize> = (0..m).collect();
            for count in 1..=fp4_mr(token) {
                let r = a.fp4_rows(&rows[m - count..]);
                for g in 0..ROW_GROUPS {
                    let grp = w.fp4_group(g);
                    let mut want = [[0f32; GROUP]; MR];
                    group_scalar(&grp, &r, &mut want);
                    for vbmi in [false, true] {
                        let mut got = [[0f32; GROUP]; MR];
                        fp4_group_v(token, vbmi, &grp, &r, &mut got);
                        for i in 0..count {
                            let (g_bits, w_bits) = (got[i].map(f32::to_bits), want[i].map(f32::to_bits));
                            assert_eq!(g_bits, w_bits, "{format:?} vbmi {vbmi} rows {count} group {g}");
                        }
                    }
                }
            }
            let gs = std::array::from_fn(|g| w.fp4_group(g));
            let (mut w3, mut w4) = ([[0f32; GROUP]; ROW_GROUPS], [[0f32; GROUP]; ROW_GROUPS]);
            fp4_row_v(scalar, false, &gs, &a.fp4_rows(&rows[3..4]), [&mut w3]);
            fp4_row_v(scalar, false, &gs, &a.fp4_rows(&rows[4..5]), [&mut w4]);
            let bits = |x: [[f32; GROUP]; ROW_GROUPS]| x.map(|g| g.map(f32::to_bits));
            for vbmi in [false, true] {
                let mut got = [[0f32; GROUP]; ROW_GROUPS];
                fp4_row_v(token, vbmi, &gs, &a.fp4_rows(&rows[3..4]), [&mut got]);
                assert_eq!(bits(got), bits(w3), "{format:?} row, vbmi {vbmi}");
                let (mut g3, mut g4) = ([[0f32; GROUP]; ROW_GROUPS], [[0f32; GROUP]; ROW_GROUPS]);
                fp4_row_v(token, vbmi, &gs, &a.fp4_rows(&rows[3..5]), [&mut g3, &mut g4]);
                assert_eq!([bits(g3), bits(g4)], [bits(w3), bits(w4)], "{format:?} two rows, vbmi {vbmi}");
            }
        }
    }

    /// The AVX2 FP4 decode kernels — one row (two groups side by side) and the few-row kernel on
    /// two to four rows (one group at a time) — bit for bit the scalar kernel, NVFP4 and MXFP4,
    /// with every E2M1 code in the weights and every byte as a weight block scale (zero,
    /// subnormal and the largest E4M3 scales; E8M0 from 2⁻¹²⁷ to the NaN byte, whose products the
    /// kernels compute alike), over block counts from one upwards, and activations with the
    /// largest corrections (blocks of ±6 only: |12 · Σa| at its bound).
    #[test]
    fn avx2_fp4_row_kernel_equals_the_scalar_kernel() {
        let Ok(token) = IsaToken::new(Some(Isa::Avx2)) else {
            eprintln!("AVX2 not available: nothing to compare");
            return;
        };
        let scalar = IsaToken::new(Some(Isa::Scalar)).unwrap();
        let n = ROW_GROUPS * GROUP;
        let x = |i: usize, s: f32| ((i as f32) * s).sin() * (1.0 + (i % 7) as f32);
        for k in [32, 96, 224, 512] {
            let wf: Vec<f32> = (0..n * k).map(|i| x(i, 0.37)).collect();
            // Row 2: +6 then −6 (after scaling) in alternate blocks; row 3: all −6.
            let af: Vec<f32> = (0..4 * k)
                .map(|i| match i / k {
                    2 => {
                        if (i % k / 16) % 2 == 0 {
                            6.0
                        } else {
                            -6.0
                        }
                    }
                    3 => -6.0,
                    _ => x(i, 0.91) * if i % 5 == 0 { 1e3 } else { 1.0 },
                })
                .collect();
            for format in [BlockFormat::Nvfp4, BlockFormat::Mxfp4] {
                let wq = quantize(format, &wf, n, k, nvfp4_global_scale(amax(&wf))).unwrap();
                let lay = wq.as_ref().scale_layout();
                let (data, mut scales, ts) = wq.into_parts();
                let mut byte = 0usize;
                for r in 0..n {
                    for kb in 0..lay.k_blocks() {
                        scales[lay.offset(r, kb)] = (byte * 97 % 256) as u8;
                        byte += 1;
                    }
                }
                let wq = QuantizedMatrix::from_parts(format, n, k, data, scales, ts).unwrap();
                if k == 512 {
                    let codes: std::collections::HashSet<u8> =
                        wq.data().iter().flat_map(|b| [b & 15, b >> 4]).collect();
                    assert_eq!(codes.len(), 16, "every E2M1 code in the weights");
                }
                let aq = quantize(format, &af, 4, k, nvfp4_global_scale(amax(&af))).unwrap();
                let (w, a) = (PackedWeights::new(wq.as_ref()), Fp4Acts::prepare(aq.as_ref(), token, Team::One));
                let gs = std::array::from_fn(|g| w.fp4_group(g));
                let bits = |x: [[f32; GROUP]; ROW_GROUPS]| x.map(|g| g.map(f32::to_bits));
                let mut want = [[[0f32; GROUP]; ROW_GROUPS]; 4];
                for (row, want) in want.iter_mut().enumerate() {
                    let mut got = [[f32::NAN; GROUP]; ROW_GROUPS];
                    fp4_row_v(scalar, false, &gs, &a.fp4_rows(&[row]), [want]);
                    fp4_row_v(token, false, &gs, &a.fp4_rows(&[row]), [&mut got]);
                    assert_eq!(bits(got), bits(*want), "{format:?} k {k} row {row}");
                }
                for pick in [&[0usize, 1][..], &[2, 3, 0], &[3, 1, 2, 0]] {
                    let mut got = [[[f32::NAN; GROUP]; ROW_GROUPS]; 4];
                    let r = a.fp4_rows(pick);
                    let [o0, o1, o2, o3] = &mut got;
                    let done = match pick.len() {
                        2 => crate::simd::fp4_few::<2>(token, &gs, &r, [o0, o1]),
                        3 => crate::simd::fp4_few::<3>(token, &gs, &r, [o0, o1, o2]),
                        _ => crate::simd::fp4_few::<4>(token, &gs, &r, [o0, o1, o2, o3]),
                    };
                    assert!(done, "AVX2 has a few-row FP4 kernel");
                    for (got, &row) in got.iter().zip(pick) {
                        assert_eq!(bits(*got), bits(want[row]), "{format:?} k {k} rows {pick:?}: row {row}");
                    }
                }
            }
        }
    }

    /// Rows (of the two below) that the few-row kernel runs at once: 2, 3 and 4 rows.
    const PICKS: [&[usize]; 3] = [&[0, 1], &[1, 0, 1], &[0, 1, 1, 0]];

    /// [`fp8_few_v`] on `rows.count` rows: the bits of each row's result.
    fn few(
        token: IsaToken,
        bits: bool,
        gs: &[crate::simd::fp8::Fp8Group<'_>; ROW_GROUPS],
        rows: &crate::simd::fp8::Fp8Rows<'_>,
        outer: Option<&crate::simd::fp8::Outer<'_>>,
    ) -> Vec<[[u32; GROUP]; ROW_GROUPS]> {
        let mut got = [[[f32::NAN; GROUP]; ROW_GROUPS]; 4];
        let [o0, o1, o2, o3] = &mut got;
        let done = match rows.count {
            2 => fp8_few_v::<2>(token, bits, gs, rows, outer, [o0, o1]),
            3 => fp8_few_v::<3>(token, bits, gs, rows, outer, [o0, o1, o2]),
            _ => fp8_few_v::<4>(token, bits, gs, rows, outer, [o0, o1, o2, o3]),
        };
        assert!(done, "{token:?} has a few-row kernel");
        got[..rows.count].iter().map(|x| x.map(|g| g.map(f32::to_bits))).collect()
    }

    /// The decode MXFP8 kernels — AVX2 (one row, and two to four in the few-row kernel), AVX-512
    /// (one and two rows), each with the half
    /// decode and with the f32-bits decode (the public tests reach only the one the CPU
    /// selects) — bit for bit the scalar kernel, with every E4M3 byte but NaN in the weights
    /// (subnormals, ±0, ±448) and in the activations, and block scales from 2⁻¹²⁷ to 2¹²⁷ on
    /// both sides (sums and scale products that overflow f32, and ones far below its normal
    /// range).
    #[test]
    fn fp8_row_kernels_with_either_decode_equal_the_scalar_kernel() {
        let tokens: Vec<IsaToken> =
            [Isa::Avx2, Isa::Avx512].into_iter().filter_map(|i| IsaToken::new(Some(i)).ok()).collect();
        if tokens.is_empty() {
            eprintln!("neither AVX2 nor AVX-512 available: nothing to compare");
            return;
        }
        let scalar = IsaToken::new(Some(Isa::Scalar)).unwrap();
        let (n, k) = (ROW_GROUPS * GROUP, 512);
        let code = |i: usize| {
            let b = (i * 37 % 256) as u8;
            if b & 0x7F == 0x7F { 0x3C } else { b } // no NaN: those columns go to the exact path
        };
        let wdata: Vec<u8> = (0..n * k).map(|i| code(i * 7 + i / k)).collect();
        let adata: Vec<u8> = (0..k).map(|i| code(i * 11 + 3)).collect();
        let all: std::collections::HashSet<u8> = wdata.iter().copied().collect();
        assert_eq!(all.len(), 254, "every E4M3 byte but the two NaNs in the weights");
        let kb = k / 32;
        let mx = |rows: usize, data: Vec<u8>, scale: &dyn Fn(usize, usize) -> u8| {
            let lay = ScaleLayout::for_operand(rows, k, 32);
            let raw: Vec<u8> = (0..rows * kb).map(|i| scale(i / kb, i % kb)).collect();
            QuantizedMatrix::from_parts(BlockFormat::Mxfp8, rows, k, data, lay.interleave(&raw).unwrap(), 1.0).unwrap()
        };
        for case in 0..3 {
            let ws = move |r: usize, b: usize| match case {
                0 => 120 + ((r + b) % 15) as u8,
                // Group 0 with the largest scales (sums that overflow), the others moderate.
                1 if r < GROUP => [0u8, 1, 254, 200, 60, 127][(r * 3 + b) % 6],
                1 => [0u8, 1, 140, 127, 60, 90][(r * 3 + b) % 6],
                _ => ((r * 31 + b * 17) % 131 + 60) as u8,
            };
            let as_ = move |_: usize, b: usize| match case {
                0 => 127,
                1 => [200u8, 0, 127, 3][b % 4],
                _ => ((b * 53) % 131 + 60) as u8,
            };
            let w = PackedWeights::new(mx(n, wdata.clone(), &ws).as_ref());
            // Row 1: the activation bytes in another order, and other scales.
            let a2: Vec<u8> = adata.iter().chain(adata.iter().rev()).copied().collect();
            let aq = mx(2, a2, &|r, b| if r == 0 { as_(r, b) } else { as_(r, b + 1) });
            let a = Fp4Acts::prepare(aq.as_ref(), scalar, Team::One);
            let gs = std::array::from_fn(|g| w.fp8_group(g));
            let (mut w0, mut w1) = ([[0f32; GROUP]; ROW_GROUPS], [[0f32; GROUP]; ROW_GROUPS]);
            fp8_row_v(scalar, false, &gs, &a.fp8_rows(&[0]), None, [&mut w0]);
            fp8_row_v(scalar, false, &gs, &a.fp8_rows(&[1]), None, [&mut w1]);
            let want = [w0, w1].map(|x| x.map(|g| g.map(f32::to_bits)));
            for r in 0..2 {
                assert!(want[r].iter().flatten().any(|&x| f32::from_bits(x).is_finite() && x != 0), "case {case}");
            }
            for (&token, bits) in tokens.iter().flat_map(|t| [(t, false), (t, true)]) {
                for r in 0..2 {
                    let mut got = [[0f32; GROUP]; ROW_GROUPS];
                    fp8_row_v(token, bits, &gs, &a.fp8_rows(&[r]), None, [&mut got]);
                    let got = got.map(|g| g.map(f32::to_bits));
                    assert_eq!(got, want[r], "case {case}, {token:?}, f32-bits decode {bits}, row {r} alone");
                }
                if row_rows(token) >= 2 {
                    let (mut g0, mut g1) = ([[0f32; GROUP]; ROW_GROUPS], [[0f32; GROUP]; ROW_GROUPS]);
                    fp8_row_v(token, bits, &gs, &a.fp8_rows(&[0, 1]), None, [&mut g0, &mut g1]);
                    let got = [g0, g1].map(|x| x.map(|g| g.map(f32::to_bits)));
                    assert_eq!(got, want, "case {case}, {token:?}, f32-bits decode {bits}, two rows");
                }
                if few_rows(token) >= 2 {
                    for pick in PICKS {
                        let got = few(token, bits, &gs, &a.fp8_rows(pick), None);
                        for (i, &r) in pick.iter().enumerate() {
                            assert_eq!(
                                got[i], want[r],
                                "case {case}, {token:?}, bits {bits}, few rows {pick:?}, row {i}"
                            );
                        }
                    }
                }
            }
            // Outer span scales (FP8 W8A8 blocks): the decode kernels against each span run
            // alone by the scalar kernel and combined (`total += span · (sa · sw)`), spans of 4
            // and of 3 blocks (the last one partial: 16 blocks).
            for sub in [4, 3] {
                let spans = kb.div_ceil(sub);
                let sa: Vec<Vec<f32>> =
                    (0..2).map(|r| (0..spans).map(|j| 0.37 + (r + 2 * j) as f32 * 0.71).collect()).collect();
                let sw: Vec<Vec<f32>> =
                    (0..ROW_GROUPS).map(|g| (0..spans).map(|j| 1.3 - (g * 5 + j) as f32 * 0.09).collect()).collect();
                let outer = crate::simd::fp8::Outer {
                    sub,
                    sa: std::array::from_fn(|r| &sa[r.min(1)][..]),
                    sw: std::array::from_fn(|g| &sw[g][..]),
                };
                let mut want = [[[0f32; GROUP]; ROW_GROUPS]; 2];
                for r in 0..2 {
                    let rows = a.fp8_rows(&[r]);
                    for j in 0..spans {
                        let sg = gs.each_ref().map(|g| crate::simd::fp8::Fp8Group {
                            w: &g.w[j * sub * 32 * GROUP..],
                            ws: &g.ws[j * sub * GROUP..],
                            v: 32,
                            kb: sub.min(kb - j * sub),
                        });
                        let sr = crate::simd::fp8::Fp8Rows {
                            a: rows.a.map(|x| &x[j * sub * 32..]),
                            sc: rows.sc.map(|x| &x[j * sub..]),
                            scf: rows.scf.map(|x| &x[j * sub..]),
                            count: 1,
                        };
                        let mut part = [[0f32; GROUP]; ROW_GROUPS];
                        assert!(fp8_row_v(scalar, false, &sg, &sr, None, [&mut part]));
                        for g in 0..ROW_GROUPS {
                            let s = sa[r][j] * sw[g][j];
                            for c in 0..GROUP {
                                want[r][g][c] += part[g][c] * s;
                            }
                        }
                    }
                }
                let want = want.map(|x| x.map(|g| g.map(f32::to_bits)));
                assert!(!fp8_row_v(
                    scalar,
                    false,
                    &gs,
                    &a.fp8_rows(&[0]),
                    Some(&outer),
                    [&mut [[0f32; GROUP]; ROW_GROUPS]]
                ));
                for (&token, bits) in tokens.iter().flat_map(|t| [(t, false), (t, true)]) {
                    for r in 0..2 {
                        let o1 = crate::simd::fp8::Outer { sub, sa: std::array::from_fn(|_| &sa[r][..]), sw: outer.sw };
                        let mut got = [[0f32; GROUP]; ROW_GROUPS];
                        assert!(fp8_row_v(token, bits, &gs, &a.fp8_rows(&[r]), Some(&o1), [&mut got]));
                        assert_eq!(
                            got.map(|g| g.map(f32::to_bits)),
                            want[r],
                            "case {case}, {token:?}, bits {bits}, spans of {sub}, row {r}"
                        );
                    }
                    if row_rows(token) >= 2 {
                        let (mut g0, mut g1) = ([[0f32; GROUP]; ROW_GROUPS], [[0f32; GROUP]; ROW_GROUPS]);
                        assert!(fp8_row_v(token, bits, &gs, &a.fp8_rows(&[0, 1]), Some(&outer), [&mut g0, &mut g1]));
                        let got = [g0, g1].map(|x| x.map(|g| g.map(f32::to_bits)));
                        assert_eq!(got, want, "case {case}, {token:?}, bits {bits}, spans of {sub}, two rows");
                    }
                    if few_rows(token) >= 2 {
                        for pick in PICKS {
                            let last = pick.len() - 1;
                            let o = crate::simd::fp8::Outer {
                                sub,
                                sa: std::array::from_fn(|i| &sa[pick[i.min(last)]][..]),
                                sw: outer.sw,
                            };
                            let got = few(token, bits, &gs, &a.fp8_rows(pick), Some(&o));
                            for (i, &r) in pick.iter().enumerate() {
                                assert_eq!(
                                    got[i], want[r],
                                    "case {case}, {token:?}, bits {bits}, spans of {sub}, {pick:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
