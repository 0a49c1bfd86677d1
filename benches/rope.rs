//! Fast RoPE: the standalone operation against a plain copy of the same bytes, and RoPE fused into
//! the QKV epilogue against the same QKV without RoPE, in the same run.
//!
//! `cargo bench --bench rope` (`PAGED_QKV_BENCH_ISA=avx2` forces an ISA, bench-only).
//! `bytes` groups count the bytes RoPE moves per call: read Q, write the output, read and write
//! the new K rows; the `copy` baseline copies exactly as many bytes (read and write).
//! `paired/…` groups state the targets' ratios: each RoPE call runs alternately with copies,
//! each fused call with one without RoPE, and the median per-pair ratio is printed
//! (`common/paired.rs`), so the VM's drift between groups stays out of the ratio.
//! `paired/fma_floor/…` groups pair one-thread RoPE calls with an FMA peak loop instead, in f32
//! lanes of multiplies and FMAs: the share of the FMA pipes the rotation's arithmetic uses.
//! `paired/threads/…` groups pair small calls on a two-thread pool with the same calls kept on
//! one thread (rows per second): whether the pool ever slows a call down.

use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main, measurement::WallTime};
use paged_qkv::fast::{self, PackedPlainWeights, PackedWeights, QkvFp4PackedArgs, QkvRaggedPackedArgs};
use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
use paged_qkv::ops::{Freqs, QkvRope};
use paged_qkv::{
    BlockFormat, CacheShape, Element, Exec, Isa, KvSel, KvStoreRaggedArgs, KvWrite, PageTable, PagedKvCache, Par,
    RopeMath, RopeRaggedArgs, bf16,
};
use std::hint::black_box;
use std::time::Duration;

struct Model {
    name: &'static str,
    k: usize,
    hq: usize,
    hkv: usize,
    hd: usize,
    theta: f64,
}

const LLAMA: Model = Model { name: "llama3-8b", k: 4096, hq: 32, hkv: 8, hd: 128, theta: 500000.0 };
const QWEN: Model = Model { name: "qwen2.5-0.5b", k: 896, hq: 14, hkv: 2, hd: 64, theta: 1000000.0 };

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
}

#[path = "common/exec.rs"]
mod exec;
use exec::exec;

fn setup_group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
    g
}

fn random<T: Element>(n: usize, seed: u64) -> Vec<T> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n).map(|_| T::from_f32(rng.f32() - 0.5)).collect()
}

/// A paged cache holding `tokens` new tokens of one sequence (pages of 128).
struct Cache<C> {
    cache: PagedKvCache<C>,
    lookup: Vec<u32>,
}

fn cache_for<C: Element>(m: &Model, tokens: usize) -> Cache<C> {
    let pages = tokens.div_ceil(128);
    let shape = CacheShape::mha(pages, 1, 128, m.hkv, m.hd).unwrap();
    let data = random::<C>(shape.len(), 3);
    Cache { cache: PagedKvCache::from_vec(shape, data).unwrap(), lookup: (0..pages as u32).collect() }
}

impl<C: Element> Cache<C> {
    fn kv(&mut self) -> KvWrite<'_, C> {
        let table = PageTable::new(&self.lookup, self.lookup.len(), &[0]).unwrap();
        KvWrite::new(self.cache.view_mut(), table, 0)
    }
}

/// The copy baseline's source and destination: one allocation, the destination placed 2 KiB
/// (mod 4 KiB) after the source. glibc's `memcpy` copies these sizes with `rep movsb`, which on
/// AMD Zen 3 runs ~20× slower when the destination lies just past the source modulo 4 KiB
/// (measured: 131 072 bytes in 56 µs with `(dst − src) mod 4096 = 16`, 2.8 µs at 0, 64, 688,
/// 2032 or 4032); with two separate `Vec`s the distance was whatever the allocator gave, and
/// some groups' copies (Qwen's 64 tokens, the 2-thread halves) ran at 3–6 GiB/s instead of ~60.
struct CopyBufs<T> {
    buf: Vec<T>,
    n: usize,
    gap: usize,
}

impl<T: Element> CopyBufs<T> {
    fn new(n: usize, seed: u64) -> Self {
        let size = size_of::<T>();
        let gap = (2048 + 4096 - (n * size) % 4096) % 4096 / size;
        let mut buf: Vec<T> = random(n, seed);
        buf.resize(2 * n + gap, T::default());
        CopyBufs { buf, n, gap }
    }

