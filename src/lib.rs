//! # paged-qkv
//!
//! CPU kernels, and a scalar oracle for them, for the prologue of attention in an inference
//! server: one pass computes Q, K and V from the hidden state, K and V land straight in a **paged
//! KV cache**, and RoPE rotates Q and the new K in place. The operations follow Modular MAX's
//! kernels of the same names bit for bit in layout (FP4 nibble order, NVIDIA's 5-D block-scale
//! layout, the paged cache `[num_blocks, kv_dim, num_layers, page_size, num_kv_heads, head_size]`),
//! and validate everything MAX leaves unchecked. What each operation computes is written out in
//! [`semantics`] (the repository's `docs/semantics.md`).
//!
//! * [`fast`]: the SIMD + rayon fast paths ([`Exec`] picks threads and ISA) — a server's path.
//! * [`reference`](mod@reference): the scalar oracle of every operation, the judge of the fast
//!   paths and of GPU kernels.
//! * [`formats`]: E2M1, E4M3, E8M0, the 5-D scale layout, quantizers.
//! * [`cache`]: the paged cache (owned or a view of caller memory), its page table, the router.
//! * [`ops`]: argument types, accumulation / rounding modes, the RoPE table builder.
//! * `case` (feature `case`, on by default): case files for checking GPU kernels.
//!
//! # Example: one decode step
//! Pack the weight once, then per step quantize the new tokens' hidden states and call the fast
//! fused QKV: Q comes back, K and V land in their cache slots (the `serve_decode` example grows
//! the page table over many steps).
//!
//! ```
//! use paged_qkv::fast::{self, PackedWeights, QkvFp4PackedArgs};
//! use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
//! use paged_qkv::{BlockFormat, CacheShape, Exec, KvWrite, PageTable, PagedKvCache, bf16};
//!
//! # fn main() -> paged_qkv::Result<()> {
//! let (k, heads, kv_heads, head) = (64, 2, 1, 16);
//! let (q_dim, n) = (heads * head, (heads + 2 * kv_heads) * head);
//! // At load time: quantize (or load) and pack the fused Q|K|V weight.
//! let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
//! let weight = PackedWeights::new(quantize(BlockFormat::Nvfp4, &w, n, k, nvfp4_global_scale(amax(&w)))?.as_ref());
//! let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(8, 1, 4, kv_heads, head)?);
//!
//! // One step: two sequences with 5 and 0 cached tokens, one new token each.
//! let x: Vec<f32> = (0..2 * k).map(|i| (i as f32 * 0.37).sin()).collect();
//! let a = quantize(BlockFormat::Nvfp4, &x, 2, k, nvfp4_global_scale(amax(&x)))?;
//! let (lookup, cache_lengths) = ([3u32, 6, 0, 7], [5u32, 0]); // [batch, 2 pages]
//! let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&lookup, 2, &cache_lengths)?, 0);
//! let mut q = vec![bf16::ZERO; 2 * q_dim];
//! let args = QkvFp4PackedArgs::new(a.as_ref(), &[0, 1, 2], &weight, q_dim);
//! fast::qkv_fp4_ragged_packed(&args, &mut q, &mut kv, Exec::default())?;
//! // Sequence 0's token is position 5: page 1 → block 6, slot 1.
//! assert_ne!(cache.get(6, 0, 0, 1, 0, 0), bf16::ZERO);
//! # Ok(())
//! # }
//! ```
#![deny(unsafe_code)] // allowed only in `simd` (kernels) and `kernels::{scatter, epilogue, schedule, rope}` (parallel writes)
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod cache;
#[cfg(feature = "case")]
pub mod case;
pub mod element;
pub mod error;
pub mod fast;
pub mod formats;
mod kernels;
pub mod ops;
pub mod reference;
#[doc = include_str!("../docs/semantics.md")]
pub mod semantics {}
mod pool;
mod simd;

pub use cache::{CacheShape, KvSel, KvWrite, PageTable, PagedKvCache, PagedKvCacheMut};
pub use element::{DType, Element};
pub use error::{Error, Expected, Result, TokenRef};
pub use fast::{Exec, Isa, Par, QkvBshdPackedArgs, QkvFp4PackedArgs, QkvRaggedPackedArgs};
pub use formats::fp8::E4M3;
pub use formats::{BlockFormat, QuantizedMatrix, QuantizedRef};
pub use half::{bf16, f16};
pub use kernels::{PackedPlainWeights, PackedWeights};
pub use ops::{
    Accumulation, KvStoreBshdArgs, KvStoreRaggedArgs, QkvBshdArgs, QkvFp4Args, QkvRaggedArgs, RopeBshdArgs, RopeMath,
    RopeRaggedArgs, freqs_cis,
};

/// The README's examples, compiled and run as doctests so that they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
