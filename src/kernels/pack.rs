//! Packers: one per operand family. A packer is the only place the fast path decodes a format.
//!
//! * [`PackedWeights`]: a block-scaled weight (NVFP4, MXFP4, MXFP8), packed once.
//! * [`Fp4Acts`]: block-scaled activations, prepared once per call.
//! * [`PackedPlainWeights`]: a bf16/f16/f32 weight, packed once.
//! * [`PlainActs`]: bf16/f16/f32 activations, prepared once per call.
//!
//! **Scales without denormals.** NVFP4 weight scales are repacked from E4M3 to an unsigned E5M3
//! byte (bias 15, exact for every E4M3 value, subnormals included), whose bits shifted left by 20
//! are a *normal* f32 equal to `scale · 2^-112`; activation scales are stored as f32
//! `scale · 2^110`. Their product is the exact scale product times 1/4 (the doubled E2M1 values
//! on both sides make every integer block sum 4× the products), and no operand is ever an f32
//! denormal (which costs a microcode assist per multiply on x86). MX (E8M0) scale products are
//! formed by adding exponents in integers and shifting into an f32 exponent field.

// Index loops mirror the packed layout's formulas; iterator chains would hide them.
#![allow(clippy::needless_range_loop)]

use super::team::Team;
use crate::element::Element;
use crate::error::Result;
use crate::error::weight_rows;
use crate::formats::fp4::fp4_code;
use crate::formats::fp8::e4m3_scale_to_f32;
use crate::formats::scale_layout::ScaleLayout;
use crate::formats::{BlockFormat, QuantizedMatrix, QuantizedRef};
use crate::pool::{Poolable, Pooled};
use crate::simd::fp4::{ActRow, Fp4Group, Fp4Rows, ScaleKind};
use crate::simd::fp8::{Fp8Group, Fp8Rows};
use crate::simd::plain::{PackedRows, PlainKind, PlainPanel};
use crate::simd::{GROUP, IsaToken, MR, prepare_row};
use std::marker::PhantomData;

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

/// A block-scaled weight `[N, K]` (NVFP4, MXFP4, MXFP8) repacked once for the fast kernels
/// (ggml-style repack): a server builds it at load time and passes it to every call of
/// [`qkv_fp4_ragged_packed`](crate::fast::qkv_fp4_ragged_packed) (see the `serve_decode` example).
///
/// It remembers the weight's [`tensor_scale`](Self::tensor_scale), so the operation's `tensor_sf`
/// is `activations.tensor_scale() · packed.tensor_scale()`
/// ([`QkvFp4PackedArgs::new`](crate::QkvFp4PackedArgs::new) forms it). The layout is the same for
/// every ISA: FP4 formats in 16-column groups (two nibbles of adjacent k-quads per byte) with
/// denormal-free scale bytes; MXFP8 in 16-column groups, k-major. About 1.03× the bytes of the
/// original weight.
#[derive(Debug, Clone)]
pub struct PackedWeights {
    pub(crate) format: BlockFormat,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) kb: usize,
    tensor_scale: f32,
    data: Vec<u8>,
    /// Kernel scale bytes (E5M3 / E8M0), in the kernels' layout.
    scales: Vec<u8>,
    /// The original scale bytes, `[n][kb]`, for the exact path.
    raw_scales: Vec<u8>,
    /// Per column: a NaN scale, and the smallest and largest E8M0 scale byte (MX formats).
    pub(crate) nan_col: Vec<bool>,
    pub(crate) min_scale: Vec<u8>,
}

impl PackedWeights {
    /// Repacks a weight (validated by [`QuantizedRef::new`]), in parallel on the current rayon
    /// pool, keeping its [`tensor_scale`](QuantizedRef::tensor_scale).
    pub fn new(weight: QuantizedRef<'_>) -> Self {
        Self::pack(weight, Team::Rayon)
    }

