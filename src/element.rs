//! Element types of activations, outputs and caches: f32, bf16, f16 and FP8 E4M3.

use crate::dtype::E4M3;
use half::{bf16, f16};

/// Names of the element types, for messages and file formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE binary16.
    F16,
    /// FP8 E4M3FN (saturating casts).
    F8E4M3,
}

impl DType {
    /// Short lower-case name (`f32`, `bf16`, `f16`, `f8e4m3`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "f8e4m3",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 => 1,
        }
    }
}

mod sealed {
    /// Only this crate implements [`Element`](super::Element): the "rounded once" promise of every
    /// operation rests on its conversions. Each element type has a per-thread free list
    /// (`crate::pool`), so that a staging buffer of any of them is reused from call to call.
    pub trait Sealed: crate::pool::Poolable {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for crate::dtype::E4M3 {}
}

crate::pool::poolable!(half::bf16, half::f16, crate::dtype::E4M3);

/// A scalar the operations read or write: `f32`, [`bf16`], [`f16`](struct@half::f16) or [`E4M3`]. Conversions round
/// to nearest, ties to even, once; casts into FP8 saturate to ±448.
///
/// The trait is sealed: the operations promise one rounding per value, which depends on these
/// four implementations.
pub trait Element: sealed::Sealed + Copy + Send + Sync + PartialEq + std::fmt::Debug + Default + 'static {
    /// This type's [`DType`].
    const DTYPE: DType;
    /// Exact widening to f32.
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (RNE; FP8 saturates).
    fn from_f32(x: f32) -> Self;
    /// Rounds an f64 to this type **once** (RNE; FP8 saturates): not through an RNE f32 step.
    fn from_f64(x: f64) -> Self;
    /// The raw bits, zero-extended (for bitwise comparisons that treat NaN like any value).
    fn to_bits(self) -> u32;
    /// From raw bits (the low `8 * size` bits are used).
    fn from_bits(bits: u32) -> Self;
}

/// Rounds `x` to f32 with round-to-odd: the nearest f32 toward zero, with its last mantissa bit
/// forced to 1 when inexact. A second rounding of this value to any format with at least 2 fewer
/// mantissa bits (bf16, f16, E4M3) is then the correctly rounded result of `x`.
pub(crate) fn f64_to_f32_round_odd(x: f64) -> f32 {
    if !x.is_finite() {
        return x as f32;
    }
    let r = x as f32; // RNE
    if r as f64 == x {
        return r;
    }
    if r.is_infinite() {
        return f32::MAX.copysign(r);
    }
    // Inexact: x lies strictly between two adjacent f32 values, one of which is odd.
    if r.to_bits() & 1 == 1 {
        return r;
    }
    if (r as f64) > x { r.next_down() } else { r.next_up() }
}

/// `bf16::from_f32(x).to_f32()` bit for bit, without branches (a loop over it vectorises):
/// round to nearest, ties to even, on the top 16 bits; a NaN keeps its sign and payload's top bits
/// and is made quiet, as `half` does.
#[inline]
pub(crate) fn bf16_through(x: f32) -> f32 {
    let b = x.to_bits();
    let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000;
    f32::from_bits(if nan { (b | 0x0040_0000) & 0xFFFF_0000 } else { rounded })
}

/// `x` rounded to `to` and widened back, where the bias step rounds there ([`biased`]): bf16 and
/// f16 round, f32 is unchanged, and an E4M3 destination does not round before its bias.
#[inline]
pub(crate) fn round_through(to: DType, x: f32) -> f32 {
    match to {
        DType::BF16 => bf16_through(x),
        DType::F16 => <f16 as Element>::from_f32(x).to_f32(),
        DType::F32 | DType::F8E4M3 => x,
    }
}

/// MAX's bias step (semantics §4): the value whose one rounding to `to` is
/// `round_to(round_to(product) + bias)` — the product rounded to the destination's dtype, the bias
/// added to that in f32 and the sum rounded — for bf16, f16 and f32 destinations; for an E4M3
/// cache, `product + bias` (rounded once, this crate's rule for FP8 caches: §9).
#[inline]
pub(crate) fn biased(to: DType, product: f32, bias: f32) -> f32 {
    round_through(to, product) + bias
}

/// [`biased`] for an exact product `v` (rounded to odd in f64): the f64 whose one rounding to `to`
/// is the result. `with_bias` gives `product + bias` exactly (rounded to odd), for an E4M3 cache.
pub(crate) fn biased_exact(to: DType, v: f64, bias: f32, with_bias: impl FnOnce() -> f64) -> f64 {
    let product = match to {
        DType::BF16 => <bf16 as Element>::from_f64(v).to_f32(),
        DType::F16 => <f16 as Element>::from_f64(v).to_f32(),
        DType::F32 => <f32 as Element>::from_f64(v),
        DType::F8E4M3 => return with_bias(),
    };
    (product + bias) as f64
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline]
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    #[inline]
    fn to_bits(self) -> u32 {
        f32::to_bits(self)
    }
    #[inline]
    fn from_bits(bits: u32) -> Self {
        f32::from_bits(bits)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline]
    fn from_f64(x: f64) -> Self {
        bf16::from_f32(f64_to_f32_round_odd(x))
    }
    #[inline]
    fn to_bits(self) -> u32 {
        bf16::to_bits(self) as u32
    }
    #[inline]
    fn from_bits(bits: u32) -> Self {
        bf16::from_bits(bits as u16)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline]
    fn from_f64(x: f64) -> Self {
        f16::from_f32(f64_to_f32_round_odd(x))
    }
    #[inline]
    fn to_bits(self) -> u32 {
        f16::to_bits(self) as u32
    }
    #[inline]
    fn from_bits(bits: u32) -> Self {
        f16::from_bits(bits as u16)
    }
}

impl Element for E4M3 {
    const DTYPE: DType = DType::F8E4M3;
    #[inline]
    fn to_f32(self) -> f32 {
        E4M3::to_f32(self)
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        E4M3::from_f32(x)
    }
    #[inline]
    fn from_f64(x: f64) -> Self {
        E4M3::from_f32(f64_to_f32_round_odd(x))
    }
    #[inline]
    fn to_bits(self) -> u32 {
        self.0 as u32
    }
    #[inline]
    fn from_bits(bits: u32) -> Self {
        E4M3(bits as u8)
    }
}
