//! FP8 formats: E4M3FN (data, NVFP4 scales, FP8 KV cache) and E8M0 (MX scales).

use crate::dtype::e4m3_magnitude_units;
pub use crate::dtype::{E4M3, E4M3_MAX, e4m3_from_f32, e4m3_to_f32};

/// The E4M3 value times 2^9 as an exact integer (`None` for NaN). |result| ≤ 229376 < 2^18.
#[inline]
pub fn e4m3_to_units(byte: u8) -> Option<i32> {
    let e = ((byte >> 3) & 0xF) as i32;
    let m = (byte & 7) as i32;
    if e == 0xF && m == 7 {
        return None;
    }
    let mag = e4m3_magnitude_units(e, m);
    Some(if byte & 0x80 != 0 { -mag } else { mag })
}

/// Decodes an NVFP4 block-scale byte as `|E4M3|`: the sign bit is ignored, as MAX's reference does
/// ([semantics §9](crate::semantics)); `0x7F`/`0xFF` stay NaN.
#[inline]
pub fn e4m3_scale_to_f32(byte: u8) -> f32 {
    e4m3_to_f32(byte & 0x7F)
}

/// An E8M0 scale byte (`float8_e8m0fnu`): `2^(e−127)`; `0x00` is 2^−127 (not zero), `0xFF` NaN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct E8M0(pub u8);

/// Decodes an E8M0 byte exactly: `2^(e−127)`, `0x00` → 2^−127 (the f32 subnormal 0x00400000), `0xFF` → NaN.
#[inline]
pub fn e8m0_to_f32(byte: u8) -> f32 {
    match byte {
        0xFF => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        e => f32::from_bits((e as u32) << 23),
    }
}

/// Encodes `|x|` to E8M0 rounding **up** (toward +∞, to the next power of two), as MAX's
/// `_convert_f32_to_float8_ue8m0` does: the exponent is incremented when the mantissa is non-zero,
/// except at exponent 0xFE (saturates at 2^127) and for subnormals ≤ 2^−127 (they give 0x00 = 2^−127).
/// NaN and ±∞ give 0xFF.
pub fn e8m0_from_f32_roundup(x: f32) -> u8 {
    if !x.is_finite() {
        return 0xFF;
    }
    let bits = x.abs().to_bits();
    let exp = (bits >> 23) & 0xFF;
    let mant = bits & 0x7F_FFFF;
    let bump = mant != 0 && exp != 0xFE && !(exp == 0 && mant <= 0x40_0000);
    (exp + bump as u32) as u8
}
