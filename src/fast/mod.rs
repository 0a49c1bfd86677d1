//! The fast paths: runtime-dispatched SIMD kernels, cache-blocked tasks on rayon, and a fused
//! epilogue that routes each finished value to Q, the K cache or the V cache.
//!
//! | operation | raw weight (packed per call) | prepacked weight (a server's path) |
//! |---|---|---|
//! | block-scaled fused QKV (NVFP4, MXFP4, MXFP8) | [`qkv_fp4_ragged`] | [`qkv_fp4_ragged_packed`] ([`PackedWeights`]) |
//! | FP8 W8A8 fused QKV (E4M3, f32 scales per tensor, channel or 128-block; + bias) | [`qkv_fp8_ragged`] | [`qkv_fp8_ragged_packed`] ([`PackedFp8Weights`]) |
//! | bf16/f16/f32 fused QKV, ragged (+ bias) | [`qkv_ragged`] | [`qkv_ragged_packed`] ([`PackedPlainWeights`]) |
//! | bf16/f16/f32 fused QKV, padded BSHD | [`qkv_bshd`] | [`qkv_bshd_packed`] |
//! | the same kernels into a plain `[M, N]` matrix | | [`matmul_fp4_packed`], [`matmul_plain_packed`] |
//! | RoPE on Q and the new K, padded / ragged | [`rope_bshd`], [`rope_ragged`] | (or fused: the `rope` argument of every fused QKV) |
//! | K or V store, ragged / padded | [`kv_store_ragged`], [`kv_store_bshd`] | |
//!
//! Every entry point takes the oracle's arguments (plus [`Exec`]), validates them exactly as the
//! oracle does before anything is written, and returns the same errors.
//!
//! # Determinism
//! Results are **bitwise identical** for every thread count, batch composition and M (no split-K;
//! every element is computed by one task in a fixed order), and for every ISA, with one
//! exception: [`Isa::Avx512Bf16`] on bf16 weights flushes subnormal operands, products and partial
//! sums to zero (`vdpbf16ps`), so it can differ where one appears. A NaN result is NaN on every
//! ISA, but its sign and payload are not promised (an FMA returns one of its NaN operands, and
//! which one depends on the instruction form). The arithmetic orders are
//! described in the module docs of `crate::simd`; the tests check every available ISA bit for
//! bit against the scalar kernel.
//!
//! # Accuracy (against the oracle's `Exact` mode)
//! * FP4 formats: each block's integer sum is exact, so
//!   `|fast − exact| ≤ (Kb + 2) · 2^-24 · Σ_blocks |block term| · |tensor_sf|` before the final
//!   rounding to the destination (Kb = blocks per row).
//! * MXFP8 (every ISA: E4M3 widened exactly through IEEE half, f32 FMAs) also sums inside a
//!   block in f32:
//!   `≤ (K + Kb + 2) · 2^-24 · Σ_k |term| · |tensor_sf|`.
//! * FP8 W8A8: the sum `Σ a·w` as MXFP8's (unit block scales) before its rounding to the output
//!   dtype, `≤ (K + Kb + 2) · 2^-24 · Σ_k |a·w|`; with 128-block scales
//!   `≤ (K + Kb + 3·⌈K/128⌉ + 2) · 2^-24 · Σ_k |a·w·sa·sw|`. The scale and bias steps that follow
//!   (in the output dtype, as MAX) are the oracle's operations.
//! * bf16/f16/f32: `≤ (K + 2) · 2^-24 · Σ_k |a_k · w_k|` for the product (a chain of K FMAs);
//!   AVX-512 BF16 adds up to `K · 2^-126` where it flushes subnormals. A bias is added as MAX adds
//!   it, to the product rounded to the destination's dtype (the same step in every mode:
//!   [semantics §4](crate::semantics)); into an E4M3 cache, `Σ + bias` is rounded once (bound
//!   `(K + 2) · 2^-24 · (Σ_k |a_k · w_k| + |bias|)`).
//! * Subnormal results add at most `2^-149` per rounding.
//!
//! Elements the fast order cannot be trusted with — a non-finite fast value (an overflowing block
//! term, for example: the true result may be finite), an MX scale product that could fall below
//! f32's normal range, a NaN scale or a NaN MXFP8 weight element — are recomputed exactly and
//! equal the oracle's `Exact` result.
//!
//! # Examples
//! The server's path (pack once, call per step) is the `serve_decode` example
//! (`cargo run --release --example serve_decode`); each entry point below has a short one.

use crate::cache::quant::Stage;
use crate::cache::{KvSel, KvWrite, SlotPlan};
use crate::dtype::E4M3;
use crate::element::Element;
use crate::error::{Error, Result, weight_rows};
use crate::formats::QuantizedRef;
use crate::kernels::epilogue::{Dest, EpiRope, EpiSpec, MatrixDest, QkvDest};
use crate::kernels::fp8::{Fp8Operands, prepare_acts};
use crate::kernels::kvquant::{QuantCache, quantize_rows};
use crate::kernels::operands::{Fp4Operands, PlainOperands};
use crate::kernels::pack::{Fp4Acts, PlainActs};
use crate::kernels::rope::{
    Bases, Planned, RopeSpec, RowSlots, Seqs, rope_rows, rope_rows_quant, slot_bases, store_rows,
};
use crate::kernels::schedule::{Panels, run};
use crate::kernels::team::Team;
pub use crate::kernels::{PackedFp8Weights, PackedPlainWeights, PackedWeights};
use crate::ops::optional_parts;
use crate::ops::{
    Fp8Scales, KvStoreBshdArgs, KvStoreRaggedArgs, QkvBshdArgs, QkvFp4Args, QkvFp8Args, QkvRaggedArgs, QkvRope,
    RopeBshdArgs, RopeMath, RopeRaggedArgs, check_tensor, kv_store_bshd_slots, kv_store_ragged_slots, rope_bshd_slots,
    rope_ragged_slots, validate_fp4, validate_fp8, validate_fp8_args, validate_kv_store_bshd, validate_kv_store_ragged,
    validate_qkv_bshd, validate_qkv_ragged, validate_rope_bshd, validate_rope_ragged, with_freqs,
};
pub use crate::simd::Isa;
use crate::simd::IsaToken;
use crate::simd::rope::{Round, same_type_mut};
pub use crate::workers::Workers;

