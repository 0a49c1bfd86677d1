//! Packers, the portable (scalar) kernels, and the task/epilogue machinery of the fast paths.
//!
//! Pipeline: `PackedWeights` (once per weight) and prepared activations (once per call) →
//! group kernels (`crate::simd`) on (≤ MR rows × 16 columns) → a per-task tile buffer of one
//! column panel → the epilogue, which multiplies by `tensor_sf`, rounds once and routes each value
//! to the output, the K cache or the V cache. No `[M, N]` intermediate exists.
//!
//! **Scales without denormals.** NVFP4 weight scales are repacked from E4M3 to an unsigned E5M3
//! byte (bias 15, exact for every E4M3 value, subnormals included), whose bits shifted left by 20
//! are a *normal* f32 equal to `scale · 2^-112`; activation scales are stored as f32
//! `scale · 2^112` (normal). Their product is the exact scale product, and no operand is ever an
//! f32 denormal (which costs a microcode assist per multiply on x86). MX (E8M0) scale products
//! are formed by adding exponents in integers and shifting into an f32 exponent field, clamped
//! to [0, 255]: exact whenever the product lies in f32's normal range, 0 or ∞ outside it.
//!
//! **NaN scales** (E4M3 `0x7F`, E8M0 `0xFF`) are recorded per activation row and per weight
//! column and turn the affected outputs into NaN in the epilogue, as in the oracle (a NaN scale
//! poisons every dot product it enters).

// Index loops mirror the packed layout's formulas; iterator chains would hide them.
#![allow(clippy::needless_range_loop)]

pub(crate) mod scatter;

use crate::cache::{CacheShape, SlotPlan};
use crate::element::Element;
use crate::formats::fp4::{E2M1_DOUBLED, fp4_code};
use crate::formats::fp8::{e4m3_scale_to_f32, e4m3_to_f32};
use crate::formats::{BlockFormat, QuantizedRef};
use crate::simd::{GROUP, MR};
use rayon::prelude::*;
use scatter::SharedMut;

/// How the block scales of a packed FP4 group are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScaleKind {
    /// NVFP4: unsigned E5M3 weight bytes; activation scales as f32 bits of `scale · 2^112`.
    E5m3,
    /// MXFP4: raw E8M0 weight bytes; activation scales as the i32 `e − 127`.
    E8m0,
}

/// One 16-column group of packed FP4 weights: for block `kb` and pair `p` (8 k's), 64 bytes; byte
/// `c·4 + j` holds column c's element `kb·V + 8p + j` in its low nibble and `+ 4` in its high one.
pub(crate) struct Fp4Group<'a> {
    pub w: &'a [u8],
    /// `[kb][16]` scale bytes.
    pub ws: &'a [u8],
    /// V / 8.
    pub pairs: usize,
    /// Blocks.
    pub kb: usize,
    pub kind: ScaleKind,
}

/// Up to MR prepared activation rows.
pub(crate) struct Fp4Rows<'a> {
    /// Doubled E2M1 activations, `kb · V` each (zero padded).
    pub a: [&'a [i8]; MR],
    /// `12 · Σa` per block (the x86 kernels' offset correction).
    pub corr: [&'a [i32]; MR],
    /// Per block scale: f32 bits (E5m3) or exponent offset (E8m0).
    pub sc: [&'a [u32]; MR],
    pub count: usize,
}

impl Fp4Rows<'_> {
    pub fn count(&self) -> usize {
        self.count
    }
}

impl Fp4Group<'_> {
    /// The lengths every kernel's unchecked loads rely on. Panics on violation (a bug, not input).
    pub fn check(&self, rows: &Fp4Rows<'_>) {
        assert!(rows.count >= 1 && rows.count <= MR);
        assert!(self.w.len() >= self.kb * self.pairs * 64 && self.ws.len() >= self.kb * GROUP);
        for r in 0..rows.count {
            assert!(rows.a[r].len() >= self.kb * self.pairs * 8);
            assert!(rows.corr[r].len() >= self.kb && rows.sc[r].len() >= self.kb);
        }
    }
}

