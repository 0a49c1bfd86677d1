//! The scalar oracle: one slow, obviously correct function per operation, written from
//! [the semantics](crate::semantics). No SIMD, no threads. Every fast path is judged against it.
//!
//! Each function validates all of its arguments first (see [`crate::ops`]); on any error the
//! output and the whole cache are unchanged. Matmul results are formed as one pre-rounding value
//! per (row, column) and rounded **once** to the destination type: Q to the output dtype, K/V to
//! the cache dtype (FP8 saturates), as [semantics §9](crate::semantics) says — except that a bias
//! is added as MAX adds it, after the product's rounding (§4).

use crate::cache::quant::{Stage, group_scale};
use crate::cache::{KvSel, KvWrite, PagedKvCacheMut, RowSlot, SlotPlan};
use crate::element::{DType, Element, biased_exact};
use crate::error::{Result, weight_rows};
use crate::exact::{ExactSum, f32_parts};
use crate::formats::fp8::{e4m3_to_f32, e4m3_to_units, e8m0_to_f32};
use crate::formats::{BlockFormat, QuantizedRef, fp4};
use crate::ops::{
    Accumulation, FP8_BLOCK, Fp8Scales, Freqs, KvStoreBshdArgs, KvStoreRaggedArgs, QkvBshdArgs, QkvFp4Args, QkvFp8Args,
    QkvRaggedArgs, QkvRope, RopeBshdArgs, RopeMath, RopeRaggedArgs, validate_fp4, validate_fp8_args,
    validate_kv_store_bshd, validate_kv_store_ragged, validate_qkv_bshd, validate_qkv_ragged, validate_rope_bshd,
    validate_rope_ragged, with_freqs,
};

/// Fused QKV projection of a ragged batch of block-scaled (NVFP4, MXFP4, MXFP8) activations with a
/// block-scaled weight, Q to `output` (`[M, q_dim]`) and K/V into the paged cache at
/// `cache_lengths[b] + t` ([semantics §4](crate::semantics)).
///
/// `value[m, n] = tensor_sf · Σ_k dec(A[m,k]) · dec(W[n,k]) · sa(m, k/V) · sb(n, k/V)`, accumulated
/// as `mode` says, rounded once. Columns `< q_dim` go to `output[m, n]`; the next
/// `num_kv_heads · head_size` to K head `(n − q_dim) / head_size`, the rest to V (MHA/GQA); with
/// an MLA cache every column `≥ q_dim` goes to K head 0, dim `n − q_dim`.
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged_scale_float4")]
pub fn qkv_fp4_ragged<O: Element, C: Element>(
    args: &QkvFp4Args<'_>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    mode: Accumulation,
) -> Result<()> {
    let (a, w) = (args.hidden_state, args.weight);
    let (plan, positions) = validate_fp4(
        a,
        args.input_row_offsets,
        (w.format(), w.rows(), w.k()),
        args.tensor_sf,
        (args.q_dim, args.rope.as_ref()),
        output.len(),
        kv,
    )?;

    let tsf = args.tensor_sf;
    writes!(kv, &plan, O, false, |kv, plan| {
        match mode {
            Accumulation::Sequential => route(w.rows(), args.q_dim, output, kv, plan, None, |r, vals, _| {
                let (av, sa) = decode_row(a, r);
                for (j, v) in vals.iter_mut().enumerate() {
                    *v = fp4_sequential(&av, &sa, w, j, tsf);
                }
            }),
            Accumulation::Exact => route(w.rows(), args.q_dim, output, kv, plan, None, |r, vals, _| {
                let ar = exact_row(a, r);
                for (j, v) in vals.iter_mut().enumerate() {
                    *v = fp4_exact(&ar, &exact_row(w, j), a, tsf);
                }
            }),
        }
        fused_rope(args.rope.as_ref(), &positions, args.q_dim, output, kv, plan);
    });
    Ok(())
}

