//! Exact accumulation: a fixed-point "superaccumulator" wide enough for every product this crate
//! forms (E2M1/E4M3 data × E4M3/E8M0 scales × an f32 tensor scale, or f32 × f32), so a dot product
//! is summed with no rounding at all and rounded once at the end.

/// Exponent of the least significant bit. The smallest term is MXFP8's
/// 2^-9 · 2^-9 · 2^-127 · 2^-127 · 2^-149 (f32 subnormal tensor scale) = 2^-421.
const LSB_EXP: i32 = -480;
/// 32-bit digits; the top one also carries the sign. 32 digits span 2^-480 .. 2^544; the largest
/// sum formed is below 2^470.
const LIMBS: usize = 32;

/// An exact sum of terms `mant · 2^exp`.
#[derive(Clone)]
pub(crate) struct ExactSum {
    /// Digit `i` has weight `2^(32 i + LSB_EXP)`; digits are not normalised while adding
    /// (each add puts < 2^63 into a digit, so 2^64 adds cannot overflow an i128).
    limbs: [i128; LIMBS],
    /// Sum of the non-finite terms (∞, NaN), which decide the result when present.
    special: f64,
    has_special: bool,
}

impl ExactSum {
    pub fn new() -> Self {
        ExactSum { limbs: [0; LIMBS], special: 0.0, has_special: false }
    }

    /// Adds `mant · 2^exp` exactly. Requires `|mant| < 2^100`, `exp ≥ -480` and `exp ≤ 440`.
    #[inline]
    pub fn add(&mut self, mant: i128, exp: i32) {
        if mant == 0 {
            return;
        }
        debug_assert!((LSB_EXP..=440).contains(&exp) && mant.unsigned_abs() < 1u128 << 100);
        let s = (exp - LSB_EXP) as usize;
        let (idx, r) = (s / 32, s % 32);
        let neg = mant < 0;
        let u = mant.unsigned_abs();
        for i in 0..4 {
            let c = ((u >> (32 * i)) & 0xFFFF_FFFF) as i128;
            if c != 0 {
                let v = c << r;
                self.limbs[idx + i] += if neg { -v } else { v };
            }
        }
    }

    /// Adds a non-finite term (∞ or NaN): the result is then the IEEE sum of those terms.
    pub fn add_special(&mut self, v: f64) {
        self.special += v;
        self.has_special = true;
    }

    /// Adds the exact product of two f32 values.
    #[inline]
    pub fn add_product_f32(&mut self, a: f32, b: f32) {
        if !a.is_finite() || !b.is_finite() {
            self.add_special(a as f64 * b as f64);
            return;
        }
        let (ma, ea) = f32_parts(a);
        let (mb, eb) = f32_parts(b);
        self.add(ma as i128 * mb as i128, ea + eb);
    }

    /// Adds an f32 value exactly.
    pub fn add_f32(&mut self, a: f32) {
        if !a.is_finite() {
            self.add_special(a as f64);
            return;
        }
        let (m, e) = f32_parts(a);
        self.add(m as i128, e);
    }

