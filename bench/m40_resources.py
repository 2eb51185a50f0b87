#!/usr/bin/env python3
"""Per-kernel resources on sm_52 (Tesla M40, GM200) from `ptxas -v`, theoretical occupancy, and the
predicted M40 time of every shape of the benchmark grid from the bytes-moved model.

  m40_resources.py --log PTXAS_LOG --src cuda/ --md OUT.md --json OUT.json
                   [--block REGEX=THREADS]... [--dyn-smem REGEX=BYTES]... [--default-block 128]
                   [--peak-gbps 288] [--efficiency 0.8] [--cmd "how the log was made"]

PTXAS_LOG is the build output of a compile with -Xptxas=-v (bench/resources.sh makes it); every
entry function ptxas reports is parsed. Block sizes come from --block, else from the source
(__launch_bounds__ or the <<<grid, threads>>> launch, constants resolved), else --default-block.
REGEX patterns match the demangled kernel name. Kernels the M40 never runs (NOT_ON_SM52) are
listed apart, not counted as M40 kernels.
"""
import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402

# GM200 (compute capability 5.2), as the CUDA occupancy calculator (cuda_occupancy.h) models it.
GM200 = dict(name="Tesla M40 (GM200, sm_52)", sms=24, regs_per_sm=65536, regs_per_block=65536,
             max_regs_per_thread=255, reg_alloc_unit=256, sub_partitions=4, max_threads_per_sm=2048,
             max_warps_per_sm=64, max_blocks_per_sm=32, smem_per_sm=98304, smem_per_block=49152,
             smem_alloc_unit=256, l2_bytes=3 << 20)