    pub(crate) fn pack(w: QuantizedRef<'_>, team: Team) -> Self {
        let (format, n, k) = (w.format(), w.rows(), w.k());
        let v = format.vector_size();
        let kb = w.k_blocks();
        let groups = n.div_ceil(GROUP);
        let raw_scales: Vec<u8> = (0..n).flat_map(|r| (0..kb).map(move |b| w.scale_byte(r, b))).collect();
        // A NaN scale, or (MXFP8) a NaN element: the SIMD decode of E4M3 has no NaN, so such
        // columns take the exact path (which gives NaN).
        let nan_col: Vec<bool> = (0..n)
            .map(|r| {
                raw_scales[r * kb..(r + 1) * kb].iter().any(|&b| format.scale_to_f32(b).is_nan())
                    || (!format.is_fp4() && w.row(r).iter().any(|&b| b & 0x7F == 0x7F))
            })
            .collect();
        let min_scale = (0..n).map(|r| raw_scales[r * kb..(r + 1) * kb].iter().copied().min().unwrap_or(0)).collect();
        let mut scales = vec![0u8; groups * kb * GROUP];
        for col in 0..n {
            for b in 0..kb {
                let sb = raw_scales[col * kb + b];
                scales[(col / GROUP * kb + b) * GROUP + col % GROUP] = match format {
                    BlockFormat::Nvfp4 => e5m3_from_e4m3_scale(sb).unwrap_or(0),
                    _ => sb,
                };
            }
        }
        let data = if format.is_fp4() {
            let pairs = v / 8;
            let gbytes = kb * pairs * 64;
            let mut data = vec![0u8; groups * gbytes];
            team.chunks_mut(&mut data, gbytes, |g, d| {
                for c in 0..GROUP.min(n.saturating_sub(g * GROUP)) {
                    let row = w.row(g * GROUP + c);
                    let code = |kk: usize| if kk < k { fp4_code(row, kk) } else { 0 };
                    for b in 0..kb {
                        for p in 0..pairs {
                            for j in 0..4 {
                                let k0 = b * v + p * 8 + j;
                                d[(b * pairs + p) * 64 + c * 4 + j] = code(k0) | code(k0 + 4) << 4;
                            }
                        }
                    }
                }
            });
            data
        } else {
            // MXFP8: 16-column groups, k-major: byte (k, c) of group g at `g·kp·16 + k·16 + c`
            // (one 16-byte load per k feeds 16 columns), zero padded to kb·V.
            let kp = kb * v;
            let mut data = vec![0u8; groups * GROUP * kp];
            team.chunks_mut(&mut data, GROUP * kp, |g, d| {
                for c in 0..GROUP.min(n.saturating_sub(g * GROUP)) {
                    for (kk, &b) in w.row(g * GROUP + c).iter().enumerate() {
                        d[kk * GROUP + c] = b;
                    }
                }
            });
            data
        };
        PackedWeights { format, n, k, kb, tensor_scale: w.tensor_scale(), data, scales, raw_scales, nan_col, min_scale }
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
    /// The weight's dequantization multiplier, as it was when packed.
    pub fn tensor_scale(&self) -> f32 {
        self.tensor_scale
    }
    /// Bytes held (data, kernel scales and the original scales kept for the exact path).
    pub fn size_bytes(&self) -> usize {
        self.data.len() + self.scales.len() + self.raw_scales.len()
    }

    /// The weight this was packed from: the codes (`[N, K/2]` packed E2M1 or `[N, K]` E4M3), the
    /// scales in the 5-D layout and the tensor scale. Packing loses nothing the operations read:
    /// every code and every scale of the `[N, K]` matrix come back bit for bit (the 5-D tensor's
    /// padding entries, which no operation reads, come back as zeros). For a server that keeps
    /// only the packed weight and still wants the oracle (`reference::qkv_fp4_ragged`).
    pub fn to_quantized(&self) -> QuantizedMatrix {
        let (format, n, k) = (self.format, self.n, self.k);
        let row_bytes = format.row_bytes(k);
        let mut data = vec![0u8; n * row_bytes];
        for (col, row) in data.chunks_exact_mut(row_bytes.max(1)).enumerate().take(n) {
            for kk in 0..k {
                if format.is_fp4() {
                    row[kk / 2] |= self.fp4_code(col, kk) << (4 * (kk % 2));
                } else {
                    row[kk] = self.fp8_byte(col, kk);
                }
            }
        }
        let layout = ScaleLayout::for_operand(n, k, format.vector_size());
        let scales = layout.interleave(&self.raw_scales).expect("the raw scales are [n][kb]");
        QuantizedMatrix::from_parts(format, n, k, data, scales, self.tensor_scale)
            .expect("the codes and scales of a packed weight have its shape")
    }

    /// Group `g` of an FP4 format.
    pub(crate) fn fp4_group(&self, g: usize) -> Fp4Group<'_> {
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

    /// Group `g` of MXFP8.
    pub(crate) fn fp8_group(&self, g: usize) -> Fp8Group<'_> {
        let v = self.format.vector_size();
        let gb = self.kb * v * GROUP;
        Fp8Group {
            w: &self.data[g * gb..(g + 1) * gb],
            ws: &self.scales[g * self.kb * GROUP..(g + 1) * self.kb * GROUP],
            v,
            kb: self.kb,
        }
    }