/// The block-scale product `s` of the canonical order (see `crate::simd`).
#[inline(always)]
pub(crate) fn scale_product(kind: ScaleKind, wb: u8, sc: u32) -> f32 {
    match kind {
        ScaleKind::E5m3 => f32::from_bits((wb as u32) << 20) * f32::from_bits(sc),
        ScaleKind::E8m0 => f32::from_bits(((wb as i32 + sc as i32).clamp(0, 255) as u32) << 23),
    }
}

/// The portable kernel: the canonical order written plainly. Bit-identical to every SIMD kernel.
pub(crate) fn group_scalar(g: &Fp4Group<'_>, rows: &Fp4Rows<'_>, out: &mut [[f32; GROUP]; MR]) {
    let v = g.pairs * 8;
    for r in 0..rows.count {
        for c in 0..GROUP {
            let mut acc = 0f32;
            for kb in 0..g.kb {
                let a = &rows.a[r][kb * v..(kb + 1) * v];
                let mut isum = 0i32;
                for p in 0..g.pairs {
                    for j in 0..4 {
                        let byte = g.w[(kb * g.pairs + p) * 64 + c * 4 + j];
                        isum += E2M1_DOUBLED[(byte & 0xF) as usize] as i32 * a[p * 8 + j] as i32;
                        isum += E2M1_DOUBLED[(byte >> 4) as usize] as i32 * a[p * 8 + 4 + j] as i32;
                    }
                }
                // Exact product (≤ 13 + 8 significant bits), so this equals the SIMD FMA.
                acc += isum as f32 * scale_product(g.kind, g.ws[kb * GROUP + c], rows.sc[r][kb]);
            }
            out[r][c] = acc;
        }
    }
}

/// The unsigned E5M3 byte (bias 15) of `|E4M3 scale byte|`, exact; `None` for NaN.
pub(crate) fn e5m3_from_e4m3_scale(b: u8) -> Option<u8> {
    let v = e4m3_scale_to_f32(b);
    if v.is_nan() {
        return None;
    }
    if v == 0.0 {
        return Some(0);
    }
    let bits = v.to_bits();
    let e = ((bits >> 23) & 0xFF) as i32 - 127; // v is a normal f32 (≥ 2^-9)
    let m = (bits >> 20) & 7;
    Some((((e + 15) as u32) << 3 | m) as u8)
}

/// A block-scaled weight `[N, K]` repacked once for the fast kernels (ggml-style repack): a
/// server builds it at load time and runs it for every call with
/// [`qkv_fp4_ragged_packed`](crate::fast::qkv_fp4_ragged_packed).
///
/// FP4 formats: 16-column groups, two nibbles of adjacent k-quads per byte (see the module docs of
/// `kernels`), scales repacked to denormal-free bytes. MXFP8: row-major bytes, padded.
/// The layout is the same for every ISA.
#[derive(Debug, Clone)]
pub struct PackedWeights {
    format: BlockFormat,
    n: usize,
    k: usize,
    kb: usize,
    groups: usize,
    data: Vec<u8>,
    scales: Vec<u8>,
    nan_col: Vec<bool>,
}

impl PackedWeights {
    /// Repacks a validated weight (in parallel on the current rayon pool).
    pub fn new(weight: QuantizedRef<'_>) -> Self {
        Self::pack(weight, true)
    }

