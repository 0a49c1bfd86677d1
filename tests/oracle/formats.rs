//! Every code of every format against values written from the spec (§A, §B).

use paged_qkv::formats::fp4::*;
use paged_qkv::formats::fp8::*;

/// E2M1 `s e e m` from the spec: e = 0 → m · 0.5; else 2^(e−1) · (1 + m/2).
fn spec_e2m1(code: u8) -> f64 {
    let s = if code & 8 != 0 { -1.0 } else { 1.0 };
    let e = ((code >> 1) & 3) as i32;
    let m = (code & 1) as f64;
    s * if e == 0 { m * 0.5 } else { 2f64.powi(e - 1) * (1.0 + m / 2.0) }
}

#[test]
fn e2m1_decode_all_codes() {
    let table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for code in 0u8..16 {
        let v = e2m1_to_f32(code);
        assert_eq!(v as f64, spec_e2m1(code), "code {code}");
        assert_eq!(v.abs(), table[(code & 7) as usize]);
        assert_eq!(v.is_sign_negative(), code >= 8, "sign of code {code}");
        assert_eq!(E2M1_DOUBLED[code as usize] as f32, 2.0 * v);
        // Only the low nibble matters.
        assert_eq!(e2m1_to_f32(code | 0xF0).to_bits(), v.to_bits());
    }
}

#[test]
fn e2m1_encode_thresholds_ties_to_even() {
    // (input, expected magnitude code) at MAX's thresholds and just beside them.
    let cases: &[(f32, u8)] = &[
        (0.0, 0),
        (0.25, 0),
        (0.2500001, 1),
        (0.5, 1),
        (0.7499999, 1),
        (0.75, 2),
        (1.25, 2),
        (1.2500001, 3),
        (1.7499999, 3),
        (1.75, 4),
        (2.5, 4),
        (2.5000002, 5),
        (3.4999998, 5),
        (3.5, 6),
        (5.0, 6),
        (5.0000005, 7),
        (6.0, 7),
        (1.0e30, 7),
        (f32::INFINITY, 7),
    ];
    for &(x, code) in cases {
        assert_eq!(e2m1_from_f32(x), code, "e2m1({x})");
        assert_eq!(e2m1_from_f32(-x), code | 8, "e2m1({})", -x);
    }
    // Every code survives a round trip (−0.0 is code 8).
    for code in 0u8..16 {
        assert_eq!(e2m1_from_f32(e2m1_to_f32(code)), code);
    }
}

#[test]
fn e2m1_packing_low_nibble_first() {
    let packed = pack_e2m1(&[0x1, 0x2, 0x3, 0xF, 0x7]);
    assert_eq!(packed, vec![0x21, 0xF3, 0x07]);
    assert_eq!(unpack_e2m1(&packed, 5), vec![0x1, 0x2, 0x3, 0xF, 0x7]);
    assert_eq!(fp4_code(&[0xAB], 0), 0xB);
    assert_eq!(fp4_code(&[0xAB], 1), 0xA);
}

/// E4M3FN from the spec: bias 7, subnormals, 0x7F/0xFF NaN.
fn spec_e4m3(b: u8) -> Option<f64> {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 7) as f64;
    if e == 15 && m == 7.0 {
        return None;
    }
    Some(s * if e == 0 { 2f64.powi(-6) * m / 8.0 } else { 2f64.powi(e - 7) * (1.0 + m / 8.0) })
}

#[test]
fn e4m3_decode_all_codes() {
    for b in 0..=255u8 {
        let v = e4m3_to_f32(b);
        match spec_e4m3(b) {
            None => assert!(v.is_nan(), "{b:#x}"),
            Some(x) => {
                assert_eq!(v as f64, x, "{b:#04x}");
                assert_eq!(v.is_sign_negative(), b & 0x80 != 0, "{b:#04x}");
                assert_eq!(e4m3_to_units(b).unwrap() as f64, x * 512.0);
            }
        }
    }
    assert_eq!(e4m3_to_f32(0x7E), 448.0);
    assert_eq!(e4m3_to_f32(0x38), 1.0);
    assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    assert!(e4m3_to_units(0x7F).is_none() && e4m3_to_units(0xFF).is_none());
}