    /// The E4M3 byte of element `k` of column `col` (MXFP8).
    pub(crate) fn fp8_byte(&self, col: usize, k: usize) -> u8 {
        let kp = self.kb * self.format.vector_size();
        self.data[(col / GROUP) * kp * GROUP + k * GROUP + col % GROUP]
    }

    /// The E2M1 code of element `k` of column `col` (FP4 formats).
    pub(crate) fn fp4_code(&self, col: usize, k: usize) -> u8 {
        let (v, pairs) = (self.format.vector_size(), self.format.vector_size() / 8);
        let (b, r) = (k / v, k % v);
        let (p, q) = (r / 8, r % 8);
        let byte = self.data[(col / GROUP) * self.kb * pairs * 64 + (b * pairs + p) * 64 + (col % GROUP) * 4 + q % 4];
        if q < 4 { byte & 0xF } else { byte >> 4 }
    }

    /// The original scale byte of (col, block).
    pub(crate) fn raw_scale(&self, col: usize, b: usize) -> u8 {
        self.raw_scales[col * self.kb + b]
    }
}

/// Fewest activation elements (`M · K`) [`Fp4Acts::prepare`] spreads over the team: below
/// them the hand-off costs more than the preparation (~0.4 ns an element on one thread).
const PREPARE_PARALLEL_ELEMENTS: usize = 1 << 16;

/// `buf` in `per`-long pieces, or endless empty pieces when it is empty (a buffer the format
/// does not use), so that it zips with the others.
fn cut<T>(buf: &mut [T], per: usize) -> impl Iterator<Item = &mut [T]> {
    let unused = buf.is_empty();
    buf.chunks_mut(per.max(1)).chain(std::iter::repeat_with(Default::default).take(if unused { usize::MAX } else { 0 }))
}

/// Rows `r0 ..` of [`Fp4Acts`]' buffers (a format's unused buffers empty).
struct Piece<'s> {
    r0: usize,
    a8: &'s mut [i8],
    af: &'s mut [f32],
    corr: &'s mut [i32],
    sc: &'s mut [u32],
    scf: &'s mut [f32],
    raw: &'s mut [u8],
    nan: &'s mut [bool],
    min: &'s mut [u8],
}

/// Block-scaled activations prepared once per call.
pub(crate) struct Fp4Acts {
    /// FP4: doubled E2M1 as i8, `[m][kb·V]`.
    a8: Pooled<i8>,
    /// MXFP8: decoded f32, `[m][kb·V]`.
    pub af: Pooled<f32>,
    corr: Pooled<i32>,
    pub sc: Pooled<u32>,
    /// MXFP4, MXFP8: `sc` as f32 (the exponent offset), `[m][kb]`; empty for NVFP4.
    scf: Pooled<f32>,
    /// The original scale bytes, `[m][kb]`.
    raw: Pooled<u8>,
    pub nan_row: Pooled<bool>,
    pub min_scale: Pooled<u8>,
    pub kp: usize,
    pub kb: usize,
}

