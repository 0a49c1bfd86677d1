//! Shared by the oracle and fast-path test binaries: random block-scaled QKV setups and an
//! independent exact evaluation.

#![allow(dead_code)]

use crate::common::*;
use paged_qkv::CacheShape;
use paged_qkv::formats::fp4::{E2M1_DOUBLED, fp4_code};
use paged_qkv::formats::fp8::e4m3_to_units;
use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
use paged_qkv::formats::{BlockFormat, QuantizedMatrix, QuantizedRef};

#[derive(Clone)]
pub struct Setup {
    pub a: QuantizedMatrix,
    pub w: QuantizedMatrix,
    pub offsets: Vec<u32>,
    pub pages: Pages,
    pub shape: CacheShape,
    pub q_dim: usize,
    pub layer: usize,
    /// (batch, t) of each row.
    pub rows: Vec<(usize, usize)>,
}

pub struct Config {
    pub format: BlockFormat,
    pub k: usize,
    pub lens: Vec<usize>,
    pub cache_lengths: Vec<u32>,
    pub hq: usize,
    pub hkv: usize,
    pub hd: usize,
    pub page: usize,
    pub layers: usize,
    pub mla_width: Option<usize>,
}

/// Random data with per-block magnitudes spread over 10^±2, quantized with the usual recipe.
pub fn random_matrix(rng: &mut Rng, format: BlockFormat, rows: usize, k: usize) -> QuantizedMatrix {
    let v = format.vector_size();
    let mut x = vec![0.0f32; rows * k];
    for r in 0..rows {
        for kb in 0..k.div_ceil(v) {
            let mag = 10f32.powi(rng.range(0, 4) as i32 - 2);
            for i in kb * v..((kb + 1) * v).min(k) {
                x[r * k + i] = rng.normal() * mag;
            }
        }
    }
    quantize(format, &x, rows, k, nvfp4_global_scale(amax(&x))).unwrap()
}

pub fn setup(rng: &mut Rng, c: &Config) -> Setup {
    let m: usize = c.lens.iter().sum();
    let q_dim = c.hq * c.hd;
    let (shape, n) = match c.mla_width {
        Some(wd) => (CacheShape::mla(64, c.layers, c.page, 1, c.hd).unwrap(), q_dim + wd),
        None => (CacheShape::mha(64, c.layers, c.page, c.hkv, c.hd).unwrap(), q_dim + 2 * c.hkv * c.hd),
    };
    let a = random_matrix(rng, c.format, m, c.k);
    let w = random_matrix(rng, c.format, n, c.k);
    let pages = pages(rng, &c.cache_lengths, &c.lens, c.page, 64);
    let rows = c.lens.iter().enumerate().flat_map(|(b, &l)| (0..l).map(move |t| (b, t))).collect();
    Setup { a, w, offsets: offsets(&c.lens), pages, shape, q_dim, layer: rng.below(c.layers), rows }
}

/// The exact value `tensor_sf · Σ …` as `S · 2^E`, computed here with i128 from the decoded
/// integers (E2M1 doubled, E4M3 in units of 2^-9, E8M0 as exponents). `None` for NaN.
pub fn exact_value(
    a: QuantizedRef<'_>,
    w: QuantizedRef<'_>,
    m: usize,
    n: usize,
    tensor_sf: f32,
) -> Option<(i128, i32)> {
    let f = a.format();
    let v = f.vector_size();
    let int = |q: &QuantizedRef<'_>, r: usize, k: usize| -> Option<i128> {
        if f.is_fp4() {
            Some(E2M1_DOUBLED[fp4_code(q.row(r), k) as usize] as i128)
        } else {
            e4m3_to_units(q.row(r)[k]).map(|u| u as i128)
        }
    };
    let data_exp = if f.is_fp4() { -1 } else { -9 };
    let scale = |q: &QuantizedRef<'_>, r: usize, kb: usize| -> Option<(i128, i32)> {
        let b = q.scale_byte(r, kb);
        match f {
            BlockFormat::Nvfp4 => e4m3_to_units(b & 0x7F).map(|u| (u as i128, -9)),
            _ if b == 0xFF => None,
            _ => Some((1, b as i32 - 127)),
        }
    };
    let mut terms = Vec::new();
    for kb in 0..a.k_blocks() {
        let (sa, ea) = scale(&a, m, kb)?;
        let (sb, eb) = scale(&w, n, kb)?;
        let mut isum = 0i128;
        for k in kb * v..((kb + 1) * v).min(a.k()) {
            isum += int(&a, m, k)? * int(&w, n, k)?;
        }
        terms.push((isum * sa * sb, 2 * data_exp + ea + eb));
    }
    let emin = terms.iter().map(|t| t.1).min().unwrap_or(0);
    let s: i128 = terms.iter().map(|&(s, e)| s << (e - emin)).sum();
    let bits = tensor_sf.to_bits();
    let (tm, te) = (((bits & 0x7F_FFFF) | 0x80_0000) as i128, ((bits >> 23) & 0xFF) as i32 - 150);
    assert!(tensor_sf > 0.0 && tensor_sf.is_normal());
    Some((s * tm, emin + te))
}

/// The cache coordinate of column `n` of row `(b, t)`.
pub fn kv_coord(s: &Setup, b: usize, t: usize, n: usize) -> Coord {
    let p = s.shape.page_size();
    let pos = s.pages.cache_lengths[b] as usize + t;
    let block = s.pages.lookup[b * s.pages.cols + pos / p] as usize;
    let j = n - s.q_dim;
    let (hd, kvw) = (s.shape.head_size(), s.shape.kv_width());
    let (kv, h, d) = if s.shape.is_mla() {
        (0, 0, j)
    } else if j < kvw {
        (0, j / hd, j % hd)
    } else {
        (1, (j - kvw) / hd, (j - kvw) % hd)
    };
    (block, kv, s.layer, pos % p, h, d)
}
