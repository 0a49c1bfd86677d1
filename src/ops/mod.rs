//! Argument types of the operations and the validation every implementation shares.
//!
//! Each operation exists as a scalar oracle in [`reference`](mod@crate::reference); every entry point validates
//! all of its arguments (shapes, offsets, page table, capacity, slot conflicts) before it writes
//! anything, so an error leaves the output and the cache unchanged.

use crate::cache::{CacheShape, KvSel, KvWrite, PageTable, SeqSlots, SlotPlan};
use crate::element::Element;
use crate::error::{Error, Expected, Result, checked_len};
use crate::formats::{BlockFormat, QuantizedRef};
use crate::kernels::MAX_FUSED_HEAD;
use crate::pool::Pooled;

/// How the reference accumulates a dot product.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Accumulation {
    /// MAX's order bit for bit: bf16/f16/f32, MAX's CPU matmul (an f32 FMA chain over k = 0..K−1,
    /// then the bias step); block-scaled, MAX's naive reference (`naive_block_scaled_matmul_kernel`:
    /// k in order in f32, then × `tensor_sf`, then one rounding).
    Sequential,
    /// Exact accumulation of the exact products (and of `tensor_sf`), one rounding at the end: the
    /// true value, correctly rounded (a bias then added as MAX adds it). The judge of every fast
    /// path.
    #[default]
    Exact,
}

/// How RoPE rounds: an argument of every RoPE entry point and of fused RoPE, independent of the
/// accumulation mode (every mode and ISA gives the same bits). `MaxCompat` is MAX's semantics and
/// the default of the command line, case files and Python; `Default` here stays `F32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RopeMath {
    /// f32 math: `y0 = fma(x0, c, −(x1·s))`, `y1 = fma(x0, s, x1·c)` in f32, then one rounding to
    /// the destination type.
    #[default]
    F32,
    /// MAX's sequence ([semantics §5](crate::semantics)) in the freqs dtype T: `t1 = rT(x1·s)`, `y0 = rT(fma(x0, c, −t1))`,
    /// `t2 = rT(x1·c)`, `y1 = rT(fma(x0, s, t2))`, with the FMA evaluated in f32 and rounded to T
    /// (MAX's CPU promotion; a native bf16 FMA can differ in rare double-rounding cases).
    MaxCompat,
}

/// A `freqs_cis` table of one of the element types RoPE accepts (f32, bf16 or f16): the one
/// spelling of RoPE frequencies in every argument struct. Made from a slice or `Vec` of any of
/// the three by `From` (`(&freqs).into()`, or passed to a constructor as `&freqs`).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Freqs<'a> {
    /// f32 (the math is f32 in both modes).
    F32(&'a [f32]),
    /// bf16 (`MaxCompat` rounds to bf16).
    Bf16(&'a [half::bf16]),
    /// f16 (`MaxCompat` rounds to f16).
    F16(&'a [half::f16]),
}

impl Freqs<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Freqs::F32(f) => f.len(),
            Freqs::Bf16(f) => f.len(),
            Freqs::F16(f) => f.len(),
        }
    }
    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `s` as a table where its element type is one RoPE accepts (f32, bf16, f16), else `None`.
    pub fn of<F: Element>(s: &[F]) -> Option<Freqs<'_>> {
        use crate::simd::rope::same_type;
        same_type::<F, f32>(s)
            .map(Freqs::F32)
            .or_else(|| same_type::<F, half::bf16>(s).map(Freqs::Bf16))
            .or_else(|| same_type::<F, half::f16>(s).map(Freqs::F16))
    }
    /// The table's element type.
    pub fn dtype(&self) -> crate::DType {
        match self {
            Freqs::F32(_) => crate::DType::F32,
            Freqs::Bf16(_) => crate::DType::BF16,
            Freqs::F16(_) => crate::DType::F16,
        }
    }
}

/// Runs `$body` with `$f` bound to the table's slice, once per element type (the generic code
/// inside is instantiated for each).
macro_rules! with_freqs {
    ($freqs:expr, $f:ident => $body:expr) => {
        match $freqs {
            $crate::ops::Freqs::F32($f) => $body,
            $crate::ops::Freqs::Bf16($f) => $body,
            $crate::ops::Freqs::F16($f) => $body,
        }
    };
}
pub(crate) use with_freqs;

/// The element types a [`Freqs`] table holds: f32, bf16 and f16 (sealed).
pub trait FreqsElement: Element {
    /// The slice as a [`Freqs`].
    fn freqs(s: &[Self]) -> Freqs<'_>;
}
impl FreqsElement for f32 {
    fn freqs(s: &[f32]) -> Freqs<'_> {
        Freqs::F32(s)
    }
}
impl FreqsElement for half::bf16 {
    fn freqs(s: &[half::bf16]) -> Freqs<'_> {
        Freqs::Bf16(s)
    }
}
impl FreqsElement for half::f16 {
    fn freqs(s: &[half::f16]) -> Freqs<'_> {
        Freqs::F16(s)
    }
}

impl<'a, F: FreqsElement> From<&'a [F]> for Freqs<'a> {
    fn from(f: &'a [F]) -> Self {
        F::freqs(f)
    }
}
impl<'a, F: FreqsElement> From<&'a Vec<F>> for Freqs<'a> {
    fn from(f: &'a Vec<F>) -> Self {
        F::freqs(f)
    }
}
impl<'a, F: FreqsElement, const N: usize> From<&'a [F; N]> for Freqs<'a> {
    fn from(f: &'a [F; N]) -> Self {
        F::freqs(f)
    }
}

/// RoPE fused into a fused QKV operation ([semantics §5](crate::semantics)): Q and the new K are
/// rotated before they are written, with the arguments of
/// [`rope_ragged`](crate::reference::rope_ragged) (the Q heads are the output's `q_dim` columns in
/// heads of `q_head_size`; K uses the cache's head size). The result is bit-identical to the QKV
/// operation followed by the standalone RoPE in the same math mode. With the BSHD operation the
/// rotation covers whole heads (`rope_dim` = both head sizes), rows `t < valid_lengths[b]` only, and
/// no `position_ids`, as [`rope_bshd`](crate::reference::rope_bshd).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QkvRope<'a> {
    /// `[rows, rope_dim]`: row `p` is `cos(p θ_0), sin(p θ_0), cos(p θ_1), …`.
    pub freqs_cis: Freqs<'a>,
    /// Q head size: `q_dim` is a whole number of Q heads.
    pub q_head_size: usize,
    /// Rotary dimensions (even, ≥ 2, ≤ both head sizes).
    pub rope_dim: usize,
    /// Pairs `(2i, 2i+1)` when true, `(i, i + rope_dim/2)` when false.
    pub interleaved: bool,
    /// Optional `[M]` positions selecting the freqs row (ragged operations only).
    pub position_ids: Option<&'a [u32]>,
    /// How the rotation rounds.
    pub math: RopeMath,
}

