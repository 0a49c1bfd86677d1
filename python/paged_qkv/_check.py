"""``check_op``: a kernel's results against the oracle, from the operation's own arguments.

The reference runs on a **compact cache** holding only the blocks the operation writes (the page
table remapped onto them), so its cost follows the written slots, not the cache's size; blocks the
operation does not touch are compared with the input byte for byte (a memcmp without the GIL) and
looked at element by element only where they differ.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _native
from ._report import Report

ULP_BUCKETS = (0, 1, 2, 4, 8, 16, 256)
_RAGGED = ("qkv_fp4_ragged", "qkv_fp8_ragged", "qkv_ragged", "rope_ragged", "kv_store_ragged")
_PADDED = ("qkv_bshd", "rope_bshd", "kv_store_bshd")
_QKV = ("qkv_fp4_ragged", "qkv_fp8_ragged", "qkv_ragged", "qkv_bshd")
_ROPE = ("rope_bshd", "rope_ragged")
_STORES = ("kv_store_ragged", "kv_store_bshd")
_ROWS_FROM = {
    "qkv_fp4_ragged": "hidden_state",
    "qkv_fp8_ragged": "hidden_state",
    "qkv_ragged": "hidden_state",
    "qkv_bshd": "hidden_state",
    "rope_bshd": "q_proj",
    "rope_ragged": "q_proj",
    "kv_store_ragged": "values",
    "kv_store_bshd": "values",
}
PADDED_Q_POLICIES = ("ignore", "compare")


class TensorCheck:
    """The comparison of one tensor (``output`` or ``kv_blocks``).

    ``index`` holds the coordinates of the failing elements in the tensor (worst first, at most
    ``max_failures`` rows), ``actual`` / ``reference`` their values (float64), ``ulps`` their
    distance in units in the last place of the dtype (``-1``: NaN against a number), and
    ``positions`` the same elements as ``(sequence, position, head, dim)`` (``position`` is the
    token's place in its sequence, ``cache_lengths[b] + t``). ``corrupted`` counts elements the
    operation does not write that differ from the input (``kv_blocks`` only);
    ``corrupted_index`` lists their coordinates (at most ``max_failures``)."""

    def __init__(self, name: str, dtype: str):
        self.name = name
        self.dtype = dtype
        self.compared = 0
        self.failures = 0
        self.max_ulp = 0
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.ulp_histogram: Dict[str, int] = {}
        self.index = np.zeros((0, 0), np.int64)
        self.actual = np.zeros(0)
        self.reference = np.zeros(0)
        self.ulps = np.zeros(0, np.int64)
        self.positions = np.zeros((0, 4), np.int64)
        self.corrupted = 0
        self.corrupted_index = np.zeros((0, 0), np.int64)

    @property
    def passed(self) -> bool:
        return self.failures == 0 and self.corrupted == 0

    def __repr__(self) -> str:
        return (
            f"TensorCheck({self.name!r}, compared={self.compared}, failures={self.failures}, "
            f"max_ulp={self.max_ulp}, corrupted={self.corrupted})"
        )


class OpReport(Report):
    """The verdict of :func:`check_op`: ``passed``, per tensor a :class:`TensorCheck`
    (``report.tensors["kv_blocks"]``), ``hints`` (patterns recognised in the failures: K/V
    swapped, slots shifted by one, a constant factor) and ``text`` (the command line's format);
    ``assert_ok()``, ``bool()`` and ``str()`` as :class:`Report`'s."""

    def __init__(self, op: str, mode: str, tensors: Dict[str, TensorCheck], hints: List[str], tol: Tuple[float, float, int], padded_q: str):
        self.op = op
        self.mode = mode
        self.tensors = tensors
        self.hints = hints
        self.passed = all(t.passed for t in tensors.values())
        super().__init__(self.passed, _text(self, tol, padded_q))

    def __repr__(self) -> str:
        return f"OpReport(op={self.op!r}, passed={self.passed})"


def _text(r: OpReport, tol: Tuple[float, float, int], padded_q: str) -> str:
    atol, rtol, ulps = tol
    lines = [f"paged_qkv.check_op: op {r.op}, reference mode {r.mode}, tolerance atol {atol} rtol {rtol} ulps {ulps}"]
    if r.op in ("qkv_bshd", "rope_bshd"):
        lines.append(f"padded Q rows (t >= valid_lengths[b]): {'compared' if padded_q == 'compare' else 'not compared'}")
    for t in r.tensors.values():
        lines.append(f"{t.name}: {t.compared} elements compared ({t.dtype})")
        lines.append(f"  max abs error {t.max_abs:.3e}, max rel error {t.max_rel:.3e}, max ulp {t.max_ulp}")
        lines.append("  ULP histogram  " + "  ".join(f"{k}: {v}" for k, v in t.ulp_histogram.items()))
        lines.append(f"  outside tolerance: {t.failures}")
        for i in range(min(len(t.actual), 10)):
            s, p, h, d = t.positions[i]
            u = "NaN" if t.ulps[i] < 0 else str(t.ulps[i])
            lines.append(
                f"    {tuple(int(x) for x in t.index[i])} = (sequence {s}, position {p}, head {h}, dim {d}): "
                f"actual {t.actual[i]:e}, reference {t.reference[i]:e}, {u} ulp"
            )
        if t.corrupted:
            lines.append(
                f"  CORRUPTION: {t.corrupted} elements the op does not write changed, e.g. at "
                f"{tuple(int(x) for x in t.corrupted_index[0])}"
            )
    for h in r.hints:
        lines.append(f"hint: {h}")
    lines.append(f"verdict: {'PASS' if r.passed else 'FAIL'}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Element bits and values


def _kind(a: np.ndarray, name: str) -> str:
    n = a.dtype.name
    if n == "float32":
        return "f32"
    if n == "float16":
        return "f16"
    if n == "bfloat16" or (a.dtype.itemsize == 2 and a.dtype.kind in "iu"):
        return "bf16"
    if n.startswith("float8_e4m3") or (a.dtype.itemsize == 1 and a.dtype.kind in "iu"):
        return "e4m3"
    raise TypeError(f"`{name}`: expected float32, float16, bfloat16 or float8_e4m3fn values, found {a.dtype}")


def _e4m3_table() -> np.ndarray:
    t = np.zeros(256)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        if e == 15 and m == 7:
            v = np.nan
        elif e == 0:
            v = m / 8 * 2.0 ** -6
        else:
            v = (1 + m / 8) * 2.0 ** (e - 7)
        t[b] = -v if s else v
    return t


_E4M3 = _e4m3_table()
_WIDTH = {"f32": 32, "f16": 16, "bf16": 16, "e4m3": 8}
_UINT = {"f32": np.uint32, "f16": np.uint16, "bf16": np.uint16, "e4m3": np.uint8}


def _ordered_values(a: np.ndarray, kind: str) -> Tuple[np.ndarray, np.ndarray]:
    """(ordered integer of the bits, float64 value) of every element (flat)."""
    bits = np.ascontiguousarray(a).view(_UINT[kind]).reshape(-1).astype(np.int64)
    if kind == "f32":
        vals = bits.astype(np.uint32).view(np.float32).astype(np.float64)
    elif kind == "bf16":
        vals = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    elif kind == "f16":
        vals = bits.astype(np.uint16).view(np.float16).astype(np.float64)
    else:
        vals = _E4M3[bits]
    sign = 1 << (_WIDTH[kind] - 1)
    return np.where(bits & sign, -(bits & (sign - 1)), bits), vals


def _compare(got: np.ndarray, want: np.ndarray, kind: str, tol: Tuple[float, float, int]):
    """Per element (flat): ulps (-1: NaN against a number), |abs|, rel, within tolerance — the rule
    of ``paged-qkv check``: within ``atol + rtol·|ref|`` or within ``ulps``; NaN matches NaN."""
    og, gv = _ordered_values(got, kind)
    orf, rv = _ordered_values(want, kind)
    gnan, rnan = np.isnan(gv), np.isnan(rv)
    mism = gnan ^ rnan
    u = np.abs(og - orf)
    u[gnan & rnan] = 0
    with np.errstate(invalid="ignore", over="ignore"):
        ab = np.where(u == 0, 0.0, np.abs(gv - rv))
    return _verdict(u, ab, gv, rv, mism, tol)


def _verdict(u, ab, gv, rv, mism, tol: Tuple[float, float, int]):
    """The common end of :func:`_compare` and :func:`_compare_values`, given per element the ulps
    ``u``, the absolute errors ``ab``, the values and where NaN meets a number (``mism``): marks
    those (ulps -1, error infinite), adds the relative errors and the verdict."""
    atol, rtol, ulp_tol = tol
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ab[mism] = np.inf
        rel = np.where(rv != 0, ab / np.abs(np.where(rv == 0, 1, rv)), np.where(ab == 0, 0.0, np.inf))
        ok = ~mism & ((ab <= atol + rtol * np.abs(rv)) | (u <= ulp_tol))
    u[mism] = -1
    return u, ab, rel, ok, gv, rv


def _histogram(u: np.ndarray) -> Dict[str, int]:
    h: Dict[str, int] = {}
    lo = 0
    for b in ULP_BUCKETS:
        label = f"{b}" if b == lo else f"{lo}-{b}"
        h[label] = int(np.count_nonzero((u >= lo) & (u <= b)))
        lo = b + 1
    h[f">{ULP_BUCKETS[-1]}"] = int(np.count_nonzero(u > ULP_BUCKETS[-1]))
    h["NaN mismatch"] = int(np.count_nonzero(u < 0))
    return h


# ----------------------------------------------------------------------------------------------
# The check


def _resolve(op: Union[str, Callable]) -> Tuple[Callable, str]:
    import paged_qkv  # the package's own functions (this module is imported by it)

    name = op if isinstance(op, str) else getattr(op, "__name__", "")
    if name not in _ROWS_FROM:
        raise ValueError(f"op: expected one of {', '.join(_ROWS_FROM)}, found {op!r}")
    return getattr(paged_qkv, name), name


def check_op(
    op: Union[str, Callable],
    inputs: Mapping[str, Any],
    actual: Mapping[str, Any],
    *,
    ulps: int = 2,
    atol: float = 0.0,
    rtol: float = 0.0,
    mode: str = "exact",
    padded_q: str = "ignore",
    max_failures: int = 1000,
) -> OpReport:
    """Checks a kernel's results against the oracle, from the arguments of the operation.

    ``op`` is an operation's name or function (``"qkv_ragged"``, ``paged_qkv.qkv_ragged``, …);
    ``inputs`` its arguments by name, with ``kv_blocks`` as it was **before** the kernel ran;
    ``actual`` the kernel's results: ``{"output": q, "kv_blocks": cache_after}`` (no ``output`` for
    the KV stores). An element passes within ``atol + rtol·|ref|`` or within ``ulps`` units in the
    last place of its dtype; cache elements the operation does not write must be unchanged.

    A quantized cache (``kv_scales`` among the inputs, as before the kernel ran; ``actual`` then
    holds the kernel's ``kv_scales`` too) is judged by its values, code × scale: an ulp is one
    step of the reference code at its scale. ``report.tensors["kv_scales"]`` reports the scales
    (their differences alone do not fail) and their corruption (which does).

    ``padded_q``: the padded operations' Q rows past ``valid_lengths[b]`` (``qkv_bshd``,
    ``rope_bshd``, fused RoPE or not) are left undefined by MAX's padded RoPE and are not
    compared by default (``"ignore"``); ``"compare"`` compares them with the oracle's rows
    (``qkv_bshd``: the unrotated projection; ``rope_bshd``: the ``output`` given, else zeros).

    Returns an :class:`OpReport`; ``report.assert_ok()`` raises with the report's text."""
    fn, name = _resolve(op)
    if padded_q not in PADDED_Q_POLICIES:
        raise ValueError(f"padded_q: expected 'ignore' or 'compare', found {padded_q!r}")
    if mode not in ("exact", "sequential", "fast"):
        raise ValueError(f"mode: expected 'exact', 'sequential' or 'fast', found {mode!r}")
    tol = (float(atol), float(rtol), int(ulps))
    sig = inspect.signature(fn)
    kwargs = {k: v for k, v in dict(inputs).items() if k not in ("mode", "threads", "out")}
    unknown = sorted(set(kwargs) - set(sig.parameters))
    if unknown:
        raise ValueError(f"inputs: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not an argument of {name}")
    sig.bind(**kwargs)  # a missing argument: TypeError naming it
    quantized = kwargs.get("kv_scales") is not None
    if not isinstance(actual, Mapping):
        raise TypeError("actual: expected a dict {'output': …, 'kv_blocks': …}")
    act = dict(actual)
    if "out" in act and "output" not in act:
        act["output"] = act.pop("out")
    has_out = name not in _STORES
    for k in ("kv_blocks",) + (("output",) if has_out else ()) + (("kv_scales",) if quantized else ()):
        if k not in act:
            raise ValueError(f"actual: missing `{k}`")

    kv_in = _native.as_array(kwargs["kv_blocks"])
    kind = _kind(kv_in, "kv_blocks")
    act_kv = _native.as_array(act["kv_blocks"])
    if act_kv.shape != kv_in.shape or _kind(act_kv, "actual kv_blocks") != kind:
        raise ValueError(f"actual `kv_blocks`: expected {kind} {kv_in.shape} (the input's), found {act_kv.dtype} {act_kv.shape}")
    nb, kv_dim, layers, page, heads, hd = kv_in.shape
    layer = int(kwargs["layer_idx"])
    sc_in = act_sc = None
    if quantized:
        # The scales are never written here: the reference writes a compact copy.
        sc_in = np.asarray(_native.as_array(kwargs["kv_scales"]))
        act_sc = np.asarray(_native.as_array(act["kv_scales"]))
        if act_sc.shape != sc_in.shape or act_sc.dtype != sc_in.dtype:
            raise ValueError(f"actual `kv_scales`: expected {sc_in.dtype} {sc_in.shape} (the input's), found {act_sc.dtype} {act_sc.shape}")

    rows = _rows(name, kwargs, kv_in.shape)
    if rows is not None:
        seq, t, pos, blocks, slots, writes = rows
        wb = blocks[writes]
        touched = np.unique(wb) if wb.size else np.zeros(1, np.int64)
        lookup = np.asarray(_native.as_array(kwargs["kv_lookup_table"])).astype(np.int64)
        remapped = np.zeros(lookup.shape, np.uint32)
        pages = pos[writes] // page
        remapped[seq[writes], pages] = np.searchsorted(touched, wb)
        # Only the written layer of the written blocks (the operation reads and writes no other).
        ref_kv = kv_in[touched, :, layer : layer + 1] if 0 <= layer < layers else None
        ref_sc = None
        try:
            if ref_kv is None:
                raise ValueError("layer_idx")
            extra = {}
            if quantized:
                if sc_in.ndim != 6 or sc_in.shape[:5] != kv_in.shape[:5]:
                    raise ValueError("kv_scales")
                ref_sc = np.ascontiguousarray(sc_in[touched, :, layer : layer + 1])
                extra = {"kv_scales": ref_sc}
            ref_out = fn(**dict(kwargs, kv_blocks=ref_kv, kv_lookup_table=remapped, layer_idx=0, mode=mode, **extra))
        except (TypeError, ValueError):
            rows = None  # the full call below raises the operation's own error
    if rows is None:
        # Arguments that do not describe a call: the operation itself names the error.
        extra = {"kv_scales": sc_in.copy()} if quantized else {}
        fn(**dict(kwargs, kv_blocks=kv_in.copy(), mode=mode, **extra))
        raise RuntimeError(f"check_op: {name} accepted arguments the checker could not follow; please report")

    tensors: Dict[str, TensorCheck] = {}
    hints: List[str] = []
    seq, t, pos, blocks, slots, writes = rows
    lens = np.asarray(_native.as_array(kwargs["cache_lengths"])).astype(np.int64)

    if has_out:
        ref_o = _native.as_array(ref_out)
        act_o = _native.as_array(act["output"])
        okind = _kind(ref_o, "output")
        if act_o.shape != ref_o.shape or _kind(act_o, "actual output") != okind:
            raise ValueError(f"actual `output`: expected {okind} {ref_o.shape}, found {act_o.dtype} {act_o.shape}")
        n_rows = len(seq)
        per_row = int(np.prod(ref_o.shape)) // max(n_rows, 1)
        mask = np.ones(n_rows, bool)
        if name in ("qkv_bshd", "rope_bshd") and padded_q == "ignore":
            mask = writes.copy()
        tc = TensorCheck("output", ref_o.dtype.name)
        flat_mask = np.repeat(mask, per_row)
        idx = np.flatnonzero(flat_mask)
        u, ab, rel, ok, gv, rv = _compare(act_o.reshape(-1)[idx], ref_o.reshape(-1)[idx], okind, tol)
        d = ref_o.shape[-1] if name in _ROPE else hd
        _fill(tc, idx, u, ab, rel, ok, gv, rv, ref_o.shape, max_failures, lambda f: _out_positions(f, per_row, d, seq, pos))
        tensors["output"] = tc
        _factor_hint(hints, "output", gv[~ok], rv[~ok])

    # The cache: the written slots of the written layer against the compact reference; the rest
    # of that layer of the written blocks, and all other memory, against the input.
    which = _kv_parts(name, kwargs, kv_dim)
    local = np.searchsorted(touched, blocks[writes])
    wmask = np.zeros(ref_kv.shape, bool)  # [touched, kv_dim, 1, page, heads, head_size]
    for kvp in which:
        wmask[local, kvp, 0, slots[writes]] = True
    uint = _UINT[kind]
    act_t = act_kv[touched, :, layer : layer + 1]
    in_t = kv_in[touched, :, layer : layer + 1]
    tc = TensorCheck("kv_blocks", kv_in.dtype.name)
    sel = np.flatnonzero(wmask.reshape(-1))
    if quantized:
        # A quantized cache is judged by its values, code × scale (the rule of `paged-qkv check`).
        tc.dtype = f"{kv_in.dtype.name} × kv_scales (values; an ulp: a step of the reference code at its scale)"
        g = hd // sc_in.shape[5]
        per_elem = lambda s: np.repeat(s, g, axis=-1).reshape(-1)[sel].astype(np.float64)  # noqa: E731
        codes = lambda a: np.ascontiguousarray(a).view(np.uint8).reshape(-1)[sel]  # noqa: E731
        act_sc_t = act_sc[touched, :, layer : layer + 1]
        u, ab, rel, ok, gv, rv = _compare_values(codes(act_t), per_elem(act_sc_t), codes(ref_kv), per_elem(ref_sc), tol)
        sc_check = _scales_check(sc_in, act_sc, ref_sc, act_sc_t, wmask, touched, layer, g, max_failures)
    else:
        u, ab, rel, ok, gv, rv = _compare(act_t.reshape(-1)[sel], ref_kv.reshape(-1)[sel], kind, tol)
    owner = np.full((len(touched), page), -1, np.int64)
    owner[local, slots[writes]] = np.flatnonzero(writes)

    def kv_positions(f: np.ndarray) -> np.ndarray:
        c = np.array(np.unravel_index(f, wmask.shape)).T
        r = owner[c[:, 0], c[:, 3]]
        return np.stack([seq[r], pos[r], c[:, 4], c[:, 5]], axis=1)

    def to_full(f: np.ndarray) -> np.ndarray:
        c = np.array(np.unravel_index(f, wmask.shape)).T.reshape(len(f), 6)
        c[:, 0] = touched[c[:, 0]]
        c[:, 2] = layer
        return c

    _fill(tc, sel, u, ab, rel, ok, gv, rv, wmask.shape, max_failures, kv_positions, to_full)
    # Corruption: unwritten elements of the written layer of the touched blocks; then every block
    # whose bytes differ anywhere (a memcmp without the GIL), element by element.
    changed = (act_t.view(uint) != in_t.view(uint)) & ~wmask
    bad = [to_full(np.flatnonzero(changed.reshape(-1)))]
    for b in _native.differing_blocks(act_kv.view(uint), kv_in.view(uint)):
        for l in range(layers):
            if l == layer and _isin(b, touched):
                continue
            d = act_kv[b, :, l].view(uint) != kv_in[b, :, l].view(uint)  # one layer at a time
            if d.any():
                c = np.array(np.nonzero(d)).T.reshape(-1, 4)
                bad.append(np.concatenate([np.full((len(c), 1), b), c[:, :1], np.full((len(c), 1), l), c[:, 1:]], axis=1))
    bad_all = np.concatenate(bad)
    tc.corrupted = len(bad_all)
    tc.corrupted_index = bad_all[:max_failures]
    tensors["kv_blocks"] = tc
    if quantized:
        tensors["kv_scales"] = sc_check

    if not tc.passed:
        if not quantized:
            _kv_hints(hints, name, kv_in.shape, act_kv, ref_kv, kind, tol, rows, touched, local, which, layer, kwargs)
        _factor_hint(hints, "kv_blocks", gv[~ok], rv[~ok])
    return OpReport(name, mode, tensors, hints, tol, padded_q)


def _compare_values(gc, gs, rc, rs, tol: Tuple[float, float, int]):
    """A quantized cache's elements (codes, their groups' scales as float64): the values
    ``code × scale`` compared as :func:`_compare` compares elements, the ulp being the E4M3 step of
    the reference code at the reference scale (rounded up; -1: NaN against a number)."""
    gv, rv = _E4M3[gc] * gs, _E4M3[rc] * rs
    gnan, rnan = np.isnan(gv), np.isnan(rv)
    mism = gnan ^ rnan
    e = (rc.astype(np.int64) >> 3) & 15
    step = np.ldexp(1.0, np.where(e == 0, -9, e - 10)) * np.abs(rs)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ab = np.where((gv == rv) | (gnan & rnan), 0.0, np.abs(gv - rv))
        q = np.where(step > 0, ab / np.where(step > 0, step, 1), np.inf)
        u = np.where(ab == 0, 0, np.where(np.isfinite(q), np.ceil(np.minimum(q, 2.0**62)), 2.0**62)).astype(np.int64)
    return _verdict(u, ab, gv, rv, mism, tol)


def _scales_check(sc_in, act_sc, ref_sc, act_sc_t, wmask, touched, layer, g, cap) -> TensorCheck:
    """A quantized cache's scales: the written groups' scales against the reference, reported (the
    values decide, not these: ``failures`` stays 0); every other scale must be unchanged."""
    tc = TensorCheck("kv_scales", sc_in.dtype.name + " (reported; the values decide)")
    written = wmask.reshape(wmask.shape[:5] + (wmask.shape[5] // g, g)).any(axis=-1)
    sel = np.flatnonzero(written.reshape(-1))
    u, ab, rel, _, gv, rv = _compare(act_sc_t.reshape(-1)[sel], ref_sc.reshape(-1)[sel], "f32", (0.0, 0.0, 0))
    _fill(tc, sel, u, ab, rel, np.ones(len(sel), bool), gv, rv, written.shape, cap, lambda f: np.zeros((len(f), 4), np.int64))
    full = np.zeros(sc_in.shape, bool)
    full[touched, :, layer : layer + 1] = written
    changed = (act_sc.view(np.uint32) != sc_in.view(np.uint32)) & ~full
    bad = np.array(np.nonzero(changed)).T.reshape(-1, 6)
    tc.corrupted = len(bad)
    tc.corrupted_index = bad[:cap]
    return tc


def _isin(b: int, touched: np.ndarray) -> bool:
    i = np.searchsorted(touched, b)
    return bool(i < len(touched) and touched[i] == b)


def _rows(name: str, kw: Mapping[str, Any], kv_shape) -> Optional[tuple]:
    """Per row of the call: sequence, t, cache position, block, slot, whether K/V is written.
    ``None`` where the arguments do not describe a call (the operation then gives its error)."""
    try:
        nb, _, _, page, _, _ = kv_shape
        lens = np.asarray(_native.as_array(kw["cache_lengths"])).astype(np.int64).reshape(-1)
        lookup = np.asarray(_native.as_array(kw["kv_lookup_table"])).astype(np.int64)
        x = _native.as_array(kw[_ROWS_FROM[name]])
        if lookup.ndim != 2 or lookup.shape[0] != len(lens) or (lens < 0).any():
            return None
        if name in _RAGGED:
            offs = np.asarray(_native.as_array(kw["input_row_offsets"])).astype(np.int64).reshape(-1)
            counts = np.diff(offs)
            if len(offs) != len(lens) + 1 or offs[0] != 0 or (counts < 0).any() or offs[-1] != x.shape[0]:
                return None
            seq = np.repeat(np.arange(len(lens)), counts)
            t = np.arange(offs[-1]) - offs[seq]
            writes = np.ones(len(seq), bool)
        else:
            valid = np.asarray(_native.as_array(kw["valid_lengths"])).astype(np.int64).reshape(-1)
            b, s = x.shape[0], x.shape[1]
            if len(valid) != b or len(lens) != b or (valid > s).any() or (valid < 0).any():
                return None
            seq = np.repeat(np.arange(b), s)
            t = np.tile(np.arange(s), b)
            writes = t < valid[seq]
        pos = lens[seq] + t
        pages, slots = pos // page, pos % page
        if (pages[writes] >= lookup.shape[1]).any():
            return None
        blocks = np.zeros(len(seq), np.int64)
        blocks[writes] = lookup[seq[writes], pages[writes]]
        if (blocks[writes] >= nb).any():
            return None
        return seq, t, pos, blocks, slots, writes
    except (KeyError, IndexError, ValueError, TypeError, AttributeError):
        return None


def _kv_parts(name: str, kw: Mapping[str, Any], kv_dim: int) -> Tuple[int, ...]:
    if name in _QKV:
        return tuple(range(kv_dim))
    if name in _ROPE:
        return (0,)
    return (1,) if str(kw.get("cache", "k")).lower() == "v" else (0,)


def _out_positions(f: np.ndarray, per_row: int, d: int, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
    r, c = f // per_row, f % per_row
    return np.stack([seq[r], pos[r], c // d, c % d], axis=1)


def _fill(tc: TensorCheck, idx, u, ab, rel, ok, gv, rv, shape, cap, positions, to_coords=None) -> None:
    tc.compared = len(idx)
    tc.failures = int(np.count_nonzero(~ok))
    tc.ulp_histogram = _histogram(u)
    finite_u = u[u >= 0]
    tc.max_ulp = int(finite_u.max()) if finite_u.size else 0
    tc.max_abs = float(ab.max()) if ab.size else 0.0
    tc.max_rel = float(rel.max()) if rel.size else 0.0
    bad = np.flatnonzero(~ok)
    order = np.lexsort((bad, -np.where(u[bad] < 0, np.iinfo(np.int64).max, u[bad])))
    bad = bad[order][:cap]
    f = np.asarray(idx)[bad]
    tc.index = to_coords(f) if to_coords else np.array(np.unravel_index(f, shape)).T.reshape(len(f), len(shape))
    tc.actual, tc.reference, tc.ulps = gv[bad], rv[bad], u[bad]
    tc.positions = positions(f).reshape(len(f), 4) if len(f) else np.zeros((0, 4), np.int64)


def _factor_hint(hints: List[str], name: str, g: np.ndarray, r: np.ndarray) -> None:
    keep = np.isfinite(g) & np.isfinite(r) & (r != 0) & (g != 0)
    if np.count_nonzero(keep) < 4:
        return
    ratio = g[keep] / r[keep]
    m = float(np.median(ratio))
    close = np.abs(ratio / m - 1) < 0.02
    if abs(m - 1) > 1e-3 and close.mean() >= 0.9:
        hints.append(
            f"{name}: actual ≈ {m:.6g} × reference in {close.mean():.0%} of the failing elements "
            "(a scale applied twice or missing: tensor_sf, a block scale?)"
        )


def _kv_hints(hints, name, shape, act_kv, ref_kv, kind, tol, rows, touched, local, which, layer, kw) -> None:
    seq, t, pos, blocks, slots, writes = rows
    nb, kv_dim, _, page, _, _ = shape
    w = np.flatnonzero(writes)
    if len(w) == 0:
        return
    blk, sl, lw = blocks[w], slots[w], local[: len(w)]
    # K and V swapped (the fused QKV ops write both).
    if name in _QKV and kv_dim == 2:
        a_k, a_v = act_kv[blk, 0, layer, sl], act_kv[blk, 1, layer, sl]
        r_k, r_v = ref_kv[lw, 0, 0, sl], ref_kv[lw, 1, 0, sl]
        ok1 = _compare(a_k, r_v, kind, tol)[3]
        ok2 = _compare(a_v, r_k, kind, tol)[3]
        if ok1.mean() >= 0.9 and ok2.mean() >= 0.9:
            hints.append("kv_blocks: K and V look swapped (the actual K holds the reference V and the V holds the K)")
    # Slots one position off.
    lookup = np.asarray(_native.as_array(kw["kv_lookup_table"])).astype(np.int64)
    for step in (1, -1):
        p2 = pos[w] + step
        pg, s2 = p2 // page, p2 % page
        valid = (p2 >= 0) & (pg < lookup.shape[1])
        if not valid.any():
            continue
        b2 = lookup[seq[w][valid], pg[valid]]
        inb = b2 < nb
        if not inb.any():
            continue
        votes = []
        for kvp in which:
            got = act_kv[b2[inb], kvp, layer, s2[valid][inb]]
            want = ref_kv[lw[valid][inb], kvp, 0, sl[valid][inb]]
            votes.append(_compare(got, want, kind, tol)[3].mean())
        if min(votes) >= 0.9 and valid.mean() * inb.mean() >= 0.5:
            where = "later" if step > 0 else "earlier"
            hints.append(
                f"kv_blocks: the values landed one position {where} than the reference's (slot of "
                f"cache_lengths[b] + t {'+' if step > 0 else '-'} 1): an off-by-one in the cache position"
            )
