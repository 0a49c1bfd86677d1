"""The Python package against the Rust command line (bit for bit, every op, every mode), its
README example, errors (ValueError naming the argument, nothing written), strided arrays, the
checker's report, formats, and a run without torch or ml_dtypes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import paged_qkv as pq

ROOT = Path(__file__).resolve().parents[2]
OPS = ["qkv_fp4_ragged", "qkv_fp8_ragged", "qkv_ragged", "qkv_bshd", "rope_bshd", "rope_ragged", "kv_store_ragged", "kv_store_bshd"]
MODES = ["exact", "sequential", "fast"]


def cli() -> str:
    """The `paged-qkv` binary (PAGED_QKV_BIN, or built here)."""
    path = os.environ.get("PAGED_QKV_BIN") or str(ROOT / "target" / "release" / "paged-qkv")
    if not Path(path).exists():
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    return path


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def call(case: pq.Case, mode: str):
    """Runs `case` through the package's op function with MAX's argument names; returns
    (output or None, kv_blocks after)."""
    t, m = case.tensors, case.meta
    kv = t["kv_blocks"].copy()
    common = dict(kv_blocks=kv, cache_lengths=t["cache_lengths"], kv_lookup_table=t["kv_lookup_table"], layer_idx=int(m["layer_idx"]), mode=mode)
    op = case.op
    if op == "qkv_fp4_ragged":
        out = pq.qkv_fp4_ragged(
            t["hidden_state"], t["input_scale"], t["input_row_offsets"], t["weight"], t["weight_scale"],
            tensor_sf=float(m["tensor_sf"]), format=m["format"], q_dim=t["output"].shape[1], **common,
        )
    elif op == "qkv_fp8_ragged":
        out = pq.qkv_fp8_ragged(
            t["hidden_state"], t["input_scale"], t["input_row_offsets"], t["weight"], t["weight_scale"],
            bias=t.get("bias"), q_dim=t["output"].shape[1], **common,
        )
    elif op == "qkv_ragged":
        out = pq.qkv_ragged(t["hidden_state"], t["input_row_offsets"], t["weight"], bias=t.get("bias"), q_dim=t["output"].shape[1], **common)
    elif op == "qkv_bshd":
        out = pq.qkv_bshd(t["hidden_state"], t["weight"], valid_lengths=t["valid_lengths"], q_dim=t["output"].shape[2], **common)
    elif op == "rope_bshd":
        out = pq.rope_bshd(t["q_proj"], t["freqs_cis"], valid_lengths=t["valid_lengths"], interleaved=m["interleaved"] == "true", output=t["output"].copy(), **common)
    elif op == "rope_ragged":
        out = pq.rope_ragged(t["q_proj"], t["input_row_offsets"], t["freqs_cis"], interleaved=m["interleaved"] == "true", **common)
    elif op == "kv_store_ragged":
        out = pq.kv_store_ragged(t["hidden_state"], t["input_row_offsets"], cache=m.get("cache", "k"), **common)
    else:
        out = pq.kv_store_bshd(t["hidden_state"], valid_lengths=t["valid_lengths"], cache=m.get("cache", "k"), **common)
    return out, kv


@pytest.mark.parametrize(
    "op", OPS + ["qkv_fp4_ragged:mxfp4", "qkv_fp4_ragged:mxfp8", "qkv_fp8_ragged:channel", "qkv_fp8_ragged:block"]
)
@pytest.mark.parametrize("mode", MODES)
def test_every_op_matches_the_cli_bit_for_bit(tmp_path, op, mode):
    op, _, fmt = op.partition(":")
    case_path, out_path = tmp_path / "case.safetensors", tmp_path / "out.safetensors"
    make = [cli(), "make-case", "--op", op, "--model", "tiny", "--batch", "3", "--seed", "11", "-o", str(case_path)]
    flag = "--granularity" if op == "qkv_fp8_ragged" else "--format"
    subprocess.run(make + ([flag, fmt] if fmt else []), check=True, capture_output=True)
    subprocess.run([cli(), "run", str(case_path), "-o", str(out_path), "--mode", mode], check=True, capture_output=True)
    want = {name: arr for (name, _, _, arr) in pq.load_case_tensors(out_path)}
    out, kv = call(pq.load_case(case_path), mode)
    assert bits(kv) == want["kv_blocks"].tobytes()
    if "output" in want:
        assert bits(out) == want["output"].tobytes()
    else:
        assert out is None


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- python-example -->\s*```python\n(.*?)```", text, re.S)
    assert m, "README has the marked Python example"
    return m.group(1)


def test_the_readme_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_example(), "README.md", "exec"), {})


def small_call():
    c = pq.make_case("qkv_fp4_ragged", seed=3)
    t, m = c.tensors, c.meta
    args = (t["hidden_state"], t["input_scale"], t["input_row_offsets"], t["weight"], t["weight_scale"])
    kw = dict(cache_lengths=t["cache_lengths"], kv_lookup_table=t["kv_lookup_table"], layer_idx=1, tensor_sf=float(m["tensor_sf"]))
    return c, args, kw


def test_errors_name_the_argument_and_write_nothing():
    c, args, kw = small_call()
    kv = c.tensors["kv_blocks"].copy()
    before = bits(kv)
    cases = {
        "kv_lookup_table": dict(kw, kv_lookup_table=np.full_like(c.tensors["kv_lookup_table"], 1000)),
        "layer_idx": dict(kw, layer_idx=7),
        "input_row_offsets": dict(kw),
        "tensor_sf": dict(kw, tensor_sf=float("nan")),
    }
    for arg, kwargs in cases.items():
        a = list(args)
        if arg == "input_row_offsets":
            a[2] = np.array([0, 2, 1, 5], dtype=np.uint32)
        with pytest.raises(ValueError, match=re.escape(arg)):
            pq.qkv_fp4_ragged(*a, kv_blocks=kv, **kwargs)
        assert bits(kv) == before, f"{arg}: kv_blocks changed by a failing call"
    with pytest.raises(ValueError, match="mode"):
        pq.qkv_fp4_ragged(*args, kv_blocks=kv, mode="fastest", **kw)
    with pytest.raises(ValueError, match="uint32"):
        pq.qkv_fp4_ragged(args[0], args[1], np.array([0, -1, 5]), *args[3:], kv_blocks=kv, **kw)


def test_strided_inputs_are_copied_and_a_strided_cache_is_rejected():
    c, args, kw = small_call()
    kv = c.tensors["kv_blocks"].copy()
    out = pq.qkv_fp4_ragged(*args, kv_blocks=kv, **kw)
    # The same hidden state as a strided view of a wider array.
    hs = args[0]
    wide = np.zeros((hs.shape[0], hs.shape[1] * 2), dtype=np.uint8)
    wide[:, ::2] = hs
    kv2 = c.tensors["kv_blocks"].copy()
    out2 = pq.qkv_fp4_ragged(wide[:, ::2], *args[1:], kv_blocks=kv2, **kw)
    assert bits(out) == bits(out2) and bits(kv) == bits(kv2)
    # A cache that is a strided view cannot be updated in place: rejected, not copied.
    kv0 = c.tensors["kv_blocks"]
    wide_kv = np.zeros(kv0.shape[:-1] + (2 * kv0.shape[-1],), dtype=kv0.dtype)
    strided = wide_kv[..., ::2]
    assert strided.shape == kv0.shape and not strided.flags.c_contiguous
    with pytest.raises(ValueError, match="kv_blocks"):
        pq.qkv_fp4_ragged(*args, kv_blocks=strided, **kw)
    assert not wide_kv.any()


def test_check_reports_like_the_cli_and_assert_ok_raises(tmp_path):
    c = pq.make_case("qkv_bshd", seed=5)
    res = c.run("fast")
    report = pq.check(c, res)
    report.assert_ok()
    assert report.passed and "verdict: PASS" in report.text
    bad = {k: v.copy() for k, v in res.items()}
    o = bad["output"].reshape(-1)  # a view
    o[3] = o[3] + 8  # a large error in one element (bf16, or its bits without ml_dtypes)
    report = pq.check(c, bad)
    assert not report.passed
    with pytest.raises(AssertionError, match="verdict: FAIL"):
        report.assert_ok()
    # The CLI prints the same report for the same files.
    case_path, act_path = tmp_path / "c.safetensors", tmp_path / "a.safetensors"
    pq.save_case(case_path, c)
    pq.save_case(act_path, pq.Case("qkv_bshd", bad))
    p = subprocess.run([cli(), "check", str(case_path), "--actual", str(act_path)], capture_output=True, text=True)
    assert p.returncode == 1
    assert p.stdout.strip() == pq.check(case_path, act_path).text.strip()


def test_cases_roundtrip_and_load_in_plain_safetensors_numpy(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="safetensors is a test dependency")
    c = pq.make_case("qkv_fp4_ragged", format="mxfp8")
    # FP8 data and scales are U8; numpy has no bf16, so give this case f32 output and cache.
    c.tensors["output"] = np.zeros(c.tensors["output"].shape, np.float32)
    c.tensors["kv_blocks"] = c.tensors["kv_blocks"].astype(np.float32)
    path = tmp_path / "c.safetensors"
    pq.save_case(path, c)
    plain = safetensors_numpy.load_file(str(path))
    assert plain["weight_scale"].dtype == np.uint8 and plain["hidden_state"].dtype == np.uint8
    back = pq.load_case(path)
    assert back.op == c.op and back.meta == c.meta
    for k, v in c.tensors.items():
        assert bits(back.tensors[k]) == bits(v), k


def test_quantize_dequantize_and_the_scale_layout():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((130, 96)).astype(np.float32)
    for fmt, v in [("nvfp4", 16), ("mxfp4", 32), ("mxfp8", 32)]:
        codes, scales, ts = pq.quantize(x, fmt)
        kb = -(-96 // v)
        assert scales.shape == (2, -(-kb // 4), 32, 4, 4)
        y = pq.dequantize(codes, scales, fmt, ts)
        assert y.shape == x.shape and np.abs(y - x).max() < 0.35 * np.abs(x).max()
        for row, b in [(0, 0), (129, kb - 1), (37, 1)]:
            assert scales[pq.scale_index(row, b)] == scales.reshape(-1)[pq.scale_offset(row, b, kb)]


def test_no_torch_and_no_ml_dtypes(tmp_path):
    """The package imports and runs without torch; without ml_dtypes bf16 comes back as uint16."""
    code = (
        "import sys; sys.modules['ml_dtypes'] = None; sys.modules['torch'] = None\n"
        "import numpy as np, paged_qkv as pq\n"
        "c = pq.make_case('rope_ragged')\n"
        "assert c.tensors['q_proj'].dtype == np.uint16\n"
        "r = c.run('fast'); assert r['output'].dtype == np.uint16\n"
        "pq.check(c, r).assert_ok()\n"
        "print('ok')\n"
    )
    # env=: Python's view of the environment (MAX's runtime, if a test loaded it, edits the C-level one).
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    # Nor does it import torch where torch is installed.
    code = "import sys, paged_qkv as pq\npq.make_case('qkv_ragged').run('fast')\nprint('torch' in sys.modules)\n"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr


def test_fused_rope_through_python_equals_qkv_then_rope():
    c = pq.make_case("qkv_ragged", seed=9)
    t = c.tensors
    hd = t["kv_blocks"].shape[5]
    import math

    rows = 64
    freqs = np.array([[f(p * 10000 ** (-2 * i / hd)) for i in range(hd // 2) for f in (math.cos, math.sin)] for p in range(rows)], dtype=np.float32)
    kw = dict(cache_lengths=t["cache_lengths"], kv_lookup_table=t["kv_lookup_table"], layer_idx=1, bias=t["bias"], q_dim=t["output"].shape[1], mode="fast")
    kv1 = t["kv_blocks"].copy()
    fused = pq.qkv_ragged(t["hidden_state"], t["input_row_offsets"], t["weight"], kv_blocks=kv1, rope={"freqs_cis": freqs, "interleaved": False}, **kw)
    kv2 = t["kv_blocks"].copy()
    q = pq.qkv_ragged(t["hidden_state"], t["input_row_offsets"], t["weight"], kv_blocks=kv2, **kw)
    heads = q.shape[1] // hd
    rot = pq.rope_ragged(q.reshape(q.shape[0], heads, hd), t["input_row_offsets"], freqs, kv2, t["cache_lengths"], t["kv_lookup_table"], 1, interleaved=False, mode="fast")
    assert bits(fused) == bits(rot.reshape(q.shape)) and bits(kv1) == bits(kv2)


def test_an_fp8_cache_is_sent_as_f8_e4m3_and_checked():
    """An E4M3 KV cache (ml_dtypes.float8_e4m3fn) travels as F8_E4M3 values, not as codes."""
    import ml_dtypes

    c = pq.make_case("qkv_ragged", seed=3)
    t = c.tensors
    kw = dict(cache_lengths=t["cache_lengths"], kv_lookup_table=t["kv_lookup_table"], layer_idx=int(c.meta["layer_idx"]), bias=t["bias"], q_dim=t["output"].shape[1])
    zeros = np.zeros(t["kv_blocks"].shape, dtype=ml_dtypes.float8_e4m3fn)
    kv_exact, kv_fast = zeros.copy(), zeros.copy()
    out = pq.qkv_ragged(t["hidden_state"], t["input_row_offsets"], t["weight"], kv_blocks=kv_exact, mode="exact", **kw)
    out_fast = pq.qkv_ragged(t["hidden_state"], t["input_row_offsets"], t["weight"], kv_blocks=kv_fast, mode="fast", **kw)
    assert bits(out) == bits(out_fast) and bits(kv_exact) == bits(kv_fast)
    assert np.count_nonzero(kv_exact.view(np.uint8)) > 0
    fp8 = pq.Case(c.op, dict(t, kv_blocks=zeros), c.meta)
    back = pq.load_case(fp8.to_bytes())
    assert back.tensors["kv_blocks"].dtype == ml_dtypes.float8_e4m3fn
    pq.check(fp8, {"output": out, "kv_blocks": kv_exact}).assert_ok()
    flat = kv_exact.reshape(-1).view(np.uint8)
    flat[np.flatnonzero(flat)[0]] ^= 0x08
    assert not pq.check(fp8, {"output": out, "kv_blocks": kv_exact}, ulps=0)
