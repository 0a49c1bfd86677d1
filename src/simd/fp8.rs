//! The operands of the MXFP8 group kernels and the portable kernel, which defines the arithmetic
//! every ISA reproduces bit for bit.
//!
//! **Canonical order.** For row r and column c, per 32-element block b:
//! `bs = Σ_k fma(a_k, w_k · 2⁻⁸, bs)` in k order (every product is exact: E4M3 × E4M3 has at
//! most 8 significant bits, and × 2⁻⁸ stays in f32's normal range), then
//! `acc = fma(bs, s · 2⁸, acc)` with `s` the E8M0 block-scale product. The `2⁻⁸` is how the SIMD
//! kernels decode E4M3: its bits, moved into an IEEE half (`(b & 0x80) << 8 | (b & 0x7F) << 7`),
//! are exactly `value · 2⁻⁸`, subnormals included, and `vcvtph2ps` / `fcvtl` widen them to f32;
//! the `2⁸` goes into the activation's scale exponent. Scaling by powers of two commutes with
//! rounding while every value stays normal, so this is the sum of exact products rounded in k
//! order — the error bound is unchanged. NaN elements (0x7F, 0xFF) have no half encoding: their
//! columns are flagged at packing and computed exactly.
//!
//! A second decode forms the same products: the byte's bits placed straight into an f32
//! (`(b & 0x80) << 24 | (b & 0x7F) << 20`) are `value · 2⁻¹²⁰` (E4M3 subnormals become f32
//! subnormals), and with the activation taken as `a · 2¹¹²` (exact) each product
//! `(a · 2¹¹²) · (w · 2⁻¹²⁰)` is the same real number `a · (w · 2⁻⁸)`, so every FMA rounds the
//! same sum (`x86::fp8::fp8_row_avx512vbmi`, where the CPU takes subnormal operands at full
//! speed).

use super::{GROUP, MR};
use crate::dtype::e4m3_to_f32;

/// The exponent offset of MXFP8 activation scales: `e − 127` for the scale, `+ 8` for the `2⁸`
/// the weights' decode leaves out (see the module docs).
pub(crate) const E8M0_FP8_ACT_BIAS: i32 = 119;

/// One 16-column group of packed MXFP8 weights: byte `k·16 + c` is column c's element k.
pub(crate) struct Fp8Group<'a> {
    pub w: &'a [u8],
    /// `[kb][16]` E8M0 scale bytes.
    pub ws: &'a [u8],
    /// V (32).
    pub v: usize,
    /// Blocks.
    pub kb: usize,
}

/// Up to MR activation rows (entries past `count` repeat the last row).
pub(crate) struct Fp8Rows<'a> {
    /// E4M3 values as f32, `kb · V` each (zero padded).
    pub a: [&'a [f32]; MR],
    /// Per block: the scale exponent offset `e − 119` (as i32 bits).
    pub sc: [&'a [u32]; MR],
    /// The same offsets as f32 (what `vscalefps` takes).
    pub scf: [&'a [f32]; MR],
    pub count: usize,
}

/// Outer f32 scales per span of `sub` blocks (the FP8 W8A8 block granularity,
/// `crate::kernels::fp8`): a decode kernel given them keeps each span's sum apart, starting from
/// zero, and after the span adds `span · (sa[r][j] · sw[g][j])` (an f32 multiply, then an f32
/// add: no FMA) to the result, j being the span's index — the bits of the span computed alone
/// and combined so.
pub(crate) struct Outer<'a> {
    /// Blocks per span.
    pub sub: usize,
    /// Per row, per span.
    pub sa: [&'a [f32]; MR],
    /// Per group, per span.
    pub sw: [&'a [f32]; super::ROW_GROUPS],
}

impl Outer<'_> {
    /// The span index, if block `b` ends a span of `kb` blocks.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // only x86 has decode kernels
    #[inline(always)]
    pub fn at_end(&self, b: usize, kb: usize) -> Option<usize> {
        ((b + 1).is_multiple_of(self.sub) || b + 1 == kb).then_some(b / self.sub)
    }
    /// The lengths the kernels index (safely) by: a span index for each of the `kb` blocks.
    pub fn check(&self, kb: usize, rows: usize) {
        assert!(self.sub >= 1);
        let spans = kb.div_ceil(self.sub);
        assert!(self.sa[..rows].iter().all(|s| s.len() >= spans) && self.sw.iter().all(|s| s.len() >= spans));
    }
}

impl Fp8Group<'_> {
    /// The lengths every kernel's unchecked loads rely on. Panics on violation (a bug, not input).
    pub fn check(&self, rows: &Fp8Rows<'_>) {
        assert!(rows.count >= 1 && rows.count <= MR);
        assert!(self.v.is_multiple_of(2), "blocks of an even number of k");
        assert!(self.w.len() >= self.kb * self.v * GROUP && self.ws.len() >= self.kb * GROUP);
        for r in 0..MR {
            assert!(rows.a[r].len() >= self.kb * self.v && rows.sc[r].len() >= self.kb && rows.scf[r].len() >= self.kb);
        }
    }
}

/// `w · 2⁻⁸` for an E4M3 byte (not NaN): what every kernel's decode gives.
#[inline(always)]
pub(crate) fn weight_value(b: u8) -> f32 {
    e4m3_to_f32(b) * f32::from_bits(119 << 23) // 2^-8, exact
}

/// The portable kernel: the canonical order written plainly.
pub(crate) fn group_scalar(g: &Fp8Group<'_>, rows: &Fp8Rows<'_>, out: &mut [[f32; GROUP]; MR]) {
    let v = g.v;
    for r in 0..rows.count {
        for c in 0..GROUP {
            let mut acc = 0f32;
            for b in 0..g.kb {
                let mut bs = 0f32;
                for kk in b * v..(b + 1) * v {
                    bs = rows.a[r][kk].mul_add(weight_value(g.w[kk * GROUP + c]), bs);
                }
                let s = super::fp4::scale_product(super::fp4::ScaleKind::E8m0, g.ws[b * GROUP + c], rows.sc[r][b]);
                acc = bs.mul_add(s, acc);
            }
            out[r][c] = acc;
        }
    }
}

/// The IEEE half bits of `b · 2⁻⁸` for an E4M3 byte `b` (not NaN), as the SIMD kernels form them.
#[cfg(test)]
fn half_bits(b: u8) -> u16 {
    let x = b as u16;
    ((x << 9) >> 2) | ((x << 8) & 0x8000)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The half trick is exact for every E4M3 byte but NaN: the basis of every SIMD decode.
    #[test]
    fn e4m3_bits_in_a_half_are_the_value_times_2_pow_minus_8() {
        for b in 0..=255u8 {
            if b & 0x7F == 0x7F {
                continue;
            }
            let h = half::f16::from_bits(half_bits(b)).to_f32();
            assert_eq!(h.to_bits(), weight_value(b).to_bits(), "byte {b:#04x}");
        }
    }
}
