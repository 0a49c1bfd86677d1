//! `paged-qkv bench`: the fused QKV + RoPE's throughput per call (`bench`) and over a whole
//! decode step of a model (`bench --decode-step`), each against a plain read of the weight bytes
//! measured in the same run.

use super::{Bad, DtypeArg, progress, uniform};
use paged_qkv::case::ModelShape;
use paged_qkv::fast::{
    self, PackedFp8Weights, PackedPlainWeights, QkvFp4PackedArgs, QkvFp8PackedArgs, QkvRaggedPackedArgs,
};
use paged_qkv::formats::BlockFormat;
use paged_qkv::formats::fp8::e4m3_from_f32;
use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
use paged_qkv::ops::{Freqs, QkvRope};
use paged_qkv::{
    CacheShape, Element, Exec, FP8_BLOCK, Fp8Scales, Isa, KvWrite, PackedWeights, PageTable, PagedKvCache, Par,
    RopeMath, Workers, bf16, f16,
};
use rayon::prelude::*;
use std::sync::Arc;
use std::time::Instant;

/// How a multi-threaded bench row runs its calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ParArg {
    /// A `Workers` team (spinning between calls): a server's setup.
    Workers,
    /// A rayon pool (`Par::Rayon`).
    Rayon,
}

/// Median of repeated runs (at least 5, up to 0.5 s), after one warm-up run.
fn time(f: &mut (dyn FnMut() + Send)) -> f64 {
    f();
    let mut v = Vec::new();
    let t0 = Instant::now();
    while v.len() < 5 || (t0.elapsed().as_secs_f64() < 0.5 && v.len() < 200) {
        let t = Instant::now();
        f();
        v.push(t.elapsed().as_secs_f64());
    }
    median(&mut v)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A plain read of `bytes` (all threads of the current pool): 64 KiB pieces, each folded 64
/// bytes at a time into eight independent lanes (a loop the compiler vectorises, not one
/// `u64` chain).
fn read_bytes(bytes: &[u8]) {
    let x: u64 = bytes
        .par_chunks(1 << 16)
        .map(|c| {
            let mut acc = [0u64; 8];
            for line in c.as_chunks::<64>().0 {
                for (a, w) in acc.iter_mut().zip(line.as_chunks::<8>().0) {
                    *a ^= u64::from_le_bytes(*w);
                }
            }
            acc.iter().fold(0, |a, b| a ^ b)
        })
        .reduce(|| 0, |a, b| a ^ b);
    std::hint::black_box(x);
}

fn pool(threads: usize) -> Result<rayon::ThreadPool, Bad> {
    Ok(rayon::ThreadPoolBuilder::new().num_threads(threads).build()?)
}

/// Where a bench row runs: the exec, and the rayon pool to call from (the read's pool, and
/// `Par::Rayon`'s).
fn exec_for(threads: usize, par: ParArg, isa: Option<Isa>) -> Result<(Exec, rayon::ThreadPool), Bad> {
    let p = pool(threads)?;
    let par = match (threads, par) {
        (1, _) => Par::Sequential,
        (_, ParArg::Rayon) => Par::Rayon,
        (_, ParArg::Workers) => Par::Workers(Workers::shared(threads)?),
    };
    Ok((Exec { par, isa }, p))
}

/// A model's fused weight in one format, packed once.
#[derive(Clone)]
enum Packed {
    Fp4(BlockFormat, Arc<PackedWeights>),
    /// FP8 W8A8: granularity 0 tensor, 1 channel, 2 block; the weight's scales.
    Fp8(usize, Arc<PackedFp8Weights>, Arc<Vec<f32>>),
    Bf16(Arc<PackedPlainWeights<bf16>>),
    F16(Arc<PackedPlainWeights<f16>>),
    F32(Arc<PackedPlainWeights<f32>>),
}

/// One layer's call on `mm` rows of fixed random activations, into a bf16 output and cache.
type LayerCall = Box<dyn FnMut(&mut [bf16], &mut KvWrite<'_, bf16>, QkvRope<'_>, Exec) + Send>;

impl Packed {
    /// The weight of `m`'s fused QKV (uniform random values) in `dt`; its name and the bytes of
    /// the weight the kernels read (data and scales).
    fn new(dt: DtypeArg, m: ModelShape) -> Result<(Packed, &'static str, usize), Bad> {
        let (k, n) = (m.hidden, (m.q_heads + 2 * m.kv_heads) * m.head);
        let mut rnd = uniform(1);
        let w: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
        fn plain<T: Element>(w: &[f32], k: usize) -> Result<(Arc<PackedPlainWeights<T>>, usize), Bad> {
            let wt: Vec<T> = w.iter().map(|&x| T::from_f32(x)).collect();
            Ok((Arc::new(PackedPlainWeights::new(&wt, k)?), std::mem::size_of_val(&wt[..])))
        }
        Ok(match dt {
            DtypeArg::Nvfp4 | DtypeArg::Mxfp4 | DtypeArg::Mxfp8 => {
                let format = match dt {
                    DtypeArg::Nvfp4 => BlockFormat::Nvfp4,
                    DtypeArg::Mxfp4 => BlockFormat::Mxfp4,
                    _ => BlockFormat::Mxfp8,
                };
                let wq = quantize(format, &w, n, k, nvfp4_global_scale(amax(&w)))?;
                let bytes = wq.data().len() + wq.scales().len();
                (Packed::Fp4(format, Arc::new(PackedWeights::new(wq.as_ref()))), format.name(), bytes)
            }
            DtypeArg::Fp8 | DtypeArg::Fp8Channel | DtypeArg::Fp8Block => {
                let (gran, name, scales) = match dt {
                    DtypeArg::Fp8 => (0, "fp8 (tensor scales)", 1),
                    DtypeArg::Fp8Channel => (1, "fp8 (channel scales)", n),
                    _ => (2, "fp8 (128-block scales)", n.div_ceil(FP8_BLOCK) * k.div_ceil(FP8_BLOCK)),
                };
                // Uniform in [-1, 1) times 256: E4M3's range, with every code class in use.
                let wq: Vec<u8> = w.iter().map(|&v| e4m3_from_f32(v * 256.0)).collect();
                let sw: Vec<f32> = (0..scales).map(|i| (1.0 + (i % 7) as f32 / 8.0) / 4096.0).collect();
                let bytes = wq.len() + 4 * sw.len();
                (Packed::Fp8(gran, Arc::new(PackedFp8Weights::new(&wq, k)?), Arc::new(sw)), name, bytes)
            }
            DtypeArg::Bf16 => plain::<bf16>(&w, k).map(|(p, b)| (Packed::Bf16(p), "bf16", b))?,
            DtypeArg::F16 => plain::<f16>(&w, k).map(|(p, b)| (Packed::F16(p), "f16", b))?,
            DtypeArg::F32 => plain::<f32>(&w, k).map(|(p, b)| (Packed::F32(p), "f32", b))?,
        })
    }

    /// A copy in its own memory (a decode step's layers are distinct weights).
    fn deep_clone(&self) -> Packed {
        match self {
            Packed::Fp4(f, p) => Packed::Fp4(*f, Arc::new((**p).clone())),
            Packed::Fp8(g, p, s) => Packed::Fp8(*g, Arc::new((**p).clone()), s.clone()),
            Packed::Bf16(p) => Packed::Bf16(Arc::new((**p).clone())),
            Packed::F16(p) => Packed::F16(Arc::new((**p).clone())),
            Packed::F32(p) => Packed::F32(Arc::new((**p).clone())),
        }
    }

    /// The call on `mm` rows (one sequence of `mm` new tokens when `seqs` is 1, else `mm`
    /// sequences of one token each).
    fn call(&self, m: ModelShape, mm: usize, seqs: usize, seed: u64) -> LayerCall {
        let (k, q_dim) = (m.hidden, m.q_heads * m.head);
        let mut rnd = uniform(seed);
        let x: Vec<f32> = (0..mm * k).map(|_| rnd()).collect();
        let offs: Vec<u32> = if seqs == 1 { vec![0, mm as u32] } else { (0..=mm as u32).collect() };
        fn plain<T: Element>(w: &Arc<PackedPlainWeights<T>>, x: &[f32], offs: Vec<u32>, q_dim: usize) -> LayerCall {
            let (w, x): (_, Vec<T>) = (w.clone(), x.iter().map(|&v| T::from_f32(v)).collect());
            Box::new(move |out, kv, rope, exec| {
                let args = QkvRaggedPackedArgs::new(&x, &offs, &w, q_dim).with_rope(rope);
                fast::qkv_ragged_packed(&args, out, kv, exec).expect("valid call");
            })
        }
        match self {
            Packed::Fp4(format, w) => {
                let a = quantize(*format, &x, mm, k, nvfp4_global_scale(amax(&x))).expect("finite input");
                let w = w.clone();
                Box::new(move |out, kv, rope, exec| {
                    let args = QkvFp4PackedArgs::new(a.as_ref(), &offs, &w, q_dim).with_rope(rope);
                    fast::qkv_fp4_ragged_packed(&args, out, kv, exec).expect("valid call");
                })
            }
            Packed::Fp8(gran, w, sw) => {
                // The activations quantized per tensor, token or block as the weight's scales say
                // (a scale per token or block from its amax, as a dynamic quantizer would).
                let (gran, w, sw) = (*gran, w.clone(), sw.clone());
                let kb = k.div_ceil(FP8_BLOCK);
                let si: Vec<f32> = match gran {
                    0 => vec![1.0 / 448.0],
                    1 => vec![1.0 / 448.0; mm],
                    _ => vec![1.0 / 448.0; kb * mm],
                };
                let a: Vec<u8> = x.iter().map(|&v| e4m3_from_f32(v * 448.0)).collect();
                Box::new(move |out, kv, rope, exec| {
                    let scales = match gran {
                        0 => Fp8Scales::Tensor { input: si[0], weight: sw[0] },
                        1 => Fp8Scales::Channel { input: &si, weight: &sw },
                        _ => Fp8Scales::Block { input: &si, weight: &sw },
                    };
                    let args = QkvFp8PackedArgs::<bf16>::new(&a, &offs, &w, scales, q_dim).with_rope(rope);
                    fast::qkv_fp8_ragged_packed(&args, out, kv, exec).expect("valid call");
                })
            }
            Packed::Bf16(w) => plain(w, &x, offs, q_dim),
            Packed::F16(w) => plain(w, &x, offs, q_dim),
            Packed::F32(w) => plain(w, &x, offs, q_dim),
        }
    }
}

/// `bench`: one layer, M = 1, 8, 64, 512 rows of one sequence.
pub(crate) fn bench(
    m: ModelShape,
    threads: Option<usize>,
    dtypes: &[DtypeArg],
    isa: Option<Isa>,
    par: ParArg,
) -> Result<(), Bad> {
    let threads = threads.unwrap_or_else(rayon::current_num_threads);
    if threads == 0 {
        return Err(Bad("--threads must be at least 1".into()));
    }
    let (exec, p) = exec_for(threads, par, isa)?;
    let (k, n) = (m.hidden, (m.q_heads + 2 * m.kv_heads) * m.head);
    outln!(
        "paged-qkv bench: {} (K {k}, N {n}), {threads} threads ({}), ISA {}",
        m.name,
        if threads == 1 { "calling thread" } else { par_name(par) },
        isa.unwrap_or_else(Isa::best).name()
    );
    let dtypes = if dtypes.is_empty() { &[DtypeArg::Nvfp4, DtypeArg::Mxfp4][..] } else { dtypes };
    let ms = [1usize, 8, 64, 512];
    let pb = progress("bench", Some((dtypes.len() * ms.len()) as u64));
    for &dt in dtypes {
        let (packed, name, bytes) = Packed::new(dt, m)?;
        let junk = vec![1u8; bytes];
        let read = p.install(|| time(&mut || read_bytes(&junk)));
        pb.suspend(|| {
            outln!(
                "  {name}: weight {:.1} MB; plain read of the weight bytes {:.3} ms = {:.1} GB/s",
                bytes as f64 / 1e6,
                read * 1e3,
                bytes as f64 / read / 1e9
            );
            outln!("    {:>5} {:>10} {:>9} {:>14} {:>12}", "M", "time", "GFLOP/s", "weight GB/s", "vs read");
        });
        for &mm in &ms {
            let mut call = packed.call(m, mm, 1, 2);
            let mut c = BenchCache::new(m, 1, mm, 1, mm, 0);
            let t = p.install(|| time(&mut || c.call(0, |out, kv, rope| call(out, kv, rope, exec))));
            pb.suspend(|| {
                outln!(
                    "    {mm:>5} {:>8.4}ms {:>9.1} {:>14.1} {:>11.2}x",
                    t * 1e3,
                    2.0 * (mm * n * k) as f64 / t / 1e9,
                    bytes as f64 / t / 1e9,
                    t / read
                )
            });
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    Ok(())
}

fn par_name(par: ParArg) -> &'static str {
    match par {
        ParArg::Workers => "workers",
        ParArg::Rayon => "rayon",
    }
}

/// Layers of a model (its real depth).
pub(crate) fn model_layers(m: ModelShape) -> usize {
    match m.name {
        "llama3-8b" => 32,
        "qwen2.5-0.5b" => 24,
        _ => 2,
    }
}

/// `bench --decode-step`: a whole decode step's fused QKV + RoPE, every layer of the model in
/// turn (each its own weight and cache layer), for `batch` sequences of one new token each at
/// cache position `position`; by thread count, on the calling thread, a rayon pool and a
/// `Workers` team, interleaved round by round, against a plain read of every layer's weight
/// bytes on the same threads.
pub(crate) fn decode_step(
    m: ModelShape,
    threads: Option<usize>,
    dtypes: &[DtypeArg],
    isa: Option<Isa>,
    batches: &[usize],
    layers: Option<usize>,
) -> Result<(), Bad> {
    let all = threads.unwrap_or_else(rayon::current_num_threads);
    if all == 0 {
        return Err(Bad("--threads must be at least 1".into()));
    }
    let layers = layers.unwrap_or_else(|| model_layers(m)).max(1);
    let position = 100.min(m.page * 4 - 1);
    // 1, 2, 4, … threads, and `all`.
    let mut counts: Vec<usize> =
        std::iter::successors(Some(1usize), |&t| Some(t * 2)).take_while(|&t| t < all).collect();
    counts.push(all);
    let mut variants: Vec<(usize, ParArg, Exec, rayon::ThreadPool)> = Vec::new();
    for &t in &counts {
        for par in [ParArg::Rayon, ParArg::Workers] {
            if t == 1 && par == ParArg::Workers {
                continue;
            }
            let (exec, p) = exec_for(t, par, isa)?;
            // A team's calls come from a thread of a one-thread pool (nothing else of rayon's
            // awake beside the team).
            let p = if par == ParArg::Workers { pool(1)? } else { p };
            variants.push((t, par, exec, p));
        }
    }
    let batches = if batches.is_empty() { &[1, 8, 32][..] } else { batches };
    let dtypes = if dtypes.is_empty() { &[DtypeArg::Nvfp4, DtypeArg::Bf16][..] } else { dtypes };
    let (k, n) = (m.hidden, (m.q_heads + 2 * m.kv_heads) * m.head);
    outln!(
        "paged-qkv bench --decode-step: {} ({layers} layers, K {k}, N {n}), ISA {}, one new token per sequence at position {position}",
        m.name,
        isa.unwrap_or_else(Isa::best).name()
    );
    outln!(
        "  step: every layer's fused QKV + RoPE into a bf16 paged cache; read: a plain read of every layer's weight bytes"
    );
    // The fixed cost of a call: the tiny model (K 64, N 64: no work to speak of, one task), one
    // token: validation, the slot plan, the activations' preparation, the epilogue.
    let tiny = paged_qkv::case::model("tiny").expect("the tiny model");
    {
        let (packed, name, _) = Packed::new(DtypeArg::Nvfp4, tiny)?;
        let mut call = packed.call(tiny, 1, 1, 2);
        let mut c = BenchCache::new(tiny, 1, 1, 1, 1, 0);
        let med = interleaved(&variants, 0.5, &mut |exec| c.call(0, |out, kv, rope| call(out, kv, rope, exec)));
        let row: Vec<String> = variants
            .iter()
            .zip(&med)
            .map(|((t, par, _, _), m)| format!("{t}t{} {:.2} µs", if *t == 1 { "" } else { par_name(*par) }, m * 1e6))
            .collect();
        outln!("  fixed cost of a call (the tiny model, {name}, one token): {}", row.join(", "));
    }
    // A server does other work between two QKV calls (attention, the MLP): one layer's call on
    // one token after 100 µs of work on the calling thread alone, against the same call back to
    // back (rayon parks idle threads after a few dozen yields; a `Workers` team spins 200 µs).
    for dt in [DtypeArg::Nvfp4, DtypeArg::Bf16] {
        let (packed, name, bytes) = Packed::new(dt, m)?;
        let mut call = packed.call(m, 1, 1, 2);
        let mut c = BenchCache::new(m, 1, 1, 1, 1, position);
        let mut row = Vec::new();
        for gap in [0u64, 100].map(std::time::Duration::from_micros) {
            let med = interleaved(&variants, 1.0, &mut |exec| {
                let t = Instant::now();
                while t.elapsed() < gap {
                    std::hint::spin_loop();
                }
                c.call(0, |out, kv, rope| call(out, kv, rope, exec));
            });
            // The call alone: the gap subtracted.
            row.push(med.iter().map(|m| m - gap.as_secs_f64()).collect::<Vec<f64>>());
        }
        let cells: Vec<String> = variants
            .iter()
            .enumerate()
            .map(|(i, (t, par, _, _))| {
                let who = if *t == 1 { format!("{t}t") } else { format!("{t}t {}", par_name(*par)) };
                format!("{who} {:.1} → {:.1} µs", row[0][i] * 1e6, row[1][i] * 1e6)
            })
            .collect();
        outln!("  one {name} layer, one token, back to back → after 100 µs of other work: {}", cells.join(", "));
        // What the same threads take to read the layer's bytes back to back (from whichever cache
        // holds them): the ceiling of the back-to-back figures' scaling.
        let junk = vec![1u8; bytes];
        let reads: Vec<String> = counts
            .iter()
            .map(|&t| pool(t).map(|p| format!("{t}t {:.1} µs", p.install(|| time(&mut || read_bytes(&junk))) * 1e6)))
            .collect::<Result<_, _>>()?;
        outln!("    a plain read of the layer's {:.2} MB back to back: {}", bytes as f64 / 1e6, reads.join(", "));
    }
    for &dt in dtypes {
        let pb = progress("packing", None);
        let (first, name, bytes) = Packed::new(dt, m)?;
        let packed: Vec<Packed> =
            (0..layers).map(|l| if l == 0 { first.clone() } else { first.deep_clone() }).collect();
        let junk = vec![1u8; bytes * layers];
        pb.finish_and_clear();
        let reads: Vec<f64> = counts
            .iter()
            .map(|&t| pool(t).map(|p| p.install(|| time(&mut || read_bytes(&junk)))))
            .collect::<Result<_, _>>()?;
        outln!(
            "  {name}: {:.1} MB of weights ({:.1} MB a layer); read {}",
            (bytes * layers) as f64 / 1e6,
            bytes as f64 / 1e6,
            counts
                .iter()
                .zip(&reads)
                .map(|(t, r)| format!("{t}t {:.2} ms ({:.1} GB/s)", r * 1e3, (bytes * layers) as f64 / r / 1e9))
                .collect::<Vec<_>>()
                .join(", ")
        );
        outln!(
            "    {:>5} {:>7} {:>8} {:>10} {:>10} {:>8} {:>16}",
            "batch",
            "threads",
            "par",
            "step",
            "tokens/s",
            "vs read",
            "speed-up (read)"
        );
        for &batch in batches {
            let mut calls: Vec<LayerCall> = packed.iter().map(|p| p.call(m, batch, batch, 2)).collect();
            let mut c = BenchCache::new(m, layers, batch, batch, 1, position);
            let mut step = |exec: Exec| {
                for (l, call) in calls.iter_mut().enumerate() {
                    c.call(l, |out, kv, rope| call(out, kv, rope, exec));
                }
            };
            let med = interleaved(&variants, 2.0, &mut step);
            for (i, (t, par, _, _)) in variants.iter().enumerate() {
                let ci = counts.iter().position(|c| c == t).unwrap_or(0);
                outln!(
                    "    {batch:>5} {t:>7} {:>8} {:>8.3}ms {:>10.0} {:>7.2}x {:>7.2}x ({:.2}x)",
                    if *t == 1 { "-" } else { par_name(*par) },
                    med[i] * 1e3,
                    batch as f64 / med[i],
                    med[i] / reads[ci],
                    med[0] / med[i],
                    reads[0] / reads[ci]
                );
            }
        }
    }
    outln!(
        "  (medians of rounds of 20 ms blocks of each variant in turn; speed-up: the 1-thread step's time over this one, in brackets the read's)"
    );
    Ok(())
}

/// Medians of `f(exec)` per variant, in rounds of blocks: each variant in turn runs `f` for 20 ms
/// (at least twice; the first call of a block, which wakes the variant's threads, is not counted),
/// until `secs` have passed (at least 3 rounds). Blocks, not single calls, so that one variant's
/// threads (a `Workers` team spins after its calls) do not share the cores with the next one's.
fn interleaved(
    variants: &[(usize, ParArg, Exec, rayon::ThreadPool)],
    secs: f64,
    f: &mut (dyn FnMut(Exec) + Send),
) -> Vec<f64> {
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let t0 = Instant::now();
    let mut round = 0;
    while round < 3 || t0.elapsed().as_secs_f64() < secs {
        for (i, (_, _, exec, p)) in variants.iter().enumerate() {
            p.install(|| {
                let start = Instant::now();
                let mut calls = 0;
                while calls < 2 || start.elapsed().as_secs_f64() < 0.02 {
                    let t = Instant::now();
                    f(*exec);
                    if calls > 0 {
                        times[i].push(t.elapsed().as_secs_f64());
                    }
                    calls += 1;
                }
            });
        }
        round += 1;
    }
    times.iter_mut().map(|v| median(v)).collect()
}

/// A bf16 output and a paged cache of `layers` layers for `seqs` sequences of `new` new tokens
/// each at cache position `position` onwards (each sequence its own pages), and the RoPE table.
struct BenchCache {
    cache: PagedKvCache<bf16>,
    lookup: Vec<u32>,
    lens: Vec<u32>,
    cols: usize,
    out: Vec<bf16>,
    freqs: Vec<f32>,
    head: usize,
}

impl BenchCache {
    fn new(m: ModelShape, layers: usize, rows: usize, seqs: usize, new: usize, position: usize) -> Self {
        let cols = (position + new).div_ceil(m.page);
        let shape = CacheShape::mha(seqs * cols, layers, m.page, m.kv_heads, m.head).expect("valid shape");
        let lookup = (0..(seqs * cols) as u32).collect();
        let freqs = paged_qkv::freqs_cis(position + new, m.head, m.rope_theta);
        BenchCache {
            cache: PagedKvCache::zeros(shape),
            lookup,
            lens: vec![position as u32; seqs],
            cols,
            out: vec![bf16::ZERO; rows * m.q_heads * m.head],
            freqs,
            head: m.head,
        }
    }

    /// Runs `f` on layer `layer` with the output, the cache and the model's RoPE (NeoX halves,
    /// f32 math) to fuse.
    fn call(&mut self, layer: usize, f: impl FnOnce(&mut [bf16], &mut KvWrite<'_, bf16>, QkvRope<'_>)) {
        let rope = QkvRope::new(Freqs::F32(&self.freqs), self.head, self.head, false).with_math(RopeMath::F32);
        let table = PageTable::new(&self.lookup, self.cols, &self.lens).expect("valid table");
        let mut kv = KvWrite::new(self.cache.view_mut(), table, layer);
        f(&mut self.out, &mut kv, rope);
    }
}