impl Fp4Acts {
    /// Prepares `a`'s rows with `token`'s build of [`prepare_row`] (vectorised), on `team` where
    /// the call has enough rows for it to pay (a decode's row stays on the calling thread).
    pub fn prepare(a: QuantizedRef<'_>, token: IsaToken, team: Team) -> Self {
        let (format, m) = (a.format(), a.rows());
        let kb = a.k_blocks();
        let kp = kb * format.vector_size();
        let mut acts = Fp4Acts {
            a8: Pooled::new(),
            af: Pooled::new(),
            corr: Pooled::filled(0, m * kb),
            sc: Pooled::filled(0, m * kb),
            scf: Pooled::new(),
            raw: Pooled::filled(0, m * kb),
            nan_row: Pooled::filled(false, m),
            min_scale: Pooled::filled(0, m),
            kp,
            kb,
        };
        if format.is_fp4() {
            acts.a8.resize(m * kp, 0);
        } else {
            acts.af.resize(m * kp, 0.0);
        }
        if format != BlockFormat::Nvfp4 {
            acts.scf.resize(m * kb, 0.0);
        }
        // Pieces of `per` rows: one for a call of few rows, else about four per thread.
        let threads = team.threads();
        let per = if threads > 1 && m * kp >= PREPARE_PARALLEL_ELEMENTS { m.div_ceil(4 * threads) } else { m.max(1) };
        let pieces = cut(&mut acts.a8, per * kp)
            .zip(cut(&mut acts.af, per * kp))
            .zip(cut(&mut acts.corr, per * kb).zip(cut(&mut acts.sc, per * kb)))
            .zip(cut(&mut acts.scf, per * kb).zip(cut(&mut acts.raw, per * kb)))
            .zip(acts.nan_row.chunks_mut(per).zip(acts.min_scale.chunks_mut(per)))
            .enumerate()
            .map(|(i, ((((a8, af), (corr, sc)), (scf, raw)), (nan, min)))| Piece {
                r0: i * per,
                a8,
                af,
                corr,
                sc,
                scf,
                raw,
                nan,
                min,
            });
        let fill = |p: Piece<'_>| {
            for j in 0..p.nan.len() {
                let r = p.r0 + j;
                let raw = &mut p.raw[j * kb..(j + 1) * kb];
                a.scale_row(r, raw);
                let row = ActRow {
                    a8: p.a8.get_mut(j * kp..(j + 1) * kp).unwrap_or_default(),
                    af: p.af.get_mut(j * kp..(j + 1) * kp).unwrap_or_default(),
                    corr: &mut p.corr[j * kb..(j + 1) * kb],
                    sc: &mut p.sc[j * kb..(j + 1) * kb],
                    scf: p.scf.get_mut(j * kb..(j + 1) * kb).unwrap_or_default(),
                    raw,
                };
                (p.nan[j], p.min[j]) = prepare_row(token, format, a.row(r), a.k(), row);
            }
        };
        if per >= m {
            pieces.for_each(fill);
        } else {
            team.each(pieces, fill);
        }
        acts
    }

    /// Rows `rows` (≤ MR; later entries repeat the last).
    pub fn fp4_rows(&self, rows: &[usize]) -> Fp4Rows<'_> {
        let (kp, kb) = (self.kp, self.kb);
        let pick = |i: usize| rows[i.min(rows.len() - 1)];
        Fp4Rows {
            a: std::array::from_fn(|i| &self.a8[pick(i) * kp..(pick(i) + 1) * kp]),
            corr: std::array::from_fn(|i| &self.corr[pick(i) * kb..(pick(i) + 1) * kb]),
            sc: std::array::from_fn(|i| &self.sc[pick(i) * kb..(pick(i) + 1) * kb]),
            scf: std::array::from_fn(|i| self.scf.get(pick(i) * kb..(pick(i) + 1) * kb).unwrap_or(&[])),
            count: rows.len().min(MR),
        }
    }

    /// MXFP8 rows `rows` (≤ MR; later entries repeat the last).
    pub fn fp8_rows(&self, rows: &[usize]) -> Fp8Rows<'_> {
        let (kp, kb) = (self.kp, self.kb);
        let pick = |i: usize| rows[i.min(rows.len() - 1)];
        Fp8Rows {
            a: std::array::from_fn(|i| &self.af[pick(i) * kp..(pick(i) + 1) * kp]),
            sc: std::array::from_fn(|i| &self.sc[pick(i) * kb..(pick(i) + 1) * kb]),
            scf: std::array::from_fn(|i| &self.scf[pick(i) * kb..(pick(i) + 1) * kb]),
            count: rows.len().min(MR),
        }
    }

    /// Doubled E2M1 element k of row r.
    pub fn a2(&self, r: usize, k: usize) -> i8 {
        self.a8[r * self.kp + k]
    }

    /// The original scale byte of (row, block).
    pub fn raw_scale(&self, r: usize, b: usize) -> u8 {
        self.raw[r * self.kb + b]
    }
}