/// Where the work runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Par {
    /// On the calling thread.
    Sequential,
    /// On the current rayon pool (the global one, or the pool of an enclosing `pool.install`).
    #[default]
    Rayon,
    /// On a long-lived [`Workers`] team: the server's choice for decode steps, whose calls are
    /// too short to pay rayon's wake-ups (docs/performance.md, "Per-call cost").
    Workers(&'static Workers),
}

/// The execution argument of every fast entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Exec {
    /// Threads.
    pub par: Par,
    /// Force an ISA (`None`: the best detected). Forcing one this CPU lacks is an error.
    pub isa: Option<Isa>,
}

impl Exec {
    /// Single-threaded, best ISA.
    pub fn sequential() -> Self {
        Exec { par: Par::Sequential, isa: None }
    }
    /// The same, with `isa` forced.
    pub fn with_isa(self, isa: Isa) -> Self {
        Exec { isa: Some(isa), ..self }
    }
    /// Every thread of `workers`, best ISA.
    pub fn on(workers: &'static Workers) -> Self {
        Exec { par: Par::Workers(workers), isa: None }
    }
    fn team(self) -> Team {
        match self.par {
            Par::Sequential => Team::One,
            Par::Rayon => Team::Rayon,
            Par::Workers(w) => Team::Workers(w),
        }
    }
}

/// Arguments of [`qkv_fp4_ragged_packed`]: as [`QkvFp4Args`], with a prepacked weight.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QkvFp4PackedArgs<'a> {
    /// The ragged activations `[M, K]` with `input_scale`.
    pub hidden_state: QuantizedRef<'a>,
    /// `[batch + 1]`.
    pub input_row_offsets: &'a [u32],
    /// The fused weight, packed once by [`PackedWeights::new`].
    pub weight: &'a PackedWeights,
    /// Multiplies the f32 accumulator: `hidden_state.tensor_scale() · weight.tensor_scale()`.
    pub tensor_sf: f32,
    /// Columns routed to `output`.
    pub q_dim: usize,
    /// RoPE on Q and the new K in the epilogue (`None`: no rotation).
    pub rope: Option<QkvRope<'a>>,
}