/// Arguments of [`qkv_fp4_ragged`](crate::reference::qkv_fp4_ragged)
/// (MAX: `fused_qkv_matmul_kv_cache_paged_ragged_scale_float4`).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QkvFp4Args<'a> {
    /// The ragged activations `[M, K]` (`M = input_row_offsets[batch]`) with `input_scale`.
    pub hidden_state: QuantizedRef<'a>,
    /// `[batch + 1]`, starting at 0, non-decreasing, ending at M.
    pub input_row_offsets: &'a [u32],
    /// The fused weight `[N, K]` (Q | K | V rows) with `weight_scale`.
    pub weight: QuantizedRef<'a>,
    /// Multiplies the f32 accumulator (cuBLAS `alpha`): `tensor_sf = a.tensor_scale · w.tensor_scale`.
    pub tensor_sf: f32,
    /// Columns routed to `output` (`output.dim(1)` in MAX).
    pub q_dim: usize,
    /// RoPE on Q and the new K in the epilogue (`None`: no rotation).
    pub rope: Option<QkvRope<'a>>,
}

/// Elements per scale block of [`Fp8Scales::Block`] along K, and weight rows per block (MAX's
/// `scales_granularity_mnk = (1, 128, 128)`: activations in 1×128 blocks, weights in 128×128).
pub const FP8_BLOCK: usize = 128;

/// How an FP8 W8A8 product's scales are laid out ([`Fp8Scales`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Fp8Granularity {
    /// One scale per tensor.
    #[default]
    Tensor,
    /// One scale per token and one per weight row.
    Channel,
    /// 1×128 activation blocks, 128×128 weight blocks.
    Block,
}

impl Fp8Granularity {
    /// All three.
    pub const ALL: [Fp8Granularity; 3] = [Fp8Granularity::Tensor, Fp8Granularity::Channel, Fp8Granularity::Block];
    /// `tensor`, `channel` or `block`.
    pub fn name(self) -> &'static str {
        match self {
            Fp8Granularity::Tensor => "tensor",
            Fp8Granularity::Channel => "channel",
            Fp8Granularity::Block => "block",
        }
    }
    /// Parses [`name`](Self::name).
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|g| g.name() == s)
    }
    /// The shapes of `(input_scale, weight_scale)` for `m` tokens and an `[n, k]` weight, as MAX
    /// lays them out (what [`Fp8Scales::infer`] recognises).
    pub fn scale_shapes(self, m: usize, n: usize, k: usize) -> ([usize; 2], [usize; 2]) {
        let kb = k.div_ceil(FP8_BLOCK);
        match self {
            Fp8Granularity::Tensor => ([1, 1], [1, 1]),
            Fp8Granularity::Channel => ([1, m], [n, 1]),
            Fp8Granularity::Block => ([kb, m], [n.div_ceil(FP8_BLOCK), kb]),
        }
    }
}

/// The f32 scales of an FP8 W8A8 product ([`QkvFp8Args`]) and their granularity, as MAX's
/// `_fused_qkv_ragged_matmul_scaled_float8` takes them (`input_scale`, `weight_scale`).
/// [`Fp8Scales::infer`] picks the granularity from the two tensors' shapes, as MAX does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fp8Scales<'a> {
    /// One scale per tensor (MAX: both `[1, 1]`, granularity `(-1, -1, -1)`).
    Tensor {
        /// The activations' scale.
        input: f32,
        /// The weight's scale.
        weight: f32,
    },
    /// One scale per token and one per weight row (MAX: `input_scale [1, M]`,
    /// `weight_scale [N, 1]`, granularity `(1, 1, -1)`). A one-element side is shared by every
    /// token (or row): MAX reads past such a tensor, this crate broadcasts it.
    Channel {
        /// `[M]` or `[1]`.
        input: &'a [f32],
        /// `[N]` or `[1]`.
        weight: &'a [f32],
    },
    /// Activations in 1×[`FP8_BLOCK`] blocks, weights in [`FP8_BLOCK`]² blocks (MAX's
    /// `scales_granularity_mnk = (1, 128, 128)`, as DeepSeek-V3 and Qwen3 FP8 checkpoints store
    /// them). Both are k-block-major, as MAX lays them out.
    Block {
        /// `[ceil(K/128), M]`: element `kb · M + m`.
        input: &'a [f32],
        /// `[ceil(N/128), ceil(K/128)]`: element `(n/128) · ceil(K/128) + kb`.
        weight: &'a [f32],
    },
}

impl<'a> Fp8Scales<'a> {
    /// The granularity MAX infers from the scale tensors' shapes (for `M` tokens, `N` weight
    /// rows, `K` columns): both `[1, 1]` (or `[]`, `[1]`) per tensor; `input [1, M]` with
    /// `weight [N, 1]` per channel (either side may be `[1, 1]`); `input [ceil(K/128), M]` with
    /// `weight [ceil(N/128), ceil(K/128)]` per block (MAX needs a `quant_config` for this one).
    /// Anything else is an error naming the tensor whose shape does not fit.
    pub fn infer(
        (input, input_shape): (&'a [f32], &[usize]),
        (weight, weight_shape): (&'a [f32], &[usize]),
        (m, n, k): (usize, usize, usize),
    ) -> Result<Self> {
        let as2 = |arg: &'static str, s: &[usize], len: usize| -> Result<[usize; 2]> {
            let d = match *s {
                [] => [1, 1],
                [a] => [1, a],
                [a, b] => [a, b],
                _ => return Err(Error::Shape { arg, expected: Expected::Rank(2), found: s.len() }),
            };
            check_tensor(arg, len, &d)?;
            Ok(d)
        };
        let (si, sw) =
            (as2("input_scale", input_shape, input.len())?, as2("weight_scale", weight_shape, weight.len())?);
        let (kb, nb) = (k.div_ceil(FP8_BLOCK), n.div_ceil(FP8_BLOCK));
        if si == [1, 1] && sw == [1, 1] {
            return Ok(Fp8Scales::Tensor { input: input[0], weight: weight[0] });
        }
        if si[0] == 1 && sw[1] == 1 {
            if si[1] != m && si[1] != 1 {
                return Err(Error::dims("input_scale", &[1, m], input.len()));
            }
            if sw[0] != n && sw[0] != 1 {
                return Err(Error::dims("weight_scale", &[n, 1], weight.len()));
            }
            return Ok(Fp8Scales::Channel { input, weight });
        }
        if si != [kb, m] {
            return Err(Error::dims("input_scale", &[kb, m], input.len()));
        }
        if sw != [nb, kb] {
            return Err(Error::dims("weight_scale", &[nb, kb], weight.len()));
        }
        Ok(Fp8Scales::Block { input, weight })
    }

    /// The granularity.
    pub fn granularity(&self) -> Fp8Granularity {
        match self {
            Fp8Scales::Tensor { .. } => Fp8Granularity::Tensor,
            Fp8Scales::Channel { .. } => Fp8Granularity::Channel,
            Fp8Scales::Block { .. } => Fp8Granularity::Block,
        }
    }

    /// The scales of granularity `g` over the slices (as [`Fp8Granularity::scale_shapes`] lays
    /// them out; a tensor scale is element 0 of each, which must not be empty). The lengths
    /// are checked by the operations.
    pub fn of(g: Fp8Granularity, input: &'a [f32], weight: &'a [f32]) -> Self {
        match g {
            Fp8Granularity::Tensor => Fp8Scales::Tensor {
                input: input.first().copied().unwrap_or(f32::NAN),
                weight: weight.first().copied().unwrap_or(f32::NAN),
            },
            Fp8Granularity::Channel => Fp8Scales::Channel { input, weight },
            Fp8Granularity::Block => Fp8Scales::Block { input, weight },
        }
    }

    /// Checks the lengths for `m` tokens and an `[n, k]` weight, and that every scale is finite.
    pub(crate) fn check(&self, m: usize, n: usize, k: usize) -> Result<()> {
        let finite = |arg: &'static str, v: &[f32]| match v.iter().position(|x| !x.is_finite()) {
            Some(index) => Err(Error::NonFinite { arg, index }),
            None => Ok(()),
        };
        match *self {
            Fp8Scales::Tensor { input, weight } => {
                finite("input_scale", &[input])?;
                finite("weight_scale", &[weight])
            }
            Fp8Scales::Channel { input, weight } => {
                if input.len() != m && input.len() != 1 {
                    return Err(Error::dims("input_scale", &[m], input.len()));
                }
                if weight.len() != n && weight.len() != 1 {
                    return Err(Error::dims("weight_scale", &[n], weight.len()));
                }
                finite("input_scale", input)?;
                finite("weight_scale", weight)
            }
            Fp8Scales::Block { input, weight } => {
                let kb = k.div_ceil(FP8_BLOCK);
                check_tensor("input_scale", input.len(), &[kb, m])?;
                check_tensor("weight_scale", weight.len(), &[n.div_ceil(FP8_BLOCK), kb])?;
                finite("input_scale", input)?;
                finite("weight_scale", weight)
            }
        }
    }

