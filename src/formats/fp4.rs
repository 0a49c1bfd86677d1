//! E2M1 (FP4) elements: decode table, MAX's encoder thresholds and the nibble packing.
//!
//! A nibble is `s e e m`. Two elements share a byte: element `2j` is the **low** nibble of byte `j`,
//! element `2j + 1` the high nibble ([semantics §1](crate::semantics)).

/// Value of each E2M1 code. Codes 8..=15 are the negatives of 0..=7 (code 8 is −0.0).
pub const E2M1_VALUES: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

pub use crate::dtype::{E2M1_DOUBLED, E2M1_MAX};

/// Decodes the low 4 bits of `code`.
#[inline]
pub fn e2m1_to_f32(code: u8) -> f32 {
    E2M1_VALUES[(code & 0xF) as usize]
}

/// Encodes `x` with MAX's thresholds (`cast_fp_to_fp4e2m1`): round to nearest, ties to even,
/// saturating at ±6. The sign bit of `x` becomes the sign bit of the code (so −0.1 → code 8, −0.0).
/// NaN encodes as 0 (quantizers reject NaN input before getting here).
#[inline]
pub fn e2m1_from_f32(x: f32) -> u8 {
    let a = x.abs();
    let mag = if a.is_nan() || a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    if x.is_sign_negative() && !x.is_nan() { mag | 8 } else { mag }
}

/// The code of logical element `k` of a packed row (two elements per byte, low nibble first).
#[inline]
pub fn fp4_code(packed_row: &[u8], k: usize) -> u8 {
    let byte = packed_row[k / 2];
    if k.is_multiple_of(2) { byte & 0xF } else { byte >> 4 }
}

/// Packs codes two per byte, element `2j` in the low nibble of byte `j`. An odd count leaves the
/// last high nibble zero.
pub fn pack_e2m1(codes: &[u8]) -> Vec<u8> {
    codes.chunks(2).map(|p| (p[0] & 0xF) | (p.get(1).copied().unwrap_or(0) & 0xF) << 4).collect()
}

/// Unpacks `n` codes from a packed row.
pub fn unpack_e2m1(packed: &[u8], n: usize) -> Vec<u8> {
    (0..n).map(|k| fp4_code(packed, k)).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn e2m1_doubled_equals_the_table() {
        for code in 0..=255u8 {
            assert_eq!(crate::dtype::e2m1_doubled(code), super::E2M1_DOUBLED[(code & 15) as usize], "code {code}");
        }
    }
}