optional_parts!(QkvFp4PackedArgs<'a>);
optional_parts!(QkvRaggedPackedArgs<'a, T>, bias);
optional_parts!(QkvBshdPackedArgs<'a, T>);

impl<'a> QkvFp4PackedArgs<'a> {
    /// The arguments with `tensor_sf` formed from the two tensor scales
    /// (`hidden_state.tensor_scale() · weight.tensor_scale()`).
    pub fn new(
        hidden_state: QuantizedRef<'a>,
        input_row_offsets: &'a [u32],
        weight: &'a PackedWeights,
        q_dim: usize,
    ) -> Self {
        let tensor_sf = hidden_state.tensor_scale() * weight.tensor_scale();
        QkvFp4PackedArgs { hidden_state, input_row_offsets, weight, tensor_sf, q_dim, rope: None }
    }
    /// Another `tensor_sf`.
    pub fn with_tensor_sf(self, tensor_sf: f32) -> Self {
        QkvFp4PackedArgs { tensor_sf, ..self }
    }
}

impl<'a, T> QkvRaggedPackedArgs<'a, T> {
    /// The arguments without bias and RoPE.
    pub fn new(
        hidden_state: &'a [T],
        input_row_offsets: &'a [u32],
        weight: &'a PackedPlainWeights<T>,
        q_dim: usize,
    ) -> Self {
        QkvRaggedPackedArgs { hidden_state, input_row_offsets, weight, bias: None, q_dim, rope: None }
    }
}

impl<'a, T> QkvBshdPackedArgs<'a, T> {
    /// The arguments without RoPE.
    pub fn new(
        hidden_state: &'a [T],
        (batch, seq_len): (usize, usize),
        weight: &'a PackedPlainWeights<T>,
        valid_lengths: &'a [u32],
        q_dim: usize,
    ) -> Self {
        QkvBshdPackedArgs { hidden_state, batch, seq_len, weight, valid_lengths, q_dim, rope: None }
    }
}

/// Arguments of [`qkv_fp8_ragged_packed`]: as [`QkvFp8Args`], with a prepacked weight.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QkvFp8PackedArgs<'a, B = half::bf16> {
    /// `[M, K]` E4M3 bytes.
    pub hidden_state: &'a [u8],
    /// `[batch + 1]`, starting at 0, non-decreasing, ending at M.
    pub input_row_offsets: &'a [u32],
    /// The fused weight `[N, K]`, packed once by [`PackedFp8Weights::new`].
    pub weight: &'a PackedFp8Weights,
    /// The scales and their granularity.
    pub scales: Fp8Scales<'a>,
    /// Optional `[N]` bias, added in the output dtype ([semantics §4](crate::semantics)).
    pub bias: Option<&'a [B]>,
    /// Columns routed to `output`.
    pub q_dim: usize,
    /// RoPE on Q and the new K in the epilogue (`None`: no rotation).
    pub rope: Option<QkvRope<'a>>,
}

optional_parts!(QkvFp8PackedArgs<'a, B>, bias);

impl<'a, B> QkvFp8PackedArgs<'a, B> {
    /// The arguments without bias and RoPE.
    pub fn new(
        hidden_state: &'a [u8],
        input_row_offsets: &'a [u32],
        weight: &'a PackedFp8Weights,
        scales: Fp8Scales<'a>,
        q_dim: usize,
    ) -> Self {
        QkvFp8PackedArgs { hidden_state, input_row_offsets, weight, scales, bias: None, q_dim, rope: None }
    }
}

/// Arguments of [`qkv_ragged_packed`]: as [`QkvRaggedArgs`], with a prepacked weight.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QkvRaggedPackedArgs<'a, T> {
    /// `[M, hidden_size]`.
    pub hidden_state: &'a [T],
    /// `[batch + 1]`, starting at 0, non-decreasing, ending at M.
    pub input_row_offsets: &'a [u32],
    /// The fused weight `[N, hidden_size]`, packed once by [`PackedPlainWeights::new`].
    pub weight: &'a PackedPlainWeights<T>,
    /// Optional `[N]` bias, added as MAX adds it ([semantics §4](crate::semantics)).
    pub bias: Option<&'a [T]>,
    /// Columns routed to `output`.
    pub q_dim: usize,
    /// RoPE on Q and the new K in the epilogue (`None`: no rotation).
    pub rope: Option<QkvRope<'a>>,
}

/// Arguments of [`qkv_bshd_packed`]: as [`QkvBshdArgs`], with a prepacked weight.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QkvBshdPackedArgs<'a, T> {
    /// `[batch, seq_len, hidden_size]`, padded.
    pub hidden_state: &'a [T],
    /// Sequences.
    pub batch: usize,
    /// Padded sequence length.
    pub seq_len: usize,
    /// The fused weight `[N, hidden_size]`, packed once by [`PackedPlainWeights::new`].
    pub weight: &'a PackedPlainWeights<T>,
    /// `[batch]`: K/V are written (and computed) for `t < valid_lengths[b]` only; Q for every `t`.
    pub valid_lengths: &'a [u32],
    /// Columns routed to `output` (`[batch, seq_len, q_dim]`).
    pub q_dim: usize,
    /// RoPE on Q and the new K in the epilogue (`None`: no rotation).
    pub rope: Option<QkvRope<'a>>,
}

/// The fast [`reference::qkv_fp4_ragged`](crate::reference::qkv_fp4_ragged), with the MAX-shaped
/// raw weight: it is repacked on every call (a server packs once and calls
/// [`qkv_fp4_ragged_packed`]).
///
/// # Examples
/// ```
/// use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
/// use paged_qkv::{BlockFormat, CacheShape, Exec, KvWrite, PageTable, PagedKvCache, QkvFp4Args, bf16, fast};
///
/// # fn main() -> paged_qkv::Result<()> {
/// let (k, q_dim, n) = (64, 32, 64); // 2 Q heads and 1 KV head of 16
/// let x: Vec<f32> = (0..2 * k).map(|i| (i as f32 * 0.37).sin()).collect();
/// let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
/// let a = quantize(BlockFormat::Nvfp4, &x, 2, k, nvfp4_global_scale(amax(&x)))?;
/// let wq = quantize(BlockFormat::Nvfp4, &w, n, k, nvfp4_global_scale(amax(&w)))?;
/// let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(4, 1, 8, 1, 16)?);
/// let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[2], 1, &[0])?, 0);
/// let mut q = vec![bf16::ZERO; 2 * q_dim];
/// // tensor_sf: a.tensor_scale() · wq.tensor_scale() (`with_tensor_sf` sets another)
/// let args = QkvFp4Args::new(a.as_ref(), &[0, 2], wq.as_ref(), q_dim);
/// fast::qkv_fp4_ragged(&args, &mut q, &mut kv, Exec::default())?;
/// # Ok(())
/// # }
/// ```
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged_scale_float4")]
pub fn qkv_fp4_ragged<O: Element, C: Element>(
    args: &QkvFp4Args<'_>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    let w = args.weight;
    let plan = validate_fp4(
        args.hidden_state,
        args.input_row_offsets,
        (w.format(), w.rows(), w.k()),
        args.tensor_sf,
        (args.q_dim, args.rope.as_ref()),
        output.len(),
        kv,
    )?;
    let packed = PackedWeights::pack(w, exec.team());
    let packed_args = QkvFp4PackedArgs {
        hidden_state: args.hidden_state,
        input_row_offsets: args.input_row_offsets,
        weight: &packed,
        tensor_sf: args.tensor_sf,
        q_dim: args.q_dim,
        rope: args.rope,
    };
    fp4_into_cache(&packed_args, output, kv, exec, token, &plan);
    Ok(())
}

/// The fast fused QKV with a prepacked weight: validates everything, then runs the kernels and
/// routes Q to `output` and K/V into the cache (nothing is written on error). The
/// `serve_decode` example shows it in a decode loop.
///
/// # Examples
/// ```
/// use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
/// use paged_qkv::fast::{self, PackedWeights, QkvFp4PackedArgs};
/// use paged_qkv::{BlockFormat, CacheShape, Exec, KvWrite, PageTable, PagedKvCache, bf16};
///
/// # fn main() -> paged_qkv::Result<()> {
/// let (k, q_dim, n) = (64, 32, 64);
/// let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
/// let packed = PackedWeights::new(quantize(BlockFormat::Nvfp4, &w, n, k, nvfp4_global_scale(amax(&w)))?.as_ref());
/// let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.37).sin()).collect();
/// let a = quantize(BlockFormat::Nvfp4, &x, 1, k, nvfp4_global_scale(amax(&x)))?;
/// let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(4, 1, 8, 1, 16)?);
/// let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[1], 1, &[3])?, 0);
/// let mut q = vec![bf16::ZERO; q_dim];
/// let args = QkvFp4PackedArgs::new(a.as_ref(), &[0, 1], &packed, q_dim);
/// fast::qkv_fp4_ragged_packed(&args, &mut q, &mut kv, Exec::default())?;
/// assert_ne!(cache.get(1, 0, 0, 3, 0, 0), bf16::ZERO); // block 1, slot 3: position 3
/// # Ok(())
/// # }
/// ```
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged_scale_float4")]
pub fn qkv_fp4_ragged_packed<O: Element, C: Element>(
    args: &QkvFp4PackedArgs<'_>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    let w = args.weight;
    let plan = validate_fp4(
        args.hidden_state,
        args.input_row_offsets,
        (w.format(), w.rows(), w.k()),
        args.tensor_sf,
        (args.q_dim, args.rope.as_ref()),
        output.len(),
        kv,
    )?;
    fp4_into_cache(args, output, kv, exec, token, &plan);
    Ok(())
}

/// A validated call's slot plan and RoPE positions.
type Plan = (SlotPlan, crate::ops::Positions);

/// The kernels' rounding of a RoPE in `math` with freqs of `F` ([`RopeMath`] translated).
fn rounding<F: Element>(math: RopeMath, _freqs: &[F]) -> Round {
    match math {
        RopeMath::F32 => Round::None,
        RopeMath::MaxCompat => Round::of::<F>(),
    }
}

/// The routed destination of a validated fused QKV (with its RoPE, if any).
fn qkv_dest<'a, O: Element, C: Element>(
    output: &'a mut [O],
    kv: &'a mut KvWrite<'_, C>,
    (plan, positions): &Plan,
    (q_dim, n): (usize, usize),
    rope: Option<&QkvRope<'_>>,
    token: IsaToken,
) -> QkvDest<'a, O, C> {
    let shape = kv.cache.shape();
    let rope = rope.map(|r| {
        let spec = |round| EpiSpec { rope_dim: r.rope_dim, q_head: r.q_head_size, interleaved: r.interleaved, round };
        with_freqs!(r.freqs_cis, f => EpiRope::new(f, spec(rounding(r.math, f)), positions, token))
    });
    QkvDest::new(output, kv.cache.data_mut(), shape, kv.layer_idx, plan, q_dim, n, rope, token)
}

