//! The operands of the FP4 group kernels (how packed weights and prepared activations lie in
//! memory) and the portable kernel, which defines the arithmetic every ISA reproduces bit for bit.

use super::{GROUP, MR};
use crate::dtype::{BlockFormat, E2M1_DOUBLED, e2m1_doubled};

/// How the block scales of a packed FP4 group are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScaleKind {
    /// NVFP4: unsigned E5M3 weight bytes (bias 15: the bits shifted left by 20 are an f32 equal
    /// to `scale · 2^-112`); activation scales as the f32 bits of `scale · 2^110`.
    E5m3,
    /// MXFP4: raw E8M0 weight bytes; activation scales as the i32 `e − 129`.
    E8m0,
}

/// The exponent offsets that make the block-scale product `s` carry the `1/4` of doubled E2M1
/// values (both operands are stored doubled, so every integer block sum is 4× the products):
/// folding it into an exact power of two keeps `tensor_sf` out of the arithmetic until the one
/// final multiply, where it cannot round early (a subnormal `tensor_sf · 1/4` would).
pub(crate) const E5M3_ACT_EXP: i32 = 110;
/// See [`E5M3_ACT_EXP`]: `e − 127` for the scale and `− 2` for the `1/4`.
pub(crate) const E8M0_ACT_BIAS: i32 = 129;

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

/// Up to MR prepared activation rows (entries past `count` repeat the last row; their results
/// are not used).
pub(crate) struct Fp4Rows<'a> {
    /// Doubled E2M1 activations, `kb · V` each (zero padded).
    pub a: [&'a [i8]; MR],
    /// `12 · Σa` per block (the x86 kernels' offset correction).
    pub corr: [&'a [i32]; MR],
    /// Per block scale: f32 bits (E5m3) or exponent offset (E8m0).
    pub sc: [&'a [u32]; MR],
    /// E8m0: the exponent offsets as f32 (what `vscalefps` takes); empty for E5m3.
    pub scf: [&'a [f32]; MR],
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
        self.check_group();
        assert!(rows.count >= 1 && rows.count <= MR);
        for r in 0..MR {
            assert!(rows.a[r].len() >= self.kb * self.pairs * 8);
            assert!(rows.corr[r].len() >= self.kb && rows.sc[r].len() >= self.kb);
            assert!(self.kind == ScaleKind::E5m3 || rows.scf[r].len() >= self.kb);
        }
    }

    /// The group's own part of [`check`](Self::check): what holds for any rows of the same `kb`,
    /// `pairs` and `kind` once `check` passed for one group.
    pub fn check_group(&self) {
        assert!(self.pairs.is_multiple_of(2), "blocks of 16 or 32 k: an even number of 8-k pairs");
        assert!(self.w.len() >= self.kb * self.pairs * 64 && self.ws.len() >= self.kb * GROUP);
    }
}

/// The block-scale product `s` (times 1/4) of the canonical order: exact in f32 for E5m3;
/// for E8m0 formed from exponents, clamped to the f32 exponent field [0, 255] (0 → 0.0,
/// 255 → ∞; the epilogue sends elements that could reach either edge to the exact path).
#[inline(always)]
pub(crate) fn scale_product(kind: ScaleKind, wb: u8, sc: u32) -> f32 {
    match kind {
        ScaleKind::E5m3 => f32::from_bits((wb as u32) << 20) * f32::from_bits(sc),
        ScaleKind::E8m0 => f32::from_bits(((wb as i32 + sc as i32).clamp(0, 255) as u32) << 23),
    }
}

/// The portable kernel: the canonical order written plainly, with a fused multiply-add as every
/// SIMD kernel uses (`f32::mul_add` is IEEE fusedMultiplyAdd on every target, so an overflowing
/// `isum · s` behaves as in `vfmadd`/`vfmaq`). Bit-identical to every SIMD kernel.
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
                acc = (isum as f32).mul_add(scale_product(g.kind, g.ws[kb * GROUP + c], rows.sc[r][kb]), acc);
            }
            out[r][c] = acc;
        }
    }
}

/// One activation row's prepared form (see `crate::kernels::pack::Fp4Acts`), filled by
/// [`prepare_row_body`]: the buffers of one format (`a8` for the FP4 formats, `af` for MXFP8,
/// `scf` for the MX formats; the others empty), `kp` and `kb` long, zero on entry.
pub(crate) struct ActRow<'a> {
    pub a8: &'a mut [i8],
    pub af: &'a mut [f32],
    pub corr: &'a mut [i32],
    pub sc: &'a mut [u32],
    pub scf: &'a mut [f32],
    /// The row's scale bytes, `[kb]`.
    pub raw: &'a [u8],
}