def ceil_div(a, b):
    return -(-a // b)


def round_up(a, b):
    return ceil_div(a, b) * b


def occupancy(regs, smem, threads, dev=GM200):
    """Resident blocks per SM and the limiting factor (cudaOccMaxActiveBlocksPerMultiprocessor)."""
    warps = ceil_div(threads, 32)
    lim = {"blocks": dev["max_blocks_per_sm"], "warps": dev["max_warps_per_sm"] // warps}
    if threads > 1024:
        lim["warps"] = 0
    rpw = round_up(regs * 32, dev["reg_alloc_unit"])
    if regs > dev["max_regs_per_thread"] or rpw * warps > dev["regs_per_block"] or \
            rpw * round_up(warps, dev["sub_partitions"]) > dev["regs_per_block"]:
        lim["registers"] = 0
    elif rpw > 0:
        per_sub = (dev["regs_per_sm"] // dev["sub_partitions"]) // rpw
        lim["registers"] = per_sub * dev["sub_partitions"] // warps
    sm = round_up(smem, dev["smem_alloc_unit"])
    if smem > dev["smem_per_block"]:
        lim["shared memory"] = 0
    elif sm > 0:
        lim["shared memory"] = dev["smem_per_sm"] // sm
    blocks = min(lim.values())
    limiter = ", ".join(k for k, v in lim.items() if v == blocks)
    # Shared memory a block could take without lowering the occupancy the other limits allow.
    other = min(v for k, v in lim.items() if k != "shared memory")
    headroom = min(dev["smem_per_block"], (dev["smem_per_sm"] // other) // dev["smem_alloc_unit"]
                   * dev["smem_alloc_unit"]) if other > 0 else 0
    return dict(blocks_per_sm=blocks, warps_per_sm=blocks * warps,
                occupancy=blocks * warps / dev["max_warps_per_sm"], limiter=limiter,
                regs_per_block=rpw * warps, smem_headroom_per_block=headroom, limits=lim)


ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
FUNC_RE = re.compile(r"Function properties for (\S+)")
STACK_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED_RE = re.compile(r"Used (\d+) registers")
SMEM_RE = re.compile(r"(\d+) bytes smem")
CMEM_RE = re.compile(r"(\d+) bytes cmem\[0\]")
BARRIER_RE = re.compile(r"used (\d+) barriers")
SRC_RE = re.compile(r"\s-c\s+(\S+\.cu)\b")


def parse_ptxas(text):
    """Entry functions in order: mangled name, arch, source, regs, smem, stack, spills, cmem."""
    kernels, cur, props_for, src = {}, None, None, None
    for line in text.splitlines():
        m = SRC_RE.search(line)
        if m and "nvcc" in line:
            src = m.group(1)
        m = ENTRY_RE.search(line)
        if m:
            cur = (m.group(1), m.group(2))
            kernels.setdefault(cur, dict(mangled=m.group(1), arch=m.group(2), source=src, regs=0, smem=0,
                                         cmem=0, stack=0, spill_stores=0, spill_loads=0, barriers=None))
            props_for = None
            continue
        m = FUNC_RE.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = STACK_RE.search(line)
        if m and cur and props_for == cur[0]:
            k = kernels[cur]
            k["stack"], k["spill_stores"], k["spill_loads"] = map(int, m.groups())
            continue
        m = USED_RE.search(line)
        if m and cur:
            k = kernels[cur]
            k["regs"] = int(m.group(1))
            s = SMEM_RE.search(line)
            k["smem"] = int(s.group(1)) if s else 0
            c = CMEM_RE.search(line)
            k["cmem"] = int(c.group(1)) if c else 0
            b = BARRIER_RE.search(line)
            k["barriers"] = int(b.group(1)) if b else None
            cur = None  # the Used line closes the entry
    return list(kernels.values())


def demangle(names):
    try:
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        out = r.stdout.splitlines()
        if len(out) == len(names):
            return out
    except (OSError, subprocess.CalledProcessError):
        pass
    return names


def short_name(demangled):
    """'void (anonymous namespace)::append_kernel<float>(float const*, ...)' -> 'append_kernel<float>'"""
    s = demangled
    if s.startswith("void "):
        s = s[5:]
    depth, cut = 0, len(s)
    for i, ch in enumerate(s):  # the argument list starts at the first '(' outside template args
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and not s.startswith("(anonymous", i):
            cut = i
            break
    s = s[:cut]
    s = re.sub(r"^(?:[\w ()]+::)+", "", s.replace("(anonymous namespace)::", ""))
    return s


def base_name(short):
    return short.split("<", 1)[0]


def read_sources(src_dir):
    text = {}
    for path in sorted(glob.glob(os.path.join(src_dir, "*.cu")) + glob.glob(os.path.join(src_dir, "*.cuh"))):
        with open(path, errors="replace") as f:
            text[path] = f.read()
    return text


def resolve_int(token, sources):
    token = token.strip()
    if re.fullmatch(r"\d+", token):
        return int(token)
    for t in sources.values():
        m = re.search(r"(?:constexpr|const)\s+(?:int|unsigned|unsigned int|size_t)\s+" + re.escape(token)
                      + r"\s*=\s*(\d+)", t) or re.search(r"#define\s+" + re.escape(token) + r"\s+(\d+)", t)
        if m:
            return int(m.group(1))
    return None


def block_from_source(name, sources):
    """(threads, min_blocks_per_sm, how) for a kernel base name."""
    for path, t in sources.items():
        m = re.search(r"__launch_bounds__\s*\(\s*([^,()]+)\s*(?:,\s*([^,()]+))?\s*\)\s*(?:\w+\s+)*" + re.escape(name)
                      + r"\s*\(", t)
        if m:
            th = resolve_int(m.group(1), sources)
            mb = resolve_int(m.group(2), sources) if m.group(2) else None
            if th:
                return th, mb, f"__launch_bounds__({m.group(1).strip()}) in {os.path.basename(path)}"
    for path, t in sources.items():
        m = re.search(re.escape(name) + r"\s*(?:<[^<>]*>)?\s*<<<\s*[^,]+,\s*([^,>]+)", t)
        if m:
            th = resolve_int(m.group(1), sources)
            if th:
                return th, None, f"launch <<<.., {m.group(1).strip()}>>> in {os.path.basename(path)}"
    return None, None, None


def parse_patterns(items):
    out = []
    for it in items:
        pat, _, val = it.rpartition("=")
        out.append((re.compile(pat), int(val)))
    return out

# Kernels the M40 never runs: compiled for every architecture but launched only on newer GPUs
# (their sm_52 image is an empty body), or never launched at all.
NOT_ON_SM52 = {"attn_mma_kernel": "tensor cores (sm_80+): the host launches it only where this build "
                                  "has an sm_80+ image of it",
               "probe_kernel": "never launched: its attributes tell which image a GPU loads "
                               "(cuda/build_info.cu)"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", required=True)
    p.add_argument("--src", default="", help="CUDA source directory (for block sizes)")
    p.add_argument("--md", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--block", action="append", default=[], help="REGEX=THREADS")
    p.add_argument("--dyn-smem", action="append", default=[], help="REGEX=BYTES of dynamic shared memory")
    p.add_argument("--default-block", type=int, default=128)
    p.add_argument("--peak-gbps", type=float, default=288.0)
    p.add_argument("--efficiency", type=float, default=0.8)
    p.add_argument("--cmd", default="", help="how the log was made (for the report)")
    p.add_argument("--nvcc", default="", help="nvcc version line (for the report)")
    args = p.parse_args()

    with open(args.log, errors="replace") as f:
        text = f.read()
    kernels = [k for k in parse_ptxas(text) if k["arch"] == "sm_52"] or parse_ptxas(text)
    if not kernels:
        sys.exit(f"m40_resources: no ptxas entry functions in {args.log} (built with -Xptxas=-v?)")
    sources = read_sources(args.src) if args.src else {}
    blocks = parse_patterns(args.block)
    dyn = parse_patterns(args.dyn_smem)
    for k, d in zip(kernels, demangle([k["mangled"] for k in kernels])):
        k["demangled"] = d
        k["name"] = short_name(d)
        th, mb, how = None, None, None
        for rx, v in blocks:
            if rx.search(d) or rx.search(k["name"]):
                th, how = v, "--block"
                break
        if th is None:
            th, mb, how = block_from_source(base_name(k["name"]), sources)
        if th is None:
            th, how = args.default_block, "default"
        k["threads"], k["min_blocks_per_sm"], k["threads_from"] = th, mb, how
        k["dyn_smem"] = next((v for rx, v in dyn if rx.search(d) or rx.search(k["name"])), 0)
        k.update(occupancy(k["regs"], k["smem"] + k["dyn_smem"], th))
        k["source"] = os.path.relpath(k["source"]) if k["source"] and os.path.exists(k["source"]) else k["source"]
    skipped = sorted({base_name(k["name"]) for k in kernels if base_name(k["name"]) in NOT_ON_SM52})
    kernels = [k for k in kernels if base_name(k["name"]) not in NOT_ON_SM52]

    shapes = grid.full_grid()
    eff = args.efficiency
    preds = []
    for s in shapes:
        kvb, qo = grid.kv_bytes(s), grid.qo_bytes_f32(s)
        by = kvb + qo
        preds.append(dict(batch=s[0], n_heads=s[1], n_kv_heads=s[2], head_dim=s[3], ctx=s[4], kv_bytes=kvb,
                          bytes=by, us_peak=by / (args.peak_gbps * 1e3), us_realistic=by / (eff * args.peak_gbps * 1e3),
                          fits_12gb=kvb <= 11.5e9, fits_24gb=kvb <= 23.5e9))

    doc = dict(device=GM200, cmd=args.cmd, nvcc=args.nvcc, kernels=kernels, peak_gbps=args.peak_gbps,
               efficiency=eff, predictions=preds)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)

    L = []
    L.append("# m40llm kernels on the Tesla M40 (sm_52): resources, occupancy, predicted times\n")
    L.append("Generated by `bench/resources.sh` (no GPU needed); do not edit by hand.\n")
    if args.nvcc:
        L.append(f"- compiler: {args.nvcc}")
    if args.cmd:
        L.append(f"- build: `{args.cmd}`")
    L.append("- occupancy model: GM200 / compute 5.2 as in cuda_occupancy.h: 65536 registers per SM in 4 "
             "sub-partitions, allocated per warp in units of 256; 2048 threads (64 warps) and 32 blocks per SM; "
             "96 KB shared memory per SM, 48 KB per block, allocated in 256-byte units.")
    L.append("- smem = static shared memory from ptxas; dynamic shared memory is not in ptxas's report: it is "
             "counted only where given with --dyn-smem. 'smem headroom' is the most shared memory (static + "
             "dynamic) a block can take before shared memory, not registers or warps, limits residency.\n")
    L.append("## Kernels\n")
    L.append("| kernel | source | regs | smem B | dyn smem B | stack B | spill st/ld B | cmem B | threads (from) "
             "| blocks/SM | warps/SM | occupancy | limited by | smem headroom B |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k in kernels:
        th = f"{k['threads']} ({k['threads_from']}" + (f"; min {k['min_blocks_per_sm']} blocks/SM" if k["min_blocks_per_sm"] else "") + ")"
        L.append(f"| `{k['name']}` | {k['source'] or '-'} | {k['regs']} | {k['smem']} | {k['dyn_smem']} | {k['stack']} | "
                 f"{k['spill_stores']}/{k['spill_loads']} | {k['cmem']} | {th} | {k['blocks_per_sm']} | {k['warps_per_sm']} | "
                 f"{100 * k['occupancy']:.0f}% | {k['limiter']} | {k['smem_headroom_per_block']} |")
    spills = [k["name"] for k in kernels if k["spill_stores"] or k["spill_loads"] or k["stack"]]
    L.append("")
    for name in skipped:
        L.append(f"Not listed: `{name}`, {NOT_ON_SM52[name]}.\n")
    L.append("Spills or stack frames: " + (", ".join(f"`{n}`" for n in spills) if spills else "none") + ".\n")
    L.append("## Predicted M40 time per shape (bytes-moved model)\n")
    L.append(f"bytes = K/V read (2 x 2 B x batch x n_kv_heads x ctx x head_dim) + FP32 Q read + FP32 out "
             f"written. Peak = {args.peak_gbps:.0f} GB/s (M40 datasheet); realistic = {100 * eff:.0f}% of it. "
             f"Launch overhead (a few us per call) is not included; with 24 SMs and a 3 MB L2, small shapes "
             f"will be launch-bound. 'fits' = K/V of one layer within the 12 GB / 24 GB M40 (n_layers 1).\n")
    L.append("| shape | K/V MB | bytes MB | us @ peak | us @ realistic | fits 12 GB | fits 24 GB |")
    L.append("|---|---|---|---|---|---|---|")
    for r in preds:
        s = (r["batch"], r["n_heads"], r["n_kv_heads"], r["head_dim"], r["ctx"])
        L.append(f"| {grid.shape_str(s)} | {r['kv_bytes'] / 1e6:.2f} | {r['bytes'] / 1e6:.2f} | {r['us_peak']:.1f} | "
                 f"{r['us_realistic']:.1f} | {'yes' if r['fits_12gb'] else 'no'} | {'yes' if r['fits_24gb'] else 'no'} |")
    with open(args.md, "w") as f:
        f.write("\n".join(L) + "\n")
    print(f"m40_resources: {len(kernels)} kernels; wrote {args.md} and {args.json}")
    for k in kernels:
        print(f"  {k['name']:<40} regs {k['regs']:3d} smem {k['smem']:6d} stack {k['stack']:4d} "
              f"spill {k['spill_stores']}/{k['spill_loads']} threads {k['threads']:4d} -> "
              f"{k['blocks_per_sm']} blocks/SM, {100 * k['occupancy']:.0f}% ({k['limiter']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
