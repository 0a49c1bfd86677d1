//! Peak loops of the instructions the kernels rely on, shared by the benches (`#[path]`): 12
//! independent accumulator chains of one instruction (16 for `vdpbf16ps`), more than its latency
//! × throughput, no memory operands; 24 · ITERS instructions per call. Each bench reports its
//! kernels' ratio to the peak measured in the same run (the machine is shared: only ratios within
//! a run mean much).
#![allow(dead_code)] // each bench uses some of the loops

use criterion::{BenchmarkGroup, Throughput, measurement::WallTime};
use std::hint::black_box;

pub const ITERS: usize = 1 << 16;

/// Operations (a multiply-add counts 2) of one call of a loop whose instruction does `per`.
pub fn ops(per_instr: usize) -> u64 {
    (ITERS * 24 * per_instr) as u64
}

/// A peak loop: its name, the CPU features it needs, operations per instruction, and the loop.
pub type Peak = (&'static str, &'static [&'static str], usize, fn() -> f32);

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::hint::black_box;

    use super::ITERS;

    // Explicit loops (a closure inside a `#[target_feature]` function does not inherit the
    // features, and its intrinsics would become calls).
    #[target_feature(enable = "avx512f")]
    pub fn fma_zmm() -> f32 {
        fma_zmm_n::<ITERS>()
    }

    /// [`fma_zmm`] of `24 · I` instructions.
    #[target_feature(enable = "avx512f")]
    pub fn fma_zmm_n<const I: usize>() -> f32 {
        let (x, y) = (_mm512_set1_ps(1.0001), _mm512_set1_ps(0.9999));
        let mut a = [_mm512_setzero_ps(); 12]; // 24 made the compiler rotate registers through moves
        for _ in 0..2 * I {
            for v in a.iter_mut() {
                *v = _mm512_fmadd_ps(x, y, *v);
            }
        }
        a.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn fma_ymm() -> f32 {
        fma_ymm_n::<ITERS>()
    }

    /// [`fma_ymm`] of `24 · I` instructions.
    #[target_feature(enable = "avx2,fma")]
    pub fn fma_ymm_n<const I: usize>() -> f32 {
        let (x, y) = (_mm256_set1_ps(1.0001), _mm256_set1_ps(0.9999));
        let mut a = [_mm256_setzero_ps(); 12];
        for _ in 0..2 * I {
            for v in a.iter_mut() {
                *v = _mm256_fmadd_ps(x, y, *v);
            }
        }
        let mut o = [0f32; 8];
        let s = a.iter().fold(_mm256_setzero_ps(), |s, &v| _mm256_add_ps(s, v));
        // SAFETY: o holds 8 f32.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), s) };
        o.iter().sum()
    }

    /// 16 chains, not 12: on Zen 5 `vdpbf16ps` runs two per cycle at a latency of ~6, so 12 chains
    /// had no slack and ran at ~93 % of the rate of 16 (a driver, unrolled 12/16/20/24 chains:
    /// 460 / 490 / 494 / 495 GFLOP/s on one core). Written out as 16 locals: a 16-element array
    /// made the compiler keep some chains on the stack.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub fn dpbf16() -> f32 {
        // SAFETY: __m512i and __m512bh are both 64 plain bytes.
        let (x, y): (__m512bh, __m512bh) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3F80_3F80)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3F80_3F81)),
            )
        };
        macro_rules! chains {
            ($($a:ident)*) => {{
                $(let mut $a = _mm512_setzero_ps();)*
                // 16 per iteration: 24 · ITERS instructions, as every loop here.
                for _ in 0..3 * ITERS / 2 {
                    $($a = _mm512_dpbf16_ps($a, x, y);)*
                }
                0.0 $(+ _mm512_reduce_add_ps($a))*
            }};
        }
        chains!(a0 a1 a2 a3 a4 a5 a6 a7 a8 a9 a10 a11 a12 a13 a14 a15)
    }

    /// `vpdpbusd` zmm: 64 u8 × i8 multiply-adds per instruction. The operands are opaque
    /// (`black_box`): with constants the compiler folded the loop away.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub fn dpbusd_zmm() -> f32 {
        let (x, y) = (black_box(_mm512_set1_epi8(3)), black_box(_mm512_set1_epi8(-2)));
        let mut a = [_mm512_setzero_si512(); 12];
        for _ in 0..2 * ITERS {
            for v in a.iter_mut() {
                *v = _mm512_dpbusd_epi32(*v, x, y);
            }
        }
        a.iter().map(|&v| _mm512_reduce_add_epi32(v) as f32).sum()
    }

    /// The AVX2 int8 chain of the FP4 kernel: `vpmaddubsw` (32 u8 × i8 multiply-adds) into a
    /// `vpaddw` accumulator; 12 chains, the pair counted as one instruction. The multiply reads
    /// its chain's accumulator (a loop-invariant product would be hoisted out of the loop); 12
    /// chains cover the pair's latency (6) × `vpmaddubsw`'s throughput (2 per cycle).
    #[target_feature(enable = "avx2")]
    pub fn maddubs_ymm() -> f32 {
        let y = black_box(_mm256_set1_epi8(-2));
        let mut a: [__m256i; 12] = std::array::from_fn(|i| black_box(_mm256_set1_epi8(i as i8)));
        for _ in 0..2 * ITERS {
            for v in a.iter_mut() {
                *v = _mm256_add_epi16(*v, _mm256_maddubs_epi16(*v, y));
            }
        }
        let s = a.iter().fold(_mm256_setzero_si256(), |s, &v| _mm256_add_epi16(s, v));
        _mm256_extract_epi16::<0>(s) as f32
    }
}

