//! Differential fuzzing of every fast entry point against the scalar ISA (bit for bit) and the
//! oracle (the same errors with nothing written; on success the oracle's bits for RoPE and the KV
//! stores, the documented error bound for the matmuls), and of the writes into a quantized cache
//! (codes and scales bit for bit, errors with nothing written).
//! `cargo +nightly fuzz run fast_paths -- -max_total_time=60`
#![no_main]

use libfuzzer_sys::fuzz_target;
use paged_qkv::formats::scale_layout::ScaleLayout;
use paged_qkv::formats::{BlockFormat, QuantizedRef};
use paged_qkv::ops::{Freqs, QkvRope};
use paged_qkv::{
    Accumulation, CacheShape, E4M3, Element, Exec, Isa, KvScales, KvSel, KvStoreRaggedArgs, KvWrite, PageTable,
    PagedKvCache, Par, QkvBshdArgs, QkvFp4Args, QkvRaggedArgs, RopeMath, RopeRaggedArgs, bf16, fast, reference,
};

/// Bytes as a stream of small numbers.
struct Src<'a>(std::iter::Cycle<std::slice::Iter<'a, u8>>);
impl Src<'_> {
    fn byte(&mut self) -> u8 {
        *self.0.next().unwrap_or(&0)
    }
    fn below(&mut self, n: usize) -> usize {
        self.byte() as usize % n.max(1)
    }
}

/// The bits of an output and a cache, or the error.
type Run = Result<(Vec<u32>, Vec<u32>), paged_qkv::Error>;

/// The bits of each element, every NaN as one value: NaN results are NaN on every ISA, but their
/// sign and payload are not part of the promise (an FMA returns one of its NaN operands, and which
/// one depends on the instruction form; found by this target on a fused RoPE of NaN values).
fn bits<T: Element>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| if x.to_f32().is_nan() { u32::MAX } else { x.to_bits() }).collect()
}