    /// The activations' scale of row `m` (tensor and channel granularities).
    #[inline]
    pub(crate) fn input_of(&self, m: usize) -> f32 {
        match *self {
            Fp8Scales::Tensor { input, .. } => input,
            Fp8Scales::Channel { input, .. } => input[if input.len() == 1 { 0 } else { m }],
            Fp8Scales::Block { .. } => 1.0,
        }
    }

    /// The f32 scale product of row `m`, column `n` (tensor and channel granularities), each
    /// factor first rounded to `O` and the product rounded to `O` (MAX multiplies in the output
    /// dtype: [semantics §4](crate::semantics)).
    #[inline]
    pub(crate) fn product<O: Element>(&self, m: usize, n: usize) -> f32 {
        let r = |x: f32| O::from_f32(x).to_f32();
        let (a, b) = match *self {
            Fp8Scales::Tensor { input, weight } => (input, weight),
            Fp8Scales::Channel { input, weight } => {
                (input[if input.len() == 1 { 0 } else { m }], weight[if weight.len() == 1 { 0 } else { n }])
            }
            Fp8Scales::Block { .. } => return 1.0,
        };
        r(r(a) * r(b))
    }
}

/// Arguments of [`qkv_fp8_ragged`](crate::reference::qkv_fp8_ragged) (MAX:
/// `_fused_qkv_ragged_matmul_scaled_float8`, op `mo.fused_qkv_matmul.ragged.paged.scale`, with its
/// `.bias` variant): FP8 E4M3 activations and weight (raw bytes, row-major), f32 scales.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QkvFp8Args<'a, B = half::bf16> {
    /// `[M, hidden_size]` E4M3 bytes (`M = input_row_offsets[batch]`).
    pub hidden_state: &'a [u8],
    /// `[batch + 1]`, starting at 0, non-decreasing, ending at M.
    pub input_row_offsets: &'a [u32],
    /// `[N, hidden_size]` E4M3 bytes (Q | K | V rows).
    pub weight: &'a [u8],
    /// K.
    pub hidden_size: usize,
    /// The scales and their granularity.
    pub scales: Fp8Scales<'a>,
    /// Optional `[N]` bias, rounded to the output dtype and added there, after the scaling
    /// (MAX's rounding: [semantics §4](crate::semantics)).
    pub bias: Option<&'a [B]>,
    /// Columns routed to `output`.
    pub q_dim: usize,
    /// RoPE on Q and the new K in the epilogue (`None`: no rotation).
    pub rope: Option<QkvRope<'a>>,
}

/// Arguments of [`qkv_ragged`](crate::reference::qkv_ragged)
/// (MAX: `fused_qkv_matmul_kv_cache_paged_ragged`, with its `_bias` variant).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QkvRaggedArgs<'a, T> {
    /// `[M, hidden_size]`.
    pub hidden_state: &'a [T],
    /// `[batch + 1]`, starting at 0, non-decreasing, ending at M.
    pub input_row_offsets: &'a [u32],
    /// `[N, hidden_size]`, N = `weight.len() / hidden_size`.
    pub weight: &'a [T],
    /// K.
    pub hidden_size: usize,
    /// Optional `[N]` bias, added as MAX adds it: to the product rounded to the destination's
    /// dtype, the sum rounded again ([semantics §4](crate::semantics)).
    pub bias: Option<&'a [T]>,
    /// Columns routed to `output`.
    pub q_dim: usize,
    /// RoPE on Q and the new K in the epilogue (`None`: no rotation).
    pub rope: Option<QkvRope<'a>>,
}

/// Arguments of [`qkv_bshd`](crate::reference::qkv_bshd)
/// (MAX: `fused_qkv_matmul_kv_cache_bshd_paged`).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct QkvBshdArgs<'a, T> {
    /// `[batch, seq_len, hidden_size]`, padded.
    pub hidden_state: &'a [T],
    /// Sequences.
    pub batch: usize,
    /// Padded sequence length.
    pub seq_len: usize,
    /// K.
    pub hidden_size: usize,
    /// `[N, hidden_size]`.
    pub weight: &'a [T],
    /// `[batch]`: K/V are written for `t < valid_lengths[b]` only; Q for every `t`.
    pub valid_lengths: &'a [u32],
    /// Columns routed to `output` (`[batch, seq_len, q_dim]`).
    pub q_dim: usize,
    /// RoPE on Q and the new K in the epilogue (`None`: no rotation).
    pub rope: Option<QkvRope<'a>>,
}

/// Arguments of [`rope_bshd`](crate::reference::rope_bshd)
/// (MAX: `fused_qk_rope_bshd_paged`). The head size is the cache's.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RopeBshdArgs<'a, T> {
    /// `[batch, seq_len, num_q_heads, head_size]`.
    pub q_proj: &'a [T],
    /// Sequences.
    pub batch: usize,
    /// Padded sequence length.
    pub seq_len: usize,
    /// Q heads.
    pub num_q_heads: usize,
    /// `[rows, head_size]`: row `p` is `cos(p θ_0), sin(p θ_0), cos(p θ_1), …` (MAX: q's dtype;
    /// any of f32, bf16, f16 here, `MaxCompat` rounding to its type).
    pub freqs_cis: Freqs<'a>,
    /// `[batch]`: positions `s ≥ valid_lengths[b]` are skipped for Q and K.
    pub valid_lengths: &'a [u32],
    /// Pairs `(2i, 2i+1)` when true, `(i, i + D/2)` when false.
    pub interleaved: bool,
}

/// Arguments of [`rope_ragged`](crate::reference::rope_ragged)
/// (MAX: `fused_qk_rope_ragged`, with partial rotary).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RopeRaggedArgs<'a, T> {
    /// `[M, num_q_heads, q_head_size]`.
    pub q_proj: &'a [T],
    /// `[batch + 1]`.
    pub input_row_offsets: &'a [u32],
    /// Q heads.
    pub num_q_heads: usize,
    /// Q head size (the K head size is the cache's; they may differ, as in MLA).
    pub q_head_size: usize,
    /// `[rows, rope_dim]`, interleaved (cos, sin) pairs; its dtype may differ from T.
    pub freqs_cis: Freqs<'a>,
    /// Rotary dimensions (even, ≤ both head sizes). Interleaved: the **last** `rope_dim` dims of
    /// each head rotate; non-interleaved: the **first** `rope_dim`, halves split at `rope_dim/2`.
    pub rope_dim: usize,
    /// Optional `[M]` positions selecting the freqs row (default `cache_length + t`). K is always
    /// stored at `cache_length + t`.
    pub position_ids: Option<&'a [u32]>,
    /// Pairing, as in [`RopeBshdArgs::interleaved`].
    pub interleaved: bool,
}