/// Fused QKV projection of a ragged batch of bf16/f16/f32 activations (MAX's non-quantized
/// sibling `fused_qkv_matmul_kv_cache_paged_ragged`, plus its optional bias): routing as in
/// [`qkv_fp4_ragged`]. The bias `[N]` is added as MAX adds it ([semantics §4](crate::semantics)):
/// to the product already rounded to the destination's dtype, and the sum rounded again.
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged")]
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged_bias")]
pub fn qkv_ragged<T: Element, O: Element, C: Element>(
    args: &QkvRaggedArgs<'_, T>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    mode: Accumulation,
) -> Result<()> {
    let k = args.hidden_size;
    let n = weight_rows(args.weight, k)?;
    let (plan, positions) = validate_qkv_ragged(
        args.hidden_state.len(),
        args.input_row_offsets,
        (n, k),
        args.bias.map(|b| b.len()),
        (args.q_dim, args.rope.as_ref()),
        output.len(),
        kv,
    )?;
    let bias = args.bias.map(|b| move |j: usize| b[j].to_f32());
    let bias_fn = bias.as_ref().map(|f| f as &dyn Fn(usize) -> f32);
    writes!(kv, &plan, O, false, |kv, plan| {
        route(n, args.q_dim, output, kv, plan, bias_fn, |r, vals, with_bias| {
            let b = if with_bias { args.bias } else { None };
            plain_row(&args.hidden_state[r * k..(r + 1) * k], args.weight, b, k, mode, vals)
        });
        fused_rope(args.rope.as_ref(), &positions, args.q_dim, output, kv, plan);
    });
    Ok(())
}

/// Fused QKV projection of a ragged batch of FP8 E4M3 activations with an E4M3 weight and f32
/// scales per tensor, per channel or per 128-block (MAX's `_fused_qkv_ragged_matmul_scaled_float8`,
/// op `mo.fused_qkv_matmul.ragged.paged.scale[.bias]`), routed as in [`qkv_fp4_ragged`]. The
/// output dtype `O` (bf16, f16 or f32; MAX's is bf16) is where MAX scales and adds the bias
/// ([semantics §4](crate::semantics)):
///
/// ```text
/// tensor, channel: out = r_O( r_O(Σ_k a·w) · r_O(r_O(sa[m]) · r_O(sw[n])) )
/// block:           out = r_O( Σ_k a·w · sa[k/128, m] · sw[n/128, k/128] )
/// bias:            out = r_O( out + r_O(bias[n]) )
/// ```
///
/// Q is `out`, K/V `out` cast to the cache dtype (FP8 saturates). The sums are formed as `mode`
/// says; each `r_O(x · y)` and `r_O(x + y)` is the f32 operation rounded to `O`.
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged_scale")]
#[doc(alias = "_fused_qkv_ragged_matmul_scaled_float8")]
pub fn qkv_fp8_ragged<B: Element, O: Element, C: Element>(
    args: &QkvFp8Args<'_, B>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    mode: Accumulation,
) -> Result<()> {
    let (n, (plan, positions)) = validate_fp8_args::<B, O, C>(args, output.len(), kv)?;
    let k = args.hidden_size;
    let m = args.hidden_state.len() / k;
    writes!(kv, &plan, O, false, |kv, plan| {
        route(n, args.q_dim, output, kv, plan, None, |r, vals, _| {
            for (j, v) in vals.iter_mut().enumerate() {
                *v = fp8_value::<B, O>(args, (r, j), (m, k), mode) as f64;
            }
        });
        fused_rope(args.rope.as_ref(), &positions, args.q_dim, output, kv, plan);
    });
    Ok(())
}

