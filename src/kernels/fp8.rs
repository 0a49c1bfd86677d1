//! FP8 W8A8 (E4M3 activations and weight, f32 scales per tensor, channel or 128-block) on the
//! MXFP8 kernels.
//!
//! The raw E4M3 bytes of an FP8 W8A8 operand are an MXFP8 operand whose E8M0 block scales are all
//! 1 (byte 127): packed and prepared that way, the MXFP8 kernels give `Σ_k a·w` in their canonical
//! order (per 32-block f32 FMA chains, blocks added in order: `crate::simd::fp8`). Per tensor and
//! per channel the scales apply after the sum, in the output dtype, as MAX applies them
//! (`Fp8Operands::finish`). Per 128-block each block's partial sum is its own call of the group
//! or decode kernel on a K slice of the packed operands, and the tile accumulates
//! `acc + partial · (sa · sw)` (two f32 roundings per block, in block order): the same operations
//! on every ISA, so the same bits.

// Index loops mirror the packed layout's formulas.
#![allow(clippy::needless_range_loop)]

use super::operands::{Fp4Operands, MAX_CHUNKS, Operands, Tile, four_groups};
use super::pack::{Fp4Acts, PackedWeights};
use super::team::Team;
use crate::element::{DType, Element, round_through};
use crate::error::{Result, weight_rows};
use crate::exact::{ExactSum, f32_parts};
use crate::formats::fp8::e4m3_to_units;
use crate::formats::scale_layout::ScaleLayout;
use crate::formats::{BlockFormat, QuantizedRef};
use crate::ops::{FP8_BLOCK, Fp8Scales};
use crate::pool::Pooled;
use crate::simd::fp8::{Fp8Group, Fp8Rows, Outer};
use crate::simd::{GROUP, IsaToken, MR, ROW_GROUPS};

/// The E8M0 byte of 1.0.
const UNIT_SCALE: u8 = 127;
/// MXFP8 blocks of 32 per FP8 scale block of 128.
const SUB: usize = FP8_BLOCK / 32;

/// An FP8 E4M3 weight `[N, K]` packed once for
/// [`qkv_fp8_ragged_packed`](crate::fast::qkv_fp8_ragged_packed): the MXFP8 kernels' layout
/// (16-column groups, k-major), about 1.06× the weight's bytes. Only the data is packed: the
/// scales (per tensor, channel or block) are passed with each call, as MAX passes them.
#[derive(Debug, Clone)]
pub struct PackedFp8Weights {
    pub(crate) inner: PackedWeights,
}

impl PackedFp8Weights {
    /// Packs `weight` (`[N, hidden_size]` E4M3 bytes, row-major), in parallel on the current
    /// rayon pool. Errors when `hidden_size` is 0 or does not divide the length.
    pub fn new(weight: &[u8], hidden_size: usize) -> Result<Self> {
        Self::pack(weight, hidden_size, Team::Rayon)
    }

    pub(crate) fn pack(weight: &[u8], k: usize, team: Team) -> Result<Self> {
        let n = weight_rows(weight, k)?;
        let scales = unit_scales(n, k);
        let w = QuantizedRef::new(BlockFormat::Mxfp8, n, k, weight, &scales)?;
        Ok(PackedFp8Weights { inner: PackedWeights::pack(w, team) })
    }
    /// N.
    pub fn rows(&self) -> usize {
        self.inner.rows()
    }
    /// K.
    pub fn k(&self) -> usize {
        self.inner.k()
    }
    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.inner.size_bytes()
    }
    /// The weight it was packed from (`[N, K]` E4M3 bytes, row-major): packing is lossless.
    pub fn to_vec(&self) -> Vec<u8> {
        self.inner.to_quantized().into_parts().0
    }
}

/// The 5-D E8M0 scales of an MXFP8 operand `[rows, k]` whose every block scale is 1.
fn unit_scales(rows: usize, k: usize) -> Pooled<u8> {
    Pooled::filled(UNIT_SCALE, ScaleLayout::for_operand(rows, k, 32).len())
}

/// Prepares E4M3 activations `[m, k]` (validated) as the MXFP8 kernels take them, with unit scales.
pub(crate) fn prepare_acts(a: &[u8], m: usize, k: usize, token: IsaToken, team: Team) -> Result<Fp4Acts> {
    let scales = unit_scales(m, k);
    let a = QuantizedRef::new(BlockFormat::Mxfp8, m, k, a, &scales)?;
    Ok(Fp4Acts::prepare(a, token, team))
}

