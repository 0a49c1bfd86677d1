//! The fast paths: runtime-dispatched SIMD kernels, cache-blocked tasks on rayon, and a fused
//! epilogue that routes each finished value to Q, the K cache or the V cache.
//!
//! Results are **bitwise identical** for every ISA, thread count, batch composition and M
//! (decode and prefill tilings share one arithmetic order, see `crate::simd`), and differ from the
//! oracle's `Exact` mode only by f32 summation: for the FP4 formats each block's integer sum is
//! exact and `|fast − exact| ≤ (Kb + 2) · 2^-24 · Σ_blocks |block term| · |tensor_sf|` plus the
//! final rounding; MXFP8 (scalar kernel, all ISAs) also sums inside a block in f32:
//! `≤ (K + Kb + 2) · 2^-24 · Σ_k |term|`. For MX scales this holds while every scale product
//! lies in f32's normal range (outside it the product flushes to 0 or overflows to ∞).

use crate::cache::{KvWrite, SlotPlan};
use crate::element::Element;
use crate::error::{Error, Result};
use crate::formats::QuantizedRef;
use crate::kernels::{Acts, Epilogue, PackedWeights, Tiling, run};
use crate::ops::{QkvFp4Args, validate_fp4};
pub use crate::simd::Isa;
use crate::simd::IsaToken;

/// Where the work runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Par {
    /// On the calling thread.
    Sequential,
    /// On the current rayon pool (the global one, or the pool of an enclosing `pool.install`).
    #[default]
    Rayon,
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
}

/// Arguments of [`qkv_fp4_ragged_packed`]: as [`QkvFp4Args`], with a prepacked weight.
#[derive(Debug, Clone, Copy)]
pub struct QkvFp4PackedArgs<'a> {
    /// The ragged activations `[M, K]` with `input_scale`.
    pub hidden_state: QuantizedRef<'a>,
    /// `[batch + 1]`.
    pub input_row_offsets: &'a [u32],
    /// The fused weight, packed once by [`PackedWeights::new`].
    pub weight: &'a PackedWeights,
    /// Multiplies the f32 accumulator.
    pub tensor_sf: f32,
    /// Columns routed to `output`.
    pub q_dim: usize,
}

/// The fast fused QKV of [`reference::qkv_fp4_ragged`](crate::reference::qkv_fp4_ragged), with
/// the MAX-shaped raw weight: it is repacked on every call (a server should pack once and call
/// [`qkv_fp4_ragged_packed`]).
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
        args.q_dim,
        output.len(),
        kv,
    )?;
    let packed = PackedWeights::pack(w, exec.par == Par::Rayon);
    let packed_args = QkvFp4PackedArgs {
        hidden_state: args.hidden_state,
        input_row_offsets: args.input_row_offsets,
        weight: &packed,
        tensor_sf: args.tensor_sf,
        q_dim: args.q_dim,
    };
    execute(&packed_args, output, kv, exec, token, &plan);
    Ok(())
}

/// The fast fused QKV with a prepacked weight: validates everything, then runs the kernels and
/// routes Q to `output` and K/V into the cache (nothing is written on error).
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
        args.q_dim,
        output.len(),
        kv,
    )?;
    execute(args, output, kv, exec, token, &plan);
    Ok(())
}

/// Runs a validated call (nothing here can fail).
fn execute<O: Element, C: Element>(
    args: &QkvFp4PackedArgs<'_>,
    output: &mut [O],
    kv: &mut KvWrite<'_, C>,
    exec: Exec,
    token: IsaToken,
    plan: &SlotPlan,
) {
    let w = args.weight;
    let m = args.hidden_state.rows();
    if m == 0 {
        return;
    }
    let acts = Acts::prepare(args.hidden_state);
    // FP4 block sums are of doubled E2M1 values on both sides: 4× the products (exact scaling).
    let mult = if w.format().is_fp4() { args.tensor_sf * 0.25 } else { args.tensor_sf };
    let shape = kv.cache.shape();
    let layer = kv.layer_idx;
    let epi = Epilogue::new(
        output,
        kv.cache.data_mut(),
        shape,
        layer,
        plan,
        args.q_dim,
        w.rows(),
        acts.nan_row(),
        w.nan_col(),
        mult,
    );
    run(w, &acts, m, token, exec.par == Par::Rayon, &epi, Tiling::choose(m, shape.head_size()));
}

/// The same kernels writing a plain row-major `[M, N]` matrix
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
            what: format!(
                "a is {} with K = {}, weight is {} with K = {}",
                a.format().name(),
                a.k(),
                weight.format().name(),
                weight.k()
            ),
        });
    }
    if !tensor_sf.is_finite() {
        return Err(Error::NonFinite { arg: "tensor_sf", index: 0 });
    }
    let (m, n) = (a.rows(), weight.rows());
    crate::ops::check_tensor("output", output.len(), &[m, n])?;
    if m == 0 {
        return Ok(());
    }
    let acts = Acts::prepare(a);
    let mult = if weight.format().is_fp4() { tensor_sf * 0.25 } else { tensor_sf };
    let mut no_cache: [O; 0] = [];
    let plan = crate::cache::SlotPlan { rows: vec![None; m] };
    let shape = crate::cache::CacheShape::mha(1, 1, 1, 1, 1)?;
    let epi =
        Epilogue::<O, O>::new(output, &mut no_cache, shape, 0, &plan, n, n, acts.nan_row(), weight.nan_col(), mult);
    run(weight, &acts, m, token, exec.par == Par::Rayon, &epi, Tiling::choose(m, 128));
    Ok(())
}
