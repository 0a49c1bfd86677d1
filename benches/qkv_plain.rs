//! Fast bf16/f16/f32 fused QKV: throughput against baselines measured in the same run.
//!
//! `cargo bench --bench qkv_plain` (filter with e.g. `-- llama3-8b/m512`; force an ISA with
//! `PAGED_QKV_BENCH_ISA=avx2`, read by this benchmark only). Group names say what one "element"
//! is: `flop` groups count 2·M·N·K FLOP, `bytes` groups count weight bytes.
//!
//! Baselines: the `gemm` crate on the same (M, N, K) (f32, and f16 for f16); a plain read of the
//! weight bytes (L3-hot, and cycling layers past the last-level cache); peak loops of the
//! instructions the kernels rely on (`vfmadd231ps` zmm/ymm, `vdpbf16ps`), in `peak/flop`.
//! `paired/…` groups state the targets' ratios: each kernel call runs alternately with its
//! baseline (the peak loop of the ISA in use, a plain read, the op writing a plain matrix, the
//! full BSHD batch), and the median per-pair ratio is printed (`common/paired.rs`), so the VM's
//! drift between groups stays out of the ratio.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use paged_qkv::fast::{PackedPlainWeights, QkvBshdPackedArgs, QkvRaggedPackedArgs, matmul_plain_packed};
use paged_qkv::{CacheShape, Element, Exec, Isa, KvWrite, PageTable, PagedKvCache, bf16, f16};
use std::hint::black_box;

#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::*;

fn random<T: Element>(n: usize, seed: u64, scale: f32) -> Vec<T> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n).map(|_| T::from_f32((rng.f32() - 0.5) * 2.0 * scale)).collect()
}

#[path = "common/exec.rs"]
mod exec;
use exec::exec;

/// A bf16 paged cache and page table for `m` new tokens in one sequence (ragged) or `batch`
/// sequences of `seq` (BSHD).
struct Cache {
    cache: PagedKvCache<bf16>,
    lookup: Vec<u32>,
    cols: usize,
    lens: Vec<u32>,
}

fn cache_for(model: &Model, batch: usize, seq: usize) -> Cache {
    let cols = seq.div_ceil(128);
    let shape = CacheShape::mha(batch * cols + 1, 1, 128, model.hkv, model.hd).unwrap();
    Cache {
        cache: PagedKvCache::zeros(shape),
        lookup: (0..(batch * cols) as u32).collect(),
        cols,
        lens: vec![0; batch],
    }
}

impl Cache {
    fn kv(&mut self) -> KvWrite<'_, bf16> {
        let table = PageTable::new(&self.lookup, self.cols, &self.lens).unwrap();
        KvWrite::new(self.cache.view_mut(), table, 0)
    }
}

fn fused<T: Element>(x: &[T], w: &PackedPlainWeights<T>, q_dim: usize, out: &mut [bf16], c: &mut Cache, e: Exec) {
    let m = x.len() / w.k();
    let offs = [0, m as u32];
    let args = QkvRaggedPackedArgs::new(x, &offs, w, q_dim);
    paged_qkv::fast::qkv_ragged_packed(&args, out, &mut c.kv(), e).unwrap();
}

/// A padded BSHD batch of 8 sequences of 64 tokens with valid lengths `valid`.
fn bshd(x: &[bf16], w: &PackedPlainWeights<bf16>, valid: &[u32; 8], q_dim: usize, out: &mut [bf16], c: &mut Cache) {
    let args = QkvBshdPackedArgs::new(x, (8, 64), w, valid, q_dim);
    paged_qkv::fast::qkv_bshd_packed(&args, out, &mut c.kv(), exec()).unwrap()
}

/// `out = x · wᵀ` with the `gemm` crate (f32 or f16), row-major, `w` `[n, k]`.
#[allow(clippy::too_many_arguments)]
fn gemm_baseline<T: Copy + 'static>(
    m: usize,
    n: usize,
    k: usize,
    x: &[T],
    w: &[T],
    out: &mut [T],
    threads: usize,
    one: T,
    zero: T,
) {
    let par = if threads == 1 { gemm::Parallelism::None } else { gemm::Parallelism::Rayon(threads) };
    // SAFETY: x is [m, k], w is [n, k] (read as Wᵀ: row stride 1, column stride k), out is [m, n],
    // all row-major and of exactly those sizes.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            zero,
            one,
            false,
            false,
            false,
            par,
        )
    }
}

