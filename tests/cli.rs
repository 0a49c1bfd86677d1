//! The `paged-qkv` binary end to end: make-case → run → check, perturbed and corrupted results,
//! malformed files (never a panic; exit 2 with a one-line message), numpy-style U8 scales.

use paged_qkv::case::Dtype;
use paged_qkv::case::{self, Case, Tensor};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_paged-qkv"))
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("paged-qkv-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(args: &[&str]) -> Output {
    let o = bin().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "the binary panicked: {err}");
    o
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn make(d: &Path, op: &str, format: &str) -> PathBuf {
    let c = d.join(format!("{op}-{format}.safetensors"));
    let o = run(&[
        "make-case",
        "--op",
        op,
        "--model",
        "tiny",
        "--batch",
        "3",
        "--seed",
        "7",
        "--format",
        format,
        "-o",
        p(&c),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    c
}

#[test]
fn every_op_runs_and_checks_against_itself() {
    let d = dir("roundtrip");
    let mut cases: Vec<(&str, &str)> = case::Op::ALL.iter().map(|o| (o.name(), "nvfp4")).collect();
    cases.push(("qkv_fp4_ragged", "mxfp4"));
    cases.push(("qkv_fp4_ragged", "mxfp8"));
    for (op, fmt) in cases {
        let c = make(&d, op, fmt);
        let out = d.join(format!("{op}-{fmt}-out.safetensors"));
        let o = run(&["run", p(&c), "-o", p(&out), "--threads", "2"]);
        assert!(o.status.success(), "{op}: {}", String::from_utf8_lossy(&o.stderr));
        let o = run(&["check", p(&c), "--actual", p(&out)]);
        let text = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(0), "{op} {fmt}: {text}");
        assert!(text.contains("verdict: PASS"), "{text}");
        // The reference run itself (sequential mode) is bit-identical to its own check.
        let o = run(&["run", p(&c), "-o", p(&out), "--mode", "exact"]);
        assert!(o.status.success());
        let o = run(&["check", p(&c), "--actual", p(&out), "--ulps", "0"]);
        assert_eq!(o.status.code(), Some(0), "{op} exact vs exact: {}", String::from_utf8_lossy(&o.stdout));
    }
}

/// `make-case --kv-quant G` makes a case with an FP8-quantized cache (E4M3 codes as U8, or
/// F8_E4M3 with `--f8-dtypes`; F32 `kv_scales` of granularity G) for every op: it runs (fast and
/// exact, `kv_blocks` written back in the case's dtype) and checks against itself, the report
/// judging the values code × scale, whichever dtype each side gives the codes in; a granularity
/// that does not divide the head size, and U8 codes without `kv_scales`, are one-line errors.
#[test]
fn quantized_cases_from_make_case() {
    let d = dir("kvquant");
    for op in case::Op::ALL.iter().map(|o| o.name()) {
        let c = d.join(format!("{op}-q.safetensors"));
        let o = run(&["make-case", "--op", op, "--kv-quant", "8", "--seed", "3", "-o", p(&c)]);
        assert!(o.status.success(), "{op}: {}", String::from_utf8_lossy(&o.stderr));
        let case = Case::from_bytes(&std::fs::read(&c).unwrap()).unwrap();
        let (kv, sc) = (&case.tensors["kv_blocks"], &case.tensors["kv_scales"]);
        assert_eq!((kv.dtype, sc.dtype), (Dtype::U8, Dtype::F32), "{op}");
        assert_eq!(sc.shape[..5], kv.shape[..5]);
        assert_eq!(sc.shape[5] * 8, kv.shape[5]);
        // The same case with F8_E4M3 codes (`--f8-dtypes`): the same bytes.
        let c8 = d.join(format!("{op}-q8.safetensors"));
        let o = run(&["make-case", "--op", op, "--kv-quant", "8", "--seed", "3", "--f8-dtypes", "-o", p(&c8)]);
        assert!(o.status.success(), "{op}: {}", String::from_utf8_lossy(&o.stderr));
        let kv8 = &Case::from_bytes(&std::fs::read(&c8).unwrap()).unwrap().tensors["kv_blocks"];
        assert_eq!((kv8.dtype, &kv8.data), (Dtype::F8E4M3, &kv.data), "{op}");
        let out = d.join(format!("{op}-q-out.safetensors"));
        let out8 = d.join(format!("{op}-q8-out.safetensors"));
        for (mode, ulps) in [("fast", "2"), ("exact", "0")] {
            for (case, o) in [(&c, &out), (&c8, &out8)] {
                let r = run(&["run", p(case), "-o", p(o), "--mode", mode]);
                assert!(r.status.success(), "{op}: {}", String::from_utf8_lossy(&r.stderr));
            }
            let written =
                |o: &Path| case::load_tensors(&std::fs::read(o).unwrap()).unwrap().remove("kv_blocks").unwrap();
            let (w, w8) = (written(&out), written(&out8));
            assert_eq!((w.dtype, w8.dtype), (Dtype::U8, Dtype::F8E4M3), "{op} {mode}");
            assert_eq!(w.data, w8.data, "{op} {mode}");
            // Each case checked against the results in its own dtype and in the other.
            for (case, o) in [(&c, &out), (&c, &out8), (&c8, &out), (&c8, &out8)] {
                let r = run(&["check", p(case), "--actual", p(o), "--ulps", ulps]);
                let text = String::from_utf8_lossy(&r.stdout);
                assert_eq!(r.status.code(), Some(0), "{op} {mode}: {text}");
                assert!(text.contains("kv_values:") && text.contains("verdict: PASS"), "{text}");
            }
        }
    }
    // U8 codes without `kv_scales` are not a cache of values.
    let c = d.join("rope_ragged-q.safetensors");
    let mut case = Case::from_bytes(&std::fs::read(&c).unwrap()).unwrap();
    case.tensors.remove("kv_scales");
    std::fs::write(&c, case.to_bytes().unwrap()).unwrap();
    let o = run(&["run", p(&c), "-o", p(&d.join("bad-out"))]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("`kv_blocks`: U8") && err.contains("kv_scales") && err.lines().count() == 1, "{err}");
    let o = run(&["make-case", "--op", "rope_ragged", "--kv-quant", "3", "-o", p(&d.join("bad"))]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("kv_scales") && err.lines().count() == 1, "{err}");
}

fn edit(path: &Path, f: impl FnOnce(&mut std::collections::BTreeMap<String, Tensor>)) {
    let mut t = case::load_tensors(&std::fs::read(path).unwrap()).unwrap();
    f(&mut t);
    std::fs::write(path, case::save_tensors(&t, None).unwrap()).unwrap();
}

#[test]
fn a_perturbed_result_fails_and_names_the_position() {
    let d = dir("perturbed");
    let c = make(&d, "qkv_fp4_ragged", "nvfp4");
    let out = d.join("out.safetensors");
    assert!(run(&["run", p(&c), "-o", p(&out)]).status.success());
    let case = Case::from_bytes(&std::fs::read(&c).unwrap()).unwrap();
    let idx = 37;
    edit(&out, |t| {
        let o = t.get_mut("output").unwrap();
        // bf16 at index 37: add a large value.
        let v = half::bf16::from_le_bytes([o.data[2 * idx], o.data[2 * idx + 1]]);
        let w = half::bf16::from_f32(v.to_f32() + 3.0).to_le_bytes();
        o.data[2 * idx..2 * idx + 2].copy_from_slice(&w);
    });
    let o = run(&["check", p(&c), "--actual", p(&out)]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains(&case.name_output(idx)), "position {} not named in:\n{text}", case.name_output(idx));
    assert!(text.contains("verdict: FAIL"));

    // A change to a cache element the op does not write is reported as corruption.
    assert!(run(&["run", p(&c), "-o", p(&out)]).status.success());
    let (_, mask) = case.written().unwrap();
    let i = mask.iter().position(|&w| !w).unwrap();
    edit(&out, |t| {
        let kv = t.get_mut("kv_blocks").unwrap();
        kv.data[2 * i] ^= 0x40;
    });
    let o = run(&["check", p(&c), "--actual", p(&out)]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("CORRUPTION") && text.contains(&case.name_cache(i)), "{text}");
}

fn expect_bad(case_path: &Path, needle: &str) {
    let out = case_path.with_extension("out");
    let o = run(&["run", p(case_path), "-o", p(&out)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(needle), "expected `{needle}` in: {err}");
    assert_eq!(err.trim().lines().count(), 1, "one-line message: {err}");
}

#[test]
fn malformed_files_are_clear_errors() {
    let d = dir("malformed");
    let good = make(&d, "qkv_fp4_ragged", "nvfp4");
    let bytes = std::fs::read(&good).unwrap();

    let f = d.join("truncated.safetensors");
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    expect_bad(&f, "not a valid safetensors file");

    let f = d.join("empty.safetensors");
    std::fs::write(&f, b"").unwrap();
    expect_bad(&f, "not a valid safetensors file");

    // The header claims more data than the file holds.
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let last_end = bytes.len() - 8 - n;
    let lying = header.replacen(&format!("{last_end}]"), &format!("{}]", last_end + 4096), 1);
    assert_ne!(lying, header);
    let mut v = (lying.len() as u64).to_le_bytes().to_vec();
    v.extend(lying.as_bytes());
    v.extend(&bytes[8 + n..]);
    let f = d.join("lying.safetensors");
    std::fs::write(&f, v).unwrap();
    expect_bad(&f, "not a valid safetensors file");

    let mut case = Case::from_bytes(&bytes).unwrap();
    let save = |c: &Case, name: &str| {
        let f = d.join(name);
        std::fs::write(&f, c.to_bytes().unwrap()).unwrap();
        f
    };
    // Wrong dtype.
    let lens = case.tensors["cache_lengths"].clone();
    case.tensors.insert("cache_lengths".into(), Tensor { dtype: Dtype::F32, ..lens.clone() });
    expect_bad(&save(&case, "dtype.safetensors"), "`cache_lengths`: expected dtype U32, found F32");
    case.tensors.insert("cache_lengths".into(), lens);
    // Wrong shape.
    let ws = case.tensors["weight_scale"].clone();
    let mut bad = ws.clone();
    bad.shape = vec![ws.shape.iter().product::<usize>()];
    case.tensors.insert("weight_scale".into(), bad);
    expect_bad(&save(&case, "shape.safetensors"), "`weight_scale`: expected 5-D shape");
    case.tensors.insert("weight_scale".into(), ws);
    // Missing tensor.
    let lut = case.tensors.remove("kv_lookup_table").unwrap();
    expect_bad(&save(&case, "missing.safetensors"), "`kv_lookup_table`: missing tensor");
    case.tensors.insert("kv_lookup_table".into(), lut);
    // A page table entry past the cache: the library's validation, in one line.
    let mut lut = case.tensors["kv_lookup_table"].clone();
    for e in lut.data.chunks_exact_mut(4) {
        e.copy_from_slice(&10_000u32.to_le_bytes());
    }
    let mut c2 = case.clone();
    c2.tensors.insert("kv_lookup_table".into(), lut);
    expect_bad(&save(&c2, "block.safetensors"), "kv_lookup_table");
    // Unknown op.
    let mut c3 = case.clone();
    c3.meta.insert("op".into(), "matmul".into());
    let f = d.join("op.safetensors");
    let t = c3.tensors.clone();
    std::fs::write(&f, case::save_tensors(&t, Some(c3.meta.clone())).unwrap()).unwrap();
    expect_bad(&f, "`__metadata__.op`");
}

/// `make-case` writes FP8 bytes as U8 (what `safetensors.numpy` loads) unless `--f8-dtypes`; the
/// reader takes both spellings and gives the same results.
#[test]
fn u8_by_default_and_f8_dtypes_still_load() {
    let d = dir("u8");
    for fmt in ["nvfp4", "mxfp8"] {
        let c = make(&d, "qkv_fp4_ragged", fmt);
        let case = Case::from_bytes(&std::fs::read(&c).unwrap()).unwrap();
        for name in ["hidden_state", "weight", "input_scale", "weight_scale"] {
            assert_eq!(case.tensors[name].dtype, Dtype::U8, "{fmt} {name}");
        }
        let f8 = d.join(format!("{fmt}-f8.safetensors"));
        let o = run(&[
            "make-case",
            "--op",
            "qkv_fp4_ragged",
            "--model",
            "tiny",
            "--batch",
            "3",
            "--seed",
            "7",
            "--format",
            fmt,
            "--f8-dtypes",
            "-o",
            p(&f8),
        ]);
        assert!(o.status.success());
        let f8_case = Case::from_bytes(&std::fs::read(&f8).unwrap()).unwrap();
        let want = if fmt == "nvfp4" { Dtype::F8E4M3 } else { Dtype::F8E8M0 };
        assert_eq!(f8_case.tensors["input_scale"].dtype, want);
        let (out_u8, out_f8) = (d.join(format!("{fmt}-u8.out")), d.join(format!("{fmt}-f8.out")));
        assert!(run(&["run", p(&c), "-o", p(&out_u8)]).status.success());
        let o = run(&["run", p(&f8), "-o", p(&out_f8)]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let a = case::load_tensors(&std::fs::read(&out_f8).unwrap()).unwrap();
        let b = case::load_tensors(&std::fs::read(&out_u8).unwrap()).unwrap();
        assert_eq!(a, b);
    }
}

/// `check … | head -1`: a closed stdout ends the command quietly with its verdict's exit code.
#[test]
fn a_broken_pipe_ends_quietly_with_the_exit_code() {
    let d = dir("pipe");
    let c = make(&d, "qkv_fp4_ragged", "nvfp4");
    let (good, bad) = (d.join("good.safetensors"), d.join("bad.safetensors"));
    assert!(run(&["run", p(&c), "-o", p(&good)]).status.success());
    assert!(run(&["run", p(&c), "-o", p(&bad)]).status.success());
    edit(&bad, |t| t.get_mut("output").unwrap().data[1] ^= 0x40);
    for (out, code) in [(&good, 0), (&bad, 1)] {
        let mut child = bin()
            .args(["check", p(&c), "--actual", p(out)])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader goes away before the first line is written
        let o = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.is_empty(), "stderr must stay quiet: {err}");
        assert_eq!(o.status.code(), Some(code), "{}", out.display());
    }
}

/// Enumerated values: a typo is an error (exit 2) with a hint; `--expected` still works.
#[test]
fn enumerated_values_and_old_spellings() {
    let d = dir("enums");
    let o = run(&["make-case", "--op", "qkv_fp4_raged", "-o", p(&d.join("x"))]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2));
    assert!(err.contains("qkv_fp4_ragged"), "hint expected: {err}");
    let o = run(&["make-case", "--op", "qkv_bshd", "--model", "llama3", "-o", p(&d.join("x"))]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("llama3-8b"));
    let c = make(&d, "qkv_bshd", "nvfp4");
    let out = d.join("out.safetensors");
    assert!(run(&["run", p(&c), "-o", p(&out)]).status.success());
    let o = run(&["check", p(&c), "--expected", p(&out)]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stdout));
}

