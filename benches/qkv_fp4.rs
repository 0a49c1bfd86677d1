//! Fast FP4 fused QKV: throughput against baselines measured in the same run.
//!
//! `cargo bench --bench qkv_fp4` (filter with e.g. `-- llama/m1`; the activation quantizer alone:
//! `-- quantize/`). Group names say what one
//! "element" is: `flop` groups count 2·M·N·K FLOP, `bytes` groups count weight + scale bytes.
//!
//! Baselines: the `gemm` crate's f32 GEMM on the same (M, N, K) with pre-dequantized operands;
//! a plain read of the same FP4 weight + scale bytes; the crate's scalar reference (M = 1); peak
//! loops of `vpdpbusd`, of the AVX2 `vpmaddubsw` chain and of f32 FMA, in `peak/ops`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use paged_qkv::fast::{matmul_fp4_packed, qkv_fp4_ragged_packed};
use paged_qkv::formats::quantize::{amax, dequantize, nvfp4_global_scale, quantize};
use paged_qkv::formats::{BlockFormat, QuantizedMatrix};
use paged_qkv::{
    Accumulation, Exec, Isa, KvWrite, PackedWeights, PageTable, QkvFp4Args, QkvFp4PackedArgs, bf16, reference,
};
use std::hint::black_box;

#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::*;

fn quant(format: BlockFormat, x: &[f32], rows: usize, k: usize) -> QuantizedMatrix {
    quantize(format, x, rows, k, nvfp4_global_scale(amax(x))).unwrap()
}

fn fused(a: &QuantizedMatrix, w: &PackedWeights, q_dim: usize, out: &mut [bf16], c: &mut Cache, exec: Exec) {
    let m = a.rows();
    let offsets = [0, m as u32];
    let args = QkvFp4PackedArgs::new(a.as_ref(), &offsets, w, q_dim).with_tensor_sf(a.tensor_scale() * w_scale());
    let table = PageTable::new(&c.lookup, c.lookup.len(), &c.lens).unwrap();
    let mut kv = KvWrite::new(c.cache.view_mut(), table, 0);
    qkv_fp4_ragged_packed(&args, out, &mut kv, exec).unwrap();
}

fn w_scale() -> f32 {
    1.0
}

#[path = "common/exec.rs"]
mod exec;
use exec::exec;

fn gemm_f32(m: usize, n: usize, k: usize, a: &[f32], w: &[f32], out: &mut [f32], threads: usize) {
    let par = if threads == 1 { gemm::Parallelism::None } else { gemm::Parallelism::Rayon(threads) };
    // SAFETY: a is [m, k], w is [n, k] (read as Wᵀ: row stride 1, column stride k), out is [m, n],
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
            a.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        )
    }
}

/// GFLOP/s of the fused op and of `gemm` f32, for each model, M, thread count and format.
fn compute(c: &mut Criterion) {
    for model in [LLAMA, QWEN] {
        let (k, n) = (model.k, model.n());
        let wf = random(n * k, 1);
        let wq: Vec<(BlockFormat, PackedWeights, QuantizedMatrix)> =
            [BlockFormat::Nvfp4, BlockFormat::Mxfp4, BlockFormat::Mxfp8]
                .into_iter()
                .map(|f| {
                    let q = quant(f, &wf, n, k);
                    (f, PackedWeights::new(q.as_ref()), q)
                })
                .collect();
        let w_deq = dequantize(wq[0].2.as_ref(), wq[0].2.tensor_scale());
        for m in [1usize, 8, 64, 512] {
            let af = random(m * k, 2 + m as u64);
            let mut g = setup_group(c, &format!("{}/m{m}/flop", model.name));
            g.throughput(Throughput::Elements((2 * m * n * k) as u64));
            for threads in [1usize, 2] {
                let p = pool(threads);
                for (f, pw, _) in &wq {
                    let a = quant(*f, &af, m, k);
                    let mut out = vec![bf16::ZERO; m * model.q_dim()];
                    let mut cache = cache_for(&model, m);
                    g.bench_function(format!("fused_{}_t{threads}", f.name()), |b| {
                        p.install(|| b.iter(|| fused(&a, pw, model.q_dim(), &mut out, &mut cache, exec())))
                    });
                    if *f == BlockFormat::Nvfp4 && m >= 64 {
                        let mut plain = vec![bf16::ZERO; m * n];
                        g.bench_function(format!("plain_matrix_{}_t{threads}", f.name()), |b| {
                            p.install(|| b.iter(|| matmul_fp4_packed(a.as_ref(), pw, 1.0, &mut plain, exec()).unwrap()))
                        });
                    }
                }
                let a_deq = dequantize(quant(BlockFormat::Nvfp4, &af, m, k).as_ref(), 1.0);
                let mut out = vec![0f32; m * n];
                g.bench_function(format!("gemm_f32_t{threads}"), |b| {
                    p.install(|| b.iter(|| gemm_f32(m, n, k, &a_deq, &w_deq, &mut out, threads)))
                });
            }
            if m == 1 {
                let (f, _, wq0) = &wq[0];
                let a = quant(*f, &af, m, k);
                let mut out = vec![bf16::ZERO; model.q_dim()];
                let mut cache = cache_for(&model, 1);
                g.bench_function("reference_sequential_nvfp4_t1", |b| {
                    b.iter(|| {
                        let args =
                            QkvFp4Args::new(a.as_ref(), &[0, 1], wq0.as_ref(), model.q_dim()).with_tensor_sf(1.0);
                        let table = PageTable::new(&cache.lookup, cache.lookup.len(), &cache.lens).unwrap();
                        let mut kv = KvWrite::new(cache.cache.view_mut(), table, 0);
                        reference::qkv_fp4_ragged(&args, &mut out, &mut kv, Accumulation::Sequential).unwrap()
                    })
                });
            }
            g.finish();
            if m == 512 && model.name == LLAMA.name {
                // The prefill targets' ratio to the peak loop of the instruction the kernel of the
                // ISA in use relies on, call by call (`common/paired.rs`).
                let gname = format!("paired/{}/m{m}/flop", model.name);
                let mut g = setup_group(c, &gname);
                let flop = (2 * m * n * k) as u64;
                for threads in [1usize, 2] {
                    let p = pool(threads);
                    for (f, pw, _) in &wq {
                        let Some((pname, _, per, l)) = peak_for(*f) else { continue };
                        let a = quant(*f, &af, m, k);
                        let mut out = vec![bf16::ZERO; m * model.q_dim()];
                        let mut cache = cache_for(&model, m);
                        let mut kern = || fused(&a, pw, model.q_dim(), &mut out, &mut cache, exec());
                        let mut base = || peak::call(l, threads);
                        let (id, pw) = (format!("fused_{}_t{threads}", f.name()), peak::ops(per) * threads as u64);
                        let kern = Side { name: &id, work: flop, run: &mut kern };
                        let peak = Side { name: &format!("{pname}_t{threads}"), work: pw, run: &mut base };
                        paired::run(&mut g, &gname, &p, kern, peak);
                    }
                }
                g.finish();
            }
        }
    }
}