/// GFLOP/s of the fused op (bf16, f32; f16 on Llama at M ≥ 64), of the same kernels into a plain
/// `[M, N]` matrix, of `gemm`, and of a padded BSHD batch half of whose rows are valid.
fn compute(c: &mut Criterion) {
    for model in [LLAMA, QWEN] {
        let (k, n, q_dim) = (model.k, model.n(), model.q_dim());
        let scale = 1.0 / (k as f32).sqrt();
        let w_bf: Vec<bf16> = random(n * k, 1, scale);
        let w_f32: Vec<f32> = w_bf.iter().map(|v| v.to_f32()).collect();
        let pw_bf = PackedPlainWeights::new(&w_bf, k).unwrap();
        let pw_f32 = PackedPlainWeights::new(&w_f32, k).unwrap();
        let w_f16: Vec<f16> = w_f32.iter().map(|&v| f16::from_f32(v)).collect();
        let pw_f16 = PackedPlainWeights::new(&w_f16, k).unwrap();
        for m in [1usize, 8, 64, 512] {
            let x_bf: Vec<bf16> = random(m * k, 2 + m as u64, 1.0);
            let x_f32: Vec<f32> = x_bf.iter().map(|v| v.to_f32()).collect();
            let x_f16: Vec<f16> = x_f32.iter().map(|&v| f16::from_f32(v)).collect();
            let mut g = setup_group(c, &format!("{}/m{m}/flop", model.name));
            g.throughput(Throughput::Elements((2 * m * n * k) as u64));
            for threads in [1usize, 2] {
                let p = pool(threads);
                let mut out = vec![bf16::ZERO; m * q_dim];
                let mut cache = cache_for(&model, 1, m);
                g.bench_function(format!("fused_bf16_t{threads}"), |b| {
                    p.install(|| b.iter(|| fused(&x_bf, &pw_bf, q_dim, &mut out, &mut cache, exec())))
                });
                g.bench_function(format!("fused_f32_t{threads}"), |b| {
                    p.install(|| b.iter(|| fused(&x_f32, &pw_f32, q_dim, &mut out, &mut cache, exec())))
                });
                let mut gout = vec![0f32; m * n];
                g.bench_function(format!("gemm_f32_t{threads}"), |b| {
                    p.install(|| b.iter(|| gemm_baseline(m, n, k, &x_f32, &w_f32, &mut gout, threads, 1.0, 0.0)))
                });
                if m >= 64 {
                    let mut plain = vec![bf16::ZERO; m * n];
                    g.bench_function(format!("plain_matrix_bf16_t{threads}"), |b| {
                        p.install(|| b.iter(|| matmul_plain_packed(&x_bf, &pw_bf, None, &mut plain, exec()).unwrap()))
                    });
                    if model.name == LLAMA.name {
                        g.bench_function(format!("fused_f16_t{threads}"), |b| {
                            p.install(|| b.iter(|| fused(&x_f16, &pw_f16, q_dim, &mut out, &mut cache, exec())))
                        });
                        let mut hout = vec![f16::ZERO; m * n];
                        g.bench_function(format!("gemm_f16_t{threads}"), |b| {
                            p.install(|| {
                                b.iter(|| {
                                    gemm_baseline(m, n, k, &x_f16, &w_f16, &mut hout, threads, f16::ONE, f16::ZERO)
                                })
                            })
                        });
                    }
                }
                if m == 512 {
                    // 8 sequences padded to 64: all valid, or valid lengths summing to half.
                    for (name, valid) in [("full", [64u32; 8]), ("half", HALF_VALID)] {
                        let mut cache = cache_for(&model, 8, 64);
                        g.bench_function(format!("bshd_bf16_{name}_t{threads}"), |b| {
                            p.install(|| b.iter(|| bshd(&x_bf, &pw_bf, &valid, q_dim, &mut out, &mut cache)))
                        });
                    }
                }
            }
            g.finish();
            if m == 512 && model.name == LLAMA.name {
                let gname = format!("paired/{}/m{m}/flop", model.name);
                let mut g = setup_group(c, &gname);
                let flop = (2 * m * n * k) as u64;
                for threads in [1usize, 2] {
                    let p = pool(threads);
                    let mut out = vec![bf16::ZERO; m * q_dim];
                    let mut cache = cache_for(&model, 1, m);
                    for (dt, bf) in [("bf16", true), ("f32", false)] {
                        let Some((pname, _, per, f)) = peak_for(bf) else { continue };
                        let mut kern = || match bf {
                            true => fused(&x_bf, &pw_bf, q_dim, &mut out, &mut cache, exec()),
                            false => fused(&x_f32, &pw_f32, q_dim, &mut out, &mut cache, exec()),
                        };
                        let mut base = || peak::call(f, threads);
                        let (id, pw) = (format!("fused_{dt}_t{threads}"), peak::ops(per) * threads as u64);
                        let kern = Side { name: &id, work: flop, run: &mut kern };
                        let peak = Side { name: &format!("{pname}_t{threads}"), work: pw, run: &mut base };
                        paired::run(&mut g, &gname, &p, kern, peak);
                    }
                    // Two calls of the op, both counted as the full batch's FLOP (so the inverse of
                    // the ratio is the time ratio).
                    let mut plain = vec![bf16::ZERO; m * n];
                    let mut kern = || fused(&x_bf, &pw_bf, q_dim, &mut out, &mut cache, exec());
                    let mut base = || matmul_plain_packed(&x_bf, &pw_bf, None, &mut plain, exec()).unwrap();
                    let id = format!("fused_vs_plain_bf16_t{threads}");
                    paired::run(
                        &mut g,
                        &gname,
                        &p,
                        Side { name: &id, work: flop, run: &mut kern },
                        Side { name: "plain_matrix_bf16", work: flop, run: &mut base },
                    );
                    let (mut half_cache, mut full_cache) = (cache_for(&model, 8, 64), cache_for(&model, 8, 64));
                    let (mut half_out, mut full_out) = (vec![bf16::ZERO; m * q_dim], vec![bf16::ZERO; m * q_dim]);
                    let id = format!("bshd_half_vs_full_bf16_t{threads}");
                    let mut kern = || bshd(&x_bf, &pw_bf, &HALF_VALID, q_dim, &mut half_out, &mut half_cache);
                    let mut base = || bshd(&x_bf, &pw_bf, &[64; 8], q_dim, &mut full_out, &mut full_cache);
                    paired::run(
                        &mut g,
                        &gname,
                        &p,
                        Side { name: &id, work: flop, run: &mut kern },
                        Side { name: "bshd_bf16_full", work: flop, run: &mut base },
                    );
                }
                g.finish();
            }
        }
    }
}

