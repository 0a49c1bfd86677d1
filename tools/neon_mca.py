#!/usr/bin/env python3
"""llvm-mca estimates of the NEON FP4 kernels' inner loops (no ARM hardware needed).

    cargo rustc --release --target aarch64-unknown-linux-gnu --lib -- --emit asm -C codegen-units=1
    python3 tools/neon_mca.py target/aarch64-unknown-linux-gnu/release/deps/paged_qkv-*.s

Finds the innermost loops of `fp4_group_neon` (smull/smlal), `fp4_group_sdot` and
`fp4_group_smmla` (one per row count R = 1..4) and prints llvm-mca's cycles per iteration and per
128 multiply-accumulates for each CPU model. An iteration covers 4 columns × R rows × 8 k
(`smlal`: one 8-k pair) or × 16 k (`sdot`, `smmla`: two pairs). Needs llvm-mca ≥ 17 for the
Neoverse models (Debian: `apt-get install llvm-19`; set LLVM_MCA to its path)."""
import glob, os, re, subprocess, sys

MCA = os.environ.get("LLVM_MCA") or next(
    (p for p in ["/usr/lib/llvm-19/bin/llvm-mca", "/usr/lib/llvm-18/bin/llvm-mca", "llvm-mca"] if os.path.exists(p) or p == "llvm-mca"))
CPUS = os.environ.get("MCA_CPUS", "neoverse-n1,cortex-a76,neoverse-v1").split(",")


def functions(lines):
    funcs, cur = {}, None
    for l in lines:
        m = re.match(r"^(_ZN\S+):$", l)
        if m:
            cur = m.group(1)
            funcs[cur] = []
        elif cur is not None:
            if l.strip().startswith(".cfi_endproc"):
                cur = None
            else:
                funcs[cur].append(l)
    return funcs


def innermost_loops(body):
    for i, l in enumerate(body):
        m = re.match(r"^(\.LBB\S+):", l)
        if not m:
            continue
        lab, ins = m.group(1), []
        for l2 in body[i + 1:]:
            if re.match(r"^\.LBB\S+:", l2):
                break
            s = l2.strip()
            if not s or s.startswith("//") or (s.startswith(".") and not s.startswith(".arch")):
                continue
            ins.append(s)
            if re.search(r"\s" + re.escape(lab) + r"$", s):
                yield ins
                break


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else max(glob.glob("target/aarch64-unknown-linux-gnu/release/deps/paged_qkv-*.s"), key=os.path.getmtime)
    funcs = functions(open(path).read().split("\n"))
    rows = set()
    print(f"{'kernel':8s} {'R':>3s} {'instrs':>6s}  " + "  ".join(f"{c + ' cyc/iter (/128 MAC)':>30s}" for c in CPUS))
    for name, body in sorted(funcs.items()):
        m = re.search(r"fp4_group_(neon|sdot|smmla)", name)
        if not m:
            continue
        kernel = {"neon": "smlal", "sdot": "sdot", "smmla": "smmla"}[m.group(1)]
        for ins in innermost_loops(body):
            txt = "\n".join(ins)
            n = len(re.findall(r"\b" + ("sm(?:lal|ull)2?" if kernel == "smlal" else kernel) + r"\b", txt))
            if n == 0:
                continue
            # Rows: smlal does 4 per row per pair (lo/hi × 2 halves); sdot 4 per row per two
            # pairs; smmla 4 per row pair per two pairs (2 with a single row pair → R ≤ 2).
            macs_per_instr = {"smlal": 8, "sdot": 16, "smmla": 32}[kernel]
            macs = n * macs_per_instr
            r = {"smlal": str(n // 4), "sdot": str(n // 4), "smmla": f"{2 * (n // 4) - 1}-{2 * (n // 4)}"}[kernel]
            cols = []
            for cpu in CPUS:
                src = "\n".join(i for i in ins if not i.startswith(".arch"))
                p = subprocess.run([MCA, "-mtriple=aarch64", f"-mcpu={cpu}", "-mattr=+dotprod,+i8mm", "-iterations=200"],
                                   input=src, capture_output=True, text=True)
                t = re.search(r"Total Cycles:\s+(\d+)", p.stdout)
                cols.append(f"{int(t.group(1)) / 200:8.2f} ({int(t.group(1)) / 200 / macs * 128:5.2f})" if t else "error")
            rows.add((kernel, r, f"{kernel:8s} {r:>3s} {len(ins):6d}  " + "  ".join(f"{c:>30s}" for c in cols)))
    for _, _, line in sorted(rows):
        print(line)


main()
