//! # paged-qkv
//!
//! CPU kernels, and a scalar oracle for them, for the prologue of attention in an inference
//! server: one pass computes Q, K and V from the hidden state, K and V land straight in a **paged
//! KV cache**, and RoPE rotates Q and the new K in place. The operations follow Modular MAX's
//! kernels of the same names bit for bit in layout (FP4 nibble order, NVIDIA's 5-D block-scale
//! layout, the paged cache `[num_blocks, kv_dim, num_layers, page_size, num_kv_heads, head_size]`),
//! and validate everything MAX leaves unchecked.
//!
//! * [`formats`]: E2M1, E4M3, E8M0, the 5-D scale layout, quantizers.
//! * [`cache`]: the paged cache (owned or a view of caller memory) and its page table.
//! * [`reference`](mod@reference): the scalar oracle of every operation.
//! * [`ops`]: argument types and accumulation / rounding modes.
//! * [`fast`]: the SIMD + rayon fast paths ([`Exec`] picks threads and ISA).
#![deny(unsafe_code)] // allowed only in `simd` (kernels) and `kernels::scatter` (parallel writes)
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod cache;
pub mod case;
pub mod element;
pub mod error;
pub mod fast;
pub mod formats;
mod kernels;
pub mod ops;
pub mod reference;
mod simd;

pub use cache::{CacheShape, KvSel, KvWrite, PageTable, PagedKvCache, PagedKvCacheMut};
pub use element::{DType, Element};
pub use error::{Error, Result, TokenRef};
pub use fast::{Exec, Isa, Par, QkvFp4PackedArgs};
pub use formats::fp8::E4M3;
pub use formats::{BlockFormat, QuantizedMatrix, QuantizedRef};
pub use half::{bf16, f16};
pub use kernels::PackedWeights;

/// The README's example, compiled and run as a doctest so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
pub use ops::{
    Accumulation, KvStoreBshdArgs, KvStoreRaggedArgs, QkvBshdArgs, QkvFp4Args, QkvRaggedArgs, RopeBshdArgs, RopeMath,
    RopeRaggedArgs,
};