/// Arguments of [`kv_store_ragged`](crate::reference::kv_store_ragged)
/// (MAX: `kv_cache_store_ragged`).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct KvStoreRaggedArgs<'a, T> {
    /// `[M, num_kv_heads, head_size]`.
    pub values: &'a [T],
    /// `[batch + 1]`.
    pub input_row_offsets: &'a [u32],
    /// K or V.
    pub which: KvSel,
}

/// Arguments of [`kv_store_bshd`](crate::reference::kv_store_bshd)
/// (MAX: `kv_cache_store_padded`).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct KvStoreBshdArgs<'a, T> {
    /// `[batch, seq_len, num_kv_heads, head_size]`.
    pub values: &'a [T],
    /// Sequences.
    pub batch: usize,
    /// Padded sequence length.
    pub seq_len: usize,
    /// `[batch]`: rows `t ≥ valid_lengths[b]` are skipped.
    pub valid_lengths: &'a [u32],
    /// K or V.
    pub which: KvSel,
}

impl<'a> QkvRope<'a> {
    /// RoPE over `rope_dim` dims of heads of `q_head_size` (Q) and the cache's head size (K),
    /// in `F32` math, each row at its cache position; [`with_position_ids`](Self::with_position_ids)
    /// and [`with_math`](Self::with_math) change those.
    pub fn new(freqs_cis: impl Into<Freqs<'a>>, q_head_size: usize, rope_dim: usize, interleaved: bool) -> Self {
        QkvRope {
            freqs_cis: freqs_cis.into(),
            q_head_size,
            rope_dim,
            interleaved,
            position_ids: None,
            math: RopeMath::F32,
        }
    }
    /// Row `i` takes freqs row `position_ids[i]` (ragged operations only).
    pub fn with_position_ids(self, position_ids: &'a [u32]) -> Self {
        QkvRope { position_ids: Some(position_ids), ..self }
    }
    /// [`with_position_ids`](Self::with_position_ids) where `Some`; `None`: each row at its
    /// cache position.
    pub fn maybe_position_ids(self, position_ids: Option<&'a [u32]>) -> Self {
        QkvRope { position_ids, ..self }
    }
    /// How the rotation rounds.
    pub fn with_math(self, math: RopeMath) -> Self {
        QkvRope { math, ..self }
    }
}

