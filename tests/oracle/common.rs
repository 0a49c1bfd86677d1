//! Test helpers: a seeded RNG, page tables, cache snapshots and an independent exact rounding.

#![allow(dead_code)]

use paged_qkv::{CacheShape, Element, PagedKvCache};

/// The tests' seeded generator: the crate's one random-number crate (fastrand) with the helpers
/// the tests use.
pub struct Rng(fastrand::Rng);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(fastrand::Rng::with_seed(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.u64(..)
    }
    pub fn below(&mut self, n: usize) -> usize {
        self.0.usize(..n)
    }
    pub fn range(&mut self, lo: usize, hi_inclusive: usize) -> usize {
        self.0.usize(lo..=hi_inclusive)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        self.0.f32() * 2.0 - 1.0
    }
    /// Approximately normal (the crate's case generator's helper).
    pub fn normal(&mut self) -> f32 {
        paged_qkv_normal(&mut self.0)
    }
    pub fn byte(&mut self) -> u8 {
        self.0.u8(..)
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        self.0.shuffle(v)
    }
}

/// Four uniforms summed: bell-shaped enough for weights (as `paged_qkv::case::normal`, which
/// needs the `case` feature).
fn paged_qkv_normal(rng: &mut fastrand::Rng) -> f32 {
    (0..4).map(|_| rng.f32() - 0.5).sum::<f32>() * 1.732
}

/// A page table that gives every sequence its own pages, drawn from a random permutation of the
/// blocks, with `cols` columns; unused entries hold the sentinel `num_blocks - 1` (MAX's null block).
#[derive(Clone, Debug)]
pub struct Pages {
    pub lookup: Vec<u32>,
    pub cols: usize,
    pub cache_lengths: Vec<u32>,
}

pub fn pages(rng: &mut Rng, cache_lengths: &[u32], new_tokens: &[usize], page_size: usize, num_blocks: usize) -> Pages {
    let need: Vec<usize> =
        cache_lengths.iter().zip(new_tokens).map(|(&c, &n)| (c as usize + n).div_ceil(page_size)).collect();
    let cols = need.iter().copied().max().unwrap_or(0) + 1;
    let mut free: Vec<u32> = (0..num_blocks as u32 - 1).collect();
    rng.shuffle(&mut free);
    assert!(need.iter().sum::<usize>() <= free.len(), "test needs more blocks");
    let mut lookup = vec![num_blocks as u32 - 1; cache_lengths.len() * cols];
    let mut next = 0;
    for (b, &n) in need.iter().enumerate() {
        for j in 0..n {
            lookup[b * cols + j] = free[next];
            next += 1;
        }
    }
    Pages { lookup, cols, cache_lengths: cache_lengths.to_vec() }
}

/// A cache filled with random finite values, so untouched bytes are recognisable.
pub fn random_cache<T: Element>(rng: &mut Rng, shape: CacheShape) -> PagedKvCache<T> {
    let data = (0..shape.len()).map(|_| T::from_f32(rng.f32() * 4.0)).collect();
    PagedKvCache::from_vec(shape, data).unwrap()
}

pub fn bits<T: Element>(x: &[T]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Row offsets from sequence lengths.
pub fn offsets(lens: &[usize]) -> Vec<u32> {
    let mut o = vec![0u32];
    for &l in lens {
        o.push(o.last().unwrap() + l as u32);
    }
    o
}

/// Rounds `s · 2^e` (an exact integer times a power of two) to nearest-even with `prec`
/// significant bits, written independently of the crate. The result must be in the normal range
/// of the target; returned as f64 (exact, since prec ≤ 24).
pub fn round_scaled(s: i128, e: i32, prec: u32) -> f64 {
    if s == 0 {
        return 0.0;
    }
    let neg = s < 0;
    let mut u = s.unsigned_abs();
    let mut e = e;
    let bits = 128 - u.leading_zeros();
    if bits > prec {
        let drop = bits - prec;
        let rem = u & ((1u128 << drop) - 1);
        let half = 1u128 << (drop - 1);
        u >>= drop;
        e += drop as i32;
        if rem > half || (rem == half && u & 1 == 1) {
            u += 1;
        }
    }
    let v = u as f64 * 2f64.powi(e);
    if neg { -v } else { v }
}

/// A cache coordinate written by an operation.
pub type Coord = (usize, usize, usize, usize, usize, usize);

/// Asserts that every element of `after` equals `before` except at `written`, where it must equal
/// the given value (bitwise).
pub fn assert_cache_writes<T: Element>(shape: CacheShape, before: &[T], after: &[T], written: &[(Coord, T)]) {
    let mut expect = bits(before);
    for &((b, kv, l, s, h, d), v) in written {
        expect[shape.index(b, kv, l, s, h, d)] = v.to_bits();
    }
    let got = bits(after);
    for (i, (g, e)) in got.iter().zip(&expect).enumerate() {
        assert_eq!(g, e, "cache element {:?} differs", shape.coords(i));
    }
}

/// Significant bits of an element type.
pub fn prec<T: Element>() -> u32 {
    match T::DTYPE {
        paged_qkv::DType::F32 => 24,
        paged_qkv::DType::BF16 => 8,
        paged_qkv::DType::F16 => 11,
        paged_qkv::DType::F8E4M3 => 4,
    }
}