/// A bf16, f16 or f32 weight `[N, K]` packed once for the fast kernels: 16-column groups, K in
/// k-pairs, the layout of every ISA's micro-kernel (see `crate::simd::plain`). A server builds it
/// at load time and passes it to [`qkv_ragged_packed`](crate::fast::qkv_ragged_packed) or
/// [`qkv_bshd_packed`](crate::fast::qkv_bshd_packed). The same bytes as the weight (f32 for
/// E4M3, widened exactly), plus zero padding to whole groups and pairs.
#[derive(Debug, Clone)]
pub struct PackedPlainWeights<T> {
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) pairs: usize,
    pub(crate) kind: PlainKind,
    data: Vec<u32>,
    _t: PhantomData<T>,
}

impl<T: Element> PackedPlainWeights<T> {
    /// Packs a row-major `[N, hidden_size]` weight (`N = weight.len() / hidden_size`), in parallel
    /// on the current rayon pool. Errors: `hidden_size == 0`, or a length that is not a whole
    /// number of rows.
    pub fn new(weight: &[T], hidden_size: usize) -> Result<Self> {
        let k = hidden_size;
        let n = weight_rows(weight, k)?;
        Ok(Self::pack(weight, n, k, Team::Rayon))
    }

    pub(crate) fn pack(weight: &[T], n: usize, k: usize, team: Team) -> Self {
        let kind = PlainKind::of::<T>();
        let pairs = k.div_ceil(2);
        let groups = n.div_ceil(GROUP);
        let glen = pairs * kind.words_per_pair();
        let mut data = vec![0u32; groups * glen];
        let bits = |x: T| match kind {
            PlainKind::F32 => x.to_f32().to_bits(),
            _ => x.to_bits(),
        };
        team.chunks_mut(&mut data, glen, |g, d| {
            let cols = GROUP.min(n - g * GROUP);
            kind.pack_group(d, pairs, cols, k, |kk, c| bits(weight[(g * GROUP + c) * k + kk]));
        });
        PackedPlainWeights { n, k, pairs, kind, data, _t: PhantomData }
    }