/// The setters of a fused QKV's optional RoPE (`with_rope`, `maybe_rope`), and with `bias` of its
/// optional bias (`with_bias`, `maybe_bias`), on an argument struct with those fields.
macro_rules! optional_parts {
    ($s:ident<'a $(, $t:ident)?>) => {
        impl<'a $(, $t)?> $s<'a $(, $t)?> {
            /// RoPE on Q and the new K in the epilogue.
            pub fn with_rope(self, rope: $crate::ops::QkvRope<'a>) -> Self {
                $s { rope: Some(rope), ..self }
            }
            /// [`with_rope`](Self::with_rope) where `Some`; `None`: no rotation.
            pub fn maybe_rope(self, rope: Option<$crate::ops::QkvRope<'a>>) -> Self {
                $s { rope, ..self }
            }
        }
    };
    ($s:ident<'a, $t:ident>, bias) => {
        optional_parts!($s<'a, $t>);
        impl<'a, $t> $s<'a, $t> {
            /// An `[N]` bias, added as MAX adds it.
            pub fn with_bias(self, bias: &'a [$t]) -> Self {
                $s { bias: Some(bias), ..self }
            }
            /// [`with_bias`](Self::with_bias) where `Some`; `None`: no bias.
            pub fn maybe_bias(self, bias: Option<&'a [$t]>) -> Self {
                $s { bias, ..self }
            }
        }
    };
}
pub(crate) use optional_parts;

optional_parts!(QkvFp4Args<'a>);
optional_parts!(QkvRaggedArgs<'a, T>, bias);
optional_parts!(QkvFp8Args<'a, B>, bias);
optional_parts!(QkvBshdArgs<'a, T>);

impl<'a> QkvFp4Args<'a> {
    /// The arguments with `tensor_sf` formed from the two tensor scales
    /// (`hidden_state.tensor_scale() · weight.tensor_scale()`) and no RoPE.
    pub fn new(
        hidden_state: QuantizedRef<'a>,
        input_row_offsets: &'a [u32],
        weight: QuantizedRef<'a>,
        q_dim: usize,
    ) -> Self {
        let tensor_sf = hidden_state.tensor_scale() * weight.tensor_scale();
        QkvFp4Args { hidden_state, input_row_offsets, weight, tensor_sf, q_dim, rope: None }
    }
    /// Another `tensor_sf`.
    pub fn with_tensor_sf(self, tensor_sf: f32) -> Self {
        QkvFp4Args { tensor_sf, ..self }
    }
}

impl<'a, T> QkvRaggedArgs<'a, T> {
    /// The arguments without bias and RoPE.
    pub fn new(
        hidden_state: &'a [T],
        input_row_offsets: &'a [u32],
        weight: &'a [T],
        hidden_size: usize,
        q_dim: usize,
    ) -> Self {
        QkvRaggedArgs { hidden_state, input_row_offsets, weight, hidden_size, bias: None, q_dim, rope: None }
    }
}

impl<'a, B> QkvFp8Args<'a, B> {
    /// The arguments without bias and RoPE.
    pub fn new(
        hidden_state: &'a [u8],
        input_row_offsets: &'a [u32],
        weight: &'a [u8],
        hidden_size: usize,
        scales: Fp8Scales<'a>,
        q_dim: usize,
    ) -> Self {
        QkvFp8Args { hidden_state, input_row_offsets, weight, hidden_size, scales, bias: None, q_dim, rope: None }
    }
}

impl<'a, T> QkvBshdArgs<'a, T> {
    /// The arguments without RoPE.
    pub fn new(
        hidden_state: &'a [T],
        (batch, seq_len, hidden_size): (usize, usize, usize),
        weight: &'a [T],
        valid_lengths: &'a [u32],
        q_dim: usize,
    ) -> Self {
        QkvBshdArgs { hidden_state, batch, seq_len, hidden_size, weight, valid_lengths, q_dim, rope: None }
    }
}

impl<'a, T> RopeBshdArgs<'a, T> {
    /// The arguments: `q_proj` is `[batch, seq_len, num_q_heads, head_size]`.
    pub fn new(
        q_proj: &'a [T],
        (batch, seq_len, num_q_heads): (usize, usize, usize),
        freqs_cis: impl Into<Freqs<'a>>,
        valid_lengths: &'a [u32],
        interleaved: bool,
    ) -> Self {
        RopeBshdArgs { q_proj, batch, seq_len, num_q_heads, freqs_cis: freqs_cis.into(), valid_lengths, interleaved }
    }
}

impl<'a, T> RopeRaggedArgs<'a, T> {
    /// The arguments, each row at its cache position: `q_proj` is
    /// `[M, num_q_heads, q_head_size]`.
    pub fn new(
        q_proj: &'a [T],
        input_row_offsets: &'a [u32],
        (num_q_heads, q_head_size): (usize, usize),
        freqs_cis: impl Into<Freqs<'a>>,
        rope_dim: usize,
        interleaved: bool,
    ) -> Self {
        RopeRaggedArgs {
            q_proj,
            input_row_offsets,
            num_q_heads,
            q_head_size,
            freqs_cis: freqs_cis.into(),
            rope_dim,
            position_ids: None,
            interleaved,
        }
    }
    /// Row `i` takes freqs row `position_ids[i]`.
    pub fn with_position_ids(self, position_ids: &'a [u32]) -> Self {
        RopeRaggedArgs { position_ids: Some(position_ids), ..self }
    }
    /// [`with_position_ids`](Self::with_position_ids) where `Some`; `None`: each row at its
    /// cache position.
    pub fn maybe_position_ids(self, position_ids: Option<&'a [u32]>) -> Self {
        RopeRaggedArgs { position_ids, ..self }
    }
}

impl<'a, T> KvStoreRaggedArgs<'a, T> {
    /// The arguments: `values` is `[M, num_kv_heads, head_size]`.
    pub fn new(values: &'a [T], input_row_offsets: &'a [u32], which: KvSel) -> Self {
        KvStoreRaggedArgs { values, input_row_offsets, which }
    }
}

impl<'a, T> KvStoreBshdArgs<'a, T> {
    /// The arguments: `values` is `[batch, seq_len, num_kv_heads, head_size]`.
    pub fn new(values: &'a [T], (batch, seq_len): (usize, usize), valid_lengths: &'a [u32], which: KvSel) -> Self {
        KvStoreBshdArgs { values, batch, seq_len, valid_lengths, which }
    }
}

/// A RoPE table as MAX builds it (`max/nn/rotary_embedding.py`): `rows` rows of `dim` values, row
/// `p` = `cos(p·θ_0), sin(p·θ_0), cos(p·θ_1), sin(p·θ_1), …` with `θ_i = theta^(−2i/dim)` computed
/// in f64 and rounded to f32, positions and cos/sin in f32. The same table serves both pairings.
///
/// # Examples
/// ```
/// let f = paged_qkv::freqs_cis(4, 8, 10000.0); // 4 positions, rope_dim 8
/// assert_eq!(f.len(), 32);
/// assert_eq!((f[0], f[1]), (1.0, 0.0)); // position 0: cos 0, sin 0
/// ```
pub fn freqs_cis(rows: usize, dim: usize, theta: f64) -> Vec<f32> {
    let mut f = Vec::with_capacity(rows * dim);
    for p in 0..rows {
        for i in 0..dim / 2 {
            let a = p as f32 * theta.powf(-2.0 * i as f64 / dim as f64) as f32;
            f.push(a.cos());
            f.push(a.sin());
        }
    }
    f
}

/// A validated RoPE: per row the freqs row of its position (`None`: the row is not rotated).
pub(crate) type Positions = Pooled<Option<usize>>;

fn check_freqs_row(position: u64, rows: usize) -> Result<usize> {
    if position < rows as u64 { Ok(position as usize) } else { Err(Error::FreqsRows { position, rows }) }
}

/// Checks `rope_dim` against both head sizes.
fn check_rope_dim(rd: usize, dq: usize, dk: usize) -> Result<()> {
    if rd == 0 || !rd.is_multiple_of(2) || rd > dq || rd > dk {
        return Err(Error::dim(
            "rope_dim",
            format!("must be even, ≥ 2 and ≤ both head sizes (q {dq}, k {dk}), found {rd}"),
        ));
    }
    Ok(())
}

/// Validates [`rope_bshd`](crate::reference::rope_bshd)'s arguments (all of them, before anything
/// is written) and returns its slot plan and positions.
pub(crate) fn validate_rope_bshd<T: Element, C: Element>(
    args: &RopeBshdArgs<'_, T>,
    output_len: usize,
    kv: &KvWrite<'_, C>,
) -> Result<(SlotPlan, Positions)> {
    crate::cache::quant::check(kv)?;
    check_rope_bshd(args, output_len, kv)?;
    let writes = padded_rows(args.valid_lengths, args.seq_len);
    let plan = SlotPlan::build(&kv.page_table, &kv.cache.shape(), kv.layer_idx, &writes)?;
    let positions = plan.rows.iter().map(|s| s.map(|s| s.pos as usize)).collect();
    Ok((plan, positions))
}

/// The fast path's validation of a padded RoPE call (as [`rope_ragged_slots`]): the slots found
/// per sequence where [`validate_rope_bshd`] would succeed with no two written pages in one
/// block, else `None`. Every written row's freqs row (its cache position) is then below the
/// freqs' rows (checked per sequence by `check_rope_bshd`).
pub(crate) fn rope_bshd_slots<'a, T: Element, C: Element>(
    args: &RopeBshdArgs<'a, T>,
    output_len: usize,
    kv: &KvWrite<'a, C>,
) -> Option<SeqSlots<'a>> {
    if kv.scales.is_some() {
        return None; // a quantized write always runs from the full plan
    }
    check_rope_bshd(args, output_len, kv).ok()?;
    SeqSlots::padded(kv.page_table, &kv.cache.shape(), kv.layer_idx, args.seq_len, args.valid_lengths)
}

/// [`validate_rope_bshd`]'s checks before its slot plan's, in its order.
fn check_rope_bshd<T: Element, C: Element>(
    args: &RopeBshdArgs<'_, T>,
    output_len: usize,
    kv: &KvWrite<'_, C>,
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
    check_tensor("output", output_len, &[batch, s, hq, d])?;
    check_valid_lengths(args.valid_lengths, batch, s)?;
    check_table_batch(&kv.page_table, batch)?;
    let rows = freqs_rows(args.freqs_cis.len(), d)?;
    for (b, &v) in args.valid_lengths.iter().enumerate() {
        if v > 0 {
            check_freqs_row(kv.page_table.cache_length(b) as u64 + v as u64 - 1, rows)?;
        }
    }
    Ok(())
}

/// Validates [`rope_ragged`](crate::reference::rope_ragged)'s arguments and returns its slot plan
/// and positions.
pub(crate) fn validate_rope_ragged<T: Element, C: Element>(
    args: &RopeRaggedArgs<'_, T>,
    output_len: usize,
    kv: &KvWrite<'_, C>,
) -> Result<(SlotPlan, Positions)> {
    crate::cache::quant::check(kv)?;
    let freq_rows = check_rope_ragged(args, output_len, kv)?;
    let m = args.input_row_offsets.last().map_or(0, |&x| x as usize);
    let rows = ragged_rows(args.input_row_offsets, m)?;
    let positions = ragged_positions(&rows, args.position_ids, kv.page_table.cache_lengths(), freq_rows)?;
    let writes: Pooled<_> = rows.iter().map(|&(b, t)| (b, t, true)).collect();
    let plan = SlotPlan::build(&kv.page_table, &kv.cache.shape(), kv.layer_idx, &writes)?;
    Ok((plan, positions))
}

/// [`validate_rope_ragged`]'s checks before its rows' (its arguments' shapes, `input_row_offsets`,
/// the table's batch, the freqs' width), in its order; returns the freqs' rows.
fn check_rope_ragged<T: Element, C: Element>(
    args: &RopeRaggedArgs<'_, T>,
    output_len: usize,
    kv: &KvWrite<'_, C>,
) -> Result<usize> {
    let shape = kv.cache.shape();
    let (hq, dq, dk, rd) = (args.num_q_heads, args.q_head_size, shape.head_size(), args.rope_dim);
    if hq == 0 {
        return Err(Error::dim("num_q_heads", "must be at least 1"));
    }
    check_rope_dim(rd, dq, dk)?;
    let m = args.input_row_offsets.last().map_or(0, |&x| x as usize);
    check_tensor("q_proj", args.q_proj.len(), &[m, hq, dq])?;
    check_tensor("output", output_len, &[m, hq, dq])?;
    check_offsets(args.input_row_offsets, m)?;
    check_table_batch(&kv.page_table, args.input_row_offsets.len() - 1)?;
    freqs_rows(args.freqs_cis.len(), rd)
}

/// The fast path's validation of a ragged RoPE call, without a pass over its rows where none is
/// needed: the slots found per sequence ([`SeqSlots`]), where [`validate_rope_ragged`] would
/// succeed and its slot plan would hold no two written pages in one block; else `None`, and the
/// caller runs [`validate_rope_ragged`] (which then finds the error, or checks every slot).
///
/// Every row's freqs row is then below the freqs' rows: `position_ids[r]` (checked here, one
/// comparison per row) or its cache position `cache_lengths[b] + t` (checked here per sequence,
/// at its last token).
pub(crate) fn rope_ragged_slots<'a, T: Element, C: Element>(
    args: &RopeRaggedArgs<'a, T>,
    output_len: usize,
    kv: &KvWrite<'a, C>,
) -> Option<SeqSlots<'a>> {
    if kv.scales.is_some() {
        return None; // a quantized write always runs from the full plan
    }
    let freq_rows = check_rope_ragged(args, output_len, kv).ok()? as u64;
    let offsets = args.input_row_offsets;
    match args.position_ids {
        Some(ids) => {
            let fits = ids.len() == offsets[offsets.len() - 1] as usize;
            if !fits || ids.iter().any(|&p| p as u64 >= freq_rows) {
                return None;
            }
        }
        None => {
            let table = &kv.page_table;
            let last = |(b, w): (usize, &[u32])| table.cache_length(b) as u64 + (w[1] - w[0]) as u64 - 1;
            if offsets.windows(2).enumerate().any(|(b, w)| w[1] > w[0] && last((b, w)) >= freq_rows) {
                return None;
            }
        }
    }
    SeqSlots::ragged(kv.page_table, &kv.cache.shape(), kv.layer_idx, offsets)
}

/// The freqs row of every row of a ragged batch: `position_ids[i]`, or `cache_lengths[b] + t`
/// (every row has one: `Some`; built as [`Positions`] directly rather than mapped into them in a
/// second pass).
fn ragged_positions(
    rows: &[(usize, usize)],
    ids: Option<&[u32]>,
    cache_lengths: &[u32],
    freq_rows: usize,
) -> Result<Positions> {
    if let Some(ids) = ids {
        check_tensor("position_ids", ids.len(), &[rows.len()])?;
    }
    // A plain loop rather than `map(…).collect::<Result<_>>()`: the latter moved each row's
    // `Result` (the size of `Error`) through `try_fold`, ~4 % of a 512-row Qwen-shaped bf16 RoPE
    // call (AMD Zen 5, `perf`).
    let mut positions = Pooled::new();
    positions.reserve(rows.len());
    for (i, &(b, t)) in rows.iter().enumerate() {
        let p = match ids {
            Some(ids) => ids[i] as u64,
            None => cache_lengths[b] as u64 + t as u64,
        };
        positions.push(Some(check_freqs_row(p, freq_rows)?));
    }
    Ok(positions)
}

/// Validates a fused QKV's RoPE against the call's other (validated) arguments and returns the
/// freqs row of every rotated row. `bshd`: the padded operation (whole heads, rows with a slot).
pub(crate) fn validate_qkv_rope(
    rope: &QkvRope<'_>,
    q_dim: usize,
    n: usize,
    shape: &CacheShape,
    plan: &SlotPlan,
    rows: Option<&[(usize, usize)]>,
    cache_lengths: &[u32],
) -> Result<Positions> {
    let (dq, dk, rd) = (rope.q_head_size, shape.head_size(), rope.rope_dim);
    if dq == 0 || !q_dim.is_multiple_of(dq) {
        return Err(Error::dim("rope.q_head_size", format!("must divide q_dim {q_dim}, found {dq}")));
    }
    if dq > MAX_FUSED_HEAD || dk > MAX_FUSED_HEAD {
        return Err(Error::Unsupported { what: format!("fused RoPE on heads over {MAX_FUSED_HEAD} dims") });
    }
    check_rope_dim(rd, dq, dk)?;
    if shape.is_mla() && (n - q_dim != dk || shape.num_kv_heads() != 1) {
        // The QKV writes K head 0 only; the standalone RoPE rotates every KV head of the slot.
        return Err(Error::Unsupported {
            what: format!(
                "fused RoPE on an MLA cache needs one KV head (found {}), written whole (N − q_dim = {dk})",
                shape.num_kv_heads()
            ),
        });
    }
    let freq_rows = if rope.freqs_cis.len().is_multiple_of(rd) {
        rope.freqs_cis.len() / rd
    } else {
        return Err(Error::Shape { arg: "freqs_cis", expected: Expected::RowsOf(rd), found: rope.freqs_cis.len() });
    };
    match rows {
        Some(rows) => ragged_positions(rows, rope.position_ids, cache_lengths, freq_rows),
        None => {
            if rope.position_ids.is_some() {
                return Err(Error::Unsupported { what: "position_ids with the BSHD fused QKV".into() });
            }
            if rd != dk || dq != dk {
                return Err(Error::dim(
                    "rope_dim",
                    format!(
                        "the BSHD RoPE rotates whole heads: rope_dim and q_head_size must be {dk}, found {rd} and {dq}"
                    ),
                ));
            }
            plan.rows.iter().map(|s| s.map(|s| check_freqs_row(s.pos as u64, freq_rows)).transpose()).collect()
        }
    }
}

/// Validates a KV store's arguments (`rows` of the call, the stored values' length) and returns
/// its slot plan. `rows` lists the call's rows: it runs only after `values` is known to hold
/// them (every cache dimension is ≥ 1), so its memory is bounded by the input (a 2.7 KB case
/// file with a row offset of 2³² − 1 once asked for 17 GB here; found by the `case_file` target).
pub(crate) fn validate_kv_store<C: Element>(
    which: KvSel,
    values_len: usize,
    dims: &[usize],
    rows: impl FnOnce() -> Result<Pooled<(usize, usize, bool)>>,
    batch: usize,
    kv: &KvWrite<'_, C>,
) -> Result<SlotPlan> {
    crate::cache::quant::check(kv)?;
    let shape = kv.cache.shape();
    if which == KvSel::V && shape.is_mla() {
        return Err(Error::Unsupported { what: "storing V into an MLA (K-only) cache".into() });
    }
    check_tensor("values", values_len, dims)?;
    let rows = rows()?;
    check_table_batch(&kv.page_table, batch)?;
    SlotPlan::build(&kv.page_table, &shape, kv.layer_idx, &rows)
}

/// Validates [`kv_store_ragged`](crate::reference::kv_store_ragged)'s arguments.
pub(crate) fn validate_kv_store_ragged<T: Element, C: Element>(
    args: &KvStoreRaggedArgs<'_, T>,
    kv: &KvWrite<'_, C>,
) -> Result<SlotPlan> {
    let shape = kv.cache.shape();
    let m = args.input_row_offsets.last().map_or(0, |&x| x as usize);
    let rows = || ragged_rows(args.input_row_offsets, m).map(|r| r.iter().map(|&(b, t)| (b, t, true)).collect());
    let dims = [m, shape.num_kv_heads(), shape.head_size()];
    validate_kv_store(args.which, args.values.len(), &dims, rows, args.input_row_offsets.len().max(1) - 1, kv)
}

/// The fast path's validation of a ragged KV store, without a pass over its rows where none is
/// needed (as [`rope_ragged_slots`]): the slots found per sequence where
/// [`validate_kv_store_ragged`] would succeed with no two written pages in one block, else `None`.
pub(crate) fn kv_store_ragged_slots<'a, T: Element, C: Element>(
    args: &KvStoreRaggedArgs<'a, T>,
    kv: &KvWrite<'a, C>,
) -> Option<SeqSlots<'a>> {
    if kv.scales.is_some() {
        return None; // a quantized write always runs from the full plan
    }
    let shape = kv.cache.shape();
    let offsets = args.input_row_offsets;
    let m = offsets.last().map_or(0, |&x| x as usize);
    if args.which == KvSel::V && shape.is_mla() {
        return None;
    }
    check_tensor("values", args.values.len(), &[m, shape.num_kv_heads(), shape.head_size()]).ok()?;
    check_offsets(offsets, m).ok()?;
    check_table_batch(&kv.page_table, offsets.len() - 1).ok()?;
    SeqSlots::ragged(kv.page_table, &shape, kv.layer_idx, offsets)
}

