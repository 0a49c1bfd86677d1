//! A server calls the packed fused QKV once per layer and step: in steady state (same shapes,
//! warm thread), those calls make no heap allocation. A counting global allocator proves it for
//! the block-scaled and the bf16 packed paths, with and without fused RoPE, into a bf16 or an
//! FP8-quantized cache, decode (M = 1) and a small prefill, sequential, on a one-thread rayon pool
//! and on a team; and for the standalone RoPE and KV store.

use paged_qkv::fast::{self, PackedPlainWeights, PackedWeights, QkvFp4PackedArgs, QkvRaggedPackedArgs};
use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
use paged_qkv::ops::{Freqs, QkvRope};
use paged_qkv::{
    BlockFormat, CacheShape, E4M3, Exec, Isa, KvScales, KvSel, KvStoreRaggedArgs, KvWrite, PageTable, PagedKvCache,
    Par, RopeMath, RopeRaggedArgs, bf16,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Counts allocations made by the current thread while `COUNTING` is set on it.
struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
}

fn note() {
    // `try_with`: the allocator also runs while thread-locals are torn down.
    let _ = COUNTING.try_with(|c| {
        if c.get() {
            let _ = COUNT.try_with(|n| n.set(n.get() + 1));
        }
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: forwarded as is (the caller upholds `GlobalAlloc::alloc`'s contract).
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: forwarded as is.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: forwarded as is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Allocations `f` makes on this thread.
fn allocations(f: impl FnOnce()) -> usize {
    COUNT.with(|n| n.set(0));
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    COUNT.with(|n| n.get())
}

/// The counter counts (the tests below would pass vacuously otherwise).
#[test]
fn the_counter_sees_an_allocation() {
    let n = allocations(|| {
        std::hint::black_box(Vec::<u8>::with_capacity(64));
    });
    assert_eq!(n, 1);
}

const K: usize = 256;
const HEAD: usize = 64;
const HQ: usize = 4;
const HKV: usize = 2;

fn weights() -> Vec<f32> {
    let n = (HQ + 2 * HKV) * HEAD;
    (0..n * K).map(|i| ((i as f32) * 0.37).sin()).collect()
}

/// Runs `call(m, exec)` a few times to warm up, then returns the allocations of 5 more calls, for
/// each row count of `ms`. On a `Workers` team (its own, of three threads), which thread runs
/// which task varies from call to call, so a helper may meet a task shape for the first time
/// (and size its buffers) after the warm-up: there the count is the fewest of up to ten windows
/// of 5 calls, a steady state reached within them.
fn steady(ms: &[usize], mut call: impl FnMut(usize, Exec) + Send) -> Vec<(usize, Par, Isa, usize)> {
    let mut found = Vec::new();
    for isa in Isa::available() {
        let team: &'static paged_qkv::Workers = Box::leak(Box::new(paged_qkv::Workers::new(3).unwrap()));
        for par in [Par::Sequential, Par::Rayon, Par::Workers(team)] {
            for &m in ms {
                let exec = Exec { par, isa: Some(isa) };
                let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
                pool.install(|| {
                    for _ in 0..4 {
                        call(m, exec);
                    }
                    let windows = if matches!(par, Par::Workers(_)) { 10 } else { 1 };
                    let mut n = usize::MAX;
                    for _ in 0..windows {
                        n = n.min(allocations(|| {
                            for _ in 0..5 {
                                call(m, exec);
                            }
                        }));
                        if n == 0 {
                            break;
                        }
                    }
                    found.push((m, par, isa, n));
                });
            }
        }
    }
    found
}

fn rope_table() -> Vec<f32> {
    paged_qkv::freqs_cis(64, HEAD, 10000.0)
}

/// Fused RoPE over whole heads of `HEAD` dims.
fn qkv_rope(freqs: &[f32]) -> QkvRope<'_> {
    QkvRope::new(Freqs::F32(freqs), HEAD, HEAD, false).with_math(RopeMath::F32)
}

/// NVFP4 and MXFP8 (whose tiles of 16 rows or more decode their weights into a per-thread buffer).
#[test]
fn packed_fp4_calls_do_not_allocate_in_steady_state() {
    let w = weights();
    let n = w.len() / K;
    let ms = [1usize, 9, 20];
    let x: Vec<f32> = (0..20 * K).map(|i| ((i as f32) * 0.11).cos()).collect();
    let freqs = rope_table();
    let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(8, 1, 16, HKV, HEAD).unwrap());
    let mut q = vec![bf16::ZERO; 20 * HQ * HEAD];
    for format in [BlockFormat::Nvfp4, BlockFormat::Mxfp8] {
        let packed = PackedWeights::new(quantize(format, &w, n, K, nvfp4_global_scale(amax(&w))).unwrap().as_ref());
        let acts: Vec<_> =
            ms.iter().map(|&m| quantize(format, &x[..m * K], m, K, nvfp4_global_scale(amax(&x))).unwrap()).collect();
        for with_rope in [false, true] {
            let found = steady(&ms, |m, exec| {
                let a = &acts[ms.iter().position(|&x| x == m).unwrap()];
                let offsets = [0u32, m as u32];
                let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[0, 1], 2, &[3]).unwrap(), 0);
                let rope = with_rope.then(|| qkv_rope(&freqs));
                let args = QkvFp4PackedArgs::new(a.as_ref(), &offsets, &packed, HQ * HEAD).maybe_rope(rope);
                fast::qkv_fp4_ragged_packed(&args, &mut q[..m * HQ * HEAD], &mut kv, exec).unwrap();
            });
            assert!(
                found.iter().all(|f| f.3 == 0),
                "{format:?} rope {with_rope}: (M, par, ISA, allocations) {found:?}"
            );
        }
        // Into an FP8-quantized cache (scales per 64 values), with fused RoPE: staged, then
        // quantized into the slots.
        let mut codes = PagedKvCache::<E4M3>::zeros(CacheShape::mha(8, 1, 16, HKV, HEAD).unwrap());
        let mut scales = KvScales::zeros(codes.shape(), 64).unwrap();
        let found = steady(&ms, |m, exec| {
            let a = &acts[ms.iter().position(|&x| x == m).unwrap()];
            let offsets = [0u32, m as u32];
            let table = PageTable::new(&[0, 1], 2, &[3]).unwrap();
            let mut kv = KvWrite::new(codes.view_mut(), table, 0).with_scales(scales.view_mut());
            let args = QkvFp4PackedArgs::new(a.as_ref(), &offsets, &packed, HQ * HEAD).with_rope(qkv_rope(&freqs));
            fast::qkv_fp4_ragged_packed(&args, &mut q[..m * HQ * HEAD], &mut kv, exec).unwrap();
        });
        assert!(found.iter().all(|f| f.3 == 0), "{format:?} quantized cache: (M, par, ISA, allocations) {found:?}");
    }
}

