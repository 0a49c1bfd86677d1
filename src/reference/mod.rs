//! The scalar oracle: one slow, obviously correct function per operation, written from
//! [the semantics](crate::semantics). No SIMD, no threads. Every fast path is judged against it.
//!
//! Each function validates all of its arguments first (see [`crate::ops`]); on any error the
//! output and the whole cache are unchanged. Matmul results are formed as one pre-rounding value
//! per (row, column) and rounded **once** to the destination type: Q to the output dtype, K/V to
//! the cache dtype (FP8 saturates), as [semantics §9](crate::semantics) says.

pub(crate) mod exact;

use crate::cache::{KvSel, KvWrite, PagedKvCacheMut, SlotPlan};
use crate::element::Element;
use crate::error::{Error, Result};
use crate::formats::fp8::{e4m3_to_units, e8m0_to_f32};
use crate::formats::{BlockFormat, QuantizedRef, fp4};
use crate::ops::{
    Accumulation, KvStoreBshdArgs, KvStoreRaggedArgs, QkvBshdArgs, QkvFp4Args, QkvRaggedArgs, RopeBshdArgs, RopeMath,
    RopeRaggedArgs, check_table_batch, check_tensor, check_valid_lengths, freqs_rows, padded_rows, ragged_rows,
    validate_fp4, validate_qkv_bshd, validate_qkv_ragged, weight_rows,
};
use exact::{ExactSum, f32_parts};

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
    let plan = validate_fp4(
        a,
        args.input_row_offsets,
        (w.format(), w.rows(), w.k()),
        args.tensor_sf,
        args.q_dim,
        output.len(),
        kv,
    )?;

    let tsf = args.tensor_sf;
    match mode {
        Accumulation::Sequential => route(w.rows(), args.q_dim, output, kv, &plan, |r, vals| {
            let (av, sa) = decode_row(a, r);
            for (j, v) in vals.iter_mut().enumerate() {
                *v = fp4_sequential(&av, &sa, w, j, tsf);
            }
        }),
        Accumulation::Exact => route(w.rows(), args.q_dim, output, kv, &plan, |r, vals| {
            let ar = exact_row(a, r);
            for (j, v) in vals.iter_mut().enumerate() {
                *v = fp4_exact(&ar, &exact_row(w, j), a, tsf);
            }
        }),
    }
    Ok(())
}