    pub(crate) fn pack(w: QuantizedRef<'_>, parallel: bool) -> Self {
        let (format, n, k) = (w.format(), w.rows(), w.k());
        let v = format.vector_size();
        let kb = w.k_blocks();
        let groups = n.div_ceil(GROUP);
        let nan_col: Vec<bool> =
            (0..n).map(|r| (0..kb).any(|b| format.scale_to_f32(w.scale_byte(r, b)).is_nan())).collect();
        let (data, scales) = if format.is_fp4() {
            let pairs = v / 8;
            let gbytes = kb * pairs * 64;
            let mut data = vec![0u8; groups * gbytes];
            let mut scales = vec![0u8; groups * kb * GROUP];
            let fill = |(g, (d, s)): (usize, (&mut [u8], &mut [u8]))| {
                for c in 0..GROUP.min(n.saturating_sub(g * GROUP)) {
                    let col = g * GROUP + c;
                    let row = w.row(col);
                    let code = |kk: usize| if kk < k { fp4_code(row, kk) } else { 0 };
                    for b in 0..kb {
                        for p in 0..pairs {
                            for j in 0..4 {
                                let k0 = b * v + p * 8 + j;
                                d[(b * pairs + p) * 64 + c * 4 + j] = code(k0) | code(k0 + 4) << 4;
                            }
                        }
                        let sb = w.scale_byte(col, b);
                        s[b * GROUP + c] = match format {
                            BlockFormat::Nvfp4 => e5m3_from_e4m3_scale(sb).unwrap_or(0),
                            _ => sb,
                        };
                    }
                }
            };
            let chunks = data.chunks_mut(gbytes.max(1)).zip(scales.chunks_mut((kb * GROUP).max(1)));
            if parallel && gbytes > 0 {
                data.par_chunks_mut(gbytes).zip(scales.par_chunks_mut(kb * GROUP)).enumerate().for_each(fill);
            } else {
                chunks.enumerate().for_each(fill);
            }
            (data, scales)
        } else {
            // MXFP8: row-major [groups·16, kb·V] bytes and [groups·16, kb] scale bytes.
            let kp = kb * v;
            let mut data = vec![0u8; groups * GROUP * kp];
            let mut scales = vec![0u8; groups * GROUP * kb];
            for col in 0..n {
                data[col * kp..col * kp + k].copy_from_slice(w.row(col));
                for b in 0..kb {
                    scales[col * kb + b] = w.scale_byte(col, b);
                }
            }
            (data, scales)
        };
        PackedWeights { format, n, k, kb, groups, data, scales, nan_col }
    }

    /// The format.
    pub fn format(&self) -> BlockFormat {
        self.format
    }
    /// Rows (N).
    pub fn rows(&self) -> usize {
        self.n
    }
    /// Logical K.
    pub fn k(&self) -> usize {
        self.k
    }
    /// Bytes held (data and scales).
    pub fn size_bytes(&self) -> usize {
        self.data.len() + self.scales.len()
    }

    fn fp4_group(&self, g: usize) -> Fp4Group<'_> {
        let pairs = self.format.vector_size() / 8;
        let gb = self.kb * pairs * 64;
        Fp4Group {
            w: &self.data[g * gb..(g + 1) * gb],
            ws: &self.scales[g * self.kb * GROUP..(g + 1) * self.kb * GROUP],
            pairs,
            kb: self.kb,
            kind: if self.format == BlockFormat::Nvfp4 { ScaleKind::E5m3 } else { ScaleKind::E8m0 },
        }
    }
}

/// 2^112, built from its bits (exact by construction; `powi` is not guaranteed exact).
const TWO_POW_112: f32 = f32::from_bits((112 + 127) << 23);

/// Activations prepared once per call.
pub(crate) struct Acts {
    /// FP4: doubled E2M1 as i8, `[m][kb·V]`.
    a8: Vec<i8>,
    /// MXFP8: decoded f32, `[m][kb·V]`.
    af: Vec<f32>,
    corr: Vec<i32>,
    sc: Vec<u32>,
    nan_row: Vec<bool>,
    kp: usize,
    kb: usize,
}

impl Acts {
    pub fn prepare(a: QuantizedRef<'_>) -> Self {
        let (format, m, k) = (a.format(), a.rows(), a.k());
        let v = format.vector_size();
        let kb = a.k_blocks();
        let kp = kb * v;
        let mut acts = Acts {
            a8: Vec::new(),
            af: Vec::new(),
            corr: vec![0; m * kb],
            sc: vec![0; m * kb],
            nan_row: vec![false; m],
            kp,
            kb,
        };
        if format.is_fp4() {
            acts.a8 = vec![0; m * kp];
        } else {
            acts.af = vec![0.0; m * kp];
        }
        for r in 0..m {
            let row = a.row(r);
            for kk in 0..k {
                if format.is_fp4() {
                    acts.a8[r * kp + kk] = E2M1_DOUBLED[fp4_code(row, kk) as usize];
                } else {
                    acts.af[r * kp + kk] = e4m3_to_f32(row[kk]);
                }
            }
            for b in 0..kb {
                let byte = a.scale_byte(r, b);
                let i = r * kb + b;
                if format.is_fp4() {
                    acts.corr[i] =
                        12 * acts.a8[r * kp + b * v..r * kp + (b + 1) * v].iter().map(|&x| x as i32).sum::<i32>();
                }
                acts.sc[i] = match format {
                    BlockFormat::Nvfp4 => {
                        let s = e4m3_scale_to_f32(byte);
                        acts.nan_row[r] |= s.is_nan();
                        (if s.is_nan() { 0.0 } else { s * TWO_POW_112 }).to_bits()
                    }
                    _ => {
                        acts.nan_row[r] |= byte == 0xFF;
                        (byte as i32 - 127) as u32
                    }
                };
            }
        }
        acts
    }

