//! The element and format types every layer names, with the exact E4M3 and E2M1 codecs the
//! kernels use: a leaf module
//! (it imports nothing from the crate), so that `element`, `error` and `formats` can all use
//! them without depending on one another. `formats` re-exports them at their public paths.

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
pub(crate) fn e4m3_magnitude_units(e: i32, m: i32) -> i32 {
    if e == 0 { m } else { (8 + m) << (e - 1) }
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

/// Each E2M1 code times two: small integers, so FP4 dot products are exact integer math.
pub const E2M1_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `E2M1_DOUBLED[code & 15]` by byte arithmetic, which the compiler vectorises (a table lookup
/// it does not). The fast paths' activation decode uses it: that decode is ~5 % of a Qwen-sized
/// decode call (Intel Xeon, `perf`), and this took its share from 5.2 to 4.8 % of the samples.
#[inline(always)]
pub(crate) fn e2m1_doubled(code: u8) -> i8 {
    let m = code & 7;
    // Magnitudes 0, 1, 2, 3, 4, 6, 8, 12 (doubled E2M1) for m = 0 … 7.
    let mag = (if m < 4 {
        m
    } else if m < 6 {
        2 * m - 4
    } else {
        4 * m - 16
    }) as i8;
    if code & 8 != 0 { -mag } else { mag }
}

/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// A block-scaled matrix format ([semantics §1](crate::semantics)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    /// E2M1 data, two per byte, one E4M3 scale (decoded as `|value|`) per 16 elements.
    Nvfp4,
    /// E2M1 data, two per byte, one E8M0 scale per 32 elements (MAX rejects it at run time;
    /// gpt-oss-class models need it).
    Mxfp4,
    /// E4M3 data, one byte each, one E8M0 scale per 32 elements.
    Mxfp8,
}

impl BlockFormat {
    /// All formats.
    pub const ALL: [BlockFormat; 3] = [BlockFormat::Nvfp4, BlockFormat::Mxfp4, BlockFormat::Mxfp8];

    /// Elements per scale (`SF_VECTOR_SIZE`): 16 for NVFP4, 32 for the MX formats.
    pub fn vector_size(self) -> usize {
        match self {
            BlockFormat::Nvfp4 => 16,
            BlockFormat::Mxfp4 | BlockFormat::Mxfp8 => 32,
        }
    }

    /// Whether data is packed E2M1 (two elements per byte).
    pub fn is_fp4(self) -> bool {
        !matches!(self, BlockFormat::Mxfp8)
    }

    /// Lower-case name: `nvfp4`, `mxfp4`, `mxfp8`.
    pub fn name(self) -> &'static str {
        match self {
            BlockFormat::Nvfp4 => "nvfp4",
            BlockFormat::Mxfp4 => "mxfp4",
            BlockFormat::Mxfp8 => "mxfp8",
        }
    }

    /// Parses [`name`](Self::name).
    pub fn from_name(s: &str) -> Option<Self> {
        BlockFormat::ALL.into_iter().find(|f| f.name() == s)
    }

    /// Bytes of data per row of logical length `k` (`k/2` for FP4, `k` for MXFP8).
    pub fn row_bytes(self, k: usize) -> usize {
        if self.is_fp4() { k / 2 } else { k }
    }
}