/// The fast path's validation of a padded KV store (as [`kv_store_ragged_slots`]).
pub(crate) fn kv_store_bshd_slots<'a, T: Element, C: Element>(
    args: &KvStoreBshdArgs<'a, T>,
    kv: &KvWrite<'a, C>,
) -> Option<SeqSlots<'a>> {
    if kv.scales.is_some() {
        return None; // a quantized write always runs from the full plan
    }
    let shape = kv.cache.shape();
    let (batch, s) = (args.batch, args.seq_len);
    if args.which == KvSel::V && shape.is_mla() {
        return None;
    }
    check_tensor("values", args.values.len(), &[batch, s, shape.num_kv_heads(), shape.head_size()]).ok()?;
    check_valid_lengths(args.valid_lengths, batch, s).ok()?;
    check_table_batch(&kv.page_table, batch).ok()?;
    SeqSlots::padded(kv.page_table, &shape, kv.layer_idx, s, args.valid_lengths)
}

/// Validates [`kv_store_bshd`](crate::reference::kv_store_bshd)'s arguments.
pub(crate) fn validate_kv_store_bshd<T: Element, C: Element>(
    args: &KvStoreBshdArgs<'_, T>,
    kv: &KvWrite<'_, C>,
) -> Result<SlotPlan> {
    let shape = kv.cache.shape();
    let (batch, s) = (args.batch, args.seq_len);
    let rows = || check_valid_lengths(args.valid_lengths, batch, s).map(|_| padded_rows(args.valid_lengths, s));
    let dims = [batch, s, shape.num_kv_heads(), shape.head_size()];
    validate_kv_store(args.which, args.values.len(), &dims, rows, batch, kv)
}

