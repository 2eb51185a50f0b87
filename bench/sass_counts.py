#!/usr/bin/env python3
"""SASS instruction counts per kernel of one architecture in a built library or object.

  bench/sass_counts.py LIB_OR_OBJ [--arch sm_52] [--base OTHER] [--json OUT]

Prints, per kernel, the instructions in its SASS and the counts of the opcodes that set the
FP32 kernels' cost on the M40 (FFMA, loads, shuffles, conversions, MUFU). With --base, a
second library (e.g. the previous main's) is counted too and each kernel gets both columns.
Needs cuobjdump from a CUDA toolkit that knows the architecture (11.8 for sm_52).

As a module (bench/m40_model.py): parse() gives each kernel's instructions in order (address,
predicate, opcode, operands, whether it opens a dual-issue pair), op_class() their class.
"""
import argparse
import collections
import json
import re
import subprocess
import sys

KEYS = ["FFMA", "FMUL", "FADD", "LDG", "LDS", "STS", "STG", "SHFL", "F2F", "HADD2", "MUFU", "BAR"]

# One instruction line of cuobjdump -sass / nvdisasm: "/*0a28*/  { @!P0 LDG.E.CI.128 R12, [R40] ;"
# A '{' opens a pair the scheduler dual-issues (sm_5x/6x); its second instruction ends in '}'.
INSTR_RE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(\{)?\s*(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[\w]+)*)"
                      r"\s*(.*?)\s*[;}]?\s*(?:/\*.*)?$")
FUNC_RE = re.compile(r"\s*Function : (\S+)")

Instr = collections.namedtuple("Instr", "addr pred op opcode args pair text")

# Instruction classes (base opcodes; anything else is "other").
CLASSES = [
    ("FFMA", {"FFMA", "FFMA32I"}),
    ("FP32", {"FADD", "FADD32I", "FMUL", "FMUL32I", "FMNMX", "FSETP", "FSET", "FCMP", "FCHK", "RRO",
              "FSWZADD", "FSEL"}),
    ("MUFU", {"MUFU"}),
    ("CVT", {"F2F", "I2F", "F2I", "I2I", "HADD2", "HMUL2", "HFMA2", "F2FP"}),
    ("INT", {"IADD", "IADD3", "IADD32I", "ISCADD", "ISCADD32I", "XMAD", "IMAD", "IMAD32I", "IMUL",
             "IMUL32I", "IMNMX", "ISETP", "ICMP", "ISET", "LOP", "LOP3", "LOP32I", "SHL", "SHR", "SHF",
             "BFE", "BFI", "PRMT", "LEA", "SEL", "MOV", "MOV32I", "PSETP", "PLOP3", "P2R", "R2P", "S2R",
             "CS2R", "S2UR", "FLO", "POPC", "VABSDIFF", "IABS", "UMOV", "UIADD3", "ULDC", "UIMAD",
             "USHF", "ULOP3", "USEL", "UISETP", "ULEA", "UPRMT", "R2UR", "VOTEU", "VOTE", "SGXT"}),
    ("LDG", {"LDG", "LD", "LDC", "LDL"}),
    ("LDS", {"LDS"}),
    ("ST", {"STS", "STG", "ST", "STL", "ATOMS", "ATOM", "RED"}),
    ("SHFL", {"SHFL"}),
    ("CTRL", {"BRA", "SSY", "SYNC", "BAR", "MEMBAR", "DEPBAR", "EXIT", "PBK", "BRK", "CAL", "RET", "NOP",
              "BSSY", "BSYNC", "WARPSYNC", "BMOV", "CALL", "YIELD", "ACQBULK", "ERRBAR", "CCTL"}),
]
CLASS_NAMES = [c for c, _ in CLASSES] + ["other"]
_CLASS_OF = {op: c for c, ops in CLASSES for op in ops}


def op_class(op):
    return _CLASS_OF.get(op, "other")


def sass_text(path, arch):
    return subprocess.run(["cuobjdump", "-sass", "-arch", arch, path], capture_output=True, text=True,
                          check=True).stdout


def demangle_all(names):
    names = list(names)
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.splitlines()
        if len(out) == len(names):
            return dict(zip(names, out))
    except (OSError, subprocess.CalledProcessError):
        pass
    return {n: n for n in names}


def parse_text(text):
    """{mangled kernel name: [Instr, ...]} of cuobjdump -sass output (one architecture)."""
    kernels, cur = {}, None
    for line in text.splitlines():
        m = FUNC_RE.match(line)
        if m:
            cur = kernels.setdefault(m.group(1), [])
            continue
        m = INSTR_RE.match(line)
        if m and cur is not None:
            addr, brace, pred, op, mods, args = m.groups()
            cur.append(Instr(int(addr, 16), (pred or "").strip() or None, op, op + (mods or ""),
                             args.strip(), bool(brace), line.strip()))
    return kernels


def parse(path, arch="sm_52"):
    """{demangled kernel name: [Instr, ...]} of one architecture's SASS in a library or object."""
    k = parse_text(sass_text(path, arch))
    names = demangle_all(k)
    return {names[n]: v for n, v in k.items()}


def counts(path, arch):
    kernels = {}
    for name, instrs in parse(path, arch).items():
        c = collections.Counter()
        for i in instrs:
            c["total"] += 1
            if i.op in KEYS:
                c[i.op] += 1
        kernels[name] = c
    return kernels


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