#[test]
fn e4m3_scale_decode_ignores_sign() {
    for b in 0..=255u8 {
        let s = e4m3_scale_to_f32(b);
        let v = e4m3_to_f32(b);
        if v.is_nan() {
            assert!(s.is_nan());
        } else {
            assert_eq!(s.to_bits(), v.abs().to_bits(), "{b:#04x}");
        }
    }
}

#[test]
fn e4m3_encode_round_trip_ties_and_saturation() {
    for b in 0..=255u8 {
        if let Some(x) = spec_e4m3(b) {
            assert_eq!(e4m3_from_f32(x as f32), b, "round trip of {b:#04x}");
        }
    }
    // Midpoints between neighbours go to the even code; a hair either side goes to the nearer.
    for b in 0..0x7Eu8 {
        let (lo, hi) = (spec_e4m3(b).unwrap(), spec_e4m3(b + 1).unwrap());
        let mid = ((lo + hi) / 2.0) as f32;
        assert_eq!(mid as f64, (lo + hi) / 2.0, "midpoint exact in f32");
        let even = if b & 1 == 0 { b } else { b + 1 };
        assert_eq!(e4m3_from_f32(mid), even, "tie between {b:#04x} and {:#04x}", b + 1);
        assert_eq!(e4m3_from_f32(mid.next_down()), b);
        assert_eq!(e4m3_from_f32(mid.next_up()), b + 1);
        assert_eq!(e4m3_from_f32(-mid), even | 0x80);
    }
    for x in [448.0f32, 449.0, 464.0, 1.0e9, f32::MAX, f32::INFINITY] {
        assert_eq!(e4m3_from_f32(x), 0x7E, "{x} saturates");
        assert_eq!(e4m3_from_f32(-x), 0xFE, "{} saturates", -x);
    }
    assert_eq!(e4m3_from_f32(f32::NAN), 0x7F);
    assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0x00, "half the smallest subnormal ties to 0");
    assert_eq!(e4m3_from_f32(2f32.powi(-10).next_up()), 0x01);
    assert_eq!(e4m3_from_f32(1.0e-30), 0x00);
}

#[test]
fn e8m0_decode_all_codes() {
    for b in 0..=255u8 {
        let v = e8m0_to_f32(b);
        match b {
            0xFF => assert!(v.is_nan()),
            0 => {
                assert_eq!(v.to_bits(), 0x0040_0000);
                assert_eq!(v as f64, 2f64.powi(-127), "0x00 is 2^-127, not zero");
            }
            _ => assert_eq!(v as f64, 2f64.powi(b as i32 - 127), "{b:#04x}"),
        }
    }
}

#[test]
fn e8m0_encode_rounds_up() {
    for e in 1..=254u8 {
        let p = e8m0_to_f32(e);
        assert_eq!(e8m0_from_f32_roundup(p), e, "exact power 2^{}", e as i32 - 127);
        let above = e8m0_from_f32_roundup(p.next_up());
        assert_eq!(above, if e == 254 { 254 } else { e + 1 }, "just above 2^{}", e as i32 - 127);
        assert_eq!(e8m0_from_f32_roundup(-p), e, "sign ignored");
    }
    assert_eq!(e8m0_from_f32_roundup(0.0), 0);
    assert_eq!(e8m0_from_f32_roundup(2f32.powi(-127)), 0);
    assert_eq!(e8m0_from_f32_roundup(2f32.powi(-130)), 0);
    assert_eq!(e8m0_from_f32_roundup(2f32.powi(-127) * 1.5), 1, "subnormal above 2^-127 rounds up to 2^-126");
    assert_eq!(e8m0_from_f32_roundup(f32::MAX), 254, "saturates at 2^127");
    assert_eq!(e8m0_from_f32_roundup(f32::NAN), 0xFF);
    assert_eq!(e8m0_from_f32_roundup(f32::INFINITY), 0xFF);
    assert_eq!(e8m0_from_f32_roundup(3.0), 128 + 1, "3 rounds up to 4");
}