/// FP8 W8A8 operands: the MXFP8 operands with unit scales (`inner`, `tensor_sf` 1) and the call's
/// scales and bias, the output dtype `O` (where MAX scales and adds the bias).
pub(crate) struct Fp8Operands<'a, B, O> {
    pub inner: Fp4Operands<'a>,
    pub scales: Fp8Scales<'a>,
    pub bias: Option<&'a [B]>,
    /// Rows of the call (the stride of the block input scales).
    pub m: usize,
    /// Block granularity: the input scales row by row, `[m][ceil(K/128)]` (the decode kernels'
    /// [`Outer`] takes a row's scales contiguous); empty otherwise.
    pub sa_rows: Pooled<f32>,
    pub _out: std::marker::PhantomData<O>,
}

impl<'a, B: Element, O: Element> Fp8Operands<'a, B, O> {
    /// The operands of a validated call of `m` rows.
    pub fn new(inner: Fp4Operands<'a>, scales: Fp8Scales<'a>, bias: Option<&'a [B]>, m: usize) -> Self {
        let sa_rows = match scales {
            Fp8Scales::Block { input, .. } => {
                let kbs = inner.w.k.div_ceil(FP8_BLOCK);
                (0..m * kbs).map(|i| input[(i % kbs) * m + i / kbs]).collect()
            }
            _ => Pooled::new(),
        };
        Fp8Operands { inner, scales, bias, m, sa_rows, _out: std::marker::PhantomData }
    }

    /// The element's value in `O` from its sum rounded to `O`, `raw` ([semantics §4](crate::semantics)):
    /// times the scale product in `O` (tensor, channel), plus the bias in `O`.
    #[inline]
    fn finish(&self, row: usize, col: usize, raw: f32) -> f32 {
        let to_o = |x: f32| round_through(O::DTYPE, x);
        let v = match self.scales {
            Fp8Scales::Block { .. } => raw,
            s => to_o(raw * s.product::<O>(row, col)),
        };
        match self.bias {
            Some(b) => to_o(v + to_o(b[col].to_f32())),
            None => v,
        }
    }