/// Runs `f` on a fresh cache and output; an error must leave both unchanged.
fn run<O: Element, C: Element>(
    shape: CacheShape,
    out_len: usize,
    table: &PageTable<'_>,
    layer: usize,
    f: impl FnOnce(&mut [O], &mut KvWrite<'_, C>) -> paged_qkv::Result<()>,
) -> Run {
    let mut cache =
        PagedKvCache::<C>::from_vec(shape, (0..shape.len()).map(|i| C::from_f32(i as f32 * 0.25 - 3.0)).collect())
            .unwrap();
    let mut out: Vec<O> = (0..out_len).map(|i| O::from_f32(i as f32 * 0.5)).collect();
    let (c0, o0) = (bits(cache.data()), bits(&out));
    let r = {
        let mut kv = KvWrite::new(cache.view_mut(), *table, layer);
        f(&mut out, &mut kv)
    };
    match r {
        Ok(()) => Ok((bits(&out), bits(cache.data()))),
        Err(e) => {
            assert_eq!(bits(cache.data()), c0, "a failing call changed the cache: {e}");
            assert_eq!(bits(&out), o0, "a failing call changed the output: {e}");
            Err(e)
        }
    }
}

/// [`run`] into an FP8-quantized cache (E4M3 codes, scales per `g` elements, made for `scales_for`,
/// which may not be the cache's shape): an error leaves codes, scales and output unchanged; on
/// success the output's bits and the codes' then the scales' bits.
fn run_q<O: Element>(
    (shape, scales_for, g): (CacheShape, CacheShape, usize),
    out_len: usize,
    table: &PageTable<'_>,
    layer: usize,
    f: impl FnOnce(&mut [O], &mut KvWrite<'_, E4M3>) -> paged_qkv::Result<()>,
) -> Run {
    let codes = (0..shape.len()).map(|i| E4M3((i * 37 % 0x7E) as u8 | (i as u8 & 0x80))).collect();
    let mut cache = PagedKvCache::<E4M3>::from_vec(shape, codes).unwrap();
    let mut scales = KvScales::zeros(scales_for, g)?;
    let sv: Vec<f32> = (0..scales.data().len()).map(|i| (i % 7) as f32 * 0.125).collect();
    scales = KvScales::from_vec(scales_for, g, sv).unwrap();
    let mut out: Vec<O> = (0..out_len).map(|i| O::from_f32(i as f32 * 0.5)).collect();
    let (c0, s0, o0) = (bits(cache.data()), bits(scales.data()), bits(&out));
    let r = {
        let mut kv = KvWrite::new(cache.view_mut(), *table, layer).with_scales(scales.view_mut());
        f(&mut out, &mut kv)
    };
    match r {
        Ok(()) => Ok((bits(&out), bits(cache.data()).into_iter().chain(bits(scales.data())).collect())),
        Err(e) => {
            assert_eq!(bits(cache.data()), c0, "a failing call changed the codes: {e}");
            assert_eq!(bits(scales.data()), s0, "a failing call changed the scales: {e}");
            assert_eq!(bits(&out), o0, "a failing call changed the output: {e}");
            Err(e)
        }
    }
}

fn scalar() -> Exec {
    Exec { par: Par::Sequential, isa: Some(Isa::Scalar) }
}

/// Every available ISA gives the scalar ISA's result (bits or error); returns it.
fn all_isas(f: impl Fn(Exec) -> Run) -> Run {
    let base = f(scalar());
    for isa in Isa::available() {
        for par in [Par::Sequential, Par::Rayon, Par::Workers(paged_qkv::Workers::shared(3).unwrap())] {
            let got = f(Exec { par, isa: Some(isa) });
            match (&got, &base) {
                (Ok(g), Ok(b)) if isa != Isa::Avx512Bf16 => assert_eq!(g, b, "{isa:?} differs from scalar"),
                (Err(g), Err(b)) => assert_eq!(g, b),
                (Ok(_), Ok(_)) => {} // AVX-512 BF16 may flush subnormals; checked against the oracle below
                _ => panic!("{isa:?}: {got:?} vs scalar {base:?}"),
            }
        }
    }
    base
}

/// The fast result `a` and the oracle's `b`: the same error, or element by element (f32
/// destinations) within the documented bound `c · 2^-24 · S + 2^-24 · |b| + 2^-140`, with `S` the
/// oracle's result on the operands' absolute values (`abs`: the sum of the terms' magnitudes).
fn close(a: &Run, b: &Run, abs: Option<&Run>, c: f64, what: &str) {
    match (a, b) {
        (Err(x), Err(y)) => assert_eq!(x, y, "{what}: different errors"),
        (Ok((o1, c1)), Ok((o2, c2))) => {
            let sums: Vec<u32> = match abs {
                Some(Ok((o, c))) => o.iter().chain(c).copied().collect(),
                _ => vec![0; o1.len() + c1.len()],
            };
            for ((x, y), sum) in o1.iter().zip(o2).chain(c1.iter().zip(c2)).zip(sums) {
                let (x, y) = (f32::from_bits(*x) as f64, f32::from_bits(*y) as f64);
                if x.is_nan() || y.is_nan() || y.is_infinite() {
                    assert!(x.is_nan() == y.is_nan() && (x == y || x.is_nan()), "{what}: {x} vs {y}");
                } else {
                    let u = 2f64.powi(-24);
                    let bound = c * u * f32::from_bits(sum).abs() as f64 + u * y.abs() + 2f64.powi(-140);
                    assert!((x - y).abs() <= bound, "{what}: fast {x} vs exact {y} (bound {bound})");
                }
            }
        }
        _ => panic!("{what}: fast {a:?} vs oracle {b:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let mut s = Src(data.iter().cycle());
    let Ok(shape) = CacheShape::new(
        s.below(6) + 1,
        1 + s.below(2),
        s.below(2) + 1,
        s.below(5) + 1,
        s.below(2) + 1,
        2 * (s.below(8) + 1),
    ) else {
        return;
    };
    let batch = s.below(4);
    let cols = s.below(5);
    let lens: Vec<u32> = (0..batch).map(|_| s.below(12) as u32).collect();
    let lookup: Vec<u32> = (0..batch * cols).map(|_| s.below(shape.num_blocks() + 1) as u32).collect();
    let Ok(table) = PageTable::new(&lookup, cols, &lens) else { return };
    let mut offsets = vec![0u32];
    for _ in 0..batch {
        // Sometimes longer sequences: 16 rows and more reach the tiled MXFP8 kernel.
        let len = if s.below(4) == 0 { s.below(12) } else { s.below(4) };
        offsets.push(offsets.last().unwrap() + len as u32);
    }
    if s.below(8) == 0 {
        offsets[batch] ^= 1; // sometimes inconsistent
    }
    let m = *offsets.last().unwrap() as usize;
    let layer = s.below(3);
    let hd = shape.head_size();
    let kvw = shape.kv_width();
    let q_dim = hd * (s.below(3) + 1) - if s.below(10) == 0 { 1 } else { 0 };
    let n = if shape.is_mla() { q_dim + 1 + s.below(hd) } else { q_dim + 2 * kvw };
    let with_rope = s.below(2) == 0;
    let mut freqs: Vec<f32> = paged_qkv::freqs_cis(s.below(24) + 1, hd, 100.0);
    if s.below(4) == 0 {
        // Arbitrary bits in some entries: NaNs with any payload, infinities, subnormals, huge
        // values (the bf16 stores' rounding and the NaN handling of the tabulated forms).
        for _ in 0..s.below(4) + 1 {
            let i = s.below(freqs.len());
            freqs[i] = f32::from_bits(u32::from_le_bytes([s.byte(), s.byte(), s.byte(), s.byte()]));
        }
    }
    // Position ids: mostly each its predecessor's plus one (the fast RoPE's runs), else random.
    let ids: Option<Vec<u32>> = (s.below(3) == 0).then(|| {
        let mut id = s.below(30);
        (0..m)
            .map(|_| {
                id = if s.below(3) == 0 { s.below(30) } else { id + 1 };
                id as u32
            })
            .collect()
    });
    let rope = with_rope.then(|| {
        QkvRope::new(Freqs::F32(&freqs), hd, hd, s.below(2) == 0)
            .maybe_position_ids(ids.as_deref())
            .with_math(if s.below(2) == 0 { RopeMath::F32 } else { RopeMath::MaxCompat })
    });

    // A quantized cache (sometimes with scales of another shape or a granularity that does not
    // divide the head): a store, a RoPE or a bf16 fused QKV, fast (every ISA) against the oracle,
    // bit for bit.
    if s.below(5) == 0 {
        let g = [2, 4, hd, 3, 1][s.below(5)];
        let other = CacheShape::new(
            shape.num_blocks() + 1,
            shape.kv_dim(),
            shape.num_layers(),
            shape.page_size(),
            shape.num_kv_heads(),
            hd,
        )
        .unwrap();
        let sfor = if s.below(8) == 0 { other } else { shape };
        let q = (shape, sfor, g);
        let vals: Vec<bf16> =
            (0..m.max(1) * 4 * kvw.max(hd * 3)).map(|_| bf16::from_f32(s.below(64) as f32 / 8.0 - 4.0)).collect();
        let (fast, oracle) = match s.below(3) {
            0 => {
                let which = if s.below(2) == 0 { KvSel::K } else { KvSel::V };
                let args = KvStoreRaggedArgs::new(&vals[..m * kvw], &offsets, which);
                let fast = all_isas(|e| run_q::<f32>(q, 0, &table, layer, |_, kv| fast::kv_store_ragged(&args, kv, e)));
                (fast, run_q::<f32>(q, 0, &table, layer, |_, kv| reference::kv_store_ragged(&args, kv)))
            }
            1 => {
                let hq = s.below(3) + 1;
                let rd = 2 * (s.below(hd / 2) + 1);
                let qv = &vals[..m * hq * hd];
                let f: Vec<bf16> =
                    paged_qkv::freqs_cis(s.below(24) + 1, rd, 1000.0).into_iter().map(bf16::from_f32).collect();
                let args = RopeRaggedArgs::new(qv, &offsets, (hq, hd), &f, rd, s.below(2) == 0)
                    .maybe_position_ids(ids.as_deref());
                let math = if s.below(2) == 0 { RopeMath::F32 } else { RopeMath::MaxCompat };
                let fast = all_isas(|e| {
                    run_q::<bf16>(q, qv.len(), &table, layer, |o, kv| fast::rope_ragged(&args, o, kv, math, e))
                });
                (fast, run_q::<bf16>(q, qv.len(), &table, layer, |o, kv| reference::rope_ragged(&args, o, kv, math)))
            }
            _ => {
                let k = s.below(20) + 1;
                let x = &vals[..m * k];
                let w: Vec<bf16> = (0..n * k).map(|_| bf16::from_f32((s.below(9) as f32 - 4.0) / 8.0)).collect();
                let args = QkvRaggedArgs::new(x, &offsets, &w, k, q_dim).maybe_rope(rope);
                let out_len = m * q_dim;
                let fast =
                    all_isas(|e| run_q::<bf16>(q, out_len, &table, layer, |o, kv| fast::qkv_ragged(&args, o, kv, e)));
                let oracle = run_q::<bf16>(q, out_len, &table, layer, |o, kv| {
                    reference::qkv_ragged(&args, o, kv, Accumulation::Exact)
                });
                (fast, oracle)
            }
        };
        assert_eq!(fast, oracle, "quantized cache");
        return;
    }

    match s.below(4) {
        // Block-scaled fused QKV.
        0 => {
            let format = BlockFormat::ALL[s.below(3)];
            let k = 2 * (s.below(40) + 1);
            let rb = format.row_bytes(k);
            let a: Vec<u8> = (0..m * rb).map(|_| s.byte()).collect();
            let w: Vec<u8> = (0..n * rb).map(|_| s.byte()).collect();
            let sa: Vec<u8> = (0..ScaleLayout::for_operand(m, k, format.vector_size()).len())
                .map(|_| 0x30 + s.below(16) as u8)
                .collect();
            let sw: Vec<u8> = (0..ScaleLayout::for_operand(n, k, format.vector_size()).len())
                .map(|_| 0x30 + s.below(16) as u8)
                .collect();
            let (Ok(a), Ok(w)) = (QuantizedRef::new(format, m, k, &a, &sa), QuantizedRef::new(format, n, k, &w, &sw))
            else {
                return;
            };
            let args = QkvFp4Args::new(a, &offsets, w, q_dim).with_tensor_sf(0.5).maybe_rope(rope);
            let out_len = m * q_dim;
            let fast = all_isas(|e| {
                run::<f32, f32>(shape, out_len, &table, layer, |o, kv| fast::qkv_fp4_ragged(&args, o, kv, e))
            });
            let oracle = run::<f32, f32>(shape, out_len, &table, layer, |o, kv| {
                reference::qkv_fp4_ragged(&args, o, kv, Accumulation::Exact)
            });
            // Σ|terms|: the oracle on the absolute values (sign bits cleared; NaN codes stay NaN).
            let strip = |d: &[u8]| -> Vec<u8> {
                d.iter().map(|&b| if format.is_fp4() { b & 0x77 } else { b & 0x7F }).collect()
            };
            let (aa, wa) = (strip(a.data()), strip(w.data()));
            let (aa, wa) = (
                QuantizedRef::new(format, m, k, &aa, &sa).unwrap(),
                QuantizedRef::new(format, n, k, &wa, &sw).unwrap(),
            );
            let abs_args = QkvFp4Args::new(aa, args.input_row_offsets, wa, args.q_dim).with_tensor_sf(args.tensor_sf);
            let abs = run::<f32, f32>(shape, out_len, &table, layer, |o, kv| {
                reference::qkv_fp4_ragged(&abs_args, o, kv, Accumulation::Exact)
            });
            let kb = a.k_blocks() as f64;
            let c = if format.is_fp4() { kb + 2.0 } else { (k as f64) + kb + 2.0 };
            if rope.is_none() {
                close(&fast, &oracle, Some(&abs), c, "qkv_fp4_ragged");
            } else {
                assert_eq!(fast.is_ok(), oracle.is_ok(), "fast {fast:?} vs oracle {oracle:?}");
                if let (Err(x), Err(y)) = (&fast, &oracle) {
                    assert_eq!(x, y);
                }
            }
        }
        // bf16 fused QKV, ragged (with bias) or padded.
        1 => {
            let k = s.below(40) + 1;
            let x: Vec<bf16> = (0..m.max(1) * 4 * k).map(|_| bf16::from_f32(s.below(9) as f32 - 4.0)).collect();
            let w: Vec<bf16> = (0..n * k).map(|_| bf16::from_f32((s.below(9) as f32 - 4.0) / 8.0)).collect();
            let bias: Vec<bf16> = (0..n).map(|_| bf16::from_f32(s.below(5) as f32)).collect();
            let ragged = s.below(2) == 0;
            let (out_len, fast, oracle) = if ragged {
                let args = QkvRaggedArgs::new(&x[..m * k], &offsets, &w, k, q_dim)
                    .maybe_bias((s.below(2) == 0).then_some(&bias[..]))
                    .maybe_rope(rope);
                let out_len = m * q_dim;
                let fast = all_isas(|e| {
                    run::<f32, f32>(shape, out_len, &table, layer, |o, kv| fast::qkv_ragged(&args, o, kv, e))
                });
                let oracle = run::<f32, f32>(shape, out_len, &table, layer, |o, kv| {
                    reference::qkv_ragged(&args, o, kv, Accumulation::Exact)
                });
                (out_len, fast, oracle)
            } else {
                let seq = s.below(4) + 1;
                let valid: Vec<u32> = (0..batch).map(|_| s.below(seq + 1) as u32).collect();
                let xs = &x[..(batch * seq * k).min(x.len())];
                let args = QkvBshdArgs::new(xs, (batch, seq, k), &w, &valid, q_dim)
                    .maybe_rope(rope.map(|r| r.maybe_position_ids(None)));
                let out_len = batch * seq * q_dim;
                let fast = all_isas(|e| {
                    run::<f32, f32>(shape, out_len, &table, layer, |o, kv| fast::qkv_bshd(&args, o, kv, e))
                });
                let oracle = run::<f32, f32>(shape, out_len, &table, layer, |o, kv| {
                    reference::qkv_bshd(&args, o, kv, Accumulation::Exact)
                });
                (out_len, fast, oracle)
            };
            let _ = out_len;
            // Small dyadic values: every product and partial sum is exact in f32, so the fast
            // path (also with RoPE on exact values) equals the oracle bit for bit.
            assert_eq!(fast, oracle, "qkv plain");
        }
        // Ragged RoPE: bit for bit with the oracle.
        2 => {
            let hq = s.below(3) + 1;
            let rd = 2 * (s.below(hd / 2) + 1);
            let q: Vec<bf16> = (0..m * hq * hd).map(|_| bf16::from_f32(s.below(64) as f32 / 8.0 - 4.0)).collect();
            let f: Vec<bf16> =
                paged_qkv::freqs_cis(s.below(24) + 1, rd, 1000.0).into_iter().map(bf16::from_f32).collect();
            let args =
                RopeRaggedArgs::new(&q, &offsets, (hq, hd), &f, rd, s.below(2) == 0).maybe_position_ids(ids.as_deref());
            let math = if s.below(2) == 0 { RopeMath::F32 } else { RopeMath::MaxCompat };
            let fast = all_isas(|e| {
                run::<bf16, bf16>(shape, q.len(), &table, layer, |o, kv| fast::rope_ragged(&args, o, kv, math, e))
            });
            let oracle =
                run::<bf16, bf16>(shape, q.len(), &table, layer, |o, kv| reference::rope_ragged(&args, o, kv, math));
            assert_eq!(fast, oracle, "rope_ragged");
        }
        // Ragged KV store: bit for bit with the oracle, f32 values (converted) or bf16 values of
        // any bits, NaNs included (copied into the bf16 cache, NaNs quieted).
        _ => {
            let which = if s.below(2) == 0 { KvSel::K } else { KvSel::V };
            if s.below(2) == 0 {
                let v: Vec<f32> = (0..m * kvw).map(|_| s.below(200) as f32 - 100.0).collect();
                let args = KvStoreRaggedArgs::new(&v, &offsets, which);
                let fast = all_isas(|e| {
                    run::<f32, bf16>(shape, 0, &table, layer, |_, kv| fast::kv_store_ragged(&args, kv, e))
                });
                let oracle = run::<f32, bf16>(shape, 0, &table, layer, |_, kv| reference::kv_store_ragged(&args, kv));
                assert_eq!(fast, oracle, "kv_store_ragged");
            } else {
                // A quarter of the values with the high byte of a NaN or infinity (0x7F, 0xFF).
                let mut value = || {
                    let hi = if s.below(4) == 0 { [0x7F, 0xFF][s.below(2)] } else { s.below(256) };
                    bf16::from_bits((hi << 8 | s.below(256)) as u16)
                };
                let v: Vec<bf16> = (0..m * kvw).map(|_| value()).collect();
                let args = KvStoreRaggedArgs::new(&v, &offsets, which);
                let fast = all_isas(|e| {
                    run::<bf16, bf16>(shape, 0, &table, layer, |_, kv| fast::kv_store_ragged(&args, kv, e))
                });
                let oracle = run::<bf16, bf16>(shape, 0, &table, layer, |_, kv| reference::kv_store_ragged(&args, kv));
                assert_eq!(fast, oracle, "kv_store_ragged (bf16 values)");
            }
        }
    }
});
