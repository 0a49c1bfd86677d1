//! Paired measurement, shared by the benches (`#[path]`): a kernel and its baseline (a peak loop,
//! a plain read or copy of the same bytes, another call of the op) run alternately, call by call,
//! and the ratio of their rates is taken per pair.
//!
//! Why: on the shared VMs these benches run on, the rate a core gives moves by ±15–50 % within
//! minutes. A ratio between two criterion groups measured a minute apart mixes that drift into
//! the kernel's figure (AMD Zen 3, 2026-12-02: forced AVX2 f32 at M = 512 on two threads read
//! 71 % of a peak loop measured a minute before it, 82–85 % of one measured between its calls).
//! A pair run back to back sees the same machine, so the median of the per-pair ratios is the
//! figure the targets are stated in; criterion still reports the kernel's own time, measured
//! while paired.
//!
//! Each sample runs on the pool's threads as one job (as an unpaired group's `p.install(|| b.iter
//! (…))` does: a job per call would add a wake-up of the pool and let the OS move it between
//! cores, which slowed µs-long copies up to ~3×), each timed run follows an untimed run of the same
//! side (warm caches, as in an unpaired group), and which side runs first alternates.

use criterion::{BenchmarkGroup, Throughput, measurement::WallTime};
use std::time::{Duration, Instant};

/// One side of a pair: its name, the units of work one call does, and the call (run on the
/// pool's threads).
pub struct Side<'a> {
    pub name: &'a str,
    pub work: u64,
    pub run: &'a mut (dyn FnMut() + Send),
}

/// Benches `kernel` as `kernel.name` in `g` (named `group`) on `pool`, each call paired with the
/// baseline repeated to take about half the kernel's time, and prints the median and quartiles of
/// the per-pair ratio kernel rate ÷ baseline rate (rate: work per second; with equal work, the
/// inverse is the kernel's time as a multiple of the baseline's).
pub fn run(
    g: &mut BenchmarkGroup<'_, WallTime>,
    group: &str,
    pool: &rayon::ThreadPool,
    kernel: Side<'_>,
    base: Side<'_>,
) {
    let (id, kernel_work, kernel) = (kernel.name, kernel.work, kernel.run);
    let (base_name, base_work, base) = (base.name, base.work, base.run);
    let time = |f: &mut (dyn FnMut() + Send), n: u32| {
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        t.elapsed()
    };
    let mut reps = 0u32; // calibrated on the first call (none when the filter skips `id`)
    // Per pair: kernel rate, baseline rate.
    let mut pairs: Vec<(f64, f64)> = Vec::new();
    g.throughput(Throughput::Elements(kernel_work));
    // 20 samples: a call of ~0.4 s (Llama-3-8B at M = 512) then gives 21 pairs. With 11, an A/A
    // pairing (the same call on both sides) read 1.045 on Zen 3: the median's noise at that size.
    g.sample_size(20);
    g.bench_function(id, |b| {
        b.iter_custom(|iters| {
            pool.install(|| {
                if reps == 0 {
                    // One warm call of each, then the repetitions that take about half the
                    // kernel's time.
                    kernel();
                    base();
                    let (tk, tb) = (time(kernel, 1), time(base, 1));
                    reps = ((tk.as_secs_f64() / 2.0 / tb.as_secs_f64().max(1e-9)).round() as u32).clamp(1, 100_000);
                }
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let (mut k, mut bt) = (Duration::ZERO, Duration::ZERO);
                    let order = if pairs.len().is_multiple_of(2) { [true, false] } else { [false, true] };
                    for kernel_side in order {
                        if kernel_side {
                            kernel();
                            k = time(kernel, 1);
                        } else {
                            base();
                            bt = time(base, reps);
                        }
                    }
                    total += k;
                    let rb = base_work as f64 * reps as f64 / bt.as_secs_f64();
                    pairs.push((kernel_work as f64 / k.as_secs_f64(), rb));
                }
                total
            })
        })
    });
    if pairs.is_empty() {
        return;
    }
    let sorted = |v: &mut dyn Iterator<Item = f64>| {
        let mut v: Vec<f64> = v.collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let at = |v: &[f64], f: f64| v[((v.len() - 1) as f64 * f).round() as usize];
    let ratios = sorted(&mut pairs.iter().map(|p| p.0 / p.1));
    let (lo, med, hi) = (at(&ratios, 0.25), at(&ratios, 0.5), at(&ratios, 0.75));
    let mk = at(&sorted(&mut pairs.iter().map(|p| p.0)), 0.5);
    let mb = at(&sorted(&mut pairs.iter().map(|p| p.1)), 0.5);
    println!(
        "{group}/{id} ÷ {base_name}: rate ratio median {med:.3} (quartiles {lo:.3}–{hi:.3}, {} pairs; \
         inverse {:.3}); medians {:.2} vs {:.2} G/s",
        pairs.len(),
        1.0 / med,
        mk / 1e9,
        mb / 1e9
    );
}

/// Decode from DRAM, paired: `kernel(i)` runs on cold layer `i` and `read(j)` reads cold layer
/// `j`, each cycling through `layers` from opposite halves (so neither finds the other's layer in
/// cache), as `dram_fused_t{threads}` against `dram_read`, `work` bytes each.
#[allow(clippy::too_many_arguments, dead_code)] // dead_code: the QKV benches use it, `rope` does not
pub fn dram(
    g: &mut BenchmarkGroup<'_, WallTime>,
    group: &str,
    pool: &rayon::ThreadPool,
    threads: usize,
    layers: usize,
    work: u64,
    kernel: &mut (dyn FnMut(usize) + Send),
    read: &mut (dyn FnMut(usize) + Send),
) {
    let (mut i, mut j) = (0, layers / 2);
    let mut kern = || {
        i = (i + 1) % layers;
        kernel(i)
    };
    let mut base = || {
        j = (j + 1) % layers;
        read(j)
    };
    let id = format!("dram_fused_t{threads}");
    run(g, group, pool, Side { name: &id, work, run: &mut kern }, Side { name: "dram_read", work, run: &mut base });
}
