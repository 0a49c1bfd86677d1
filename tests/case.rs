//! Case files under adversarial input: tiny files never ask for unbounded memory, naming never
//! divides by zero, every tensor's shape is checked, and `Error`'s messages never overflow.

use paged_qkv::case::{self, Case, Dtype, Mode, Op, Tensor};
use paged_qkv::{Error, Exec};

fn tiny(op: Op) -> Case {
    case::make(op, case::model("tiny").unwrap(), 3, 1, paged_qkv::BlockFormat::Nvfp4).unwrap()
}

fn with(c: &Case, name: &str, t: Tensor) -> Case {
    let mut c = c.clone();
    c.tensors.insert(name.into(), t);
    Case::from_bytes(&c.to_bytes().unwrap()).unwrap()
}

/// A zero-sized tensor with an enormous other dimension: before, `written()` sized its row list
/// by that dimension (26 TB, SIGABRT). Now every count is bounded by the file.
#[test]
fn written_never_allocates_beyond_the_file() {
    for op in Op::ALL {
        let c = tiny(op);
        let x = if matches!(op, Op::RopeBshd | Op::RopeRagged) { "q_proj" } else { "hidden_state" };
        let dt = c.tensors[x].dtype;
        for shape in [vec![u32::MAX as usize, 0], vec![0, u32::MAX as usize, 0], vec![0, u32::MAX as usize, 4]] {
            let c2 = with(&c, x, Tensor { dtype: dt, shape, data: vec![] });
            let t = std::time::Instant::now();
            let _ = c2.written();
            let _ = c2.run(Mode::Exact, Exec::sequential());
            assert!(t.elapsed().as_secs() < 5, "{op:?} took too long");
        }
        // BSHD: valid_lengths with more entries than the batch dimension.
        if matches!(op, Op::QkvBshd | Op::KvStoreBshd | Op::RopeBshd) {
            let v = Tensor::from_u32(vec![1000], &[5; 1000]);
            let c2 = with(&c, "valid_lengths", v);
            assert!(c2.written().is_err(), "{op:?}");
        }
    }
}

/// `name_output` on an `output` with a zero or huge dimension names `#i` instead of dividing by 0
/// or overflowing.
#[test]
fn naming_never_divides_by_zero() {
    for op in [Op::QkvFp4Ragged, Op::QkvBshd, Op::RopeBshd, Op::RopeRagged] {
        let c = tiny(op);
        let dt = c.tensors["output"].dtype;
        for shape in
            [vec![0, 0], vec![1, 0, 0], vec![0, 0, 0, 0], vec![2, usize::MAX / 2, 3, 5], vec![1, 1 << 40, 1 << 40]]
        {
            let c2 = Case {
                tensors: c
                    .tensors
                    .clone()
                    .into_iter()
                    .chain([("output".to_string(), Tensor { dtype: dt, shape, data: vec![] })])
                    .collect(),
                ..c.clone()
            };
            for i in [0, 7, usize::MAX] {
                assert!(!c2.name_output(i).is_empty());
            }
        }
    }
}

/// Every tensor's shape is checked, not only its element count: `run` and `check` agree.
#[test]
fn lax_shapes_are_errors() {
    let c = tiny(Op::QkvFp4Ragged);
    let lens = c.tensors["cache_lengths"].clone();
    let bad = with(&c, "cache_lengths", Tensor { shape: vec![1, lens.shape[0]], ..lens });
    assert!(bad.run(Mode::Fast, Exec::sequential()).is_err(), "cache_lengths of rank 2");
    let offs = c.tensors["input_row_offsets"].clone();
    let bad = with(&c, "input_row_offsets", Tensor { shape: vec![offs.shape[0], 1], ..offs });
    assert!(bad.run(Mode::Fast, Exec::sequential()).is_err(), "input_row_offsets of rank 2");
    let c = tiny(Op::KvStoreRagged);
    let x = c.tensors["hidden_state"].clone();
    let flat = x.shape.iter().product::<usize>();
    let bad = with(&c, "hidden_state", Tensor { shape: vec![x.shape[0], flat / x.shape[0]], ..x.clone() });
    let e = bad.run(Mode::Fast, Exec::sequential()).unwrap_err();
    assert!(e.0.contains("hidden_state"), "{e}");
    let bad = with(&c, "hidden_state", Tensor { shape: vec![x.shape[0], x.shape[2], x.shape[1]], ..x });
    assert!(bad.run(Mode::Exact, Exec::sequential()).is_err(), "heads and head size swapped");
    // Strictness does not reject the files make-case writes (every op, every mode).
    for op in Op::ALL {
        for mode in [Mode::Fast, Mode::Exact, Mode::Sequential] {
            tiny(op).run(mode, Exec::sequential()).unwrap();
        }
    }
}