/// One element of [`qkv_fp8_ragged`] in `O` (carried exactly in an f32).
fn fp8_value<B: Element, O: Element>(
    args: &QkvFp8Args<'_, B>,
    (r, j): (usize, usize),
    (m, k): (usize, usize),
    mode: Accumulation,
) -> f32 {
    let (a, w) = (&args.hidden_state[r * k..(r + 1) * k], &args.weight[j * k..(j + 1) * k]);
    let to_o = |x: f32| O::from_f32(x).to_f32();
    let exact_o = |acc: ExactSum| O::from_f64(acc.to_f64_round_odd()).to_f32();
    // The exact integer sum of E4M3 products over `range`, in units of 2^-18 (None: a NaN element).
    let units = |range: std::ops::Range<usize>| -> Option<i128> {
        range.map(|kk| Some(e4m3_to_units(a[kk])? as i128 * e4m3_to_units(w[kk])? as i128)).sum()
    };
    let scaled = match (args.scales, mode) {
        (Fp8Scales::Block { input, weight }, Accumulation::Exact) => {
            let kb = k.div_ceil(FP8_BLOCK);
            let mut acc = ExactSum::new();
            for b in 0..kb {
                let Some(isum) = units(b * FP8_BLOCK..((b + 1) * FP8_BLOCK).min(k)) else { return f32::NAN };
                let (sa, ea) = f32_parts(input[b * m + r]);
                let (sw, ew) = f32_parts(weight[j / FP8_BLOCK * kb + b]);
                acc.add(isum * (sa as i128 * sw as i128), -18 + ea + ew);
            }
            exact_o(acc)
        }
        (Fp8Scales::Block { input, weight }, Accumulation::Sequential) => {
            // MAX's naive blockwise kernel: `accum += a_val * b_val * a_scale_factor * b_scale_factor`.
            let kb = k.div_ceil(FP8_BLOCK);
            let mut acc = 0f32;
            for kk in 0..k {
                let (sa, sw) = (input[kk / FP8_BLOCK * m + r], weight[j / FP8_BLOCK * kb + kk / FP8_BLOCK]);
                acc += e4m3_to_f32(a[kk]) * e4m3_to_f32(w[kk]) * sa * sw;
            }
            to_o(acc)
        }
        (scales, mode) => {
            let raw = match mode {
                Accumulation::Exact => match units(0..k) {
                    Some(isum) => {
                        let mut acc = ExactSum::new();
                        acc.add(isum, -18);
                        exact_o(acc)
                    }
                    None => f32::NAN,
                },
                Accumulation::Sequential => {
                    let mut acc = 0f32;
                    for (x, y) in a.iter().zip(w) {
                        acc = e4m3_to_f32(*x).mul_add(e4m3_to_f32(*y), acc);
                    }
                    to_o(acc)
                }
            };
            to_o(raw * scales.product::<O>(r, j))
        }
    };
    match args.bias {
        Some(b) => to_o(scaled + to_o(b[j].to_f32())),
        None => scaled,
    }
}

/// Fused QKV projection of a padded `[batch, seq_len, hidden]` batch (MAX's
/// `fused_qkv_matmul_kv_cache_bshd_paged`): Q to `output` (`[batch, seq_len, q_dim]`) for
/// **every** `(b, t)`, padded positions included; K/V into the cache only for
/// `t < valid_lengths[b]`, at `cache_lengths[b] + t`. MHA/GQA only.
///
/// Memory is O(N) beyond the arguments and time O(values written × K): padded rows compute
/// their Q columns only.
#[doc(alias = "fused_qkv_matmul_kv_cache_bshd_paged")]
pub fn qkv_bshd<T: Element, O: Element, C: Element>(
    args: &QkvBshdArgs<'_, T>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    mode: Accumulation,
) -> Result<()> {
    let k = args.hidden_size;
    let n = weight_rows(args.weight, k)?;
    let (plan, positions) = validate_qkv_bshd(
        args.hidden_state.len(),
        (args.batch, args.seq_len),
        (n, k),
        args.valid_lengths,
        (args.q_dim, args.rope.as_ref()),
        output.len(),
        kv,
    )?;
    writes!(kv, &plan, O, false, |kv, plan| {
        route(n, args.q_dim, output, kv, plan, None, |r, vals, _| {
            plain_row(&args.hidden_state[r * k..(r + 1) * k], args.weight, None, k, mode, vals)
        });
        fused_rope(args.rope.as_ref(), &positions, args.q_dim, output, kv, plan);
    });
    Ok(())
}

