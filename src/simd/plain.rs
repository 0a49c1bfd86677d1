//! The operands of the bf16/f16/f32 micro-kernels and the portable kernel, which defines the
//! arithmetic the FMA kernels reproduce bit for bit.
//!
//! **Canonical order** (every ISA): for output `(r, c)`, `acc = 0`, then for each k-pair `p` in
//! order, `acc = fma(a[2p+1], w[2p+1, c], acc)` and then `acc = fma(a[2p], w[2p, c], acc)`, over K
//! padded with one zero when odd. Odd element first is the order `vdpbf16ps` uses inside a pair, so
//! the AVX-512 BF16 kernel computes the same chain of roundings as the FMA kernels; it differs
//! only where it flushes subnormals (see [`Isa::Avx512Bf16`](super::Isa::Avx512Bf16)).

use super::GROUP;
use crate::element::Element;

/// How a packed weight group stores its elements (see [`PlainPanel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum PlainKind {
    /// Per k-pair 16 words: word `c` = `bits(w[2p, c]) | bits(w[2p+1, c]) << 16`.
    Bf16,
    /// Per k-pair 16 words: the 16 f16 of `k = 2p+1` (columns in order), then the 16 of `k = 2p`.
    F16,
    /// Per k-pair 32 words: the 16 f32 of `k = 2p+1`, then the 16 of `k = 2p`.
    F32,
}

impl PlainKind {
    /// The packed kind of an element type (E4M3 is widened exactly to f32).
    pub fn of<T: Element>() -> Self {
        match T::DTYPE {
            crate::DType::BF16 => PlainKind::Bf16,
            crate::DType::F16 => PlainKind::F16,
            crate::DType::F32 | crate::DType::F8E4M3 => PlainKind::F32,
        }
    }
    /// u32 words per k-pair of one 16-column group.
    pub fn words_per_pair(self) -> usize {
        match self {
            PlainKind::Bf16 | PlainKind::F16 => GROUP,
            PlainKind::F32 => 2 * GROUP,
        }
    }
    /// Packs `w(k, c)` (for `c < cols ≤ 16`, `k < k_len`, zero elsewhere) into one group of `pairs`
    /// k-pairs.
    pub fn pack_group(self, dst: &mut [u32], pairs: usize, cols: usize, k_len: usize, w: impl Fn(usize, usize) -> u32) {
        let wpp = self.words_per_pair();
        let get = |k: usize, c: usize| if k < k_len && c < cols { w(k, c) } else { 0 };
        for p in 0..pairs {
            let d = &mut dst[p * wpp..(p + 1) * wpp];
            match self {
                PlainKind::Bf16 => {
                    for c in 0..GROUP {
                        d[c] = get(2 * p, c) | get(2 * p + 1, c) << 16;
                    }
                }
                PlainKind::F16 => {
                    for j in 0..GROUP / 2 {
                        d[j] = get(2 * p + 1, 2 * j) | get(2 * p + 1, 2 * j + 1) << 16;
                        d[GROUP / 2 + j] = get(2 * p, 2 * j) | get(2 * p, 2 * j + 1) << 16;
                    }
                }
                PlainKind::F32 => {
                    for c in 0..GROUP {
                        d[c] = get(2 * p + 1, c);
                        d[GROUP + c] = get(2 * p, c);
                    }
                }
            }
        }
    }
    /// The stored bits of element `(k, c)` of a packed group: the element's own 16 bits (bf16,
    /// f16) or the f32's 32 bits.
    pub fn bits(self, group: &[u32], k: usize, c: usize) -> u32 {
        let (p, odd) = (k / 2, k % 2 == 1);
        let wpp = self.words_per_pair();
        let d = &group[p * wpp..(p + 1) * wpp];
        match self {
            PlainKind::Bf16 => {
                if odd {
                    d[c] >> 16
                } else {
                    d[c] & 0xFFFF
                }
            }
            PlainKind::F16 => (d[if odd { 0 } else { GROUP / 2 } + c / 2] >> (16 * (c % 2))) & 0xFFFF,
            PlainKind::F32 => d[if odd { c } else { GROUP + c }],
        }
    }
    /// Element `(k, c)` of a packed group, widened to f32 (exact).
    #[inline]
    pub fn get(self, group: &[u32], k: usize, c: usize) -> f32 {
        let (p, odd) = (k / 2, k % 2 == 1);
        let wpp = self.words_per_pair();
        let d = &group[p * wpp..(p + 1) * wpp];
        match self {
            PlainKind::Bf16 => f32::from_bits(if odd { d[c] & 0xFFFF_0000 } else { d[c] << 16 }),
            PlainKind::F16 => {
                let word = d[if odd { 0 } else { GROUP / 2 } + c / 2];
                half::f16::from_bits((word >> (16 * (c % 2))) as u16).to_f32()
            }
            PlainKind::F32 => f32::from_bits(d[if odd { c } else { GROUP + c }]),
        }
    }
}