/// Runs a validated block-scaled call into the cache (nothing here can fail).
fn fp4_into_cache<O: Element, C: Element>(
    args: &QkvFp4PackedArgs<'_>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
    token: IsaToken,
    plan: &Plan,
) {
    if kv.scales.is_some() {
        return staged::<O, C, _>(kv, plan, exec, token, |kv, plan| {
            fp4_into_cache(args, output, kv, exec, token, plan)
        });
    }
    let m = args.hidden_state.rows();
    if m == 0 {
        return;
    }
    let shape = kv.cache.shape();
    let dest = qkv_dest(output, kv, plan, (args.q_dim, args.weight.rows()), args.rope.as_ref(), token);
    run_fp4(args.hidden_state, args.weight, args.tensor_sf, &dest, exec, token, shape.head_size());
}

fn run_fp4<D: Dest>(
    a: QuantizedRef<'_>,
    w: &PackedWeights,
    tensor_sf: f32,
    dest: &D,
    exec: Exec,
    token: IsaToken,
    head: usize,
) {
    let team = exec.team();
    let acts = Fp4Acts::prepare(a, token, team);
    let src = Fp4Operands { w, a: &acts, tensor_sf };
    // At least 128 columns (two heads of Qwen2.5-0.5B's 64): measured there on one thread,
    // M = 1 17.4 → 16.2 µs and M = 512 5.77 → 5.24 ms (fewer tasks, each operand set built once).
    // (Head-wide panels for calls of one row tile on several threads, so that two threads'
    // shares of Qwen's tasks come out even, 18 tasks instead of 9, measured slower: 2 threads
    // M = 1 8 → 9 µs, Zen 5, three alternating runs of `paged-qkv bench`. Nor did wider panels
    // that two threads share evenly, 6 of 192 columns instead of 9 of 128: bimodal, 4.9–5.2 µs
    // or 7.8–8.4 µs a call against 4.9–5.1 µs, three alternating runs of `bench --decode-step`.)
    let panels = Panels::new(w.rows(), Panels::target(head).max(128), |c| dest.may_cut(c));
    run(&src, dest, a.rows(), token, team, &panels);
}

/// The same block-scaled kernels writing a plain row-major `[M, N]` matrix
/// (`output[m, n] = round(tensor_sf · Σ …)`): a block-scaled GEMM `A · Wᵀ` without routing.
pub fn matmul_fp4_packed<O: Element>(
    a: QuantizedRef<'_>,
    weight: &PackedWeights,
    tensor_sf: f32,
    output: &mut [O],
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    if a.format() != weight.format() || a.k() != weight.k() {
        return Err(Error::FormatMismatch {
            hidden_state: a.format(),
            hidden_k: a.k(),
            weight: weight.format(),
            weight_k: weight.k(),
        });
    }
    if !tensor_sf.is_finite() {
        return Err(Error::NonFinite { arg: "tensor_sf", index: 0 });
    }
    let (m, n) = (a.rows(), weight.rows());
    check_tensor("output", output.len(), &[m, n])?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    run_fp4(a, weight, tensor_sf, &MatrixDest::new(output, n, token), exec, token, 128);
    Ok(())
}

/// The fast [`reference::qkv_fp8_ragged`](crate::reference::qkv_fp8_ragged) (FP8 W8A8 with
/// tensor, channel or block scales), with the raw weight: it is packed on every call (a server
/// packs once and calls [`qkv_fp8_ragged_packed`]).
///
/// # Examples
/// ```
/// use paged_qkv::{CacheShape, Exec, Fp8Scales, KvWrite, PageTable, PagedKvCache, QkvFp8Args, bf16, fast};
/// use paged_qkv::formats::fp8::e4m3_from_f32;
///
/// # fn main() -> paged_qkv::Result<()> {
/// let (k, q_dim, n) = (64, 32, 64); // 2 Q heads and 1 KV head of 16
/// let x: Vec<u8> = (0..2 * k).map(|i| e4m3_from_f32((i as f32 * 0.37).sin())).collect();
/// let w: Vec<u8> = (0..n * k).map(|i| e4m3_from_f32((i as f32 * 0.11).cos())).collect();
/// let scales = Fp8Scales::Tensor { input: 0.5, weight: 0.01 };
/// let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(4, 1, 8, 1, 16)?);
/// let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[2], 1, &[0])?, 0);
/// let mut q = vec![bf16::ZERO; 2 * q_dim];
/// let args: QkvFp8Args = QkvFp8Args::new(&x, &[0, 2], &w, k, scales, q_dim);
/// fast::qkv_fp8_ragged(&args, &mut q, &mut kv, Exec::default())?;
/// # Ok(())
/// # }
/// ```
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged_scale")]
#[doc(alias = "_fused_qkv_ragged_matmul_scaled_float8")]
pub fn qkv_fp8_ragged<B: Element, O: Element, C: Element>(
    args: &QkvFp8Args<'_, B>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    let (_, plan) = validate_fp8_args::<B, O, C>(args, output.len(), kv)?;
    let packed = PackedFp8Weights::pack(args.weight, args.hidden_size, exec.team())?;
    let packed_args = QkvFp8PackedArgs {
        hidden_state: args.hidden_state,
        input_row_offsets: args.input_row_offsets,
        weight: &packed,
        scales: args.scales,
        bias: args.bias,
        q_dim: args.q_dim,
        rope: args.rope,
    };
    fp8_into_cache(&packed_args, output, kv, exec, token, &plan)
}