    /// Copies the source to the destination on 1 or 2 threads.
    fn copy(&mut self, threads: usize) {
        let (src, rest) = self.buf.split_at_mut(self.n);
        let (src, dst) = (black_box(&*src), &mut rest[self.gap..]);
        if threads == 1 {
            dst.copy_from_slice(src);
        } else {
            let h = src.len() / 2;
            let (d0, d1) = dst.split_at_mut(h);
            rayon::join(|| d0.copy_from_slice(&src[..h]), || d1.copy_from_slice(&src[h..]));
        }
    }
}

/// One sequence's ragged RoPE arguments for `m`'s heads (the whole head rotated, no position ids).
fn rope_args<'a, T: Element>(
    m: &Model,
    q: &'a [T],
    offs: &'a [u32],
    freqs: &'a [f32],
    interleaved: bool,
) -> RopeRaggedArgs<'a, T> {
    RopeRaggedArgs::new(q, offs, (m.hq, m.hd), freqs, m.hd, interleaved)
}

/// Standalone ragged RoPE (NeoX halves, or interleaved pairs in the `rope_interleaved` groups;
/// f32 math, f32 freqs) vs a copy of the same bytes.
fn standalone<T: Element>(c: &mut Criterion, dtype: &str, interleaved: bool, token_counts: &[usize]) {
    let op = if interleaved { "rope_interleaved" } else { "rope" };
    for m in [LLAMA, QWEN] {
        for &tokens in token_counts {
            let q: Vec<T> = random(tokens * m.hq * m.hd, 1);
            let mut out = vec![T::default(); q.len()];
            let freqs = paged_qkv::freqs_cis(tokens, m.hd, m.theta);
            let mut cache = cache_for::<T>(&m, tokens);
            let per_token = (m.hq + m.hkv) * m.hd;
            let bytes = 2 * tokens * per_token * size_of::<T>();
            let mut bufs = CopyBufs::<T>::new(tokens * per_token, 2);
            let offs = [0, tokens as u32];
            let mut g = setup_group(c, &format!("{op}/{}/{dtype}/t{tokens}/bytes", m.name));
            g.throughput(Throughput::Bytes(bytes as u64));
            let rope = |out: &mut [T], cache: &mut Cache<T>| {
                let args = rope_args(&m, &q, &offs, &freqs, interleaved);
                fast::rope_ragged(&args, out, &mut cache.kv(), RopeMath::F32, exec()).unwrap()
            };
            for threads in [1usize, 2] {
                let p = pool(threads);
                g.bench_function(format!("rope_t{threads}"), |b| p.install(|| b.iter(|| rope(&mut out, &mut cache))));
                g.bench_function(format!("copy_t{threads}"), |b| p.install(|| b.iter(|| bufs.copy(threads))));
            }
            g.finish();
            if tokens >= 64 {
                // The targets' ratio, each RoPE call paired with copies (`common/paired.rs`).
                let gname = format!("paired/{op}/{}/{dtype}/t{tokens}/bytes", m.name);
                let mut g = setup_group(c, &gname);
                for threads in [1usize, 2] {
                    let p = pool(threads);
                    let mut kern = || rope(&mut out, &mut cache);
                    let mut base = || bufs.copy(threads);
                    let (id, b) = (format!("rope_t{threads}"), bytes as u64);
                    paired::run(
                        &mut g,
                        &gname,
                        &p,
                        Side { name: &id, work: b, run: &mut kern },
                        Side { name: &format!("copy_t{threads}"), work: b, run: &mut base },
                    );
                }
                g.finish();
            }
            // The rotation's arithmetic against the FMA pipes' peak (half-split, 64 and 512
            // tokens): a second yardstick beside the copy, where the RoPE is bound by its
            // arithmetic rather than by memory. Work: a multiply and an FMA per rotated value
            // (the oracle's `fma(x0, c, −x1·s)` needs both), counted in f32 lanes, against the
            // lanes of a short FMA peak loop of the vector width in use (`common/peak.rs`). So
            // the ratio is the share of the FMA pipes' capacity the rotation's own operations
            // use; the rest of the call (loading, widening, rounding, storing, the call itself)
            // takes the remainder. One thread: paired with µs-long calls, a two-thread peak loop
            // measured the pool's hand-off (its `rayon::join` ran at one core's rate on Zen 5).
            let floor = peak::fma_short(exec().isa.unwrap_or_else(Isa::best));
            if let (Some((lanes, f)), false, 64 | 512) = (floor, interleaved, tokens) {
                let gname = format!("paired/fma_floor/rope/{}/{dtype}/t{tokens}/lanes", m.name);
                let mut g = setup_group(c, &gname);
                let p = pool(1);
                let mut kern = || rope(&mut out, &mut cache);
                let mut base = || peak::call(f, 1);
                let (work, base_work) = ((2 * tokens * per_token) as u64, (24 * peak::SHORT_ITERS * lanes) as u64);
                paired::run(
                    &mut g,
                    &gname,
                    &p,
                    Side { name: "rope_t1", work, run: &mut kern },
                    Side { name: "fma_peak_t1", work: base_work, run: &mut base },
                );
                g.finish();
            }
        }
    }
}

