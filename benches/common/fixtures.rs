//! What the QKV benches share: the model shapes, a rayon pool of n threads, the plain read
//! baseline, and the criterion group settings.
#![allow(dead_code)] // each bench uses its own subset

use criterion::{BenchmarkGroup, Criterion, measurement::WallTime};
use paged_qkv::{CacheShape, PagedKvCache, bf16};
use std::time::Duration;

pub struct Model {
    pub name: &'static str,
    pub k: usize,
    pub hq: usize,
    pub hkv: usize,
    pub hd: usize,
}

pub const LLAMA: Model = Model { name: "llama3-8b", k: 4096, hq: 32, hkv: 8, hd: 128 };
pub const QWEN: Model = Model { name: "qwen2.5-0.5b", k: 896, hq: 14, hkv: 2, hd: 64 };

impl Model {
    /// N: the fused Q|K|V rows.
    pub fn n(&self) -> usize {
        (self.hq + 2 * self.hkv) * self.hd
    }
    pub fn q_dim(&self) -> usize {
        self.hq * self.hd
    }
}

/// Uniform values in [-1, 1) from a seeded xorshift (the block-scaled benches' inputs).
pub fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

/// A paged bf16 cache and page table for `m` new tokens in one sequence.
pub struct Cache {
    pub cache: PagedKvCache<bf16>,
    pub lookup: Vec<u32>,
    pub lens: [u32; 1],
}

/// [`Cache`] of 128-token pages for `m` new tokens of `model`.
pub fn cache_for(model: &Model, m: usize) -> Cache {
    let pages = m.div_ceil(128) + 1;
    let shape = CacheShape::mha(pages + 1, 1, 128, model.hkv, model.hd).unwrap();
    Cache { cache: PagedKvCache::zeros(shape), lookup: (0..pages as u32).collect(), lens: [0] }
}

pub fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
}

/// A plain read of `bytes`: four independent u64 lanes per 32 bytes.
pub fn plain_read(bytes: &[u8]) -> u64 {
    let mut acc = [0u64; 4];
    for c in bytes.chunks_exact(32) {
        for (i, a) in acc.iter_mut().enumerate() {
            *a = a.wrapping_add(u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().unwrap()));
        }
    }
    acc.iter().fold(0, |x, y| x ^ y)
}

/// [`plain_read`] split over two threads of the current pool when `threads` > 1.
pub fn plain_read_par(bytes: &[u8], threads: usize) -> u64 {
    if threads == 1 {
        return plain_read(bytes);
    }
    let half = bytes.len() / 2 / 32 * 32;
    let (a, b) = bytes.split_at(half);
    let (x, y) = rayon::join(|| plain_read(a), || plain_read(b));
    x ^ y
}

/// A group of 10 samples, 0.3 s warm-up, 2 s of measurement.
pub fn setup_group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
    g
}
