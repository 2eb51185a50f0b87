#!/usr/bin/env python3
"""SASS instruction counts per kernel of one architecture in a built library or object.

  bench/sass_counts.py LIB_OR_OBJ [--arch sm_52] [--base OTHER] [--json OUT]

Prints, per kernel, the instructions in its SASS and the counts of the opcodes that set the
FP32 kernels' cost on the M40 (FFMA, loads, shuffles, conversions, MUFU). With --base, a
second library (e.g. the previous main's) is counted too and each kernel gets both columns.
Needs cuobjdump from a CUDA toolkit that knows the architecture (11.8 for sm_52).
"""
import argparse
import collections
import json
import re
import subprocess
import sys

KEYS = ["FFMA", "FMUL", "FADD", "LDG", "LDS", "STS", "STG", "SHFL", "F2F", "HADD2", "MUFU", "BAR"]


def counts(path, arch):
    out = subprocess.run(["cuobjdump", "-sass", "-arch", arch, path], capture_output=True,
                         text=True, check=True).stdout
    kernels = {}
    name = None
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = demangle(m.group(1))
            kernels[name] = collections.Counter()
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.\S*)?", line)
        if m and name:
            op = m.group(2)
            kernels[name]["total"] += 1
            for k in KEYS:
                if op == k:
                    kernels[name][k] += 1
    return kernels


def demangle(sym):
    try:
        return subprocess.run(["c++filt", sym], capture_output=True, text=True).stdout.strip()
    except OSError:
        return sym


def short(name):
    return re.sub(r"\(.*\)$", "", re.sub(r"\(anonymous namespace\)::", "", name))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("lib")
    p.add_argument("--arch", default="sm_52")
    p.add_argument("--base", default="")
    p.add_argument("--json", default="")
    a = p.parse_args()
    new = {short(k): v for k, v in counts(a.lib, a.arch).items()}
    base = {short(k): v for k, v in counts(a.base, a.arch).items()} if a.base else {}
    cols = ["total"] + KEYS
    print(f"SASS of {a.lib} ({a.arch})" + (f" against {a.base}" if a.base else ""))
    print("| kernel | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for k in sorted(new):
        row = []
        for c in cols:
            v = new[k][c]
            if base:
                b = next((base[x][c] for x in base if norm(x) == norm(k)), None)
                row.append(f"{v}" if b is None or b == v else f"{v} ({b})")
            else:
                row.append(str(v))
        print(f"| `{k}` | " + " | ".join(row) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"arch": a.arch, "kernels": {k: dict(v) for k, v in new.items()},
                       "base": {k: dict(v) for k, v in base.items()}}, f, indent=1)
    return 0


def norm(name):
    """Kernel names across the rename (attn_split_kernel<GT, D> -> attn_fp32_kernel<KvF16, GT, D>)."""
    n = name.replace("attn_split_kernel<", "attn_fp32_kernel<")
    return re.sub(r"<KvF16, ", "<", n)


if __name__ == "__main__":
    sys.exit(main())