/// RoPE on a padded batch ([semantics §5](crate::semantics)): rotates Q from `q_proj` into `output` and the new K **in
/// place** in the layer's K cache at `cache_lengths[b] + s`, for `s < valid_lengths[b]` only.
///
/// Padded rows (`s ≥ valid_lengths[b]`) of `output` are **not written**: they keep what the buffer
/// held, as in MAX. Calling it twice rotates twice. It must run after the K of these tokens was
/// stored (e.g. by [`qkv_bshd`]).
#[doc(alias = "fused_qk_rope_bshd_paged")]
pub fn rope_bshd<T: Element, C: Element>(
    args: &RopeBshdArgs<'_, T>,
    output: &mut [T],
    kv: &mut KvWrite<'_, C>,
    math: RopeMath,
) -> Result<()> {
    let (plan, positions) = validate_rope_bshd(args, output.len(), kv)?;
    let d = kv.cache.shape().head_size();
    let hq = args.num_q_heads;
    let pairs = rope_pairs(d, d, args.interleaved);
    writes!(kv, &plan, T, true, |kv, plan| {
        with_freqs!(args.freqs_cis, freqs => {
            for (r, slot) in plan.rows.iter().enumerate() {
                let (Some(slot), Some(p)) = (slot, positions[r]) else { continue };
                let f = &freqs[p * d..][..d];
                for h in 0..hq {
                    let base = (r * hq + h) * d;
                    rotate(&args.q_proj[base..base + d], &mut output[base..base + d], f, &pairs, math);
                }
                rotate_k(&mut kv.cache, kv.layer_idx, slot.block, slot.offset, f, &pairs, math);
            }
        });
    });
    Ok(())
}

/// RoPE on a ragged batch with optional partial rotary and position ids (MAX's
/// `fused_qk_rope_ragged`, [semantics §5](crate::semantics)). Q (`[M, num_q_heads, q_head_size]`) is written to `output`
/// whole: rotated dims rotated, the others copied. K is rotated in place at `cache_lengths[b] + t`
/// over its own head size (the cache's), the other K dims untouched.
///
/// Supported: one position per token (`position_ids` `[M]`); MAX's multi-section mrope is not.
#[doc(alias = "fused_qk_rope_ragged")]
pub fn rope_ragged<T: Element, C: Element>(
    args: &RopeRaggedArgs<'_, T>,
    output: &mut [T],
    kv: &mut KvWrite<'_, C>,
    math: RopeMath,
) -> Result<()> {
    let (plan, positions) = validate_rope_ragged(args, output.len(), kv)?;
    let (hq, dq, dk, rd) = (args.num_q_heads, args.q_head_size, kv.cache.shape().head_size(), args.rope_dim);
    let q_pairs = rope_pairs(dq, rd, args.interleaved);
    let k_pairs = rope_pairs(dk, rd, args.interleaved);
    writes!(kv, &plan, T, true, |kv, plan| {
        with_freqs!(args.freqs_cis, freqs => {
            for (r, slot) in plan.rows.iter().enumerate() {
                let (Some(slot), Some(p)) = (slot, positions[r]) else { continue };
                let f = &freqs[p * rd..][..rd];
                for h in 0..hq {
                    let base = (r * hq + h) * dq;
                    output[base..base + dq].copy_from_slice(&args.q_proj[base..base + dq]);
                    rotate(&args.q_proj[base..base + dq], &mut output[base..base + dq], f, &q_pairs, math);
                }
                rotate_k(&mut kv.cache, kv.layer_idx, slot.block, slot.offset, f, &k_pairs, math);
            }
        });
    });
    Ok(())
}

/// Stores a ragged `[M, num_kv_heads, head_size]` K or V tensor at `cache_lengths[b] + t`
/// (MAX's `kv_cache_store_ragged`), rounding once to the cache dtype.
#[doc(alias = "kv_cache_store_ragged")]
pub fn kv_store_ragged<T: Element, C: Element>(args: &KvStoreRaggedArgs<'_, T>, kv: &mut KvWrite<'_, C>) -> Result<()> {
    let plan = validate_kv_store_ragged(args, kv)?;
    store_rows(args.values, args.which, kv, &plan);
    Ok(())
}