/// FP8 W8A8, every scale granularity (the block scales' tiled kernel stages its partial sums in
/// a per-thread buffer).
#[test]
fn packed_fp8_calls_do_not_allocate_in_steady_state() {
    use paged_qkv::fast::{PackedFp8Weights, QkvFp8PackedArgs};
    use paged_qkv::formats::fp8::e4m3_from_f32;
    use paged_qkv::ops::Fp8Scales;
    let w: Vec<u8> = weights().into_iter().map(|v| e4m3_from_f32(v * 64.0)).collect();
    let n = w.len() / K;
    let packed = PackedFp8Weights::new(&w, K).unwrap();
    let ms = [1usize, 9, 20];
    let x: Vec<u8> = (0..20 * K).map(|i| e4m3_from_f32(((i as f32) * 0.11).cos() * 64.0)).collect();
    let freqs = rope_table();
    let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(8, 1, 16, HKV, HEAD).unwrap());
    let mut q = vec![bf16::ZERO; 20 * HQ * HEAD];
    let (kb, nb) = (K.div_ceil(128), n.div_ceil(128));
    let rows: Vec<f32> = (0..20.max(n)).map(|i| 0.01 + i as f32 * 1e-4).collect();
    let blocks: Vec<f32> = (0..kb * 20.max(nb)).map(|i| 0.01 + i as f32 * 1e-4).collect();
    for gran in 0..3 {
        let found = steady(&ms, |m, exec| {
            let scales = match gran {
                0 => Fp8Scales::Tensor { input: 0.02, weight: 0.03 },
                1 => Fp8Scales::Channel { input: &rows[..m], weight: &rows[..n] },
                _ => Fp8Scales::Block { input: &blocks[..kb * m], weight: &blocks[..nb * kb] },
            };
            let offsets = [0u32, m as u32];
            let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[0, 1], 2, &[3]).unwrap(), 0);
            let args = QkvFp8PackedArgs::<bf16>::new(&x[..m * K], &offsets, &packed, scales, HQ * HEAD)
                .with_rope(qkv_rope(&freqs));
            fast::qkv_fp8_ragged_packed(&args, &mut q[..m * HQ * HEAD], &mut kv, exec).unwrap();
        });
        assert!(found.iter().all(|f| f.3 == 0), "granularity {gran}: (M, par, ISA, allocations) {found:?}");
    }
}