/// `Error`'s `Display` with extreme fields: no overflow (a panic with overflow checks), no wrong
/// arithmetic.
#[test]
fn error_display_never_overflows() {
    let e = Error::ColumnSplit { n: 0, q_dim: usize::MAX, kv_width: usize::MAX, mla: false };
    let s = e.to_string();
    assert!(s.contains(&(usize::MAX as u128 * 3).to_string()), "{s}");
    let e = Error::Shape { arg: "x", expected: paged_qkv::Expected::Dims(vec![usize::MAX, 4]), found: 3 };
    assert!(e.to_string().contains("overflows"), "{e}");
}

/// A q_dim from an `output` of shape `[0, 2^64 − 1]` is rejected by validation (the column split)
/// instead of reaching arithmetic.
#[test]
fn huge_q_dim_is_rejected() {
    let c = tiny(Op::QkvFp4Ragged);
    let o = c.tensors["output"].clone();
    let bad = with(&c, "output", Tensor { dtype: o.dtype, shape: vec![0, usize::MAX], data: vec![] });
    for mode in [Mode::Fast, Mode::Exact] {
        assert!(bad.run(mode, Exec::sequential()).is_err());
    }
    assert_eq!(o.dtype, Dtype::BF16);
}

/// `c` with its cache quantized: E4M3 codes (from the cache's values) and `kv_scales` of
/// granularity `g` (positive, varied).
fn quantized(c: &Case, g: usize) -> Case {
    let kv = &c.tensors["kv_blocks"];
    let vals = case::decode::<paged_qkv::bf16>(&kv.data); // the made cases' caches are bf16
    let codes: Vec<paged_qkv::E4M3> = vals.iter().map(|v| paged_qkv::E4M3::from_f32(v.to_f32() * 64.0)).collect();
    let mut shape = kv.shape.clone();
    shape[5] /= g;
    let scales: Vec<f32> = (0..shape.iter().product::<usize>()).map(|i| 1.0 / 64.0 + (i % 5) as f32 * 1e-3).collect();
    let c = with(c, "kv_blocks", Tensor::from_elements(kv.shape.clone(), &codes));
    with(&c, "kv_scales", Tensor::from_elements(shape, &scales))
}

/// A quantized cache is judged by its values, code × scale: a written group stored as half the
/// codes at twice the scale (the same values) passes at zero tolerance, its codes and scales
/// reported as off; a code one E4M3 step off fails at zero tolerance and passes at one ulp, named
/// as the cache element, with the step counted as its ulp.
#[test]
fn quantized_caches_are_compared_by_value() {
    let c = quantized(&tiny(Op::KvStoreRagged), 2);
    let all = c.run_all(Mode::Exact, Exec::default()).unwrap();
    let (codes, scales): (Vec<u8>, Vec<f32>) = (all["kv_blocks"].data.clone(), case::decode(&all["kv_scales"].data));
    let input: Vec<f32> = case::decode(&c.tensors["kv_scales"].data);
    // A written group whose codes all halve exactly (normal codes with an exponent field of 2 or
    // more, or zeros) and are not all zero.
    let halves = |c: u8| c & 0x7F == 0 || (c & 0x7F) >> 3 >= 2;
    let q = (0..scales.len())
        .find(|&q| {
            let grp = &codes[2 * q..2 * q + 2];
            scales[q] != input[q] && grp.iter().all(|&c| halves(c)) && grp.iter().any(|&c| c & 0x7F != 0)
        })
        .expect("a written group of halvable codes");
    let mut same = all.clone();
    let mut co = codes.clone();
    for c in &mut co[2 * q..2 * q + 2] {
        if *c & 0x7F != 0 {
            *c -= 8; // one exponent down: half the value
        }
    }
    let mut sc = scales.clone();
    sc[q] *= 2.0;
    same.insert("kv_blocks".into(), Tensor { data: co, ..all["kv_blocks"].clone() });
    same.insert("kv_scales".into(), Tensor::from_elements(all["kv_scales"].shape.clone(), &sc));
    let zero = case::Tolerance { atol: 0.0, rtol: 0.0, ulps: 0 };
    let r = case::check(&c, &same, zero, Mode::Exact).unwrap();
    assert!(r.passed, "{}", r.text);
    assert!(r.text.contains("kv_values:") && r.text.contains("(reported: the values decide)"), "{}", r.text);
    // One code one step up (its magnitude below the largest finite code).
    let mut off = all.clone();
    let mut co = codes.clone();
    let i = (0..co.len()).find(|&i| co[i] & 0x7F != 0 && co[i] & 0x7F < 0x7E && scales[i / 2] != input[i / 2]).unwrap();
    co[i] += 1;
    off.insert("kv_blocks".into(), Tensor { data: co, ..all["kv_blocks"].clone() });
    let r = case::check(&c, &off, zero, Mode::Exact).unwrap();
    assert!(!r.passed, "{}", r.text);
    let (_, v) = r.tensors.iter().find(|(n, _)| n == "kv_values").unwrap();
    assert_eq!((v.failures, v.worst[0].0, v.worst[0].3), (1, i, 1), "{}", r.text);
    let one = case::Tolerance { ulps: 1, ..zero };
    assert!(case::check(&c, &off, one, Mode::Exact).unwrap().passed);
}