/// `(batch, t)` of every row of a ragged batch, after checking `input_row_offsets`: at least one
/// entry, starting at 0, non-decreasing, ending at `m`.
pub(crate) fn ragged_rows(offsets: &[u32], m: usize) -> Result<Pooled<(usize, usize)>> {
    check_offsets(offsets, m)?;
    let mut rows = Pooled::new();
    rows.reserve(m);
    for (b, w) in offsets.windows(2).enumerate() {
        rows.extend((0..(w[1] - w[0]) as usize).map(|t| (b, t)));
    }
    Ok(rows)
}

/// Checks `input_row_offsets`: at least one entry, starting at 0, non-decreasing, ending at `m`.
fn check_offsets(offsets: &[u32], m: usize) -> Result<()> {
    let Some(&first) = offsets.first() else {
        return Err(Error::Shape { arg: "input_row_offsets", expected: Expected::AtLeast(1), found: 0 });
    };
    if first != 0 {
        return Err(Error::RowOffsets { index: 0, reason: format!("must be 0, found {first}") });
    }
    for (i, w) in offsets.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(Error::RowOffsets { index: i + 1, reason: format!("decreases: {} after {}", w[1], w[0]) });
        }
    }
    let last = *offsets.last().unwrap_or(&0) as usize;
    if last != m {
        return Err(Error::RowOffsets {
            index: offsets.len() - 1,
            reason: format!("must equal the row count {m}, found {last}"),
        });
    }
    Ok(())
}

/// Checks `valid_lengths` (`[batch]`, each ≤ `seq_len`).
pub(crate) fn check_valid_lengths(valid_lengths: &[u32], batch: usize, seq_len: usize) -> Result<()> {
    if valid_lengths.len() != batch {
        return Err(Error::dims("valid_lengths", &[batch], valid_lengths.len()));
    }
    for (b, &v) in valid_lengths.iter().enumerate() {
        if v as usize > seq_len {
            return Err(Error::ValidLength { batch: b, valid_length: v, seq_len });
        }
    }
    Ok(())
}

/// Checks that the page table describes `batch` sequences.
pub(crate) fn check_table_batch(table: &PageTable<'_>, batch: usize) -> Result<()> {
    if table.batch_size() == batch { Ok(()) } else { Err(Error::dims("cache_lengths", &[batch], table.batch_size())) }
}

/// Checks the Q | K | V split of N weight rows for this cache ([semantics §4](crate::semantics)).
pub(crate) fn check_split(n: usize, q_dim: usize, shape: &CacheShape) -> Result<()> {
    let kv_width = shape.kv_width();
    let ok = if shape.is_mla() {
        n > q_dim && n - q_dim <= shape.head_size()
    } else {
        q_dim.checked_add(2 * kv_width) == Some(n)
    };
    if ok {
        Ok(())
    } else {
        let kv_width = if shape.is_mla() { shape.head_size() } else { kv_width };
        Err(Error::ColumnSplit { n, q_dim, kv_width, mla: shape.is_mla() })
    }
}

/// Checks `len == product(dims)` for an activation or output tensor.
pub(crate) fn check_tensor(arg: &'static str, len: usize, dims: &[usize]) -> Result<()> {
    let want = checked_len(arg, dims)?;
    if len == want { Ok(()) } else { Err(Error::dims(arg, dims, len)) }
}

/// Checks a RoPE freqs table of `len` elements and returns its row count.
pub(crate) fn freqs_rows(len: usize, width: usize) -> Result<usize> {
    if width == 0 {
        return Err(Error::dim("freqs_cis", "the row width must be at least 1"));
    }
    if !len.is_multiple_of(width) {
        return Err(Error::Shape { arg: "freqs_cis", expected: Expected::RowsOf(width), found: len });
    }
    Ok(len / width)
}

