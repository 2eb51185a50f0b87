#!/usr/bin/env python3
"""The FP32 causal kernels on the Tesla M40, modeled from their sm_52 SASS (no GPU needed).

  python3 bench/m40_causal_model.py OBJ_OR_LIB [--base OTHER [--base-name NAME]] [--md OUT.md]

For the F16 instances of causal_warp_kernel (head-dim class 64; 128 too in a library from
before causal_wide_kernel took it) and causal_wide_kernel (128, 256; causal_fp32_kernel at 256
in a library from before, given as --base), it follows one full tile of an F16 cache at
head_dim = the class (every position visible, no protected rows): the tile loop is the smallest
backward branch around four or more __syncthreads; its inner loops
over the score pass's steps (head_dim) and the output pass's (the tile's positions) are
counted whole, body x trips, trips from the FFMAs a thread owes; the rest, and the old
kernel's load loop (x the chunks a thread loads), is walked as one path: a conditional branch
on a null 64-bit pointer (the protected slots', absent here) taken, also where the compiler
keeps the test as a flag in a register (PSET of the pointer's compare, tested with
ISETP.NE ... RZ: null_flags), every other conditional branch not taken. A pass unrolled whole (causal_wide_kernel's, head_dim 64's) has no inner loop
and counts under "other". A dual-issued pair ('{' in sm_5x SASS) is one issue slot.

Issue-bound model: FFMA slots / all slots is the share of the FP32 peak a full tile reaches
when the SM's four schedulers issue every cycle (none of the latency, barriers or shared-memory
bandwidth that the H200 measurements in bench/RESULTS.md show). A call at T rows on P cached
positions computes whole tiles: the share times visible / computed (query, position) pairs
(the FLOPs issue 17 counts, 4 x head_dim per visible pair).
"""
import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import m40_model as mm  # noqa: E402
import sass_counts as sc  # noqa: E402

VECTOR_DIMS = 4096  # kCausalVectorDims
WARP_VECTORS = 8    # kCausalWarpVectors
WIDE_THREADS = 128  # WideShape::NT
WIDE_VECTORS = 16   # WideShape::BM
OLD_THREADS = 256   # the old kernel's (kCausalThreads)
M40_PEAK_TFLOPS = 24 * 128 * 2 * 1.114e9 / 1e12