/// A case with a quantized cache: `run_all` updates `kv_scales` as the library call does, `run`
/// still gives the output and codes, `check` passes the oracle's own results and fails a changed
/// scale (named), a changed scale of an unwritten group (corruption) or missing scales; bad
/// `kv_scales` shapes and dtypes are one-line errors naming the tensor.
#[test]
fn quantized_cache_cases_run_and_check() {
    for op in [Op::QkvRagged, Op::RopeRagged, Op::KvStoreBshd] {
        let c = quantized(&tiny(op), 2);
        let all = c.run_all(Mode::Exact, Exec::default()).unwrap();
        assert!(all.contains_key("kv_scales") && all.contains_key("kv_blocks"), "{op:?}");
        assert_ne!(all["kv_scales"].data, c.tensors["kv_scales"].data, "{op:?}: no scale written");
        let (o, kv) = c.run(Mode::Exact, Exec::default()).unwrap();
        assert_eq!(kv.data, all["kv_blocks"].data);
        assert_eq!(o.map(|t| t.data), all.get("output").map(|t| t.data.clone()));
        // The fast path gives the oracle's bits for these (RoPE and stores are exact; the QKV's
        // tiny sums are compared with the report below).
        let tol = case::Tolerance { atol: 0.0, rtol: 0.0, ulps: 0 };
        let r = case::check(&c, &all, tol, Mode::Exact).unwrap();
        assert!(r.passed, "{op:?}: {}", r.text);
        assert!(r.text.contains("kv_scales:"), "{}", r.text);
        // A written scale off by a little: named as the scale of a cache element.
        let mut bad = all.clone();
        let want: Vec<f32> = case::decode(&all["kv_scales"].data);
        let i = (0..want.len()).find(|&i| want[i] != case::decode::<f32>(&c.tensors["kv_scales"].data)[i]).unwrap();
        let mut sc = want.clone();
        sc[i] *= 1.5;
        bad.insert("kv_scales".into(), Tensor::from_elements(all["kv_scales"].shape.clone(), &sc));
        let r = case::check(&c, &bad, tol, Mode::Exact).unwrap();
        assert!(!r.passed && r.text.contains("the scale of"), "{}", r.text);
        // An unwritten group's scale changed: corruption.
        let input: Vec<f32> = case::decode(&c.tensors["kv_scales"].data);
        let j = (0..want.len()).rev().find(|&j| want[j] == input[j]).unwrap();
        let mut sc = want.clone();
        sc[j] += 1.0;
        bad.insert("kv_scales".into(), Tensor::from_elements(all["kv_scales"].shape.clone(), &sc));
        let r = case::check(&c, &bad, tol, Mode::Exact).unwrap();
        assert!(!r.passed && r.text.contains("CORRUPTION"), "{}", r.text);
        // Missing scales in the actual results.
        let mut missing = all.clone();
        missing.remove("kv_scales");
        let e = case::check(&c, &missing, tol, Mode::Exact).unwrap_err();
        assert!(e.0.contains("kv_scales"), "{e}");
    }
    // Bad scales: wrong rank, wrong first dimensions, a granularity not dividing the head, F16.
    let c = quantized(&tiny(Op::KvStoreRagged), 2);
    let s = c.tensors["kv_scales"].clone();
    let n: usize = s.shape.iter().product();
    let mut first = s.shape.clone();
    first[0] += 1;
    let mut odd = s.shape.clone();
    odd[5] = c.tensors["kv_blocks"].shape[5] + 1;
    for t in [
        Tensor::from_elements(vec![n], &vec![0f32; n]),
        Tensor::from_elements(first.clone(), &vec![0f32; first.iter().product()]),
        Tensor::from_elements(odd.clone(), &vec![0f32; odd.iter().product()]),
        Tensor::from_elements(s.shape.clone(), &vec![paged_qkv::f16::ZERO; n]),
    ] {
        let e = with(&c, "kv_scales", t).run_all(Mode::Exact, Exec::default()).unwrap_err();
        assert!(e.0.contains("kv_scales"), "{e}");
    }
    // Scales with a bf16 cache: the library's error, naming kv_scales.
    let e = with(&tiny(Op::KvStoreRagged), "kv_scales", s).run_all(Mode::Fast, Exec::default()).unwrap_err();
    assert!(e.0.contains("kv_scales"), "{e}");
}