mod fuzzish {
    use super::*;
    use paged_qkv::Exec;
    use paged_qkv::case::Mode;
    use proptest::prelude::*;

    fn seed_cases() -> Vec<Vec<u8>> {
        ["qkv_fp4_ragged", "rope_ragged", "qkv_bshd", "kv_store_bshd"]
            .iter()
            .map(|op| {
                let m = case::model("tiny").unwrap();
                case::make(case::Op::from_name(op).unwrap(), m, 3, 1, paged_qkv::BlockFormat::Nvfp4)
                    .unwrap()
                    .to_bytes()
                    .unwrap()
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        /// Byte flips anywhere in a valid case (header included): the reader and every step of
        /// run/written/naming return errors or results, never panic.
        #[test]
        fn mutated_case_files_never_panic(which in 0usize..4, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6), cut in any::<bool>()) {
            let mut bytes = seed_cases()[which].clone();
            for (pos, x) in flips {
                let i = pos % bytes.len();
                bytes[i] ^= x | 1;
            }
            if cut { bytes.truncate(bytes.len() * 3 / 4); }
            if let Ok(c) = Case::from_bytes(&bytes) {
                let _ = c.run(Mode::Exact, Exec::sequential());
                let _ = c.run(Mode::Fast, Exec::sequential());
                let _ = c.written();
                let _ = c.name_output(3);
                let _ = c.name_cache(3);
            }
        }
    }
}

#[test]
fn f4_dtype_tensors_load_like_packed_u8() {
    let m = case::model("tiny").unwrap();
    let c = case::make(case::Op::QkvFp4Ragged, m, 3, 5, paged_qkv::BlockFormat::Nvfp4).unwrap();
    let mut f4 = c.clone();
    for name in ["hidden_state", "weight"] {
        let t = f4.tensors.get_mut(name).unwrap();
        t.dtype = Dtype::F4;
        t.shape[1] *= 2; // [rows, K]: same bytes, two elements per byte
    }
    let f4 = Case::from_bytes(&f4.to_bytes().unwrap()).unwrap();
    let exec = paged_qkv::Exec::sequential();
    assert_eq!(c.run(case::Mode::Exact, exec).unwrap(), f4.run(case::Mode::Exact, exec).unwrap());
}

/// `isa --available` prints the crate's own list (what CI compares the fast-path tests with);
/// `isa` names the best level and every available one.
#[test]
fn isa_lists_the_detected_levels() {
    let o = run(&["isa", "--available"]);
    assert!(o.status.success());
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), format!("{:?}", paged_qkv::Isa::available()));
    let o = run(&["isa"]);
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(text.starts_with(&format!("best: {}\n", paged_qkv::Isa::best().name())), "{text}");
    for i in paged_qkv::Isa::available() {
        assert!(text.contains(i.name()), "{text}");
    }
}