/// The fast FP8 W8A8 fused QKV with a prepacked weight: validates everything, then runs the
/// kernels and routes Q to `output` and K/V into the cache (nothing is written on error).
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged_scale")]
pub fn qkv_fp8_ragged_packed<B: Element, O: Element, C: Element>(
    args: &QkvFp8PackedArgs<'_, B>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    let w = args.weight;
    let plan = validate_fp8::<O, C>(
        args.hidden_state.len(),
        args.input_row_offsets,
        (w.rows(), w.k()),
        &args.scales,
        args.bias.map(|b| b.len()),
        (args.q_dim, args.rope.as_ref()),
        output.len(),
        kv,
    )?;
    fp8_into_cache(args, output, kv, exec, token, &plan)
}

/// Runs a validated FP8 W8A8 call into the cache.
fn fp8_into_cache<B: Element, O: Element, C: Element>(
    args: &QkvFp8PackedArgs<'_, B>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
    token: IsaToken,
    plan: &Plan,
) -> Result<()> {
    if kv.scales.is_some() {
        return staged::<O, C, _>(kv, plan, exec, token, |kv, plan| {
            fp8_into_cache(args, output, kv, exec, token, plan)
        });
    }
    let (n, k) = (args.weight.rows(), args.weight.k());
    let m = args.hidden_state.len() / k;
    if m == 0 {
        return Ok(());
    }
    let team = exec.team();
    // Cannot fail on validated lengths; prepared before anything is written all the same.
    let acts = prepare_acts(args.hidden_state, m, k, token, team)?;
    let head = kv.cache.shape().head_size();
    let dest = qkv_dest(output, kv, plan, (args.q_dim, n), args.rope.as_ref(), token);
    let inner = Fp4Operands { w: &args.weight.inner, a: &acts, tensor_sf: 1.0 };
    let src = Fp8Operands::<B, O>::new(inner, args.scales, args.bias, m);
    let panels = Panels::new(n, Panels::target(head).max(128), |c| dest.may_cut(c));
    run(&src, &dest, m, token, team, &panels);
    Ok(())
}

/// The fast [`reference::qkv_ragged`](crate::reference::qkv_ragged) (bf16/f16/f32, optional
/// bias), with the raw weight packed on every call (a server packs once and calls
/// [`qkv_ragged_packed`]).
///
/// # Examples
/// ```
/// use paged_qkv::{CacheShape, Exec, KvWrite, PageTable, PagedKvCache, QkvRaggedArgs, bf16, fast};
///
/// # fn main() -> paged_qkv::Result<()> {
/// let (k, q_dim, n) = (64, 32, 64); // 2 Q heads and 1 KV head of 16
/// let x: Vec<bf16> = (0..3 * k).map(|i| bf16::from_f32((i as f32 * 0.37).sin())).collect();
/// let w: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32((i as f32 * 0.11).cos() / 8.0)).collect();
/// let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(4, 1, 8, 1, 16)?);
/// let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[0, 3], 1, &[5, 0])?, 0);
/// let mut q = vec![bf16::ZERO; 3 * q_dim];
/// let args = QkvRaggedArgs::new(&x, &[0, 2, 3], &w, k, q_dim);
/// fast::qkv_ragged(&args, &mut q, &mut kv, Exec::default())?;
/// # Ok(())
/// # }
/// ```
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged")]
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged_bias")]
pub fn qkv_ragged<T: Element, O: Element, C: Element>(
    args: &QkvRaggedArgs<'_, T>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    let k = args.hidden_size;
    let n = weight_rows(args.weight, k)?;
    let plan = validate_qkv_ragged(
        args.hidden_state.len(),
        args.input_row_offsets,
        (n, k),
        args.bias.map(|b| b.len()),
        (args.q_dim, args.rope.as_ref()),
        output.len(),
        kv,
    )?;
    let w = PackedPlainWeights::pack(args.weight, n, k, exec.team());
    let pargs = QkvRaggedPackedArgs {
        hidden_state: args.hidden_state,
        input_row_offsets: args.input_row_offsets,
        weight: &w,
        bias: args.bias,
        q_dim: args.q_dim,
        rope: args.rope,
    };
    plain_into_cache(
        args.hidden_state,
        &w,
        (pargs.bias, pargs.q_dim, pargs.rope.as_ref()),
        output,
        kv,
        exec,
        token,
        &plan,
    );
    Ok(())
}

