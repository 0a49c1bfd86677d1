//! The fast paths' kernel layer, one file per pipeline stage:
//!
//! ```text
//! operand bytes ──pack──▶ packed panels ──simd micro-kernels──▶ f32 tile ──epilogue──▶ output | K | V
//!   (pack.rs)              (per family)     (crate::simd)        (schedule.rs)  (epilogue.rs)
//! ```
//!
//! * `pack`: one packer per operand family (block-scaled weights and activations; bf16/f16/f32
//!   weights and activations). The only place a format is decoded.
//! * `operands`: a family's packed operands as the scheduler sees them: compute a tile (through
//!   `crate::simd`), turn an accumulator into the value to round, compute an element exactly.
//! * `schedule`: head-aligned column panels, row tiles, tasks on the call's `team` (the calling
//!   thread, rayon, or a `Workers` team).
//! * `epilogue`: destinations (a plain matrix, or Q/K/V routed into the paged cache), rounding
//!   once, per-head transforms.
//! * `scatter`: the parallel disjoint writes (`SharedMut`). With `epilogue`, `schedule` and `rope`
//!   (which write through it under their SAFETY arguments), and `crate::workers` (the job
//!   hand-off), the only unsafe code outside `crate::simd`.
//!
//! No `[M, N]` intermediate exists. The kernels take their own descriptions of a call (`RopeSpec`,
//! `EpiSpec`: rounding modes, not the public `RopeMath`); `crate::fast` translates the public
//! argument types into them.

pub(crate) mod epilogue;
pub(crate) mod fp8;
pub(crate) mod kvquant;
pub(crate) mod operands;
pub(crate) mod pack;
pub(crate) mod rope;
pub(crate) mod scatter;
pub(crate) mod schedule;
pub(crate) mod team;

pub use fp8::PackedFp8Weights;
pub use pack::{PackedPlainWeights, PackedWeights};

/// Largest head (in dims) the fused-RoPE epilogue rotates (its per-thread scratch size; the
/// validation of every path rejects larger heads).
pub(crate) const MAX_FUSED_HEAD: usize = 1024;