/// The loops this CPU can run.
#[cfg(target_arch = "x86_64")]
pub fn loops() -> Vec<Peak> {
    // Each loop runs only after `available` found its features (the filter below, and `run`).
    let all: [Peak; 5] = [
        // SAFETY: AVX-512 F checked (above).
        ("fma_zmm", &["avx512f"], 32, || unsafe { x86::fma_zmm() }),
        // SAFETY: AVX2 and FMA checked (above).
        ("fma_ymm", &["avx2", "fma"], 16, || unsafe { x86::fma_ymm() }),
        // SAFETY: AVX-512 F and BF16 checked (above).
        ("vdpbf16ps_zmm", &["avx512f", "avx512bf16"], 64, || unsafe { x86::dpbf16() }),
        // SAFETY: AVX-512 F, BW and VNNI checked (above).
        ("vpdpbusd_zmm", &["avx512f", "avx512bw", "avx512vnni"], 128, || unsafe { x86::dpbusd_zmm() }),
        // SAFETY: AVX2 checked (above).
        ("maddubs_ymm", &["avx2"], 64, || unsafe { x86::maddubs_ymm() }),
    ];
    all.into_iter().filter(|p| p.1.iter().all(|f| available(f))).collect()
}

#[cfg(target_arch = "x86_64")]
fn available(f: &str) -> bool {
    match f {
        "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
        "avx512bw" => std::arch::is_x86_feature_detected!("avx512bw"),
        "avx512vnni" => std::arch::is_x86_feature_detected!("avx512vnni"),
        "avx512bf16" => std::arch::is_x86_feature_detected!("avx512bf16"),
        "fma" => std::arch::is_x86_feature_detected!("fma"),
        "avx2" => std::arch::is_x86_feature_detected!("avx2"),
        _ => false,
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub fn loops() -> Vec<Peak> {
    Vec::new()
}

/// The instruction a kernel's inner loop is built on, for [`for_isa`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// f32 FMA of the vector width (the f32/f16 kernels, MXFP8, RoPE's rotation).
    Fma,
    /// `vdpbf16ps` where the ISA uses it for bf16 (`Avx512Bf16`), else f32 FMA.
    Bf16Dot,
    /// The int8 dot products of the FP4 kernels: `vpdpbusd`, or the AVX2 `vpmaddubsw` chain.
    Int8Dot,
}

/// The name of the peak loop of `unit` on `isa`; `None` below AVX2 (no loop here).
pub fn name_for(isa: paged_qkv::Isa, unit: Unit) -> Option<&'static str> {
    use paged_qkv::Isa;
    Some(match (isa, unit) {
        (Isa::Avx512Bf16, Unit::Bf16Dot) => "vdpbf16ps_zmm",
        (Isa::Avx512 | Isa::Avx512Bf16, Unit::Int8Dot) => "vpdpbusd_zmm",
        (Isa::Avx512 | Isa::Avx512Bf16, _) => "fma_zmm",
        (Isa::Avx2, Unit::Int8Dot) => "maddubs_ymm",
        (Isa::Avx2, _) => "fma_ymm",
        _ => return None,
    })
}

/// The peak loop of `unit` on `isa` ([`name_for`]), where this CPU can run it.
pub fn for_isa(isa: paged_qkv::Isa, unit: Unit) -> Option<Peak> {
    let name = name_for(isa, unit)?;
    loops().into_iter().find(|l| l.0 == name)
}

/// Iterations of the short FMA loops ([`fma_short`]): `24 · SHORT_ITERS` instructions per call,
/// ~3 µs on a 4 GHz core, so that a call of a few µs can be paired with a few of them.
pub const SHORT_ITERS: usize = 1 << 10;

/// The FMA peak loop of `isa` ([`for_isa`] with [`Unit::Fma`]), short ([`SHORT_ITERS`]): its f32
/// lanes per instruction and the loop; `None` where that gives none.
#[cfg(target_arch = "x86_64")]
pub fn fma_short(isa: paged_qkv::Isa) -> Option<(usize, fn() -> f32)> {
    // `for_isa` found the loop among `loops()`, which checked its features.
    match for_isa(isa, Unit::Fma)?.0 {
        // SAFETY: AVX-512 F checked by `loops()`.
        "fma_zmm" => Some((16, || unsafe { x86::fma_zmm_n::<SHORT_ITERS>() })),
        // SAFETY: AVX2 and FMA checked by `loops()`.
        "fma_ymm" => Some((8, || unsafe { x86::fma_ymm_n::<SHORT_ITERS>() })),
        _ => None,
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub fn fma_short(_: paged_qkv::Isa) -> Option<(usize, fn() -> f32)> {
    None
}

/// One call of a peak loop on each of `threads` (1 or 2) threads of the current pool.
pub fn call(f: fn() -> f32, threads: usize) {
    if threads == 1 {
        black_box(f());
    } else {
        black_box(rayon::join(f, f));
    }
}

/// Benches the named loops (those this CPU has) at 1 and 2 threads in group `g`.
pub fn run(g: &mut BenchmarkGroup<'_, WallTime>, names: &[&str]) {
    for (name, _, per, f) in loops().into_iter().filter(|p| names.contains(&p.0)) {
        for threads in [1usize, 2] {
            let p = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            g.throughput(Throughput::Elements(ops(per) * threads as u64));
            g.bench_function(format!("{name}_t{threads}"), |b| p.install(|| b.iter(|| call(f, threads))));
        }
    }
}