/// Validates a bf16/f16/f32 ragged fused QKV call (`weight` is `[n, k]`, already checked) and
/// returns its slot plan; the checks and their order are the oracle's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn validate_qkv_ragged<C: Element>(
    hidden_len: usize,
    input_row_offsets: &[u32],
    (n, k): (usize, usize),
    bias_len: Option<usize>,
    (q_dim, rope): (usize, Option<&QkvRope<'_>>),
    output_len: usize,
    kv: &KvWrite<'_, C>,
) -> Result<(SlotPlan, Positions)> {
    crate::cache::quant::check(kv)?;
    let m = input_row_offsets.last().map_or(0, |&x| x as usize);
    check_tensor("hidden_state", hidden_len, &[m, k])?;
    let rows = ragged_rows(input_row_offsets, m)?;
    let shape = kv.cache.shape();
    check_table_batch(&kv.page_table, input_row_offsets.len() - 1)?;
    check_split(n, q_dim, &shape)?;
    crate::cache::quant::check_columns(kv, n - q_dim)?;
    if let Some(len) = bias_len {
        check_tensor("bias", len, &[n])?;
    }
    check_tensor("output", output_len, &[m, q_dim])?;
    let writes: Pooled<_> = rows.iter().map(|&(b, t)| (b, t, true)).collect();
    let plan = SlotPlan::build(&kv.page_table, &shape, kv.layer_idx, &writes)?;
    let positions = match rope {
        Some(r) => validate_qkv_rope(r, q_dim, n, &shape, &plan, Some(&rows), kv.page_table.cache_lengths())?,
        None => Pooled::new(),
    };
    Ok((plan, positions))
}

/// Validates a padded (BSHD) fused QKV call (`weight` is `[n, k]`, already checked) and returns
/// its slot plan (padded rows: no slot); the checks and their order are the oracle's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn validate_qkv_bshd<C: Element>(
    hidden_len: usize,
    (batch, seq_len): (usize, usize),
    (n, k): (usize, usize),
    valid_lengths: &[u32],
    (q_dim, rope): (usize, Option<&QkvRope<'_>>),
    output_len: usize,
    kv: &KvWrite<'_, C>,
) -> Result<(SlotPlan, Positions)> {
    crate::cache::quant::check(kv)?;
    let shape = kv.cache.shape();
    if shape.is_mla() {
        return Err(Error::Unsupported { what: "the BSHD fused QKV needs a K and V cache (MLA has no V)".into() });
    }
    check_tensor("hidden_state", hidden_len, &[batch, seq_len, k])?;
    check_valid_lengths(valid_lengths, batch, seq_len)?;
    check_table_batch(&kv.page_table, batch)?;
    check_split(n, q_dim, &shape)?;
    crate::cache::quant::check_columns(kv, n - q_dim)?;
    check_tensor("output", output_len, &[batch, seq_len, q_dim])?;
    let writes = padded_rows(valid_lengths, seq_len);
    let plan = SlotPlan::build(&kv.page_table, &shape, kv.layer_idx, &writes)?;
    let positions = match rope {
        Some(r) => validate_qkv_rope(r, q_dim, n, &shape, &plan, None, kv.page_table.cache_lengths())?,
        None => Pooled::new(),
    };
    Ok((plan, positions))
}

/// `(b, t, t < valid_lengths[b])` for every row of a padded batch.
pub(crate) fn padded_rows(valid_lengths: &[u32], seq_len: usize) -> Pooled<(usize, usize, bool)> {
    let mut rows = Pooled::new();
    rows.reserve(valid_lengths.len() * seq_len);
    for (b, &v) in valid_lengths.iter().enumerate() {
        rows.extend((0..seq_len).map(|t| (b, t, t < v as usize)));
    }
    rows
}

/// Validates a block-scaled fused QKV call (every check of [semantics §8](crate::semantics), the project's
/// decisions) and returns its slot plan. `weight` is (format, N, K).
#[allow(clippy::too_many_arguments)]
pub(crate) fn validate_fp4<C: Element>(
    a: QuantizedRef<'_>,
    input_row_offsets: &[u32],
    weight: (BlockFormat, usize, usize),
    tensor_sf: f32,
    (q_dim, rope): (usize, Option<&QkvRope<'_>>),
    output_len: usize,
    kv: &KvWrite<'_, C>,
) -> Result<(SlotPlan, Positions)> {
    crate::cache::quant::check(kv)?;
    let (w_format, n, w_k) = weight;
    if a.format() != w_format || a.k() != w_k {
        return Err(Error::FormatMismatch {
            hidden_state: a.format(),
            hidden_k: a.k(),
            weight: w_format,
            weight_k: w_k,
        });
    }
    if !tensor_sf.is_finite() {
        return Err(Error::NonFinite { arg: "tensor_sf", index: 0 });
    }
    let m = a.rows();
    let rows = ragged_rows(input_row_offsets, m)?;
    let shape = kv.cache.shape();
    check_table_batch(&kv.page_table, input_row_offsets.len() - 1)?;
    check_split(n, q_dim, &shape)?;
    crate::cache::quant::check_columns(kv, n - q_dim)?;
    check_tensor("output", output_len, &[m, q_dim])?;
    let writes: Pooled<_> = rows.iter().map(|&(b, t)| (b, t, true)).collect();
    let plan = SlotPlan::build(&kv.page_table, &shape, kv.layer_idx, &writes)?;
    let positions = match rope {
        Some(r) => validate_qkv_rope(r, q_dim, n, &shape, &plan, Some(&rows), kv.page_table.cache_lengths())?,
        None => Pooled::new(),
    };
    Ok((plan, positions))
}

/// Validates an FP8 W8A8 fused QKV call (`weight` is `[n, k]`, already checked) and returns its
/// slot plan: the output dtype (bf16, f16 or f32: the scaling is computed in it), every check of
/// the bf16/f16/f32 ragged QKV, then the scales (shapes for `M` tokens, finite).
#[allow(clippy::too_many_arguments)]
pub(crate) fn validate_fp8<O: Element, C: Element>(
    hidden_len: usize,
    input_row_offsets: &[u32],
    (n, k): (usize, usize),
    scales: &Fp8Scales<'_>,
    bias_len: Option<usize>,
    (q_dim, rope): (usize, Option<&QkvRope<'_>>),
    output_len: usize,
    kv: &KvWrite<'_, C>,
) -> Result<(SlotPlan, Positions)> {
    crate::cache::quant::check(kv)?;
    if O::DTYPE == crate::DType::F8E4M3 {
        return Err(Error::Unsupported {
            what: "an FP8 output for the FP8 W8A8 QKV (its scaling is computed in the output dtype: bf16, f16 or f32)"
                .into(),
        });
    }
    let plan = validate_qkv_ragged(hidden_len, input_row_offsets, (n, k), bias_len, (q_dim, rope), output_len, kv)?;
    let m = input_row_offsets.last().map_or(0, |&x| x as usize);
    scales.check(m, n, k)?;
    Ok(plan)
}

/// [`validate_fp8`] for a [`QkvFp8Args`] call (N from the weight's length): N and the slot plan.
pub(crate) fn validate_fp8_args<B, O: Element, C: Element>(
    args: &QkvFp8Args<'_, B>,
    output_len: usize,
    kv: &KvWrite<'_, C>,
) -> Result<(usize, (SlotPlan, Positions))> {
    let k = args.hidden_size;
    let n = crate::error::weight_rows(args.weight, k)?;
    let plan = validate_fp8::<O, C>(
        args.hidden_state.len(),
        args.input_row_offsets,
        (n, k),
        &args.scales,
        args.bias.map(|b| b.len()),
        (args.q_dim, args.rope.as_ref()),
        output_len,
        kv,
    )?;
    Ok((n, plan))
}