/// [`qkv_ragged`] with a prepacked weight.
///
/// # Examples
/// ```
/// use paged_qkv::fast::{self, PackedPlainWeights, QkvRaggedPackedArgs};
/// use paged_qkv::{CacheShape, Exec, KvWrite, PageTable, PagedKvCache, bf16};
///
/// # fn main() -> paged_qkv::Result<()> {
/// let (k, q_dim, n) = (64, 32, 64);
/// let w: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32((i as f32 * 0.11).cos() / 8.0)).collect();
/// let bias = vec![bf16::from_f32(0.5); n];
/// let packed = PackedPlainWeights::new(&w, k)?; // once, at load time
/// let x: Vec<bf16> = (0..k).map(|i| bf16::from_f32((i as f32 * 0.37).sin())).collect();
/// let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(4, 1, 8, 1, 16)?);
/// let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[2], 1, &[7])?, 0);
/// let mut q = vec![bf16::ZERO; q_dim];
/// let args = QkvRaggedPackedArgs::new(&x, &[0, 1], &packed, q_dim).with_bias(&bias);
/// fast::qkv_ragged_packed(&args, &mut q, &mut kv, Exec::default())?;
/// # Ok(())
/// # }
/// ```
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged")]
#[doc(alias = "fused_qkv_matmul_kv_cache_paged_ragged_bias")]
pub fn qkv_ragged_packed<T: Element, O: Element, C: Element>(
    args: &QkvRaggedPackedArgs<'_, T>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    let w = args.weight;
    let plan = validate_qkv_ragged(
        args.hidden_state.len(),
        args.input_row_offsets,
        (w.rows(), w.k()),
        args.bias.map(|b| b.len()),
        (args.q_dim, args.rope.as_ref()),
        output.len(),
        kv,
    )?;
    plain_into_cache(args.hidden_state, w, (args.bias, args.q_dim, args.rope.as_ref()), output, kv, exec, token, &plan);
    Ok(())
}

/// The fast [`reference::qkv_bshd`](crate::reference::qkv_bshd) (MAX's
/// `fused_qkv_matmul_kv_cache_bshd_paged`), with the raw weight packed on every call. Padded rows
/// (`t ≥ valid_lengths[b]`) compute and write their Q columns only.
///
/// # Examples
/// ```
/// use paged_qkv::{CacheShape, Exec, KvWrite, PageTable, PagedKvCache, QkvBshdArgs, bf16, fast};
///
/// # fn main() -> paged_qkv::Result<()> {
/// let (k, q_dim, n, seq) = (64, 32, 64, 4);
/// let x: Vec<bf16> = (0..2 * seq * k).map(|i| bf16::from_f32((i as f32 * 0.37).sin())).collect();
/// let w: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32((i as f32 * 0.11).cos() / 8.0)).collect();
/// let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(4, 1, 8, 1, 16)?);
/// let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[0, 1], 1, &[0, 2])?, 0);
/// let mut q = vec![bf16::ZERO; 2 * seq * q_dim];
/// let args = QkvBshdArgs::new(&x, (2, seq, k), &w, &[4, 1], q_dim); // (batch, seq_len, hidden_size)
/// fast::qkv_bshd(&args, &mut q, &mut kv, Exec::default())?;
/// # Ok(())
/// # }
/// ```
#[doc(alias = "fused_qkv_matmul_kv_cache_bshd_paged")]
pub fn qkv_bshd<T: Element, O: Element, C: Element>(
    args: &QkvBshdArgs<'_, T>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    let k = args.hidden_size;
    let n = weight_rows(args.weight, k)?;
    let plan = validate_qkv_bshd(
        args.hidden_state.len(),
        (args.batch, args.seq_len),
        (n, k),
        args.valid_lengths,
        (args.q_dim, args.rope.as_ref()),
        output.len(),
        kv,
    )?;
    let w = PackedPlainWeights::pack(args.weight, n, k, exec.team());
    plain_into_cache(args.hidden_state, &w, (None, args.q_dim, args.rope.as_ref()), output, kv, exec, token, &plan);
    Ok(())
}

/// [`qkv_bshd`] with a prepacked weight.
#[doc(alias = "fused_qkv_matmul_kv_cache_bshd_paged")]
pub fn qkv_bshd_packed<T: Element, O: Element, C: Element>(
    args: &QkvBshdPackedArgs<'_, T>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    let w = args.weight;
    let plan = validate_qkv_bshd(
        args.hidden_state.len(),
        (args.batch, args.seq_len),
        (w.rows(), w.k()),
        args.valid_lengths,
        (args.q_dim, args.rope.as_ref()),
        output.len(),
        kv,
    )?;
    plain_into_cache(args.hidden_state, w, (None, args.q_dim, args.rope.as_ref()), output, kv, exec, token, &plan);
    Ok(())
}