#[path = "common/paired.rs"]
mod paired;
#[path = "common/peak.rs"]
mod peak;
use paired::Side;

fn standalone_all(c: &mut Criterion) {
    let all = [1usize, 64, 512, 4096];
    standalone::<bf16>(c, "bf16", false, &all);
    standalone::<f32>(c, "f32", false, &all);
    // Interleaved pairs (GPT-J style; MAX's Llama with GGUF weights) on their own token kernel.
    standalone::<bf16>(c, "bf16", true, &[64, 512]);
}

/// The fused QKV with RoPE in its epilogue against the same QKV without RoPE (Llama-3-8B shape;
/// NVFP4 and bf16 weights; bf16 output and cache).
fn fused(c: &mut Criterion) {
    let m = LLAMA;
    let (k, n, q_dim) = (m.k, (m.hq + 2 * m.hkv) * m.hd, m.hq * m.hd);
    let wf: Vec<f32> = random(n * k, 5);
    let wq = quantize(BlockFormat::Nvfp4, &wf, n, k, nvfp4_global_scale(amax(&wf))).unwrap();
    let pw = PackedWeights::new(wq.as_ref());
    let wb: Vec<bf16> = wf.iter().map(|&x| bf16::from_f32(x / 64.0)).collect();
    let pb = PackedPlainWeights::new(&wb, k).unwrap();
    for tokens in [1usize, 64, 512] {
        let freqs = paged_qkv::freqs_cis(tokens, m.hd, m.theta);
        let rope = QkvRope::new(Freqs::F32(&freqs), m.hd, m.hd, false).with_math(RopeMath::F32);
        let xf: Vec<f32> = random(tokens * k, 6);
        let a = quantize(BlockFormat::Nvfp4, &xf, tokens, k, nvfp4_global_scale(amax(&xf))).unwrap();
        let xb: Vec<bf16> = xf.iter().map(|&x| bf16::from_f32(x)).collect();
        let offs = [0, tokens as u32];
        let mut out = vec![bf16::ZERO; tokens * q_dim];
        let mut cache = cache_for::<bf16>(&m, tokens);
        let fp4 = |r: Option<QkvRope<'_>>, out: &mut [bf16], cache: &mut Cache<bf16>| {
            let args = QkvFp4PackedArgs::new(a.as_ref(), &offs, &pw, q_dim).maybe_rope(r);
            fast::qkv_fp4_ragged_packed(&args, out, &mut cache.kv(), exec()).unwrap()
        };
        let plain = |r: Option<QkvRope<'_>>, out: &mut [bf16], cache: &mut Cache<bf16>| {
            let args = QkvRaggedPackedArgs::new(&xb, &offs, &pb, q_dim).maybe_rope(r);
            fast::qkv_ragged_packed(&args, out, &mut cache.kv(), exec()).unwrap()
        };
        type Op<'a> = &'a (dyn Fn(Option<QkvRope<'_>>, &mut [bf16], &mut Cache<bf16>) + Sync);
        let ops: [(&str, Op<'_>); 2] = [("nvfp4", &fp4), ("bf16", &plain)];
        let mut g = setup_group(c, &format!("fused_rope/{}/m{tokens}/flop", m.name));
        g.throughput(Throughput::Elements((2 * tokens * n * k) as u64));
        for threads in [1usize, 2] {
            let p = pool(threads);
            for (name, op) in ops {
                for (what, r) in [("qkv", None), ("qkv_rope", Some(rope))] {
                    g.bench_function(format!("{name}_{what}_t{threads}"), |b| {
                        p.install(|| b.iter(|| op(r, &mut out, &mut cache)))
                    });
                }
            }
        }
        g.finish();
        // The target's ratio, each fused call paired with one without RoPE (`common/paired.rs`);
        // the inverse of the ratio is the time ratio.
        let gname = format!("paired/fused_rope/{}/m{tokens}/flop", m.name);
        let mut g = setup_group(c, &gname);
        let flop = (2 * tokens * n * k) as u64;
        let (mut out_b, mut cache_b) = (out.clone(), cache_for::<bf16>(&m, tokens));
        for threads in [1usize, 2] {
            let p = pool(threads);
            for (name, op) in ops {
                let mut kern = || op(Some(rope), &mut out, &mut cache);
                let mut base = || op(None, &mut out_b, &mut cache_b);
                let (id, base_id) = (format!("{name}_qkv_rope_t{threads}"), format!("{name}_qkv"));
                let base = Side { name: &base_id, work: flop, run: &mut base };
                paired::run(&mut g, &gname, &p, Side { name: &id, work: flop, run: &mut kern }, base);
            }
        }
        g.finish();
    }
}

/// The ragged KV store (bf16 values into a bf16 cache, the K part of a sequence's new tokens)
/// against a copy of the same bytes (read the values, write the cache rows), paired.
fn kv_store(c: &mut Criterion) {
    for m in [LLAMA, QWEN] {
        for tokens in [64usize, 512, 4096] {
            let width = m.hkv * m.hd;
            let vals: Vec<bf16> = random(tokens * width, 1);
            let mut cache = cache_for::<bf16>(&m, tokens);
            let mut bufs = CopyBufs::<bf16>::new(tokens * width, 2);
            let offs = [0, tokens as u32];
            let bytes = (2 * tokens * width * size_of::<bf16>()) as u64;
            let gname = format!("paired/kv_store/{}/bf16/t{tokens}/bytes", m.name);
            let mut g = setup_group(c, &gname);
            for threads in [1usize, 2] {
                let p = pool(threads);
                let mut kern = || {
                    let args = KvStoreRaggedArgs::new(&vals, &offs, KvSel::K);
                    fast::kv_store_ragged(&args, &mut cache.kv(), exec()).unwrap()
                };
                let mut base = || bufs.copy(threads);
                let id = format!("kv_store_t{threads}");
                paired::run(
                    &mut g,
                    &gname,
                    &p,
                    Side { name: &id, work: bytes, run: &mut kern },
                    Side { name: &format!("copy_t{threads}"), work: bytes, run: &mut base },
                );
            }
            g.finish();
        }
    }
}

/// Small calls on a two-thread pool: each call (bf16, half-split RoPE of one sequence's new
/// tokens, or its KV store of the K rows) as the pool runs it, paired with the same call told to
/// stay on the calling thread (`Par::Sequential`), in rows per second. A ratio below 1 means the
/// second thread slowed the call down; `kernels::rope` keeps calls below a byte grain per share
/// on one thread for that reason (docs/performance.md, "Small calls on one thread").
fn small_calls(c: &mut Criterion) {
    let p = pool(2);
    for m in [LLAMA, QWEN] {
        for tokens in [8usize, 16, 32, 64, 128] {
            let q: Vec<bf16> = random(tokens * m.hq * m.hd, 1);
            let freqs = paged_qkv::freqs_cis(tokens, m.hd, m.theta);
            let offs = [0, tokens as u32];
            let rope_args = rope_args(&m, &q, &offs, &freqs, false);
            let vals: Vec<bf16> = random(tokens * m.hkv * m.hd, 2);
            let store_args = KvStoreRaggedArgs::new(&vals, &offs, KvSel::K);
            // Each side its own output and cache.
            let (mut out, mut out1) = (vec![bf16::default(); q.len()], vec![bf16::default(); q.len()]);
            let (mut cache, mut cache1) = (cache_for::<bf16>(&m, tokens), cache_for::<bf16>(&m, tokens));
            let seq = Exec { par: Par::Sequential, ..exec() };
            let gname = format!("paired/threads/rope/{}/bf16/t{tokens}/rows", m.name);
            let mut g = setup_group(c, &gname);
            let mut kern = || fast::rope_ragged(&rope_args, &mut out, &mut cache.kv(), RopeMath::F32, exec()).unwrap();
            let mut base = || fast::rope_ragged(&rope_args, &mut out1, &mut cache1.kv(), RopeMath::F32, seq).unwrap();
            let work = tokens as u64;
            let (k, b) =
                (Side { name: "pool_t2", work, run: &mut kern }, Side { name: "one_thread", work, run: &mut base });
            paired::run(&mut g, &gname, &p, k, b);
            g.finish();
            let gname = format!("paired/threads/kv_store/{}/bf16/t{tokens}/rows", m.name);
            let mut g = setup_group(c, &gname);
            let mut kern = || fast::kv_store_ragged(&store_args, &mut cache.kv(), exec()).unwrap();
            let mut base = || fast::kv_store_ragged(&store_args, &mut cache1.kv(), seq).unwrap();
            let (k, b) =
                (Side { name: "pool_t2", work, run: &mut kern }, Side { name: "one_thread", work, run: &mut base });
            paired::run(&mut g, &gname, &p, k, b);
            g.finish();
        }
    }
}

criterion_group!(benches, standalone_all, fused, kv_store, small_calls);
criterion_main!(benches);