    /// Rows (N).
    pub fn rows(&self) -> usize {
        self.n
    }
    /// K (`hidden_size`).
    pub fn k(&self) -> usize {
        self.k
    }
    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        4 * self.data.len()
    }

    /// The `[N, K]` weight this was packed from, bit for bit (packing is a permutation of the
    /// elements). For a server that keeps only the packed weight and still wants the oracle.
    pub fn to_vec(&self) -> Vec<T> {
        let glen = self.pairs * self.kind.words_per_pair();
        let mut w = Vec::with_capacity(self.n * self.k);
        for col in 0..self.n {
            let group = &self.data[col / GROUP * glen..(col / GROUP + 1) * glen];
            w.extend((0..self.k).map(|kk| {
                let bits = self.kind.bits(group, kk, col % GROUP);
                // E4M3 is stored widened to f32 (exactly): narrowing it back is exact.
                if T::DTYPE == crate::DType::F8E4M3 { T::from_f32(f32::from_bits(bits)) } else { T::from_bits(bits) }
            }));
        }
        w
    }

    /// Groups `g0 .. g1`, k-pairs `p0 .. p1`.
    pub(crate) fn panel(&self, g0: usize, g1: usize, p0: usize, p1: usize) -> PlainPanel<'_> {
        let wpp = self.kind.words_per_pair();
        let glen = self.pairs * wpp;
        // A task walks its panel's k-blocks in order; the next task of a thread is usually the
        // same row tile's next panel (`schedule::run`).
        let next = if p1 < self.pairs { g0 * glen + p1 * wpp } else { g1 * glen };
        PlainPanel {
            data: &self.data[g0 * glen + p0 * wpp..(g1 - 1) * glen + p1 * wpp],
            groups: g1 - g0,
            pairs: p1 - p0,
            stride: glen,
            kind: self.kind,
            next: self.data.get(next..).unwrap_or(&[]),
        }
    }

    /// Weight element (k, col), widened to f32.
    pub(crate) fn get(&self, col: usize, k: usize) -> f32 {
        let glen = self.pairs * self.kind.words_per_pair();
        let g = col / GROUP;
        self.kind.get(&self.data[g * glen..(g + 1) * glen], k, col % GROUP)
    }
}

/// Most rows of a packed block (every micro-kernel's MR: 12, 6, 4).
const MAX_MR: usize = 16;

/// Fewest row blocks [`PlainActs::prepare`] packs on the pool (a decode's one block stays on the
/// calling thread).
const PAR_PACK_BLOCKS: usize = 4;

/// Sizes `buf` to `blocks` blocks of `per` values and has `pack(b, block)` write each: on the
/// team when there are enough blocks (a serial pack was ~5 % of a Llama-3-8B
/// M = 512 bf16 call on two Zen 5 threads). The buffer is zeroed first (~0.1 ms for 4 MiB), then
/// every value overwritten.
fn fill_blocks<E: Copy + Default + Send + Poolable>(
    buf: &mut Pooled<E>,
    blocks: usize,
    per: usize,
    team: Team,
    pack: impl Fn(usize, &mut [E]) + Sync,
) {
    buf.resize(blocks * per, E::default());
    let team = if blocks >= PAR_PACK_BLOCKS { team } else { Team::One };
    team.chunks_mut(buf, per, pack);
}

/// bf16/f16/f32 activations packed once per call in the layout of the token's micro-kernel
/// ([`PackedRows`]): all rows in order, and (when some rows write no K/V, as padded BSHD rows) the
/// K/V rows alone, so the K/V panels skip the padded rows without copying per task.
pub(crate) struct PlainActs {
    pairs: usize,
    mr: usize,
    bf16_pairs: bool,
    all: (Pooled<f32>, Pooled<u32>),
    kv: Option<(Pooled<f32>, Pooled<u32>)>,
}