def shape(kernel, dmax):
    """(threads, BM, BN, FFMAs a thread a full tile in the score and output passes)."""
    bm = VECTOR_DIMS // dmax
    if kernel == "causal_warp_kernel":
        bn, nt = 32, 32 * bm // WARP_VECTORS
        return nt, bm, bn, WARP_VECTORS * dmax, WARP_VECTORS * (dmax // 32) * bn
    if kernel == "causal_wide_kernel":
        bm, bn, nt = WIDE_VECTORS, 32, WIDE_THREADS
        return nt, bm, bn, bm * bn * dmax // nt, bm * bn * dmax // nt
    bn = 32 if dmax == 128 else 16  # causal_tile() of the old kernel
    return OLD_THREADS, bm, bn, bm * bn // OLD_THREADS * dmax, bm * dmax * bn // OLD_THREADS


def slot_of(instrs, j):
    """1 for an issue slot, 0 for the second instruction of a dual-issued pair."""
    return 0 if j > 0 and instrs[j - 1].pair else 1


def null_flags(instrs):
    """Registers that hold 'this 64-bit pointer is null' as a flag: PSET.AND.AND R, P, PT, PT
    of a predicate P last set by ISETP.EQ.X P, PT, R', RZ (alone or OR-ed with another
    predicate: true whenever the pointer is null), R written by nothing else in the kernel."""
    flags, eq, writes = set(), {}, collections.Counter()
    for x in instrs:
        d = re.match(r"(R\d+),", x.args)
        if d and not x.op.startswith("ST"):
            writes[d.group(1)] += 1
        m = re.match(r"(P\d)(?:, P\d)?,", x.args)
        if m:  # any predicate writer: ISETP, FSETP, PSETP, ...
            eq[m.group(1)] = x.opcode in ("ISETP.EQ.X.AND", "ISETP.EQ.X.OR") and bool(
                re.match(r"P\d, PT, R\d+, RZ, (PT|!?P\d)$", x.args.rstrip())) and (
                x.opcode.endswith(".OR") or x.args.rstrip().endswith("PT"))
            continue
        m = re.match(r"(R\d+), (P\d), PT, PT", x.args)
        if x.opcode == "PSET.AND.AND" and m and eq.get(m.group(2)):
            flags.add(m.group(1))
    return {r for r in flags if writes[r] == 1}


def walk(instrs, lo, hi, nodes, flags=frozenset()):
    """Slots and instructions by class, and slots by phase, of one path from lo to hi (the back
    edge) under the rules of the docstring; nodes: {first index: (last index, slots, instrs,
    phase)}, inner loops counted whole (body x trips) where the path reaches them; flags: the
    registers that hold a null-pointer test (null_flags)."""
    c_slots, c_instr, phase = collections.Counter(), collections.Counter(), collections.Counter()
    at = lambda addr: mm.at_addr(instrs, addr)
    pc, ssy, pbk, defs, null_if = lo, [], [], {}, {}
    for _ in range(100000):
        if pc in nodes:
            last, sl, ins, where = nodes[pc]
            c_slots.update(sl)
            c_instr.update(ins)
            phase[where] += sum(sl.values())
            pc = last + 1
            continue
        x = instrs[pc]
        cls = sc.op_class(x.op)
        c_slots[cls] += slot_of(instrs, pc)
        c_instr[cls] += 1
        phase["other"] += slot_of(instrs, pc)
        if pc == hi:
            return c_slots, c_instr, phase
        if x.op == "ISETP":
            p = re.match(r"(P\d)", x.args)
            if p:
                defs[p.group(1)] = ".X" in x.opcode and x.args.rstrip().endswith("RZ, PT")
        p = re.match(r"(P\d),", x.args)
        if p:  # any predicate writer
            f = re.match(r"P\d, PT, (R\d+), RZ, PT$", x.args.rstrip())
            null_if[p.group(1)] = bool(f and f.group(1) in flags and x.opcode == "ISETP.NE.AND")
        if x.op in ("SSY", "PBK"):
            (ssy if x.op == "SSY" else pbk).append(int(x.args.split()[0], 16))
        elif x.op in ("SYNC", "BRK") and not x.pred:
            pc = at((ssy if x.op == "SYNC" else pbk).pop())
            continue
        elif x.op == "BRA":
            t = mm.branch_target(x)
            p = re.match(r"@(!?)(P\d)", x.pred or "")
            null_test = p and ((defs.get(p.group(2)) and p.group(1) == "!") or
                               (null_if.get(p.group(2)) and p.group(1) == ""))
            if t is not None and t > x.addr and (not x.pred or null_test):
                pc = at(t)
                continue
        pc += 1
    raise RuntimeError("the path never reached the loop's back edge")


def scaled(c, f):
    return collections.Counter({k: v * f for k, v in c.items()})


def tile_count(instrs, kernel, dmax):
    loops = mm.backward_loops(instrs)
    bars = lambda l: sum(1 for j in range(l[0], l[1] + 1) if instrs[j].op == "BAR")
    a, b = min((l for l in loops if bars(l) >= 4), key=lambda l: l[1] - l[0])
    nt, bm, bn, score_ffma, out_ffma = shape(kernel, dmax)
    nodes, ffma_loops = {}, 0
    for x, y in sorted((x, y) for x, y in loops if a < x and y < b):
        body = [instrs[j].op for j in range(x, y + 1)]
        if "LDG" in body:  # the old kernel's loads: a thread's chunks of 8 dims in turn
            per_trip = body.count("STS") / 2  # chunks a trip: two 16-byte stores each
            trips = (bn * dmax / 8 / nt) / per_trip
            sl, ins, _ = walk(instrs, x, y, {})
            nodes[x] = (y, scaled(sl, trips), scaled(ins, trips), "loads")
        elif "FFMA" in body:  # every instruction of a pass's step runs
            trips = (score_ffma if ffma_loops == 0 else out_ffma) / body.count("FFMA")
            sl = collections.Counter()
            for j in range(x, y + 1):
                sl[sc.op_class(instrs[j].op)] += slot_of(instrs, j)
            ins = collections.Counter(sc.op_class(instrs[j].op) for j in range(x, y + 1))
            nodes[x] = (y, scaled(sl, trips), scaled(ins, trips), "score" if ffma_loops == 0 else "output")
            ffma_loops += 1
    c_slots, c_instr, phase = walk(instrs, a, b, nodes, null_flags(instrs))
    return dict(threads=nt, bm=bm, bn=bn, ffma=score_ffma + out_ffma, slots=sum(c_slots.values()),
                instr=sum(c_instr.values()), classes=c_slots, phase=phase)


def visible_share(t, p, rows_per_block, bn):
    """Visible / computed (query, position) pairs of a call (whole tiles from the block's start)."""
    vis = comp = 0
    for r0 in range(0, t, rows_per_block):
        nr = min(rows_per_block, t - r0)
        last = p + r0 + nr  # positions the block's last row sees
        comp += nr * (-(-last // bn) * bn)
        vis += sum(p + r0 + i + 1 for i in range(nr))
    return vis / comp


def kernels(path, base=False):
    out = {}
    for name, instrs in sc.parse(path).items():
        m = re.search(r"(causal_warp_kernel|causal_wide_kernel|causal_fp32_kernel)<KvPair<KvF16, KvF16>, (\d), (\d+)>", name)
        if not m:
            continue
        kernel, gt, dmax = m.group(1), int(m.group(2)), int(m.group(3))
        out[(kernel, gt, dmax)] = tile_count(instrs, kernel, dmax)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lib")
    ap.add_argument("--base", default="")
    ap.add_argument("--base-name", default="base", help="the base's name in the table")
    ap.add_argument("--md", default="")
    args = ap.parse_args()
    rows = [("this tree", k, v) for k, v in sorted(kernels(args.lib).items(), key=lambda x: (x[0][2], x[0][1]))]
    if args.base:
        rows += [(args.base_name, k, v) for k, v in sorted(kernels(args.base).items(), key=lambda x: (x[0][2], x[0][1]))]
    L = ["# The FP32 causal kernels on the Tesla M40: SASS counts of a full tile and the share of the FP32 peak\n",
         "Generated by `bench/m40_causal_model.py` (no GPU); do not edit by hand. What it models and what it leaves "
         "out: the script's docstring. Regenerate (CUDA 11.8):\n",
         "    nvcc -ccbin g++-11 -std=c++17 -O3 -Ic/include -Ic/src -Icuda -DM40LLM_HAVE_CUDA=1 \\",
         "      -DM40LLM_CUDA_ARCHITECTURES='\"52\"' -gencode arch=compute_52,code=sm_52 \\",
         "      -c cuda/attention_causal_fp32.cu -o /tmp/causal52.o",
         "    python3 bench/m40_causal_model.py /tmp/causal52.o [--base BASE.o --base-name REV] \\",
         "      --md bench/m40_causal_model.md\n",
         "Per full tile of an F16 cache at head_dim = the class, per thread: FFMAs, issue slots by phase (score "
         "and output: their inner loops; loads: the old kernel's load loop; other: the tile loop's path outside "
         "them: loads of the new kernel, softmax, masks, barriers), and FFMA slots / all slots, the share of "
         f"the FP32 peak ({M40_PEAK_TFLOPS:.2f} TFLOP/s on an M40 at 1114 MHz) an issue-bound full tile reaches. "
         "`T512 P0` and `T8192 P0`: that share times the visible pairs' share of the tiles a prefill computes "
         "(issue 17's target: 60% at T >= 512).\n",
         "| build | kernel | GT | class | threads | BM x BN | FFMA | slots: score | output | loads | other | all "
         "| full tile | T512 P0 | T8192 P0 |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for who, (kernel, gt, dmax), v in rows:
        share = v["ffma"] / v["slots"]
        rpb = v["bm"] // gt
        s512 = share * visible_share(512, 0, rpb, v["bn"])
        s8k = share * visible_share(8192, 0, rpb, v["bn"])
        ph = v["phase"]
        L.append(f"| {who} | `{kernel}` | {gt} | {dmax} | {v['threads']} | {v['bm']} x {v['bn']} | {v['ffma']} | "
                 f"{ph['score']:.0f} | {ph['output']:.0f} | {ph['loads']:.0f} | {ph['other']:.0f} | "
                 f"{v['slots']:.0f} | {100 * share:.0f}% | {100 * s512:.0f}% | {100 * s8k:.0f}% |")
    text = "\n".join(L) + "\n"
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
