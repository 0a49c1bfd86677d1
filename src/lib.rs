#![doc = include_str!("../README.md")]
//!
//! # Modules
//!
//! * [`fast`]: the SIMD + rayon fast paths ([`Exec`] picks threads and ISA) — a server's path.
//! * [`reference`](mod@reference): the scalar oracle of every operation, the judge of the fast
//!   paths and of GPU kernels.
//! * [`formats`]: E2M1, E4M3, E8M0, the 5-D scale layout, quantizers.
//! * [`cache`]: the paged cache (owned or a view of caller memory), its page table, the router.
//! * [`ops`]: argument types, accumulation / rounding modes, the RoPE table builder.
//! * [`semantics`]: what each operation computes (the repository's `docs/semantics.md`).
//! * `case` (feature `case`, on by default): case files for checking GPU kernels.
#![deny(unsafe_code)]
// allowed only in `simd` (kernels), `kernels::{scatter, epilogue, schedule, rope}` (parallel writes) and `workers` (the job hand-off)
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub mod cache;
#[cfg(feature = "case")]
pub mod case;
mod dtype;
pub mod element;
pub mod error;
mod exact;
pub mod fast;
pub mod formats;
mod kernels;
pub mod ops;
pub mod reference;
#[doc = include_str!("../docs/semantics.md")]
pub mod semantics {}
mod pool;
mod simd;
mod workers;

pub use cache::{CacheShape, KvScales, KvScalesMut, KvSel, KvWrite, PageTable, PagedKvCache, PagedKvCacheMut};
pub use element::{DType, Element};
pub use error::{Error, Expected, Result, TokenRef};
pub use fast::{Exec, Isa, Par, QkvBshdPackedArgs, QkvFp4PackedArgs, QkvFp8PackedArgs, QkvRaggedPackedArgs, Workers};
pub use formats::fp8::E4M3;
pub use formats::{BlockFormat, QuantizedMatrix, QuantizedRef};
pub use half::{bf16, f16};
pub use kernels::{PackedFp8Weights, PackedPlainWeights, PackedWeights};
pub use ops::{
    Accumulation, FP8_BLOCK, Fp8Granularity, Fp8Scales, Freqs, FreqsElement, KvStoreBshdArgs, KvStoreRaggedArgs,
    QkvBshdArgs, QkvFp4Args, QkvFp8Args, QkvRaggedArgs, QkvRope, RopeBshdArgs, RopeMath, RopeRaggedArgs, freqs_cis,
};