/// M = 1 against a plain read of the same bytes: L3-hot (one layer) and from DRAM (cycling
/// through enough layers to exceed the last-level cache), and with 1/64 subnormal scales.
fn decode(c: &mut Criterion) {
    for model in [LLAMA, QWEN] {
        decode_model(c, model);
    }
}

fn decode_model(c: &mut Criterion, model: Model) {
    let (k, n) = (model.k, model.n());
    let wf = random(n * k, 1);
    let af = random(k, 9);
    for f in [BlockFormat::Nvfp4, BlockFormat::Mxfp4, BlockFormat::Mxfp8] {
        let q = quant(f, &wf, n, k);
        let raw_bytes = q.data().len() + q.scales().len();
        let pw = PackedWeights::new(q.as_ref());
        let layers = (400 << 20) / raw_bytes + 1; // > the 260 MiB last-level cache reported here
        let cold: Vec<PackedWeights> = (0..layers).map(|_| pw.clone()).collect();
        let cold_raw: Vec<Vec<u8>> = (0..layers).map(|_| [q.data(), q.scales()].concat()).collect();
        let hot_raw = [q.data(), q.scales()].concat();
        let a = quant(f, &af, 1, k);
        let mut out = vec![bf16::ZERO; model.q_dim()];
        let mut cache = cache_for(&model, 1);
        let mut g = setup_group(c, &format!("{}/decode_{}/bytes", model.name, f.name()));
        g.throughput(Throughput::Bytes(raw_bytes as u64));
        for threads in [1usize, 2] {
            let p = pool(threads);
            g.bench_function(format!("hot_fused_t{threads}"), |b| {
                p.install(|| b.iter(|| fused(&a, &pw, model.q_dim(), &mut out, &mut cache, exec())))
            });
            g.bench_function(format!("hot_read_t{threads}"), |b| {
                p.install(|| b.iter(|| black_box(plain_read_par(&hot_raw, threads))))
            });
            let mut i = 0;
            g.bench_function(format!("dram_fused_t{threads}"), |b| {
                p.install(|| {
                    b.iter(|| {
                        i = (i + 1) % layers;
                        fused(&a, &cold[i], model.q_dim(), &mut out, &mut cache, exec())
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
        if f == BlockFormat::Nvfp4 {
            // 1 in 64 weight scales subnormal (E4M3 0x01..0x07), the rest as quantized.
            let lay = q.as_ref().scale_layout();
            let (data, mut scales, ts) = q.clone().into_parts();
            for r in 0..n {
                for kb in (r % 64..lay.k_blocks()).step_by(64) {
                    scales[lay.offset(r, kb)] = 1 + (kb % 7) as u8;
                }
            }
            let qs = QuantizedMatrix::from_parts(f, n, k, data, scales, ts).unwrap();
            let pws = PackedWeights::new(qs.as_ref());
            let p = pool(1);
            g.bench_function("hot_fused_subnormal_scales_t1", |b| {
                p.install(|| b.iter(|| fused(&a, &pws, model.q_dim(), &mut out, &mut cache, exec())))
            });
        }
        g.finish();
        // The targets' ratios call by call (`common/paired.rs`): from DRAM, each call on its own
        // cold layer paired with a read of another; L3-hot, the one layer against a read of its
        // bytes. Equal work on both sides, so the inverse of the ratio is the time ratio.
        let gname = format!("paired/{}/decode_{}/bytes", model.name, f.name());
        let mut g = setup_group(c, &gname);
        let b = raw_bytes as u64;
        for threads in [1usize, 2] {
            let p = pool(threads);
            let mut kern = |i: usize| fused(&a, &cold[i], model.q_dim(), &mut out, &mut cache, exec());
            let mut read = |j: usize| {
                black_box(plain_read_par(&cold_raw[j], threads));
            };
            paired::dram(&mut g, &gname, &p, threads, layers, b, &mut kern, &mut read);
            let mut kern = || fused(&a, &pw, model.q_dim(), &mut out, &mut cache, exec());
            let mut base = || {
                black_box(plain_read_par(&hot_raw, threads));
            };
            let id = format!("hot_fused_t{threads}");
            let (kern, base) =
                (Side { name: &id, work: b, run: &mut kern }, Side { name: "hot_read", work: b, run: &mut base });
            paired::run(&mut g, &gname, &p, kern, base);
        }
        g.finish();
        // Two rows (two sequences decoding together, or two tokens of one): the decode kernels
        // take both rows in one call on AVX-512, so the weight bytes are still read once.
        let gname = format!("paired/{}/decode2_{}/bytes", model.name, f.name());
        let mut g = setup_group(c, &gname);
        let a2 = quant(f, &random(2 * k, 11), 2, k);
        let mut out2 = vec![bf16::ZERO; 2 * model.q_dim()];
        let mut cache2 = cache_for(&model, 2);
        for threads in [1usize, 2] {
            let p = pool(threads);
            let mut kern = |i: usize| fused(&a2, &cold[i], model.q_dim(), &mut out2, &mut cache2, exec());
            let mut read = |j: usize| {
                black_box(plain_read_par(&cold_raw[j], threads));
            };
            paired::dram(&mut g, &gname, &p, threads, layers, b, &mut kern, &mut read);
        }
        g.finish();
    }
}

#[path = "common/peak.rs"]
mod peak;

#[path = "common/paired.rs"]
mod paired;
use paired::Side;

/// The peak loop the `format` kernels of the ISA in use rely on: `vpdpbusd` (AVX-512 VNNI) or
/// the `vpmaddubsw` chain (AVX2) for the FP4 formats, f32 FMA of the vector width for MXFP8;
/// `None` off x86 or below AVX2.
fn peak_for(format: BlockFormat) -> Option<peak::Peak> {
    let unit = if format == BlockFormat::Mxfp8 { peak::Unit::Fma } else { peak::Unit::Int8Dot };
    peak::for_isa(exec().isa.unwrap_or_else(Isa::best), unit)
}

/// The peaks the targets are stated against: `vpdpbusd` (AVX-512 VNNI) and the AVX2
/// `vpmaddubsw` + `vpaddw` chain for the FP4 formats, f32 FMA (zmm, ymm) for MXFP8, per thread
/// count; ops count a multiply-add as 2, like FLOP.
fn peaks(c: &mut Criterion) {
    let mut g = setup_group(c, "peak/ops");
    peak::run(&mut g, &["vpdpbusd_zmm", "maddubs_ymm", "fma_zmm", "fma_ymm"]);
    g.finish();
}

/// Quantizing a decode call's activations (what an NVFP4/MX server does before every call):
/// elements per second of `quantize` from f32 and bf16, for each model's K and M = 1, 8, 64. One
/// thread (the quantizer runs on the calling thread).
fn quantizer(c: &mut Criterion) {
    for model in [LLAMA, QWEN] {
        let k = model.k;
        for m in [1usize, 8, 64] {
            let x = random(m * k, 9 + m as u64);
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let mut g = setup_group(c, &format!("quantize/{}/m{m}/elements", model.name));
            g.throughput(Throughput::Elements((m * k) as u64));
            for f in [BlockFormat::Nvfp4, BlockFormat::Mxfp4, BlockFormat::Mxfp8] {
                let gs = nvfp4_global_scale(amax(&x));
                g.bench_function(format!("{}/f32", f.name()), |b| {
                    b.iter(|| black_box(quantize(f, black_box(&x), m, k, gs).unwrap()))
                });
                g.bench_function(format!("{}/bf16", f.name()), |b| {
                    b.iter(|| black_box(quantize(f, black_box(&xb), m, k, gs).unwrap()))
                });
            }
            g.finish();
        }
    }
}

criterion_group!(benches, peaks, decode, compute, quantizer);
criterion_main!(benches);