/// Stores a padded `[batch, seq_len, num_kv_heads, head_size]` K or V tensor at
/// `cache_lengths[b] + t` for `t < valid_lengths[b]` (MAX's `kv_cache_store_padded`).
#[doc(alias = "kv_cache_store_padded")]
pub fn kv_store_bshd<T: Element, C: Element>(args: &KvStoreBshdArgs<'_, T>, kv: &mut KvWrite<'_, C>) -> Result<()> {
    let plan = validate_kv_store_bshd(args, kv)?;
    store_rows(args.values, args.which, kv, &plan);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Validation helpers local to the oracle.

// ---------------------------------------------------------------------------------------------
// Matmuls, one row at a time: one pre-rounding value per (row, column), as f64. A Sequential
// value is an f32, so rounding it from f64 is the same as rounding the f32; an Exact value is
// round-to-odd, so its one rounding to the destination is correct. Memory is O(N); a row that
// writes no K/V (a padded BSHD row) computes its Q columns only.

/// Decoded data and scales of one operand row (f32; exact).
fn decode_row(q: QuantizedRef<'_>, r: usize) -> (Vec<f32>, Vec<f32>) {
    let row = q.row(r);
    let vals = (0..q.k()).map(|i| q.format().element_to_f32(row, i)).collect();
    let scales = (0..q.k_blocks()).map(|kb| q.scale(r, kb)).collect();
    (vals, scales)
}

/// `naive_block_scaled_matmul_kernel`: `((a · b) · sa) · sb` in k order in f32, then × tensor_sf.
fn fp4_sequential(av: &[f32], sa: &[f32], w: QuantizedRef<'_>, j: usize, tensor_sf: f32) -> f64 {
    let v = w.format().vector_size();
    let (wv, ws) = decode_row(w, j);
    let mut acc = 0.0f32;
    for kk in 0..av.len() {
        acc += ((av[kk] * wv[kk]) * sa[kk / v]) * ws[kk / v];
    }
    (acc * tensor_sf) as f64
}

/// One operand row for exact accumulation: data as integers (`value = int · 2^data_exp`) and per
/// block the scale as `int · 2^exp`, `None` when the block holds a NaN (data or scale).
struct ExactRow {
    ints: Vec<i64>,
    scales: Vec<Option<(i64, i32)>>,
}

fn data_exp(format: BlockFormat) -> i32 {
    if format.is_fp4() { -1 } else { -9 }
}

fn exact_row(q: QuantizedRef<'_>, r: usize) -> ExactRow {
    let (k, v, f) = (q.k(), q.format().vector_size(), q.format());
    let row = q.row(r);
    let mut nan_block = vec![false; q.k_blocks()];
    let ints = (0..k)
        .map(|i| {
            if f.is_fp4() {
                fp4::E2M1_DOUBLED[fp4::fp4_code(row, i) as usize] as i64
            } else {
                e4m3_to_units(row[i]).map_or_else(
                    || {
                        nan_block[i / v] = true;
                        0
                    },
                    |u| u as i64,
                )
            }
        })
        .collect();
    let scales = (0..q.k_blocks())
        .map(|kb| {
            let byte = q.scale_byte(r, kb);
            let s = match f {
                BlockFormat::Nvfp4 => e4m3_to_units(byte & 0x7F).map(|u| (u as i64, -9)),
                BlockFormat::Mxfp4 | BlockFormat::Mxfp8 => {
                    (!e8m0_to_f32(byte).is_nan()).then_some((1, byte as i32 - 127))
                }
            };
            if nan_block[kb] { None } else { s }
        })
        .collect();
    ExactRow { ints, scales }
}

fn fp4_exact(ar: &ExactRow, wr: &ExactRow, a: QuantizedRef<'_>, tensor_sf: f32) -> f64 {
    let (k, v) = (a.k(), a.format().vector_size());
    let dexp = 2 * data_exp(a.format());
    let (tm, te) = f32_parts(tensor_sf);
    let mut acc = ExactSum::new();
    for kb in 0..a.k_blocks() {
        let (Some((sa, ea)), Some((sb, eb))) = (ar.scales[kb], wr.scales[kb]) else {
            return f64::NAN;
        };
        let range = kb * v..((kb + 1) * v).min(k);
        let isum: i64 = ar.ints[range.clone()].iter().zip(&wr.ints[range]).map(|(x, y)| x * y).sum();
        acc.add(isum as i128 * (sa * sb) as i128 * tm as i128, dexp + ea + eb + te);
    }
    acc.to_f64_round_odd()
}

/// Row `x` times the first `vals.len()` weight rows, as `mode` says (plus `bias` in the sum when
/// given: the E4M3 destinations' rule, semantics §4). `Sequential` is MAX's CPU order: a chain of
/// f32 FMAs over k in order (bf16 and f16 products are exact in f32, so for them it is also the
/// multiply-then-add chain).
fn plain_row<T: Element>(x: &[T], w: &[T], bias: Option<&[T]>, k: usize, mode: Accumulation, vals: &mut [f64]) {
    for (j, out) in vals.iter_mut().enumerate() {
        let wr = &w[j * k..(j + 1) * k];
        let b = bias.map(|b| b[j].to_f32());
        *out = match mode {
            Accumulation::Sequential => {
                let mut acc = 0.0f32;
                for (a, c) in x.iter().zip(wr) {
                    acc = a.to_f32().mul_add(c.to_f32(), acc);
                }
                (acc + b.unwrap_or(0.0)) as f64
            }
            Accumulation::Exact => {
                let mut acc = ExactSum::new();
                for (a, c) in x.iter().zip(wr) {
                    acc.add_product_f32(a.to_f32(), c.to_f32());
                }
                if let Some(b) = b {
                    acc.add_f32(b);
                }
                acc.to_f64_round_odd()
            }
        };
    }
}

/// Runs `$body` with `$k` the write (`&mut KvWrite`) and `$p` the slot plan: directly into the
/// cache, or, for a quantized cache, into a staging cache of `$s` whose rows are then quantized
/// into their slots ([`staged`]; `$rope`: the body rotates the K already in the cache).
macro_rules! writes {
    ($kv:ident, $plan:expr, $s:ty, $rope:expr, |$k:ident, $p:ident| $body:block) => {{
        if $kv.scales.is_some() {
            staged::<$s, _>($kv, $plan, $rope, |$k, $p| $body)?;
        } else {
            let ($k, $p) = (&mut *$kv, $plan);
            $body
        }
    }};
}
use writes;

/// A write into a quantized cache ([semantics §3.1](crate::semantics)): `write` stores the rows
/// of `plan` into a staging cache of `S` (for a RoPE, `rope`, holding their K dequantized first:
/// `S(code · scale)`), then every staged group is quantized into its slot ([`quantize_part`]):
/// K and V, or K alone after a RoPE.
fn staged<S: Element, C: Element>(
    kv: &mut KvWrite<'_, C>,
    plan: &SlotPlan,
    rope: bool,
    write: impl FnOnce(&mut KvWrite<'_, S>, &SlotPlan),
) -> Result<()> {
    let shape = kv.cache.shape();
    let mut st = Stage::<S>::new(plan, shape)?;
    let Some(scales) = &kv.scales else { unreachable!("staged writes are quantized") };
    let g = scales.granularity();
    if rope {
        let sshape = st.shape;
        for (i, &(_, slot)) in st.rows.iter().enumerate() {
            let at = shape.index(slot.block, 0, kv.layer_idx, slot.offset, 0, 0);
            let to = sshape.index(i, 0, 0, 0, 0, 0);
            for j in 0..shape.kv_width() {
                let x = kv.cache.data()[at + j].to_f32() * scales.data()[(at + j) / g];
                st.data[to + j] = S::from_f32(x);
            }
        }
    }
    let splan = st.plan.clone();
    write(&mut st.kv(kv.page_table), &splan);
    let parts: &[KvSel] = if rope || shape.is_mla() { &[KvSel::K] } else { &[KvSel::K, KvSel::V] };
    for (i, &(_, slot)) in st.rows.iter().enumerate() {
        for &p in parts {
            quantize_part(kv, slot, p, st.part(i, p));
        }
    }
    Ok(())
}

/// Quantizes one token's K or V (`vals`: `num_kv_heads · head_size` values) into its slot: per
/// group of `granularity` elements of a head, `scale = amax / 448` (`amax` the largest magnitude,
/// NaN ignored), each element `E4M3(x · (1 / scale))` (0 for a zero scale), as MAX's FP8 KV
/// writer stores them; the scale at the group's place in the scales tensor.
fn quantize_part<S: Element, C: Element>(kv: &mut KvWrite<'_, C>, slot: RowSlot, which: KvSel, vals: &[S]) {
    let shape = kv.cache.shape();
    let Some(scales) = &mut kv.scales else { unreachable!("quantized writes have scales") };
    let g = scales.granularity();
    let at = shape.index(slot.block, which as usize, kv.layer_idx, slot.offset, 0, 0);
    let data = kv.cache.data_mut();
    for (q, x) in vals.chunks(g).enumerate() {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
        let (scale, inv) = group_scale(amax);
        let base = at + q * g;
        for (j, v) in x.iter().enumerate() {
            data[base + j] = C::from_f32(v.to_f32() * inv);
        }
        // The group's scale: the scales tensor is the cache with its last dimension divided by
        // `g`, and `g` divides the head size.
        scales.data_mut()[base / g] = scale;
    }
}

/// A product's value for a destination of type D: rounded once, or with a bias through MAX's
/// bias step ([`biased_exact`]); `with_bias` is the product plus the bias in one value (the E4M3
/// cache's rule).
fn dest_value<D: Element>(v: f64, bias: Option<f32>, with_bias: f64) -> D {
    match bias {
        None => D::from_f64(v),
        Some(b) => D::from_f64(biased_exact(D::DTYPE, v, b, || with_bias)),
    }
}

/// For every row of the plan: computes its values with `row_values(r, vals, with_bias)` (all `n`
/// columns when the row has a slot, else its `q_dim` Q columns; `with_bias`: the bias inside the
/// sum), then writes Q to `output[r]` and K/V through the cache router, each rounded once — or,
/// with a `bias`, through MAX's bias step ([semantics §4](crate::semantics)).
fn route<O: Element, C: Element>(
    n: usize,
    q_dim: usize,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    plan: &SlotPlan,
    bias: Option<&dyn Fn(usize) -> f32>,
    mut row_values: impl FnMut(usize, &mut [f64], bool),
) {
    let shape = kv.cache.shape();
    let layer = kv.layer_idx;
    let data = kv.cache.data_mut();
    let mut vals = vec![0.0; n];
    // An E4M3 destination rounds product + bias once: those sums, computed only where needed.
    let fp8 = O::DTYPE == DType::F8E4M3 || C::DTYPE == DType::F8E4M3;
    let mut summed = vec![0.0; if bias.is_some() && fp8 { n } else { 0 }];
    let b = |j: usize| bias.map(|f| f(j));
    for (r, slot) in plan.rows.iter().enumerate() {
        let width = if slot.is_some() { n } else { q_dim };
        row_values(r, &mut vals[..width], false);
        if !summed.is_empty() {
            row_values(r, &mut summed[..width], true);
        }
        let sum = |j: usize| summed.get(j).copied().unwrap_or(f64::NAN);
        for (j, o) in output[r * q_dim..(r + 1) * q_dim].iter_mut().enumerate() {
            *o = dest_value(vals[j], b(j), sum(j));
        }
        let Some(slot) = slot else { continue };
        let base = shape.slot_base(slot.block, layer, slot.offset);
        for (j, &v) in vals[q_dim..width].iter().enumerate() {
            data[base + shape.kv_column_offset(j)] = dest_value(v, b(q_dim + j), sum(q_dim + j));
        }
    }
}

fn store_rows<T: Element, C: Element>(values: &[T], which: KvSel, kv: &mut KvWrite<'_, C>, plan: &SlotPlan) {
    let shape = kv.cache.shape();
    let width = shape.kv_width();
    if kv.scales.is_some() {
        for (r, slot) in plan.rows.iter().enumerate() {
            let Some(slot) = slot else { continue };
            quantize_part(kv, *slot, which, &values[r * width..(r + 1) * width]);
        }
        return;
    }
    let data = kv.cache.data_mut();
    for (r, slot) in plan.rows.iter().enumerate() {
        let Some(slot) = slot else { continue };
        let start = shape.index(slot.block, which as usize, kv.layer_idx, slot.offset, 0, 0);
        for (dst, src) in data[start..start + width].iter_mut().zip(&values[r * width..(r + 1) * width]) {
            *dst = C::from_f32(src.to_f32());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RoPE.

/// A fused QKV's RoPE, after the QKV values were written: exactly the standalone
/// [`rope_ragged`] (`rope_bshd` for whole heads) applied to the output in place and to the K just
/// stored, for the rows `positions` names.
fn fused_rope<O: Element, C: Element>(
    rope: Option<&QkvRope<'_>>,
    positions: &[Option<usize>],
    q_dim: usize,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    plan: &SlotPlan,
) {
    let Some(rope) = rope else { return };
    match rope.freqs_cis {
        Freqs::F32(f) => fused_rope_f(rope, f, positions, q_dim, output, kv, plan),
        Freqs::Bf16(f) => fused_rope_f(rope, f, positions, q_dim, output, kv, plan),
        Freqs::F16(f) => fused_rope_f(rope, f, positions, q_dim, output, kv, plan),
    }
}

fn fused_rope_f<O: Element, C: Element, F: Element>(
    rope: &QkvRope<'_>,
    freqs: &[F],
    positions: &[Option<usize>],
    q_dim: usize,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    plan: &SlotPlan,
) {
    let (dq, dk, rd) = (rope.q_head_size, kv.cache.shape().head_size(), rope.rope_dim);
    let q_pairs = rope_pairs(dq, rd, rope.interleaved);
    let k_pairs = rope_pairs(dk, rd, rope.interleaved);
    for (r, slot) in plan.rows.iter().enumerate() {
        let (Some(slot), Some(p)) = (slot, positions[r]) else { continue };
        let f = &freqs[p * rd..][..rd];
        for h in 0..q_dim / dq {
            let base = r * q_dim + h * dq;
            let q = output[base..base + dq].to_vec();
            rotate(&q, &mut output[base..base + dq], f, &q_pairs, rope.math);
        }
        rotate_k(&mut kv.cache, kv.layer_idx, slot.block, slot.offset, f, &k_pairs, rope.math);
    }
}

/// The element pairs `(j0, j1)` of a head of size `head` for pair index `i < rope_dim / 2`
/// (freqs columns `2i`, `2i + 1`): interleaved rotates the last `rope_dim` dims in adjacent pairs,
/// non-interleaved the first `rope_dim` dims in halves.
fn rope_pairs(head: usize, rope_dim: usize, interleaved: bool) -> Vec<(usize, usize)> {
    let half = rope_dim / 2;
    if interleaved {
        let off = head - rope_dim;
        (0..half).map(|i| (off + 2 * i, off + 2 * i + 1)).collect()
    } else {
        (0..half).map(|i| (i, i + half)).collect()
    }
}

/// Rotates one pair ([semantics §5](crate::semantics)).
fn rope_pair<F: Element>(x0: f32, x1: f32, c: F, s: F, math: RopeMath) -> (f32, f32) {
    let (c, s) = (c.to_f32(), s.to_f32());
    match math {
        RopeMath::F32 => {
            let t1 = x1 * s;
            let t2 = x1 * c;
            (x0.mul_add(c, -t1), x0.mul_add(s, t2))
        }
        RopeMath::MaxCompat => {
            let r = |v: f32| F::from_f32(v).to_f32();
            let (x0, x1) = (r(x0), r(x1));
            let t1 = r(x1 * s);
            let y0 = r(x0.mul_add(c, -t1));
            let t2 = r(x1 * c);
            let y1 = r(x0.mul_add(s, t2));
            (y0, y1)
        }
    }
}

fn rotate<T: Element, F: Element>(src: &[T], dst: &mut [T], f: &[F], pairs: &[(usize, usize)], math: RopeMath) {
    for (i, &(j0, j1)) in pairs.iter().enumerate() {
        let (y0, y1) = rope_pair(src[j0].to_f32(), src[j1].to_f32(), f[2 * i], f[2 * i + 1], math);
        dst[j0] = T::from_f32(y0);
        dst[j1] = T::from_f32(y1);
    }
}

fn rotate_k<C: Element, F: Element>(
    cache: &mut PagedKvCacheMut<'_, C>,
    layer: usize,
    block: usize,
    offset: usize,
    f: &[F],
    pairs: &[(usize, usize)],
    math: RopeMath,
) {
    let shape = cache.shape();
    let d = shape.head_size();
    let data = cache.data_mut();
    for h in 0..shape.num_kv_heads() {
        let base = shape.index(block, 0, layer, offset, h, 0);
        let head = &mut data[base..base + d];
        for (i, &(j0, j1)) in pairs.iter().enumerate() {
            let (y0, y1) = rope_pair(head[j0].to_f32(), head[j1].to_f32(), f[2 * i], f[2 * i + 1], math);
            head[j0] = C::from_f32(y0);
            head[j1] = C::from_f32(y1);
        }
    }
}
