//! `paged-qkv`: the crate's demo. Quantizes a Llama-3-8B-shaped QKV layer (random weights) to
//! NVFP4, runs the reference fused QKV of a ragged prefill batch into a paged cache, and prints
//! what it did.

use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
use paged_qkv::reference::qkv_fp4_ragged;
use paged_qkv::{Accumulation, BlockFormat, CacheShape, KvWrite, PageTable, PagedKvCache, QkvFp4Args, bf16};
use std::time::Instant;

/// Llama-3-8B attention shapes.
const HIDDEN: usize = 4096;
const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD: usize = 128;
const PAGE: usize = 128;

struct Rng(u64);
impl Rng {
    fn normal(&mut self) -> f32 {
        let mut s = 0.0;
        for _ in 0..4 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            s += (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        }
        s * 1.732
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let q_dim = Q_HEADS * HEAD;
    let n = q_dim + 2 * KV_HEADS * HEAD;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    println!(
        "paged-qkv demo: Llama-3-8B QKV layer (K = {HIDDEN}, N = {n}: {Q_HEADS} Q + 2 x {KV_HEADS} KV heads of {HEAD})"
    );

    let t = Instant::now();
    let w: Vec<f32> = (0..n * HIDDEN).map(|_| rng.normal() * 0.02).collect();
    let wq = quantize(BlockFormat::Nvfp4, &w, n, HIDDEN, nvfp4_global_scale(amax(&w)))?;
    println!(
        "  quantized the weight to NVFP4: {} data + {} scale bytes ({:.1} MB, f32 was {:.1} MB) in {:.2?}",
        wq.data().len(),
        wq.scales().len(),
        (wq.data().len() + wq.scales().len()) as f64 / 1e6,
        (w.len() * 4) as f64 / 1e6,
        t.elapsed()
    );

    // A ragged prefill of 4 prompts, two of which continue earlier context.
    let lens = [5usize, 3, 7, 1];
    let cache_lengths = [0u32, 130, 0, 17];
    let m: usize = lens.iter().sum();
    let x: Vec<bf16> = (0..m * HIDDEN).map(|_| bf16::from_f32(rng.normal())).collect();
    let xq = quantize(BlockFormat::Nvfp4, &x, m, HIDDEN, nvfp4_global_scale(amax(&x)))?;
    let mut offsets = vec![0u32];
    for l in lens {
        offsets.push(offsets.last().copied().unwrap_or(0) + l as u32);
    }

    // Pages: each sequence gets the pages it needs, scattered over the cache.
    let cols = 4;
    let num_blocks = 16;
    let mut lookup = vec![(num_blocks - 1) as u32; lens.len() * cols];
    let mut next = 0u32;
    for (b, (&l, &c)) in lens.iter().zip(&cache_lengths).enumerate() {
        for j in 0..(c as usize + l).div_ceil(PAGE) {
            lookup[b * cols + j] = (next * 7) % (num_blocks as u32 - 1);
            next += 1;
        }
    }
    let shape = CacheShape::mha(num_blocks, 1, PAGE, KV_HEADS, HEAD)?;
    let mut cache = PagedKvCache::<bf16>::zeros(shape);
    println!(
        "  batch: {} tokens in {} sequences {:?}, cache lengths {:?}; cache {:?} bf16, {} pages in use",
        m,
        lens.len(),
        lens,
        cache_lengths,
        shape.dims(),
        next
    );

    let args = QkvFp4Args {
        hidden_state: xq.as_ref(),
        input_row_offsets: &offsets,
        weight: wq.as_ref(),
        tensor_sf: xq.tensor_scale() * wq.tensor_scale(),
        q_dim,
    };
    let mut results = Vec::new();
    for mode in [Accumulation::Exact, Accumulation::Sequential] {
        let mut out = vec![bf16::ZERO; m * q_dim];
        let table = PageTable::new(&lookup, cols, &cache_lengths)?;
        let mut kv = KvWrite::new(cache.view_mut(), table, 0);
        let t = Instant::now();
        qkv_fp4_ragged(&args, &mut out, &mut kv, mode)?;
        let dt = t.elapsed();
        let flop = 2.0 * (m * n * HIDDEN) as f64;
        println!("  reference fused QKV ({mode:?}): {dt:.2?}, {:.2} GFLOP/s", flop / dt.as_secs_f64() / 1e9);
        results.push(out);
    }
    let max_diff =
        results[0].iter().zip(&results[1]).map(|(a, b)| (a.to_f32() - b.to_f32()).abs()).fold(0.0f32, f32::max);
    println!("  max |exact - sequential| over Q: {max_diff:e} (summation order only)");
    println!("  Q[0, 0..4] = {:?}", &results[0][..4].iter().map(|v| v.to_f32()).collect::<Vec<_>>());
    let p = cache_lengths[1] as usize;
    let blk = lookup[cols + p / PAGE] as usize;
    println!(
        "  sequence 1, token 0 -> position {p}: block {blk}, slot {}; K head 0 dims 0..4 = {:?}",
        p % PAGE,
        (0..4).map(|d| cache.get(blk, 0, 0, p % PAGE, 0, d).to_f32()).collect::<Vec<_>>()
    );
    Ok(())
}