/// The f32 bits of an E4M3 byte's value (NaN for `0x7F`/`0xFF`, the default NaN), by integer
/// selects the compiler vectorises (a 256-entry table it does not): a normal number's fields
/// moved into an f32's (`e + 120`: bias 7 → 127), a subnormal one's `m · 2⁻⁹` (exact), the sign
/// or-ed in. Equal to `e4m3_to_f32(b).to_bits()` for every byte (tested).
#[inline(always)]
pub(crate) fn e4m3_f32_bits(b: u8) -> u32 {
    let x = b as u32;
    let (e, m) = ((x >> 3) & 0xF, x & 7);
    let normal = ((e + 120) << 23) | (m << 20);
    let sub = (m as f32 * (1.0 / 512.0)).to_bits();
    let v = ((x & 0x80) << 24) | if e == 0 { sub } else { normal };
    if x & 0x7F == 0x7F { f32::NAN.to_bits() } else { v }
}

/// An NVFP4 activation scale byte as the kernels take it: the f32 bits of `|E4M3| · 2^110`
/// ([`E5M3_ACT_EXP`]), and whether it is NaN (then 0), by the selects of [`e4m3_f32_bits`]
/// (`2^110` folded into the exponent: `e + 230`; a subnormal's `m · 2⁻⁹ · 2^110 = m · 2^101`).
#[inline(always)]
pub(crate) fn nvfp4_act_scale_bits(b: u8) -> (u32, bool) {
    const _: () = assert!(E5M3_ACT_EXP == 110);
    let x = (b & 0x7F) as u32;
    let (e, m) = (x >> 3, x & 7);
    let normal = ((e + 230) << 23) | (m << 20);
    let sub = (m as f32 * f32::from_bits((101 + 127) << 23)).to_bits();
    let nan = x == 0x7F;
    (
        if nan {
            0
        } else if e == 0 {
            sub
        } else {
            normal
        },
        nan,
    )
}

/// Prepares one activation row (`data`: its `k` elements' bytes) into `out`; returns whether a
/// scale is NaN and the smallest scale byte. Branch-free loops, so that the build for each ISA
/// (`crate::simd::prepare_row`) vectorises them at its width (inlined there: a body compiled
/// once would be the baseline's).
#[inline(always)]
pub(crate) fn prepare_row_body(format: BlockFormat, data: &[u8], k: usize, out: ActRow<'_>) -> (bool, u8) {
    let v = format.vector_size();
    if format.is_fp4() {
        // Two elements per byte (low nibble first), doubled E2M1.
        let dst = &mut out.a8[..k];
        for (d, &byte) in dst.as_chunks_mut::<2>().0.iter_mut().zip(data) {
            *d = [e2m1_doubled(byte), e2m1_doubled(byte >> 4)];
        }
        if k % 2 == 1 {
            dst[k - 1] = e2m1_doubled(data[k / 2]);
        }
        for (c, block) in out.corr.iter_mut().zip(out.a8.chunks_exact(v)) {
            *c = 12 * block.iter().map(|&x| x as i32).sum::<i32>();
        }
    } else {
        for (d, &b) in out.af[..k].iter_mut().zip(&data[..k]) {
            *d = f32::from_bits(e4m3_f32_bits(b));
        }
    }
    let min = out.raw.iter().fold(u8::MAX, |m, &b| m.min(b));
    let mut nan = false;
    match format {
        BlockFormat::Nvfp4 => {
            for (s, &b) in out.sc.iter_mut().zip(out.raw) {
                let (bits, n) = nvfp4_act_scale_bits(b);
                *s = bits;
                nan |= n;
            }
        }
        BlockFormat::Mxfp4 | BlockFormat::Mxfp8 => {
            let bias = if format == BlockFormat::Mxfp4 { E8M0_ACT_BIAS } else { super::fp8::E8M0_FP8_ACT_BIAS };
            for ((s, f), &b) in out.sc.iter_mut().zip(out.scf.iter_mut()).zip(out.raw) {
                let e = b as i32 - bias;
                *s = e as u32;
                *f = e as f32;
                nan |= b == 0xFF;
            }
        }
    }
    (nan, min)
}