/// Valid lengths of the half-valid BSHD batch (8 sequences padded to 64).
const HALF_VALID: [u32; 8] = [64, 0, 64, 0, 32, 32, 48, 16];

/// The peak loop the kernels of the ISA in use rely on, for bf16 or f32 weights (`None` off x86
/// or below AVX2).
fn peak_for(bf16: bool) -> Option<peak::Peak> {
    let unit = if bf16 { peak::Unit::Bf16Dot } else { peak::Unit::Fma };
    peak::for_isa(exec().isa.unwrap_or_else(Isa::best), unit)
}

/// M = 1 against a plain read of the same bytes: L3-hot (one layer) and from DRAM (cycling
/// through enough layers to exceed the last-level cache).
fn decode(c: &mut Criterion) {
    let model = LLAMA;
    let (k, n) = (model.k, model.n());
    let w: Vec<bf16> = random(n * k, 1, 1.0 / 64.0);
    let x: Vec<bf16> = random(k, 9, 1.0);
    let pw = PackedPlainWeights::new(&w, k).unwrap();
    let bytes = pw.size_bytes();
    let layers = (400 << 20) / bytes + 1; // > the 260 MiB last-level cache reported here
    let cold: Vec<PackedPlainWeights<bf16>> = (0..layers).map(|_| pw.clone()).collect();
    let hot_raw: Vec<u8> = w.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
    let cold_raw: Vec<Vec<u8>> = (0..layers).map(|_| hot_raw.clone()).collect();
    let mut out = vec![bf16::ZERO; model.q_dim()];
    let mut cache = cache_for(&model, 1, 1);
    let mut g = setup_group(c, &format!("{}/decode_bf16/bytes", model.name));
    g.throughput(Throughput::Bytes(hot_raw.len() as u64));
    for threads in [1usize, 2] {
        let p = pool(threads);
        g.bench_function(format!("hot_fused_t{threads}"), |b| {
            p.install(|| b.iter(|| fused(&x, &pw, model.q_dim(), &mut out, &mut cache, exec())))
        });
        g.bench_function(format!("hot_read_t{threads}"), |b| {
            p.install(|| b.iter(|| black_box(plain_read_par(&hot_raw, threads))))
        });
        let mut i = 0;
        g.bench_function(format!("dram_fused_t{threads}"), |b| {
            p.install(|| {
                b.iter(|| {
                    i = (i + 1) % layers;
                    fused(&x, &cold[i], model.q_dim(), &mut out, &mut cache, exec())
                })
            })
        });
        g.bench_function(format!("dram_read_t{threads}"), |b| {
            p.install(|| {
                b.iter(|| {
                    i = (i + 1) % layers;
                    black_box(plain_read_par(&cold_raw[i], threads))
                })
            })
        });
    }
    g.finish();
    let gname = format!("paired/{}/decode_bf16/bytes", model.name);
    let mut g = setup_group(c, &gname);
    for threads in [1usize, 2] {
        let b = hot_raw.len() as u64;
        let mut kern = |i: usize| fused(&x, &cold[i], model.q_dim(), &mut out, &mut cache, exec());
        let mut read = |j: usize| {
            black_box(plain_read_par(&cold_raw[j], threads));
        };
        paired::dram(&mut g, &gname, &pool(threads), threads, layers, b, &mut kern, &mut read);
    }
    g.finish();
}

#[path = "common/peak.rs"]
mod peak;

#[path = "common/paired.rs"]
mod paired;
use paired::Side;

/// The instruction peaks the targets are stated against (per thread count).
fn peaks(c: &mut Criterion) {
    let mut g = setup_group(c, "peak/flop");
    peak::run(&mut g, &["fma_zmm", "fma_ymm", "vdpbf16ps_zmm"]);
    g.finish();
}

criterion_group!(benches, peaks, decode, compute);
criterion_main!(benches);
