//! The 5-D scale layout against the spec's shapes, its offset formula and zero padding (§C).

use crate::common::Rng;
use paged_qkv::formats::scale_layout::ScaleLayout;
use std::collections::HashSet;

#[test]
fn spec_examples() {
    assert_eq!(ScaleLayout::for_operand(129, 192, 16).shape(), [2, 3, 32, 4, 4]);
    assert_eq!(ScaleLayout::for_operand(129, 192, 32).shape(), [2, 2, 32, 4, 4]);
    // block_scales_interleave on a [129, 136] scale matrix.
    let l = ScaleLayout::new(129, 136);
    assert_eq!(l.shape(), [2, 34, 32, 4, 4]);
    let plain: Vec<u8> = (0..129 * 136).map(|i| (i % 255 + 1) as u8).collect();
    assert_eq!(l.interleave(&plain).unwrap().len(), 2 * 34 * 32 * 4 * 4);
}

/// The offset from the 5-D coordinate and row-major strides, written independently.
fn coord_offset(l: &ScaleLayout, r: usize, kb: usize) -> usize {
    let s = l.shape();
    let c = [r / 128, kb / 4, r % 32, (r % 128) / 32, kb % 4];
    let strides = [s[1] * s[2] * s[3] * s[4], s[2] * s[3] * s[4], s[3] * s[4], s[4], 1];
    c.iter().zip(strides).map(|(a, b)| a * b).sum()
}

#[test]
fn offsets_are_a_bijection_onto_non_padding_slots() {
    let mut rng = Rng::new(1);
    for _ in 0..60 {
        let (r, kb) = (rng.range(1, 300), rng.range(1, 40));
        let l = ScaleLayout::new(r, kb);
        let mut seen = HashSet::new();
        for row in 0..r {
            for b in 0..kb {
                let o = l.offset(row, b);
                assert_eq!(o, coord_offset(&l, row, b));
                assert!(o < l.len());
                // Inside a 512-byte tile: (r%32)*16 + ((r%128)/32)*4 + kb%4.
                assert_eq!(o % 512, (row % 32) * 16 + ((row % 128) / 32) * 4 + b % 4);
                assert!(seen.insert(o), "offset {o} hit twice");
            }
        }
        assert_eq!(seen.len(), r * kb);
        assert_eq!(l.len(), r.div_ceil(128) * 128 * kb.div_ceil(4) * 4);
    }
}

#[test]
fn interleave_round_trip_pads_with_zero_and_never_reads_padding() {
    let mut rng = Rng::new(2);
    for _ in 0..30 {
        let (r, kb) = (rng.range(1, 260), rng.range(1, 13));
        let l = ScaleLayout::new(r, kb);
        let plain: Vec<u8> = (0..r * kb).map(|_| rng.byte() | 1).collect();
        let mut five = l.interleave(&plain).unwrap();
        let used: HashSet<usize> =
            (0..r).flat_map(|row| (0..kb).map(move |b| (row, b))).map(|(a, b)| l.offset(a, b)).collect();
        for (i, &v) in five.iter().enumerate() {
            if !used.contains(&i) {
                assert_eq!(v, 0, "padding slot {i} must be zero");
            }
        }
        assert_eq!(l.deinterleave(&five).unwrap(), plain);
        // Garbage in the padding does not change what is read back.
        for (i, v) in five.iter_mut().enumerate() {
            if !used.contains(&i) {
                *v = 0xAA;
            }
        }
        assert_eq!(l.deinterleave(&five).unwrap(), plain);
    }
}

#[test]
fn wrong_lengths_are_errors() {
    let l = ScaleLayout::new(3, 5);
    assert!(l.interleave(&[0u8; 14]).is_err());
    assert!(l.deinterleave(&[0u8; 10]).is_err());
}