    /// The sum rounded to f64 with round-to-odd, so that one more rounding to any format of at
    /// most 51 significant bits (f32, bf16, f16, E4M3) is the correctly rounded exact sum.
    /// An exactly zero sum is +0.
    pub fn to_f64_round_odd(&self) -> f64 {
        if self.has_special {
            return self.special;
        }
        let mut d = self.limbs;
        normalise(&mut d);
        let neg = d[LIMBS - 1] < 0;
        if neg {
            for x in d.iter_mut() {
                *x = -*x;
            }
            normalise(&mut d);
        }
        // Now every digit is in [0, 2^32) (the top one too: the sum is far below 2^544).
        let Some(top) = (0..LIMBS).rev().find(|&i| d[i] != 0) else {
            return 0.0;
        };
        // Gather the top three digits (≥ 65 significant bits) and a sticky bit for the rest.
        let mut window: u128 = 0;
        let mut sticky = false;
        for j in 0..3 {
            window <<= 32;
            if top >= j {
                window |= d[top - j] as u128;
            }
        }
        if top >= 3 {
            sticky = d[..top - 2].iter().any(|&x| x != 0);
        }
        // window holds digits top, top-1, top-2: weight of its bit 0 is 2^(32 (top-2) + LSB_EXP).
        let lz = window.leading_zeros() as i32; // window < 2^96, so lz ≥ 32
        let msb = 127 - lz; // bit index of the leading one in window
        let drop = msb - 52; // keep 53 bits
        let mut m = (window >> drop) as u64;
        if window & ((1u128 << drop) - 1) != 0 || sticky {
            m |= 1; // round to odd
        }
        let exp = drop + 32 * (top as i32 - 2) + LSB_EXP;
        let v = m as f64 * pow2(exp);
        if neg { -v } else { v }
    }
}

/// Carries every digit into `[0, 2^32)` except the top one, which keeps the sign.
fn normalise(d: &mut [i128; LIMBS]) {
    for i in 0..LIMBS - 1 {
        let c = d[i] >> 32;
        d[i] -= c << 32;
        d[i + 1] += c;
    }
}

/// 2^e for e in the f64 normal range.
fn pow2(e: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&e));
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// `x = mant · 2^exp` exactly, for finite `x` (`|mant| < 2^24`).
#[inline]
pub(crate) fn f32_parts(x: f32) -> (i64, i32) {
    let bits = x.to_bits();
    let e = ((bits >> 23) & 0xFF) as i32;
    let frac = (bits & 0x7F_FFFF) as i64;
    let (m, exp) = if e == 0 { (frac, -149) } else { (frac | 0x80_0000, e - 150) };
    (if bits >> 31 == 1 { -m } else { m }, exp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_that_f64_cannot() {
        let mut s = ExactSum::new();
        s.add_f32(1.0e30);
        s.add_f32(1.0);
        s.add_f32(-1.0e30);
        assert_eq!(s.to_f64_round_odd(), 1.0);

        let mut s = ExactSum::new();
        s.add(1, -400);
        s.add(1, 400);
        s.add(-1, 400);
        assert_eq!(s.to_f64_round_odd(), pow2(-400));
    }

    #[test]
    fn round_to_odd_then_round_is_correct() {
        // 1 + 2^-24 + 2^-60: RNE to f32 must round up (above the midpoint), which a plain f64 sum
        // (1 + 2^-24 exactly, a tie) would round to even (down).
        let mut s = ExactSum::new();
        s.add(1, 0);
        s.add(1, -24);
        s.add(1, -60);
        let v = s.to_f64_round_odd();
        assert_eq!(v as f32, 1.0 + f32::EPSILON);
        assert_eq!((1.0f64 + 2f64.powi(-24)) as f32, 1.0);
    }

    #[test]
    fn negative_and_zero() {
        let mut s = ExactSum::new();
        s.add(-3, -2);
        assert_eq!(s.to_f64_round_odd(), -0.75);
        s.add(3, -2);
        assert_eq!(s.to_f64_round_odd(), 0.0);
        let mut s = ExactSum::new();
        s.add_product_f32(f32::INFINITY, 1.0);
        s.add_f32(5.0);
        assert_eq!(s.to_f64_round_odd(), f64::INFINITY);
        s.add_product_f32(f32::NEG_INFINITY, 1.0);
        assert!(s.to_f64_round_odd().is_nan());
    }

    #[test]
    fn parts_roundtrip() {
        for x in [0.0f32, -0.0, 1.0, -1.5, f32::MIN_POSITIVE, 1e-45, f32::MAX, -3.3e-39] {
            let (m, e) = f32_parts(x);
            assert_eq!(m as f64 * 2f64.powi(e), x as f64);
        }
    }
}
