//! FP8 formats: E4M3FN (data, NVFP4 scales, FP8 KV cache) and E8M0 (MX scales).

/// An FP8 E4M3FN value (bias 7, subnormals, `0x7F`/`0xFF` NaN, no infinity, max 448), as stored
/// in an FP8 KV cache or an MXFP8 tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct E4M3(pub u8);

/// Largest finite E4M3FN magnitude.
pub const E4M3_MAX: f32 = 448.0;

impl E4M3 {
    /// Decodes to f32 (exact).
    #[inline]
    pub fn to_f32(self) -> f32 {
        e4m3_to_f32(self.0)
    }
    /// Encodes with round-to-nearest-even, saturating to ±448; NaN gives `0x7F`.
    #[inline]
    pub fn from_f32(x: f32) -> Self {
        E4M3(e4m3_from_f32(x))
    }
}

/// Decodes an E4M3FN byte: `(−1)^s · 2^(e−7) · (1 + m/8)`, subnormal `(−1)^s · 2^−6 · m/8`,
/// `0x7F`/`0xFF` NaN ([semantics §1](crate::semantics)).
#[inline]
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((byte >> 3) & 0xF) as i32;
    let m = (byte & 7) as i32;
    if e == 0xF && m == 7 {
        return f32::NAN;
    }
    // Every E4M3 value is an integer multiple of 2^-9: build it exactly from that integer.
    sign * e4m3_magnitude_units(e, m) as f32 * (1.0 / 512.0)
}

/// `|value| · 2^9` of a non-NaN E4M3 code with exponent field `e` and mantissa `m` (an integer ≤ 229376).
#[inline]
fn e4m3_magnitude_units(e: i32, m: i32) -> i32 {
    if e == 0 { m } else { (8 + m) << (e - 1) }
}

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

/// Encodes f32 to E4M3FN: round to nearest, ties to even, saturating (|x| ≥ 448 and ±∞ give ±448),
/// NaN gives `0x7F`. This is MAX's software `_convert_f32_to_float8_scalar`.
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs() as f64;
    if a >= E4M3_MAX as f64 {
        return sign | 0x7E;
    }
    // Below 2^-6 the grid is m · 2^-9 (subnormals); m = 8 is the smallest normal, code 0x08.
    if a < 1.0 / 64.0 {
        let m = (a * 512.0).round_ties_even() as u8;
        return sign | m;
    }
    // a is a normal f64 in [2^-6, 448): split it exactly into 2^e · frac with frac in [1, 2).
    let bits = a.to_bits();
    let e = ((bits >> 52) & 0x7FF) as i32 - 1023;
    let frac = f64::from_bits((bits & ((1u64 << 52) - 1)) | (1023u64 << 52));
    let mut m = ((frac - 1.0) * 8.0).round_ties_even() as i32;
    let mut e = e;
    if m == 8 {
        m = 0;
        e += 1;
    }
    let code = (((e + 7) as u8) << 3) | m as u8;
    if code >= 0x7F { sign | 0x7E } else { sign | code }
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