    fn fp4_rows(&self, r0: usize, count: usize) -> Fp4Rows<'_> {
        let (kp, kb) = (self.kp, self.kb);
        let pick = |i: usize| r0 + i.min(count - 1);
        Fp4Rows {
            a: std::array::from_fn(|i| &self.a8[pick(i) * kp..(pick(i) + 1) * kp]),
            corr: std::array::from_fn(|i| &self.corr[pick(i) * kb..(pick(i) + 1) * kb]),
            sc: std::array::from_fn(|i| &self.sc[pick(i) * kb..(pick(i) + 1) * kb]),
            count,
        }
    }
}

/// MXFP8 group kernel (all ISAs; scalar): per block an f32 sum of exact products in k order,
/// times the exact (in-range) scale product.
fn group_fp8(pw: &PackedWeights, acts: &Acts, g: usize, r0: usize, count: usize, out: &mut [[f32; GROUP]; MR]) {
    let (kb, kp) = (pw.kb, acts.kp);
    let v = pw.format.vector_size();
    let table: [f32; 256] = std::array::from_fn(|b| e4m3_to_f32(b as u8));
    for c in 0..GROUP {
        let col = g * GROUP + c;
        let w = &pw.data[col * kp..(col + 1) * kp];
        let ws = &pw.scales[col * kb..(col + 1) * kb];
        for (r, o) in out.iter_mut().enumerate().take(count) {
            let row = r0 + r;
            let a = &acts.af[row * kp..(row + 1) * kp];
            let mut acc = 0f32;
            for b in 0..kb {
                let mut bs = 0f32;
                for kk in b * v..(b + 1) * v {
                    bs += a[kk] * table[w[kk] as usize];
                }
                acc += bs * scale_product(ScaleKind::E8m0, ws[b], acts.sc[row * kb + b]);
            }
            o[c] = acc;
        }
    }
}

/// Where finished values go: Q to the output, K/V to their cache slots, each rounded once.
pub(crate) struct Epilogue<'a, O, C> {
    out: SharedMut<'a, O>,
    cache: SharedMut<'a, C>,
    q_dim: usize,
    n: usize,
    /// For column `q_dim + j`: its offset from the slot's `[block, 0, layer, slot, 0, 0]`.
    col_off: Vec<usize>,
    /// Per row: the flat index of `[block, 0, layer, slot, 0, 0]`, or None (no K/V write).
    slot_base: Vec<Option<usize>>,
    nan_row: &'a [bool],
    nan_col: &'a [bool],
    mult: f32,
}

impl<'a, O: Element, C: Element> Epilogue<'a, O, C> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        output: &'a mut [O],
        cache: &'a mut [C],
        shape: CacheShape,
        layer: usize,
        plan: &SlotPlan,
        q_dim: usize,
        n: usize,
        nan_row: &'a [bool],
        nan_col: &'a [bool],
        mult: f32,
    ) -> Self {
        let kvw = shape.kv_width();
        let v_stride = shape.index(0, 1.min(shape.kv_dim() - 1), 0, 0, 0, 0);
        let col_off =
            (0..n - q_dim).map(|j| if shape.is_mla() || j < kvw { j } else { v_stride + (j - kvw) }).collect();
        let slot_base = plan.rows.iter().map(|s| s.map(|s| shape.index(s.block, 0, layer, s.offset, 0, 0))).collect();
        Epilogue {
            out: SharedMut::new(output),
            cache: SharedMut::new(cache),
            q_dim,
            n,
            col_off,
            slot_base,
            nan_row,
            nan_col,
            mult,
        }
    }

    /// Finishes columns `c0 .. c0 + vals.len()` of `row` (a whole head when panels are
    /// head-aligned: the place for a fused per-head transform such as RoPE).
    fn finish(&self, row: usize, c0: usize, vals: &[f32]) {
        for (j, &acc) in vals.iter().enumerate() {
            let c = c0 + j;
            if c >= self.n {
                break;
            }
            let v = if self.nan_row[row] || self.nan_col[c] { f32::NAN } else { acc * self.mult };
            if c < self.q_dim {
                // SAFETY: (row, c) belongs to exactly one task's tile.
                unsafe_write(&self.out, row * self.q_dim + c, O::from_f32(v));
            } else if let Some(base) = self.slot_base[row] {
                // SAFETY: the slot plan gives each row its own slot, and (row, c) one task.
                unsafe_write(&self.cache, base + self.col_off[c - self.q_dim], C::from_f32(v));
            }
        }
    }
}