/// Fused QKV projection of a ragged batch of bf16/f16/f32 activations (MAX's non-quantized
/// sibling `fused_qkv_matmul_kv_cache_paged_ragged`, plus its optional bias): routing as in
/// [`qkv_fp4_ragged`]; the bias `[N]` is added to the accumulator before the one rounding.
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
    let plan = validate_qkv_ragged(
        args.hidden_state.len(),
        args.input_row_offsets,
        (n, k),
        args.bias.map(|b| b.len()),
        args.q_dim,
        output.len(),
        kv,
    )?;
    route(n, args.q_dim, output, kv, &plan, |r, vals| {
        plain_row(&args.hidden_state[r * k..(r + 1) * k], args.weight, args.bias, k, mode, vals)
    });
    Ok(())
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
    let plan = validate_qkv_bshd(
        args.hidden_state.len(),
        (args.batch, args.seq_len),
        (n, k),
        args.valid_lengths,
        args.q_dim,
        output.len(),
        kv,
    )?;
    route(n, args.q_dim, output, kv, &plan, |r, vals| {
        plain_row(&args.hidden_state[r * k..(r + 1) * k], args.weight, None, k, mode, vals)
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
    let shape = kv.cache.shape();
    let d = shape.head_size();
    if !d.is_multiple_of(2) {
        return Err(Error::dim("kv_blocks", format!("head_size must be even for RoPE pairs, found {d}")));
    }
    let (batch, s, hq) = (args.batch, args.seq_len, args.num_q_heads);
    if hq == 0 {
        // Zero heads would let any (batch, seq_len) pass with an empty q_proj.
        return Err(Error::dim("num_q_heads", "must be at least 1"));
    }
    check_tensor("q_proj", args.q_proj.len(), &[batch, s, hq, d])?;
    check_tensor("output", output.len(), &[batch, s, hq, d])?;
    check_valid_lengths(args.valid_lengths, batch, s)?;
    check_table_batch(&kv.page_table, batch)?;
    let rows = freqs_rows(args.freqs_cis, d)?;
    for (b, &v) in args.valid_lengths.iter().enumerate() {
        if v > 0 {
            check_freqs_row(kv.page_table.cache_length(b) as u64 + v as u64 - 1, rows)?;
        }
    }
    let writes = padded_rows(args.valid_lengths, s);
    let plan = SlotPlan::build(&kv.page_table, &shape, kv.layer_idx, &writes)?;

    let pairs = rope_pairs(d, d, args.interleaved);
    for (r, slot) in plan.rows.iter().enumerate() {
        let Some(slot) = slot else { continue };
        let f = &args.freqs_cis[slot.pos as usize * d..][..d];
        for h in 0..hq {
            let base = (r * hq + h) * d;
            rotate(&args.q_proj[base..base + d], &mut output[base..base + d], f, &pairs, math);
        }
        rotate_k(&mut kv.cache, kv.layer_idx, slot.block, slot.offset, f, &pairs, math);
    }
    Ok(())
}

/// RoPE on a ragged batch with optional partial rotary and position ids (MAX's
/// `fused_qk_rope_ragged`, [semantics §5](crate::semantics)). Q (`[M, num_q_heads, q_head_size]`) is written to `output`
/// whole: rotated dims rotated, the others copied. K is rotated in place at `cache_lengths[b] + t`
/// over its own head size (the cache's), the other K dims untouched.
///
/// Supported: one position per token (`position_ids` `[M]`); MAX's multi-section mrope is not.
#[doc(alias = "fused_qk_rope_ragged")]
pub fn rope_ragged<T: Element, F: Element, C: Element>(
    args: &RopeRaggedArgs<'_, T, F>,
    output: &mut [T],
    kv: &mut KvWrite<'_, C>,
    math: RopeMath,
) -> Result<()> {
    let shape = kv.cache.shape();
    let (hq, dq, dk, rd) = (args.num_q_heads, args.q_head_size, shape.head_size(), args.rope_dim);
    if hq == 0 {
        return Err(Error::dim("num_q_heads", "must be at least 1"));
    }
    if rd == 0 || rd % 2 != 0 || rd > dq || rd > dk {
        return Err(Error::dim(
            "rope_dim",
            format!("must be even, ≥ 2 and ≤ both head sizes (q {dq}, k {dk}), found {rd}"),
        ));
    }
    let m = args.input_row_offsets.last().map_or(0, |&x| x as usize);
    check_tensor("q_proj", args.q_proj.len(), &[m, hq, dq])?;
    check_tensor("output", output.len(), &[m, hq, dq])?;
    let rows = ragged_rows(args.input_row_offsets, m)?;
    check_table_batch(&kv.page_table, args.input_row_offsets.len() - 1)?;
    let freq_rows = freqs_rows(args.freqs_cis, rd)?;
    if let Some(ids) = args.position_ids {
        check_tensor("position_ids", ids.len(), &[m])?;
    }
    let position = |i: usize, b: usize, t: usize| -> u64 {
        match args.position_ids {
            Some(ids) => ids[i] as u64,
            None => kv.page_table.cache_length(b) as u64 + t as u64,
        }
    };
    for (i, &(b, t)) in rows.iter().enumerate() {
        check_freqs_row(position(i, b, t), freq_rows)?;
    }
    let positions: Vec<u64> = rows.iter().enumerate().map(|(i, &(b, t))| position(i, b, t)).collect();
    let writes: Vec<_> = rows.iter().map(|&(b, t)| (b, t, true)).collect();
    let plan = SlotPlan::build(&kv.page_table, &shape, kv.layer_idx, &writes)?;

    let q_pairs = rope_pairs(dq, rd, args.interleaved);
    let k_pairs = rope_pairs(dk, rd, args.interleaved);
    for (r, slot) in plan.rows.iter().enumerate() {
        let Some(slot) = slot else { continue };
        let f = &args.freqs_cis[positions[r] as usize * rd..][..rd];
        for h in 0..hq {
            let base = (r * hq + h) * dq;
            output[base..base + dq].copy_from_slice(&args.q_proj[base..base + dq]);
            rotate(&args.q_proj[base..base + dq], &mut output[base..base + dq], f, &q_pairs, math);
        }
        rotate_k(&mut kv.cache, kv.layer_idx, slot.block, slot.offset, f, &k_pairs, math);
    }
    Ok(())
}

/// Stores a ragged `[M, num_kv_heads, head_size]` K or V tensor at `cache_lengths[b] + t`
/// (MAX's `kv_cache_store_ragged`), rounding once to the cache dtype.
#[doc(alias = "kv_cache_store_ragged")]
pub fn kv_store_ragged<T: Element, C: Element>(args: &KvStoreRaggedArgs<'_, T>, kv: &mut KvWrite<'_, C>) -> Result<()> {
    let shape = kv.cache.shape();
    check_kv_sel(args.which, &shape)?;
    let m = args.input_row_offsets.last().map_or(0, |&x| x as usize);
    check_tensor("values", args.values.len(), &[m, shape.num_kv_heads(), shape.head_size()])?;
    let rows = ragged_rows(args.input_row_offsets, m)?;
    check_table_batch(&kv.page_table, args.input_row_offsets.len() - 1)?;
    let writes: Vec<_> = rows.iter().map(|&(b, t)| (b, t, true)).collect();
    let plan = SlotPlan::build(&kv.page_table, &shape, kv.layer_idx, &writes)?;
    store_rows(args.values, args.which, kv, &plan);
    Ok(())
}

/// Stores a padded `[batch, seq_len, num_kv_heads, head_size]` K or V tensor at
/// `cache_lengths[b] + t` for `t < valid_lengths[b]` (MAX's `kv_cache_store_padded`).
#[doc(alias = "kv_cache_store_padded")]
pub fn kv_store_bshd<T: Element, C: Element>(args: &KvStoreBshdArgs<'_, T>, kv: &mut KvWrite<'_, C>) -> Result<()> {
    let shape = kv.cache.shape();
    check_kv_sel(args.which, &shape)?;
    let (batch, s) = (args.batch, args.seq_len);
    check_tensor("values", args.values.len(), &[batch, s, shape.num_kv_heads(), shape.head_size()])?;
    check_valid_lengths(args.valid_lengths, batch, s)?;
    check_table_batch(&kv.page_table, batch)?;
    let writes = padded_rows(args.valid_lengths, s);
    let plan = SlotPlan::build(&kv.page_table, &shape, kv.layer_idx, &writes)?;
    store_rows(args.values, args.which, kv, &plan);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Validation helpers local to the oracle.

fn check_freqs_row(position: u64, rows: usize) -> Result<()> {
    if position < rows as u64 { Ok(()) } else { Err(Error::FreqsRows { position, rows }) }
}

fn check_kv_sel(which: KvSel, shape: &crate::cache::CacheShape) -> Result<()> {
    if which == KvSel::V && shape.is_mla() {
        Err(Error::Unsupported { what: "storing V into an MLA (K-only) cache".into() })
    } else {
        Ok(())
    }
}

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

/// Row `x` times the first `vals.len()` weight rows (+ bias), as `mode` says.
fn plain_row<T: Element>(x: &[T], w: &[T], bias: Option<&[T]>, k: usize, mode: Accumulation, vals: &mut [f64]) {
    for (j, out) in vals.iter_mut().enumerate() {
        let wr = &w[j * k..(j + 1) * k];
        let b = bias.map(|b| b[j].to_f32());
        *out = match mode {
            Accumulation::Sequential => {
                let mut acc = 0.0f32;
                for (a, c) in x.iter().zip(wr) {
                    acc += a.to_f32() * c.to_f32();
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

/// For every row of the plan: computes its values with `row_values(r, vals)` (all `n` columns
/// when the row has a slot, else its `q_dim` Q columns), then writes Q to `output[r]` and K/V
/// through the cache router, each rounded once.
fn route<O: Element, C: Element>(
    n: usize,
    q_dim: usize,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    plan: &SlotPlan,
    mut row_values: impl FnMut(usize, &mut [f64]),
) {
    let shape = kv.cache.shape();
    let layer = kv.layer_idx;
    let data = kv.cache.data_mut();
    let mut vals = vec![0.0; n];
    for (r, slot) in plan.rows.iter().enumerate() {
        let width = if slot.is_some() { n } else { q_dim };
        row_values(r, &mut vals[..width]);
        for (o, &v) in output[r * q_dim..(r + 1) * q_dim].iter_mut().zip(&vals[..q_dim]) {
            *o = O::from_f64(v);
        }
        let Some(slot) = slot else { continue };
        let base = shape.slot_base(slot.block, layer, slot.offset);
        for (j, &v) in vals[q_dim..].iter().enumerate() {
            data[base + shape.kv_column_offset(j)] = C::from_f64(v);
        }
    }
}

fn store_rows<T: Element, C: Element>(values: &[T], which: KvSel, kv: &mut KvWrite<'_, C>, plan: &SlotPlan) {
    let shape = kv.cache.shape();
    let width = shape.kv_width();
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