/// A block of a packed weight: `groups` consecutive 16-column groups (one column panel), `pairs`
/// consecutive k-pairs of each (one k-block). Group `g` starts at word `g · stride` of `data`.
#[derive(Clone, Copy)]
pub(crate) struct PlainPanel<'a> {
    pub data: &'a [u32],
    pub groups: usize,
    pub pairs: usize,
    pub stride: usize,
    pub kind: PlainKind,
    /// The packed weight from where the same task reads next: the next k-block of these groups
    /// or, after the last one, the next column panel at pair 0 (its groups at the same `stride`);
    /// empty when nothing follows. Only prefetched (`crate::simd::x86`'s prefill tiles), never
    /// read.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the x86 kernels prefetch it
    pub next: &'a [u32],
}

impl<'a> PlainPanel<'a> {
    /// Words of one group's k-block.
    pub fn group_len(&self) -> usize {
        self.pairs * self.kind.words_per_pair()
    }
    pub fn group(&self, g: usize) -> &'a [u32] {
        &self.data[g * self.stride..g * self.stride + self.group_len()]
    }
}

/// Activations packed for a micro-kernel of `mr` rows (the layout [`super::plain_layout`] gives a
/// token): row block `b` holds rows `b·mr ..` (a short last block repeats its last row). In f32
/// form, pair `p` of a block holds the `mr` elements `2p+1` of its rows, then the `mr` elements
/// `2p`; in bf16-pair form, the `mr` pairs of its rows. One pointer then walks a micro-tile's
/// activations.
#[derive(Clone, Copy)]
pub(crate) struct PackedRows<'a> {
    /// f32 form (empty in pair form).
    pub f: &'a [f32],
    /// bf16-pair form (empty in f32 form).
    pub p: &'a [u32],
    /// k-pairs of a whole row (a block's length is `pairs · per_pair`).
    pub pairs: usize,
    pub mr: usize,
    pub bf16_pairs: bool,
}

impl PackedRows<'_> {
    /// Values per pair of one block.
    pub fn per_pair(&self) -> usize {
        if self.bf16_pairs { self.mr } else { 2 * self.mr }
    }
    /// Values per block.
    pub fn block_len(&self) -> usize {
        self.pairs * self.per_pair()
    }
    /// Offset of element `k` (f32 form) or of pair `k / 2` (pair form) of row `r` of block `b`.
    #[inline]
    pub fn offset(pairs: usize, mr: usize, bf16_pairs: bool, b: usize, r: usize, k: usize) -> usize {
        if bf16_pairs {
            b * pairs * mr + (k / 2) * mr + r
        } else {
            b * pairs * 2 * mr + (k / 2) * 2 * mr + if k % 2 == 1 { 0 } else { mr } + r
        }
    }
    /// Element k of row `i`, widened to f32 (exact).
    #[inline]
    pub fn get(&self, i: usize, k: usize) -> f32 {
        let o = Self::offset(self.pairs, self.mr, self.bf16_pairs, i / self.mr, i % self.mr, k);
        if self.bf16_pairs {
            let w = self.p[o];
            f32::from_bits(if k % 2 == 1 { w & 0xFFFF_0000 } else { w << 16 })
        } else {
            self.f[o]
        }
    }
}

impl PlainPanel<'_> {
    /// The lengths every kernel's unchecked loads rely on, for `n` rows from pair `p0`. Panics on
    /// violation (a bug, not input).
    pub fn check(&self, a: &PackedRows<'_>, p0: usize, n: usize, out_len: usize, ld: usize) {
        assert!(self.groups >= 1 && self.stride >= self.group_len());
        assert!(self.data.len() >= (self.groups - 1) * self.stride + self.group_len());
        assert!(ld >= self.groups * GROUP);
        assert!(n == 0 || out_len >= (n - 1) * ld + self.groups * GROUP);
        assert!(p0 + self.pairs <= a.pairs && a.mr >= 1);
        let len = if a.bf16_pairs { a.p.len() } else { a.f.len() };
        assert!(len >= n.div_ceil(a.mr) * a.block_len());
        assert!(!a.bf16_pairs || self.kind == PlainKind::Bf16);
    }
}

/// The portable kernel: `out[i·ld + c]` for rows `i < n` and every panel column `c`, over pairs
/// `p0 .. p0 + w.pairs`, in the canonical order with `f32::mul_add` (IEEE fusedMultiplyAdd, as
/// `vfmadd`/`vfmaq`), continuing from the values in `out` when `acc_in` (a later k-block of the
/// same chain) or from 0.
#[allow(clippy::too_many_arguments)]
pub(crate) fn panel_scalar(
    w: &PlainPanel<'_>,
    a: &PackedRows<'_>,
    p0: usize,
    n: usize,
    out: &mut [f32],
    ld: usize,
    acc_in: bool,
) {
    for g in 0..w.groups {
        let grp = w.group(g);
        for i in 0..n {
            for c in 0..GROUP {
                let mut acc = if acc_in { out[i * ld + g * GROUP + c] } else { 0f32 };
                for p in 0..w.pairs {
                    let (k1, k0) = (2 * p + 1, 2 * p);
                    acc = a.get(i, 2 * p0 + k1).mul_add(w.kind.get(grp, k1, c), acc);
                    acc = a.get(i, 2 * p0 + k0).mul_add(w.kind.get(grp, k0, c), acc);
                }
                out[i * ld + g * GROUP + c] = acc;
            }
        }
    }
}