/// Runs a validated bf16/f16/f32 call into the cache (nothing here can fail).
#[allow(clippy::too_many_arguments)]
fn plain_into_cache<T: Element, O: Element, C: Element>(
    x: &[T],
    w: &PackedPlainWeights<T>,
    (bias, q_dim, rope): (Option<&[T]>, usize, Option<&QkvRope<'_>>),
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
    token: IsaToken,
    plan: &Plan,
) {
    if kv.scales.is_some() {
        let parts = (bias, q_dim, rope);
        return staged::<O, C, _>(kv, plan, exec, token, |kv, plan| {
            plain_into_cache(x, w, parts, output, kv, exec, token, plan)
        });
    }
    let m = plan.0.rows.len();
    if m == 0 {
        return;
    }
    let shape = kv.cache.shape();
    let dest = qkv_dest(output, kv, plan, (q_dim, w.rows()), rope, token);
    run_plain(x, m, w, bias, &dest, exec, token, shape.head_size());
}

#[allow(clippy::too_many_arguments)]
fn run_plain<T: Element, D: Dest>(
    x: &[T],
    m: usize,
    w: &PackedPlainWeights<T>,
    bias: Option<&[T]>,
    dest: &D,
    exec: Exec,
    token: IsaToken,
    head: usize,
) {
    let acts = PlainActs::prepare(x, m, w.k(), token, w.kind, dest.kv_rows(), exec.team());
    let src = PlainOperands { w, a: &acts, bias, token };
    let panels = Panels::new(w.rows(), Panels::target(head), |c| dest.may_cut(c));
    run(&src, dest, m, token, exec.team(), &panels);
}

/// The bf16/f16/f32 kernels writing a plain row-major `[M, N]` matrix
/// (`output[m, n] = round(Σ_k x[m, k] · w[n, k] (+ bias[n]))`): `X · Wᵀ` without routing.
pub fn matmul_plain_packed<T: Element, O: Element>(
    x: &[T],
    weight: &PackedPlainWeights<T>,
    bias: Option<&[T]>,
    output: &mut [O],
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    let (k, n) = (weight.k(), weight.rows());
    if !x.len().is_multiple_of(k) {
        return Err(Error::Shape { arg: "hidden_state", expected: crate::error::Expected::RowsOf(k), found: x.len() });
    }
    let m = x.len() / k;
    if let Some(b) = bias {
        check_tensor("bias", b.len(), &[n])?;
    }
    check_tensor("output", output.len(), &[m, n])?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    run_plain(x, m, weight, bias, &MatrixDest::new(output, n, token), exec, token, 128);
    Ok(())
}

/// The fast [`reference::rope_bshd`](crate::reference::rope_bshd) (MAX's
/// `fused_qk_rope_bshd_paged`): the same arguments and validation, bit for bit the same results in
/// either math mode on every ISA; parallel over rows.
///
/// # Examples
/// ```
/// use paged_qkv::{CacheShape, Exec, KvWrite, PageTable, PagedKvCache, RopeBshdArgs, RopeMath, bf16, fast};
///
/// # fn main() -> paged_qkv::Result<()> {
/// let (heads, d) = (2, 8);
/// let freqs: Vec<bf16> = paged_qkv::freqs_cis(16, d, 10000.0).into_iter().map(bf16::from_f32).collect();
/// let q = vec![bf16::ONE; 3 * heads * d]; // [batch 1, seq 3, heads, d]
/// let mut out = vec![bf16::ZERO; q.len()];
/// let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(2, 1, 4, 1, d)?);
/// let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[1], 1, &[0])?, 0);
/// // (batch, seq_len, num_q_heads); valid_lengths [2]: the third row is padding, its output
/// // is not written; interleaved pairs.
/// let args = RopeBshdArgs::new(&q, (1, 3, heads), &freqs, &[2], true);
/// fast::rope_bshd(&args, &mut out, &mut kv, RopeMath::F32, Exec::default())?;
/// assert_eq!(out[2 * heads * d], bf16::ZERO);
/// # Ok(())
/// # }
/// ```
#[doc(alias = "fused_qk_rope_bshd_paged")]
pub fn rope_bshd<T: Element, C: Element>(
    args: &RopeBshdArgs<'_, T>,
    output: &mut [T],
    kv: &mut KvWrite<'_, C>,
    math: RopeMath,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    let shape = kv.cache.shape();
    let d = shape.head_size();
    with_freqs!(args.freqs_cis, freqs => {
        let spec = RopeSpec {
            freqs,
            rope_dim: d,
            interleaved: args.interleaved,
            round: rounding(math, freqs),
            q_heads: (args.num_q_heads, d),
            k_heads: (shape.num_kv_heads(), d),
        };
        let team = exec.team();
        // As in `rope_ragged`: no pass over the rows where none is needed.
        if let Some(slots) = rope_bshd_slots(args, output.len(), kv) {
            let slots = Seqs { slots, ids: None };
            rope_rows(token, team, &spec, args.q_proj, output, kv.cache.data_mut(), &slots);
            return Ok(());
        }
        let plan = validate_rope_bshd(args, output.len(), kv)?;
        rope_planned(token, exec, &spec, args.q_proj, output, kv, &plan);
        Ok(())
    })
}

/// The fast [`reference::rope_ragged`](crate::reference::rope_ragged) (MAX's `fused_qk_rope_ragged`:
/// partial rotary, position ids, MLA head sizes): the same arguments and validation, bit for bit
/// the same results in either math mode on every ISA; parallel over rows.
///
/// # Examples
/// ```
/// use paged_qkv::{CacheShape, Exec, KvWrite, PageTable, PagedKvCache, RopeMath, RopeRaggedArgs, fast};
///
/// # fn main() -> paged_qkv::Result<()> {
/// let freqs = paged_qkv::freqs_cis(64, 4, 10000.0); // rope_dim 4 of heads of 8
/// let q = vec![1.0f32; 2 * 8]; // 2 tokens, 1 head of 8
/// let mut out = vec![0.0f32; q.len()];
/// let mut cache = PagedKvCache::<f32>::zeros(CacheShape::mha(2, 1, 4, 1, 8)?);
/// let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[0, 1], 1, &[0, 0])?, 0);
/// // 1 Q head of 8, rope_dim 4, half-split pairs; the two rows at positions 7 and 9
/// let args = RopeRaggedArgs::new(&q, &[0, 1, 2], (1, 8), &freqs, 4, false).with_position_ids(&[7, 9]);
/// fast::rope_ragged(&args, &mut out, &mut kv, RopeMath::F32, Exec::default())?;
/// assert_eq!(out[4..8], [1.0; 4]); // the last 4 dims are not rotary: copied
/// # Ok(())
/// # }
/// ```
#[doc(alias = "fused_qk_rope_ragged")]
pub fn rope_ragged<T: Element, C: Element>(
    args: &RopeRaggedArgs<'_, T>,
    output: &mut [T],
    kv: &mut KvWrite<'_, C>,
    math: RopeMath,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    let shape = kv.cache.shape();
    with_freqs!(args.freqs_cis, freqs => {
        let spec = RopeSpec {
            freqs,
            rope_dim: args.rope_dim,
            interleaved: args.interleaved,
            round: rounding(math, freqs),
            q_heads: (args.num_q_heads, args.q_head_size),
            k_heads: (shape.num_kv_heads(), shape.head_size()),
        };
        let team = exec.team();
        // The usual call (no two written pages in one block, nothing invalid) needs no pass over
        // its rows before the kernels: each row finds its slot from its sequence when it is
        // rotated. Otherwise the full validation finds the error, or checks every slot.
        if let Some(slots) = rope_ragged_slots(args, output.len(), kv) {
            let slots = Seqs { slots, ids: args.position_ids };
            rope_rows(token, team, &spec, args.q_proj, output, kv.cache.data_mut(), &slots);
            return Ok(());
        }
        let plan = validate_rope_ragged(args, output.len(), kv)?;
        rope_planned(token, exec, &spec, args.q_proj, output, kv, &plan);
        Ok(())
    })
}

/// The fast [`reference::kv_store_ragged`](crate::reference::kv_store_ragged) (MAX's
/// `kv_cache_store_ragged`): the same validation and results; parallel over rows.
#[doc(alias = "kv_cache_store_ragged")]
pub fn kv_store_ragged<T: Element, C: Element>(
    args: &KvStoreRaggedArgs<'_, T>,
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    // As in `rope_ragged`: no pass over the rows where none is needed.
    if let Some(slots) = kv_store_ragged_slots(args, kv) {
        store(token, exec, args.values, args.which, kv, &Seqs { slots, ids: None });
        return Ok(());
    }
    let plan = validate_kv_store_ragged(args, kv)?;
    store_planned(token, exec, args.values, args.which, kv, &plan);
    Ok(())
}

/// The fast [`reference::kv_store_bshd`](crate::reference::kv_store_bshd) (MAX's
/// `kv_cache_store_padded`): the same validation and results; parallel over rows.
#[doc(alias = "kv_cache_store_padded")]
pub fn kv_store_bshd<T: Element, C: Element>(
    args: &KvStoreBshdArgs<'_, T>,
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
) -> Result<()> {
    let token = IsaToken::new(exec.isa)?;
    if let Some(slots) = kv_store_bshd_slots(args, kv) {
        store(token, exec, args.values, args.which, kv, &Seqs { slots, ids: None });
        return Ok(());
    }
    let plan = validate_kv_store_bshd(args, kv)?;
    store_planned(token, exec, args.values, args.which, kv, &plan);
    Ok(())
}

/// A validated store from its plan: into the slots, or quantized into them.
fn store_planned<T: Element, C: Element>(
    token: IsaToken,
    exec: Exec,
    values: &[T],
    which: KvSel,
    kv: &mut KvWrite<'_, C>,
    plan: &SlotPlan,
) {
    let shape = kv.cache.shape();
    if let Some(scales) = &mut kv.scales {
        let rows: Vec<_> = plan.rows.iter().enumerate().filter_map(|(r, s)| s.map(|s| (r, s))).collect();
        let g = scales.granularity();
        let dst = QuantCache {
            data: kv.cache.data_mut(),
            scales: scales.data_mut(),
            shape,
            layer: kv.layer_idx,
            granularity: g,
        };
        quantize_rows(token, exec.team(), values, shape.kv_width(), &rows, &[(which, 0)], dst);
        return;
    }
    let bases = slot_bases(plan, &shape, kv.layer_idx, 0);
    store(token, exec, values, which, kv, &Bases(&bases));
}

/// A validated RoPE from its plan (directly, or through a staging cache for a quantized one).
fn rope_planned<T: Element, F: Element, C: Element>(
    token: IsaToken,
    exec: Exec,
    spec: &RopeSpec<'_, F>,
    q_proj: &[T],
    output: &mut [T],
    kv: &mut KvWrite<'_, C>,
    plan: &Plan,
) {
    let bases = slot_bases(&plan.0, &kv.cache.shape(), kv.layer_idx, 0);
    let slots = Planned { bases: &bases, positions: &plan.1 };
    if let Some(scales) = &mut kv.scales {
        // One pass per row (dequantize, rotate, requantize) rather than `staged`'s passes.
        let (shape, layer, granularity) = (kv.cache.shape(), kv.layer_idx, scales.granularity());
        let Some(data) = same_type_mut::<C, E4M3>(kv.cache.data_mut()) else {
            unreachable!("a quantized cache holds E4M3 codes (checked by the validation)")
        };
        let dst = QuantCache { data, scales: scales.data_mut(), shape, layer, granularity };
        return rope_rows_quant(token, exec.team(), spec, q_proj, output, dst, &slots);
    }
    rope_rows(token, exec.team(), spec, q_proj, output, kv.cache.data_mut(), &slots);
}

/// A fused QKV's write into a quantized cache (the oracle's `staged`,
/// [semantics §3.1](crate::semantics)): `write` runs the usual kernels into a staging cache of
/// `S` (one slot per written row), then the staged rows (K and V; K alone for MLA) are
/// quantized into their slots. (A RoPE takes one pass per row instead: `rope_rows_quant`.)
fn staged<S: Element, C: Element, R>(
    kv: &mut KvWrite<'_, C>,
    plan: &Plan,
    exec: Exec,
    token: IsaToken,
    write: impl FnOnce(&mut KvWrite<'_, S>, &Plan) -> R,
) -> R {
    let shape = kv.cache.shape();
    // Cannot fail: the staged rows are distinct slots of the cache, so the staging cache is no
    // larger than the cache.
    let mut st = Stage::<S>::new(&plan.0, shape).expect("a staging cache no larger than the cache");
    let Some(scales) = &mut kv.scales else { unreachable!("staged writes are quantized") };
    let g = scales.granularity();
    let stride = st.shape.kv_dim() * shape.kv_width();
    let splan = (st.plan.clone(), plan.1.clone());
    let r = write(&mut st.kv(kv.page_table), &splan);
    let v = shape.kv_width();
    let parts: &[(KvSel, usize)] = if shape.is_mla() { &[(KvSel::K, 0)] } else { &[(KvSel::K, 0), (KvSel::V, v)] };
    let dst =
        QuantCache { data: kv.cache.data_mut(), scales: scales.data_mut(), shape, layer: kv.layer_idx, granularity: g };
    quantize_rows(token, exec.team(), &st.data, stride, &st.rows, parts, dst);
    r
}

fn store<T: Element, C: Element>(
    token: IsaToken,
    exec: Exec,
    values: &[T],
    which: KvSel,
    kv: &mut KvWrite<'_, C>,
    slots: &impl RowSlots,
) {
    let shape = kv.cache.shape();
    let v_offset = shape.index(0, which as usize, 0, 0, 0, 0);
    store_rows(token, exec.team(), values, kv.cache.data_mut(), slots, (v_offset, shape.kv_width()));
}