    /// Per 128-block: each block's partial sums from the group or decode kernel on the K slice,
    /// accumulated as `acc + partial · (sa · sw)` in block order.
    fn block_tile(&self, token: IsaToken, t: &Tile<'_>, buf: &mut [f32], (input, weight): (&[f32], &[f32])) {
        let (w, a) = (self.inner.w, self.inner.a);
        let (rows, c0, c1) = (t.rows, t.c0, t.c1);
        let width = c1 - c0;
        let buf = &mut buf[..rows.len() * width];
        buf.fill(0.0);
        let kbs = w.kb.div_ceil(SUB);
        let (g0, g1) = (c0 / GROUP, c1 / GROUP);
        let mut tile = [[0f32; GROUP]; MR];
        let combine = |buf: &mut [f32], i: usize, at: usize, part: &[f32; GROUP], sa: f32, sw: f32| {
            let s = sa * sw;
            for (o, &p) in buf[i * width + at..][..GROUP].iter_mut().zip(part) {
                *o += p * s;
            }
        };
        let mut g = g0;
        if rows.len() <= crate::simd::row_rows(token) {
            // The decode kernels with the span scales inside (x86): one call per group set.
            let full = a.fp8_rows(rows);
            let last = rows.len() - 1;
            while g + ROW_GROUPS <= g1 {
                let gs: [_; ROW_GROUPS] = std::array::from_fn(|i| w.fp8_group(g + i));
                let outer = Outer {
                    sub: SUB,
                    sa: std::array::from_fn(|i| &self.sa_rows[rows[i.min(last)] * kbs..][..kbs]),
                    sw: std::array::from_fn(|i| &weight[(g + i) * GROUP / FP8_BLOCK * kbs..][..kbs]),
                };
                let at = g * GROUP - c0;
                let (row0, row1) = buf.split_at_mut(if rows.len() == 2 { width } else { buf.len() });
                let done = if rows.len() == 2 {
                    crate::simd::fp8_row_outer(
                        token,
                        &gs,
                        &full,
                        &outer,
                        [four_groups(row0, at), four_groups(row1, at)],
                    )
                } else {
                    crate::simd::fp8_row_outer(token, &gs, &full, &outer, [four_groups(row0, at)])
                };
                if !done {
                    break; // no decode kernel: the group kernel below, span by span
                }
                g += ROW_GROUPS;
            }
        }
        let few = super::operands::FewWeight::Fp8Block;
        if super::operands::few_fits(token, rows.len(), w.format.vector_size(), few) {
            // A few rows: the few-row kernel, each chunk with its rows' span scales.
            while g + ROW_GROUPS <= g1 {
                let gs: [_; ROW_GROUPS] = std::array::from_fn(|i| w.fp8_group(g + i));
                let outer = |chunk: &[usize]| {
                    let last = chunk.len() - 1;
                    Some(Outer {
                        sub: SUB,
                        sa: std::array::from_fn(|i| &self.sa_rows[chunk[i.min(last)] * kbs..][..kbs]),
                        sw: std::array::from_fn(|i| &weight[(g + i) * GROUP / FP8_BLOCK * kbs..][..kbs]),
                    })
                };
                let kernel = super::operands::Fp8Few { token, weight: few, gs: &gs, a, outer };
                super::operands::few_chunks(&kernel, rows, buf, width, g * GROUP - c0);
                g += ROW_GROUPS;
            }
        }
        let mr = crate::simd::fp4_mr(token);
        if rows.len() >= 2 * mr && crate::simd::fp8_decodes(token) && g < g1 {
            // The tiled kernel per 128-block (weights decoded once per tile and block), its
            // partial sums staged in the thread's buffer.
            // The row chunks in fixed arrays, as the MXFP8 tile builds them (entries past `n`
            // repeat the last chunk, unread): no allocation per call.
            let n = rows.len().div_ceil(mr);
            assert!(n <= MAX_CHUNKS, "a tile of {} rows", rows.len());
            let chunks: [Fp8Rows<'_>; MAX_CHUNKS] = std::array::from_fn(|i| {
                let i = i.min(n - 1);
                a.fp8_rows(&rows[i * mr..((i + 1) * mr).min(rows.len())])
            });
            let ld = (g1 - g) * GROUP;
            let at = g * GROUP - c0;
            // Each block's slices of the chunks, rebuilt in place (the first `n`) per block.
            let mut sub: [Fp8Rows<'_>; MAX_CHUNKS] = std::array::from_fn(|i| rows_from(&chunks[i], 0));
            BLOCK_SCRATCH.with_borrow_mut(|(part, wd)| {
                part.resize(rows.len() * ld, 0.0);
                for b in 0..kbs {
                    for (s, c) in sub.iter_mut().zip(&chunks).take(n) {
                        *s = rows_from(c, b);
                    }
                    let group = |i: usize| group_from(&w.fp8_group(g + i), b);
                    crate::simd::fp8_tiled(token, g1 - g, group, &sub[..n], part, ld, wd);
                    for (i, &r) in rows.iter().enumerate() {
                        let sa = input[b * self.m + r];
                        let (src, dst) = (&part[i * ld..(i + 1) * ld], &mut buf[i * width + at..][..ld]);
                        for (q, (dd, pp)) in dst.chunks_mut(GROUP).zip(src.chunks(GROUP)).enumerate() {
                            // A group's 16 columns lie in one 128-row weight block.
                            let s = sa * weight[(g + q) * GROUP / FP8_BLOCK * kbs + b];
                            for (o, &x) in dd.iter_mut().zip(pp) {
                                *o += x * s;
                            }
                        }
                    }
                }
            });
            return;
        }
        for g in g..g1 {
            let full_g = w.fp8_group(g);
            let col = g * GROUP;
            for (ci, chunk) in rows.chunks(mr).enumerate() {
                let full_r = a.fp8_rows(chunk);
                for b in 0..kbs {
                    crate::simd::fp8_group(token, &group_from(&full_g, b), &rows_from(&full_r, b), &mut tile);
                    for (i, &r) in chunk.iter().enumerate() {
                        combine(
                            buf,
                            ci * mr + i,
                            col - c0,
                            &tile[i],
                            input[b * self.m + r],
                            weight[col / FP8_BLOCK * kbs + b],
                        );
                    }
                }
            }
        }
    }
}

thread_local! {
    /// Each worker's partial sums of one 128-block and its decoded weights (block granularity,
    /// tiled kernel), kept between calls.
    static BLOCK_SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// The group's slice for scale block `b` (of 128) alone.
fn group_from<'g>(g: &Fp8Group<'g>, b: usize) -> Fp8Group<'g> {
    Fp8Group { w: &g.w[b * FP8_BLOCK * GROUP..], ws: &g.ws[b * SUB * GROUP..], v: g.v, kb: SUB.min(g.kb - b * SUB) }
}