impl PlainActs {
    pub fn prepare<T: Element>(
        x: &[T],
        m: usize,
        k: usize,
        token: IsaToken,
        kind: PlainKind,
        kv_rows: Option<&[usize]>,
        team: Team,
    ) -> Self {
        let pairs = k.div_ceil(2);
        let (mr, bf16_pairs) = crate::simd::plain_layout(token, kind);
        // Each block written in the layout's order (pair, row), so the writes are sequential: the
        // earlier scatter per row wrote every 2·MR-th value of the block (with the zeroing, 2.3 %
        // of a Llama-3-8B M = 512 bf16 call's samples on Zen 3, then 1.25 %). A short last block
        // repeats its last row (its results are never stored); a missing last element of an odd
        // K is 0.
        let pack = |row_of: &(dyn Fn(usize) -> usize + Sync), n: usize| -> (Pooled<f32>, Pooled<u32>) {
            let (mut f, mut p) = (Pooled::new(), Pooled::new());
            let blocks = n.div_ceil(mr);
            let per = pairs * if bf16_pairs { mr } else { 2 * mr };
            assert!(mr <= MAX_MR);
            let rows_of = |b: usize| {
                let mut rows: [&[T]; MAX_MR] = [&[]; MAX_MR];
                for (i, row) in rows.iter_mut().enumerate().take(mr) {
                    let r = row_of((b * mr + i).min(n - 1));
                    *row = &x[r * k..(r + 1) * k];
                }
                rows
            };
            // Pair `pp` of a row: its even element always exists (2·pp < K); the odd one does not
            // in the last pair of an odd K.
            let whole = k / 2;
            let pack_pairs = |b: usize, dst: &mut [u32]| {
                let rows = rows_of(b);
                for (pp, d) in dst.chunks_exact_mut(mr).enumerate() {
                    for (o, r) in d.iter_mut().zip(&rows[..mr]) {
                        let odd = if pp < whole { r[2 * pp + 1].to_bits() } else { 0 };
                        *o = r[2 * pp].to_bits() | (odd << 16);
                    }
                }
            };
            let pack_f32 = |b: usize, dst: &mut [f32]| {
                let rows = rows_of(b);
                for (pp, d) in dst.chunks_exact_mut(2 * mr).enumerate() {
                    let (odd, even) = d.split_at_mut(mr);
                    for ((o, e), r) in odd.iter_mut().zip(even.iter_mut()).zip(&rows[..mr]) {
                        *o = if pp < whole { r[2 * pp + 1].to_f32() } else { 0.0 };
                        *e = r[2 * pp].to_f32();
                    }
                }
            };
            if bf16_pairs {
                fill_blocks(&mut p, blocks, per, team, pack_pairs);
            } else {
                fill_blocks(&mut f, blocks, per, team, pack_f32);
            }
            (f, p)
        };
        let all = pack(&|i| i, m);
        let kv = kv_rows.map(|rows| pack(&|i| rows[i], rows.len()));
        PlainActs { pairs, mr, bf16_pairs, all, kv }
    }