/// `check --compare-padded-q` compares the padded Q rows the default check leaves alone.
#[test]
fn padded_q_rows_are_compared_only_when_asked() {
    let d = dir("padded-q");
    let c = make(&d, "qkv_bshd", "nvfp4");
    let out = d.join("out.safetensors");
    assert!(run(&["run", p(&c), "-o", p(&out), "--mode", "fast"]).status.success());
    let case = Case::from_bytes(&std::fs::read(&c).unwrap()).unwrap();
    let valid: Vec<u32> =
        case.tensors["valid_lengths"].data.chunks(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let [_, s, q]: [usize; 3] = case.tensors["output"].shape.clone().try_into().unwrap();
    let (b, t) = valid
        .iter()
        .enumerate()
        .find(|(_, v)| (**v as usize) < s)
        .map(|(b, v)| (b, *v as usize))
        .expect("a padded row");
    assert_eq!(case.tensors["output"].dtype, Dtype::BF16);
    edit(&out, |tensors| {
        let i = ((b * s + t) * q) * 2; // the first element of padded row (b, t), bf16
        tensors.get_mut("output").unwrap().data[i + 1] ^= 0x40; // a large change
    });
    assert!(run(&["check", p(&c), "--actual", p(&out)]).status.success());
    assert_eq!(run(&["check", p(&c), "--actual", p(&out), "--compare-padded-q"]).status.code(), Some(1));
}