/// The rows' slice from scale block `b` (of 128) on.
fn rows_from<'r>(r: &Fp8Rows<'r>, b: usize) -> Fp8Rows<'r> {
    Fp8Rows {
        a: r.a.map(|x| &x[b * FP8_BLOCK..]),
        sc: r.sc.map(|x| &x[b * SUB..]),
        scf: r.scf.map(|x| &x[b * SUB..]),
        count: r.count,
    }
}

impl<B: Element, O: Element> Operands for Fp8Operands<'_, B, O> {
    const MC: usize = <Fp4Operands<'_> as Operands>::MC;

    fn mc(&self, token: IsaToken) -> usize {
        match self.scales {
            Fp8Scales::Block { .. } => Self::MC,
            _ => self.inner.mc(token),
        }
    }

    fn tile(&self, token: IsaToken, t: &Tile<'_>, buf: &mut [f32]) {
        match self.scales {
            Fp8Scales::Block { input, weight } => self.block_tile(token, t, buf, (input, weight)),
            _ => self.inner.tile(token, t, buf),
        }
    }

    #[inline]
    fn value(&self, row: usize, col: usize, acc: f32, to: DType) -> Option<f32> {
        let acc = self.inner.value(row, col, acc, to)?;
        Some(self.finish(row, col, round_through(O::DTYPE, acc)))
    }

    /// [`finish`](Self::finish) over a range, with the per-call and per-row parts hoisted so that
    /// each loop vectorises (the per-element form was ~10 % of a Llama-3-8B call at M = 512).
    fn values(&self, row: usize, c: usize, accs: &[f32], out: &mut [f32], to: DType) -> bool {
        if !self.inner.values(row, c, accs, out, to) {
            return false;
        }
        let to_o = |x: f32| round_through(O::DTYPE, x);
        match self.scales {
            Fp8Scales::Block { .. } => out.iter_mut().for_each(|o| *o = to_o(*o)),
            Fp8Scales::Channel { weight, .. } if weight.len() > 1 => {
                let sa = to_o(self.scales.input_of(row));
                for (o, &sw) in out.iter_mut().zip(&weight[c..]) {
                    *o = to_o(to_o(*o) * to_o(sa * to_o(sw)));
                }
            }
            s => {
                let p = s.product::<O>(row, c);
                out.iter_mut().for_each(|o| *o = to_o(to_o(*o) * p));
            }
        }
        if let Some(b) = self.bias {
            for (o, b) in out.iter_mut().zip(&b[c..]) {
                *o = to_o(*o + to_o(b.to_f32()));
            }
        }
        true
    }

    fn exact(&self, row: usize, col: usize, to: DType) -> f64 {
        let raw = match self.scales {
            Fp8Scales::Block { input, weight } => {
                let (w, a) = (self.inner.w, self.inner.a);
                let k = w.k;
                let kbs = k.div_ceil(FP8_BLOCK);
                let mut acc = ExactSum::new();
                for b in 0..kbs {
                    let mut isum = 0i128;
                    for kk in b * FP8_BLOCK..((b + 1) * FP8_BLOCK).min(k) {
                        let (Some(x), Some(y)) = (units_f32(a.af[row * a.kp + kk]), e4m3_to_units(w.fp8_byte(col, kk)))
                        else {
                            return f64::NAN;
                        };
                        isum += x as i128 * y as i128;
                    }
                    let (sa, ea) = f32_parts(input[b * self.m + row]);
                    let (sw, ew) = f32_parts(weight[col / FP8_BLOCK * kbs + b]);
                    acc.add(isum * (sa as i128 * sw as i128), -18 + ea + ew);
                }
                O::from_f64(acc.to_f64_round_odd()).to_f32()
            }
            _ => O::from_f64(self.inner.exact(row, col, to)).to_f32(),
        };
        self.finish(row, col, raw) as f64
    }
}

/// An E4M3 value decoded to f32, back in its units of 2^-9 (`None` for NaN).
fn units_f32(x: f32) -> Option<i32> {
    if x.is_nan() {
        return None;
    }
    // Every E4M3 value is an integer multiple of 2^-9 below 2^9: exact.
    Some((x as f64 * 512.0) as i32)
}