#[allow(unsafe_code)]
#[inline(always)]
fn unsafe_write<T>(s: &SharedMut<'_, T>, i: usize, v: T) {
    // SAFETY: callers (the epilogue) write each index from one task only: tasks own disjoint
    // (row, column) tiles and the validated slot plan maps rows to distinct cache slots.
    unsafe { s.write(i, v) }
}

/// Rows per task tile and columns per panel.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tiling {
    pub mc: usize,
    pub nc: usize,
}

impl Tiling {
    /// Panels are one head wide when heads are a multiple of 16 columns (≤ 256), so the epilogue
    /// sees finished heads (where a fused per-head transform such as RoPE goes); else 128 columns.
    /// Rows: one tile up to `MC` rows (decode and small prefill stream W once), then `MC`-row
    /// tiles so a W panel is reused from L2. Measured on the Llama-3-8B shape (README):
    /// head-wide (128) panels beat 64-column ones at M = 1 and 8.
    pub fn choose(m: usize, head_size: usize) -> Tiling {
        let nc = if head_size.is_multiple_of(GROUP) && (GROUP..=256).contains(&head_size) { head_size } else { 128 };
        Tiling { mc: m.clamp(1, MC), nc }
    }
}

/// Row tile of the prefill regime (measured: 32 ≈ 64 < 128 at M = 512, see README).
const MC: usize = 64;

/// Runs all tasks of a call. Each task owns a (row tile × column panel) and finishes it.
pub(crate) fn run<O: Element, C: Element>(
    pw: &PackedWeights,
    acts: &Acts,
    m: usize,
    token: crate::simd::IsaToken,
    parallel: bool,
    epi: &Epilogue<'_, O, C>,
    tiling: Tiling,
) {
    let np = pw.groups * GROUP;
    let (mc, nc) = (tiling.mc, tiling.nc);
    let row_tiles = m.div_ceil(mc);
    let panels = np.div_ceil(nc);
    let task = |t: usize| {
        let (rt, pc) = (t / panels, t % panels);
        let (r0, c0) = (rt * mc, pc * nc);
        let (r1, c1) = ((r0 + mc).min(m), (c0 + nc).min(np));
        let width = c1 - c0;
        let mut buf = vec![0f32; (r1 - r0) * width];
        let mut tile = [[0f32; GROUP]; MR];
        for g in c0 / GROUP..c1 / GROUP {
            let group = pw.format.is_fp4().then(|| pw.fp4_group(g));
            for rr in (r0..r1).step_by(MR) {
                let count = MR.min(r1 - rr);
                match &group {
                    Some(gr) => crate::simd::fp4_group(token, gr, &acts.fp4_rows(rr, count), &mut tile),
                    None => group_fp8(pw, acts, g, rr, count, &mut tile),
                }
                for (i, t) in tile.iter().enumerate().take(count) {
                    let off = (rr - r0 + i) * width + g * GROUP - c0;
                    buf[off..off + GROUP].copy_from_slice(t);
                }
            }
        }
        for r in r0..r1 {
            epi.finish(r, c0, &buf[(r - r0) * width..(r - r0 + 1) * width]);
        }
    };
    let tasks = row_tiles * panels;
    if parallel && tasks > 1 {
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
}

impl Acts {
    pub fn nan_row(&self) -> &[bool] {
        &self.nan_row
    }
}

impl PackedWeights {
    pub(crate) fn nan_col(&self) -> &[bool] {
        &self.nan_col
    }
}