    /// The packed rows of a set (`kv`: the K/V rows; else all rows).
    pub fn rows(&self, kv: bool) -> PackedRows<'_> {
        let (f, p) = match (&self.kv, kv) {
            (Some(set), true) => set,
            _ => &self.all,
        };
        PackedRows { f, p, pairs: self.pairs, mr: self.mr, bf16_pairs: self.bf16_pairs }
    }

    /// Element k of row r, widened to f32 (exact).
    pub fn get(&self, r: usize, k: usize) -> f32 {
        self.rows(false).get(r, k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::fp4::E2M1_DOUBLED;
    use crate::formats::fp8::e4m3_to_f32;
    use crate::simd::Isa;
    use crate::simd::fp4::{E5M3_ACT_EXP, E8M0_ACT_BIAS, e4m3_f32_bits, nvfp4_act_scale_bits};
    use crate::simd::fp8::E8M0_FP8_ACT_BIAS;

    /// The vectorisable decodes equal the formulas for every byte.
    #[test]
    fn branch_free_decodes_equal_the_formulas() {
        for b in 0..=255u8 {
            assert_eq!(e4m3_f32_bits(b), e4m3_to_f32(b).to_bits(), "E4M3 {b:#04x}");
            let s = e4m3_scale_to_f32(b);
            let want = if s.is_nan() { 0 } else { (s * f32::from_bits(((E5M3_ACT_EXP + 127) as u32) << 23)).to_bits() };
            assert_eq!(nvfp4_act_scale_bits(b), (want, s.is_nan()), "NVFP4 scale {b:#04x}");
        }
    }

    /// What [`Fp4Acts::prepare`] computes, element by element from the formulas.
    fn expected(a: QuantizedRef<'_>) -> Fp4Acts {
        let (format, m, k) = (a.format(), a.rows(), a.k());
        let (v, kb) = (format.vector_size(), a.k_blocks());
        let kp = kb * v;
        let mut e = Fp4Acts {
            a8: Pooled::filled(0, if format.is_fp4() { m * kp } else { 0 }),
            af: Pooled::filled(0.0, if format.is_fp4() { 0 } else { m * kp }),
            corr: Pooled::filled(0, m * kb),
            sc: Pooled::filled(0, m * kb),
            scf: Pooled::filled(0.0, if format == BlockFormat::Nvfp4 { 0 } else { m * kb }),
            raw: Pooled::filled(0, m * kb),
            nan_row: Pooled::filled(false, m),
            min_scale: Pooled::filled(u8::MAX, m),
            kp,
            kb,
        };
        for r in 0..m {
            for i in 0..k {
                if format.is_fp4() {
                    e.a8[r * kp + i] = E2M1_DOUBLED[fp4_code(a.row(r), i) as usize & 15];
                } else {
                    e.af[r * kp + i] = e4m3_to_f32(a.row(r)[i]);
                }
            }
            for b in 0..kb {
                let (i, byte) = (r * kb + b, a.scale_byte(r, b));
                e.raw[i] = byte;
                e.min_scale[r] = e.min_scale[r].min(byte);
                if format.is_fp4() {
                    e.corr[i] = 12 * (0..v).map(|j| e.a8[r * kp + b * v + j] as i32).sum::<i32>();
                }
                let off = match format {
                    BlockFormat::Nvfp4 => {
                        let s = e4m3_scale_to_f32(byte);
                        e.nan_row[r] |= s.is_nan();
                        e.sc[i] = if s.is_nan() { 0 } else { (s * 2f32.powi(E5M3_ACT_EXP)).to_bits() };
                        continue;
                    }
                    BlockFormat::Mxfp4 => E8M0_ACT_BIAS,
                    BlockFormat::Mxfp8 => E8M0_FP8_ACT_BIAS,
                };
                e.nan_row[r] |= byte == 0xFF;
                e.sc[i] = (byte as i32 - off) as u32;
                e.scf[i] = (byte as i32 - off) as f32;
            }
        }
        e
    }

    fn same(x: &Fp4Acts, y: &Fp4Acts) -> bool {
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        x.a8[..] == y.a8[..]
            && bits(&x.af) == bits(&y.af)
            && x.corr[..] == y.corr[..]
            && x.sc[..] == y.sc[..]
            && bits(&x.scf) == bits(&y.scf)
            && x.raw[..] == y.raw[..]
            && x.nan_row[..] == y.nan_row[..]
            && x.min_scale[..] == y.min_scale[..]
            && (x.kp, x.kb) == (y.kp, y.kb)
    }

    /// Every ISA's build, on one thread and spread over a team (a call large enough to be cut
    /// into pieces, with a partial last piece), prepares every byte (NaN codes and scales
    /// included) as the formulas do, for each format and for K not a whole number of blocks.
    #[test]
    fn prepare_equals_the_formulas_on_every_isa_and_team() {
        let workers: &'static crate::Workers = Box::leak(Box::new(crate::Workers::new(3).unwrap()));
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut byte = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        };
        for format in [BlockFormat::Nvfp4, BlockFormat::Mxfp4, BlockFormat::Mxfp8] {
            for (m, k) in [(1usize, 4096usize), (3, 70), (37, 2048), (2, 18)] {
                let layout = ScaleLayout::new(m, k.div_ceil(format.vector_size()));
                let data: Vec<u8> = (0..m * format.row_bytes(k)).map(|_| byte()).collect();
                let scales: Vec<u8> = (0..layout.len()).map(|_| byte()).collect();
                let q = QuantizedMatrix::from_parts(format, m, k, data, scales, 1.0).unwrap();
                let want = expected(q.as_ref());
                for isa in Isa::available() {
                    let token = IsaToken::new(Some(isa)).unwrap();
                    for team in [Team::One, Team::Rayon, Team::Workers(workers)] {
                        let got = Fp4Acts::prepare(q.as_ref(), token, team);
                        assert!(same(&got, &want), "{format:?} m {m} k {k} {isa:?} {team:?}");
                    }
                }
            }
        }
    }
}
