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

/// Consecutive 16-column groups of a packed weight (one column panel), each `pairs · words_per_pair`
/// words.
#[derive(Clone, Copy)]
pub(crate) struct PlainPanel<'a> {
    pub data: &'a [u32],
    pub groups: usize,
    pub pairs: usize,
    pub kind: PlainKind,
}

impl<'a> PlainPanel<'a> {
    pub fn group_len(&self) -> usize {
        self.pairs * self.kind.words_per_pair()
    }
    pub fn group(&self, g: usize) -> &'a [u32] {
        let l = self.group_len();
        &self.data[g * l..(g + 1) * l]
    }
}

/// The activation rows a panel is multiplied with, each `2 · pairs` long (zero padded).
#[derive(Clone, Copy)]
pub(crate) enum PlainRows<'a> {
    /// f32 rows (the FMA kernels).
    F32(&'a [&'a [f32]]),
    /// bf16 rows as pairs in u32 words, element `2p` in the low half (the `vdpbf16ps` kernel).
    Bf16Pairs(&'a [&'a [u32]]),
}

impl PlainRows<'_> {
    pub fn len(&self) -> usize {
        match self {
            PlainRows::F32(r) => r.len(),
            PlainRows::Bf16Pairs(r) => r.len(),
        }
    }

    /// Element k of row r, widened to f32.
    #[inline]
    pub fn get(&self, r: usize, k: usize) -> f32 {
        match self {
            PlainRows::F32(rows) => rows[r][k],
            PlainRows::Bf16Pairs(rows) => {
                let w = rows[r][k / 2];
                f32::from_bits(if k % 2 == 1 { w & 0xFFFF_0000 } else { w << 16 })
            }
        }
    }
}

impl PlainPanel<'_> {
    /// The lengths every kernel's unchecked loads rely on. Panics on violation (a bug, not input).
    pub fn check(&self, rows: &PlainRows<'_>, out_len: usize, ld: usize) {
        assert!(self.data.len() >= self.groups * self.group_len());
        assert!(ld >= self.groups * GROUP);
        assert!(rows.len() == 0 || out_len >= (rows.len() - 1) * ld + self.groups * GROUP);
        match rows {
            PlainRows::F32(r) => assert!(r.iter().all(|x| x.len() >= 2 * self.pairs)),
            PlainRows::Bf16Pairs(r) => {
                assert!(self.kind == PlainKind::Bf16 && r.iter().all(|x| x.len() >= self.pairs))
            }
        }
    }
}

/// The portable kernel: `out[i·ld + c]` for every row `i` and panel column `c`, in the canonical
/// order with `f32::mul_add` (IEEE fusedMultiplyAdd, as `vfmadd`/`vfmaq`).
pub(crate) fn panel_scalar(w: &PlainPanel<'_>, rows: &PlainRows<'_>, out: &mut [f32], ld: usize) {
    for g in 0..w.groups {
        let grp = w.group(g);
        for i in 0..rows.len() {
            for c in 0..GROUP {
                let mut acc = 0f32;
                for p in 0..w.pairs {
                    let (k1, k0) = (2 * p + 1, 2 * p);
                    acc = rows.get(i, k1).mul_add(w.kind.get(grp, k1, c), acc);
                    acc = rows.get(i, k0).mul_add(w.kind.get(grp, k0, c), acc);
                }
                out[i * ld + g * GROUP + c] = acc;
            }
        }
    }
}
