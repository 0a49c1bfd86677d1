//! A server's use of the crate, end to end: pack the layer's fused Q|K|V weight **once**, then at
//! every step run the fast fused QKV + RoPE on the new tokens of all running sequences (Q comes
//! back rotated; K and V land in the paged cache, K rotated), growing each sequence's page table
//! when it crosses a page boundary. Sequences finish and give their pages back; a new one joins.
//! Every 8th step one token is checked against the exact oracle.
//!
//! ```sh
//! cargo run --release --example serve_decode
//! ```
//!
//! (Qwen2.5-0.5B's attention shape, NVFP4 weights and activations, a bf16 cache of 16-token pages.)

use paged_qkv::fast::{self, PackedWeights, QkvFp4PackedArgs};
use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
use paged_qkv::ops::QkvRope;
use paged_qkv::{
    Accumulation, BlockFormat, CacheShape, Exec, KvWrite, PageTable, PagedKvCache, QkvFp4Args, Workers, bf16, reference,
};
use std::time::Instant;

/// One running sequence: tokens already in the cache, its pages, steps left.
struct Seq {
    id: usize,
    cached: usize,
    pages: Vec<u32>,
    steps_left: usize,
}

fn main() -> paged_qkv::Result<()> {
    // The model: K 896, 14 Q heads and 2 KV heads of 64 (Qwen2.5-0.5B), RoPE θ = 10^6.
    let (k, hq, hkv, hd) = (896, 14, 2, 64);
    let (q_dim, n) = (hq * hd, (hq + 2 * hkv) * hd);
    let (page, num_blocks) = (16, 64);
    let mut rng = fastrand::Rng::with_seed(7);
    let mut random = |len: usize, scale: f32| -> Vec<f32> { (0..len).map(|_| (rng.f32() - 0.5) * scale).collect() };

    // Load time: quantize (or load) the fused weight, pack it once, build the RoPE table.
    let w = random(n * k, 0.1);
    let wq = quantize(BlockFormat::Nvfp4, &w, n, k, nvfp4_global_scale(amax(&w)))?;
    let weight = PackedWeights::new(wq.as_ref()); // remembers wq.tensor_scale()
    // The threads every step runs on: a team that stays awake between a step's calls.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let exec = Exec::on(Workers::shared(threads).expect("could not start the worker threads"));
    let freqs = paged_qkv::freqs_cis(4096, hd, 1e6);
    // NeoX halves (interleaved: false), as Qwen and Llama checkpoints use; each token at its
    // position (tokens already cached + index in this step); F32 math.
    let rope = QkvRope::new(&freqs, hd, hd, false);
    let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(num_blocks, 1, page, hkv, hd)?);
    let mut free: Vec<u32> = (0..num_blocks as u32).rev().collect();

    // Three prompts arrive together: 37, 5 and 20 tokens of prefill, then decode steps.
    let mut seqs: Vec<Seq> = [(37, 24), (5, 40), (20, 12)]
        .iter()
        .enumerate()
        .map(|(id, &(_, steps))| Seq { id, cached: 0, pages: Vec::new(), steps_left: steps })
        .collect();
    let mut new_tokens: Vec<usize> = vec![37, 5, 20];
    let (mut steps, mut tokens, mut worst_ulp) = (0, 0, 0u64);
    let t0 = Instant::now();
    while !seqs.is_empty() {
        // Grow every page table to hold the step's tokens.
        for (s, &new) in seqs.iter_mut().zip(&new_tokens) {
            while s.pages.len() * page < s.cached + new {
                s.pages.push(free.pop().expect("the cache has room"));
            }
        }
        let cols = seqs.iter().map(|s| s.pages.len()).max().unwrap_or(0);
        let lookup: Vec<u32> =
            seqs.iter().flat_map(|s| s.pages.iter().copied().chain(std::iter::repeat(0)).take(cols)).collect();
        let cache_lengths: Vec<u32> = seqs.iter().map(|s| s.cached as u32).collect();
        let mut offsets = vec![0u32];
        for &t in &new_tokens {
            offsets.push(offsets.last().unwrap() + t as u32);
        }
        let m = *offsets.last().unwrap() as usize;

        // The step: quantize the new tokens' hidden states, one fused call.
        let x = random(m * k, 2.0);
        let a = quantize(BlockFormat::Nvfp4, &x, m, k, nvfp4_global_scale(amax(&x)))?;
        let mut q = vec![bf16::ZERO; m * q_dim];
        let before = (steps % 8 == 0).then(|| cache.clone());
        let table = PageTable::new(&lookup, cols, &cache_lengths)?;
        let mut kv = KvWrite::new(cache.view_mut(), table, 0);
        let args = QkvFp4PackedArgs::new(a.as_ref(), &offsets, &weight, q_dim).with_rope(rope);
        fast::qkv_fp4_ragged_packed(&args, &mut q, &mut kv, exec)?;

        // Now and then: the same step through the oracle (exact accumulation), the largest
        // difference of the rotated Q in bf16 ULPs.
        if let Some(mut scratch) = before {
            let table = PageTable::new(&lookup, cols, &cache_lengths)?;
            let mut kv = KvWrite::new(scratch.view_mut(), table, 0);
            let mut q_ref = vec![bf16::ZERO; m * q_dim];
            let args = QkvFp4Args::new(a.as_ref(), &offsets, wq.as_ref(), q_dim)
                .with_tensor_sf(a.tensor_scale() * weight.tensor_scale())
                .with_rope(rope);
            reference::qkv_fp4_ragged(&args, &mut q_ref, &mut kv, Accumulation::Exact)?;
            let ord = |b: u16| if b & 0x8000 != 0 { -((b & 0x7FFF) as i64) } else { b as i64 };
            for (f, e) in q.iter().zip(&q_ref) {
                worst_ulp = worst_ulp.max((ord(f.to_bits()) - ord(e.to_bits())).unsigned_abs());
            }
        }

        // Advance: tokens are now cached; finished sequences free their pages; one joins.
        steps += 1;
        tokens += m;
        for (s, &new) in seqs.iter_mut().zip(&new_tokens) {
            s.cached += new;
            s.steps_left -= 1;
        }
        for s in seqs.iter().filter(|s| s.steps_left == 0) {
            println!(
                "  step {steps:>2}: sequence {} done after {} tokens, {} pages freed",
                s.id,
                s.cached,
                s.pages.len()
            );
            free.extend(&s.pages);
        }
        seqs.retain(|s| s.steps_left > 0);
        new_tokens = vec![1; seqs.len()];
        if steps == 10 {
            seqs.push(Seq { id: 3, cached: 0, pages: Vec::new(), steps_left: 20 });
            new_tokens.push(50); // its prompt
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{steps} steps, {tokens} tokens in {:.1} ms ({:.2} ms per step, oracle checks included); \
         pages free at the end: {}/{num_blocks}; largest |fast − exact| of Q: {worst_ulp} bf16 ulp",
        secs * 1e3,
        secs * 1e3 / steps as f64,
        free.len()
    );
    assert_eq!(free.len(), num_blocks, "every page returned");
    Ok(())
}