#[test]
fn packed_bf16_calls_do_not_allocate_in_steady_state() {
    let w: Vec<bf16> = weights().into_iter().map(bf16::from_f32).collect();
    let packed = PackedPlainWeights::new(&w, K).unwrap();
    // M = 64: several row blocks, packed on the pool.
    let x: Vec<bf16> = (0..64 * K).map(|i| bf16::from_f32(((i as f32) * 0.11).cos())).collect();
    let freqs = paged_qkv::freqs_cis(128, HEAD, 10000.0);
    let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(8, 1, 16, HKV, HEAD).unwrap());
    let mut q = vec![bf16::ZERO; 64 * HQ * HEAD];
    let lookup: Vec<u32> = (0..8).collect();
    for with_rope in [false, true] {
        let found = steady(&[1, 9, 64], |m, exec| {
            let offsets = [0u32, m as u32];
            let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&lookup, 8, &[3]).unwrap(), 0);
            let rope = with_rope.then(|| qkv_rope(&freqs));
            let args = QkvRaggedPackedArgs::new(&x[..m * K], &offsets, &packed, HQ * HEAD).maybe_rope(rope);
            fast::qkv_ragged_packed(&args, &mut q[..m * HQ * HEAD], &mut kv, exec).unwrap();
        });
        assert!(found.iter().all(|f| f.3 == 0), "rope {with_rope}: (M, par, ISA, allocations) {found:?}");
    }
    // The same calls into an FP8-quantized cache (scales per 64 values): the rows staged in bf16,
    // then quantized into their slots.
    let mut codes = PagedKvCache::<E4M3>::zeros(CacheShape::mha(8, 1, 16, HKV, HEAD).unwrap());
    let mut scales = KvScales::zeros(codes.shape(), 64).unwrap();
    for with_rope in [false, true] {
        let found = steady(&[1, 9, 64], |m, exec| {
            let offsets = [0u32, m as u32];
            let table = PageTable::new(&lookup, 8, &[3]).unwrap();
            let mut kv = KvWrite::new(codes.view_mut(), table, 0).with_scales(scales.view_mut());
            let rope = with_rope.then(|| qkv_rope(&freqs));
            let args = QkvRaggedPackedArgs::new(&x[..m * K], &offsets, &packed, HQ * HEAD).maybe_rope(rope);
            fast::qkv_ragged_packed(&args, &mut q[..m * HQ * HEAD], &mut kv, exec).unwrap();
        });
        assert!(
            found.iter().all(|f| f.3 == 0),
            "quantized cache, rope {with_rope}: (M, par, ISA, allocations) {found:?}"
        );
    }
}

/// The standalone RoPE (both pairings; and on a quantized cache) and the KV store, up to a 200-row prefill (slot validation
/// sorted with a stable sort, which allocates a buffer for that many rows).
#[test]
fn rope_and_kv_store_calls_do_not_allocate_in_steady_state() {
    const M: usize = 200;
    let freqs = paged_qkv::freqs_cis(256, HEAD, 10000.0);
    let q: Vec<bf16> = (0..M * HQ * HEAD).map(|i| bf16::from_f32(((i as f32) * 0.21).sin())).collect();
    let mut out = vec![bf16::ZERO; q.len()];
    let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(16, 1, 16, HKV, HEAD).unwrap());
    let lookup: Vec<u32> = (0..16).map(|i| (i * 7) % 16).collect();
    for interleaved in [false, true] {
        let found = steady(&[1, 9, M], |m, exec| {
            let offsets = [0u32, m as u32];
            let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&lookup, 16, &[3]).unwrap(), 0);
            let args = RopeRaggedArgs::new(&q[..m * HQ * HEAD], &offsets, (HQ, HEAD), &freqs, HEAD, interleaved);
            fast::rope_ragged(&args, &mut out[..m * HQ * HEAD], &mut kv, RopeMath::F32, exec).unwrap();
        });
        assert!(found.iter().all(|f| f.3 == 0), "interleaved {interleaved}: (M, par, ISA, allocations) {found:?}");
    }
    // The same RoPE on an FP8-quantized cache (scales per 64 values): dequantized, rotated and
    // requantized row by row, its K row staged without a heap buffer.
    let mut codes = PagedKvCache::<E4M3>::zeros(CacheShape::mha(16, 1, 16, HKV, HEAD).unwrap());
    let mut scales = KvScales::zeros(codes.shape(), 64).unwrap();
    let found = steady(&[1, 9, M], |m, exec| {
        let offsets = [0u32, m as u32];
        let table = PageTable::new(&lookup, 16, &[3]).unwrap();
        let mut kv = KvWrite::new(codes.view_mut(), table, 0).with_scales(scales.view_mut());
        let args = RopeRaggedArgs::new(&q[..m * HQ * HEAD], &offsets, (HQ, HEAD), &freqs, HEAD, false);
        fast::rope_ragged(&args, &mut out[..m * HQ * HEAD], &mut kv, RopeMath::F32, exec).unwrap();
    });
    assert!(found.iter().all(|f| f.3 == 0), "quantized cache: (M, par, ISA, allocations) {found:?}");
    let values: Vec<bf16> = (0..M * HKV * HEAD).map(|i| bf16::from_f32(((i as f32) * 0.3).cos())).collect();
    let found = steady(&[1, 9, M], |m, exec| {
        let offsets = [0u32, m as u32];
        let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&lookup, 16, &[3]).unwrap(), 0);
        let args = KvStoreRaggedArgs::new(&values[..m * HKV * HEAD], &offsets, KvSel::V);
        fast::kv_store_ragged(&args, &mut kv, exec).unwrap();
    });
    assert!(found.iter().all(|f| f.3 == 0), "kv store: (M, par, ISA, allocations) {found:?}");
}
