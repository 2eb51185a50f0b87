#!/usr/bin/env python3
"""The FP32 split kernel on the Tesla M40, modeled from its sm_52 SASS (no GPU needed).

  python3 bench/m40_model.py BUILD_DIR_OR_libm40llm.a [--md bench/m40_model.md] [--json OUT]
                             [--clock-ghz 1.114] [--bw-gbps 288] [--ptx LIB] [--no-h100]

For attn_fp32_kernel<KvPair<K, V>, GT, DMAX> of every format pair and group tile in the sm_52
SASS (CUDA 11.8), it finds the main tile loop (the backward branch around the three
__syncthreads of a tile), counts its instructions by class and its issue slots (a '{' pair is
dual-issued: one slot), and divides by the tile's K/V elements. The softmax pass, a thread a
(head, position), runs in ceil(GT x T / 32) warps (one for a one-head tile); everything else every warp runs.

Then, per benchmark shape (bench/formats.sh's), time = max(bytes / bandwidth, issue slots /
issue rate), the issue slots of the whole plan (the library's split planner, ported), the
busiest SM's share. Where the library carries compute_52 PTX (the default architecture list,
52-real;52-virtual), the same is done for an H100 running that PTX (ptxas of CUDA 11.8 for
sm_90 stands in for the driver's JIT) and set against the H100 measurements of bench/RESULTS.md.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402
import m40_resources  # noqa: E402
import sass_counts as sc  # noqa: E402

# ---- devices ----
M40 = dict(m40_resources.GM200, name="Tesla M40 (GM200, sm_52)", clock_ghz=1.114, base_ghz=0.948,
           bw_gbps=288.0, schedulers=4, arch="sm_52")
# H100 SXM5 80GB: 132 SMs, 4 schedulers each; 1.98 GHz is its maximum boost; the copy figure is the
# one measured in the same run as the PTX timings below (bench/RESULTS.md).
H100 = dict(name="H100 80GB HBM3 (compute_52 PTX, sm_90 SASS)", sms=132, regs_per_sm=65536,
            regs_per_block=65536, max_regs_per_thread=255, reg_alloc_unit=256, sub_partitions=4,
            max_threads_per_sm=2048, max_warps_per_sm=64, max_blocks_per_sm=32, smem_per_sm=233472,
            smem_per_block=49152, smem_alloc_unit=128, clock_ghz=1.98, bw_gbps=3031.0, schedulers=4,
            arch="sm_90")

# ---- the kernel's constants (cuda/tuning.cuh, attention_fp32.cu), sm_5x values ----
THREADS = 128
WARPS = THREADS // 32
WAVES = 2                 # kAttnWaves
SPLIT_ROWS_PER_HEAD = 64  # kSplitRowsPerHead
KEPT_SPLIT_ROWS = 32      # kKeptSplitRows
MIXED_MIN_ROWS = 256      # kFp32MixedMinRows
SINKS, WINDOW = 4, 128    # the defaults of a quantized cache (m40llm_kvcache_options v3)
LATENCY_BLOCKS_PER_SM = 2  # below this (8 warps an SM, 2 a scheduler), latency, not issue, binds


def wide_tile(gt, dmax, exact=True):
    """8-head tiles at head_dim 128 and 256, head_dim equal to its class: 128 registers, 4 blocks
    an SM (cuda/tuning.cuh)."""
    return gt >= 8 and dmax >= 128 and exact


def dense_tiles(gt, dmax, kfmt, vfmt, exact=True):
    """Quantized tiles at a head_dim of its class: up to 4 heads (V under 8 bits beside 4); and
    wide 8-head tiles, F16 ones too (cuda/attention_fp32.cuh)."""
    if (kfmt, vfmt) == ("KvF16", "KvF16") or not exact:
        return wide_tile(gt, dmax, exact)
    return gt <= 2 or (gt <= 4 and vfmt not in ("KvQ8", "KvF16")) or wide_tile(gt, dmax, exact)


def tile_rows(gt, dmax, device=True, tight=False, exact=True, dense=False):
    """Positions per tile: sm_5x/6x code (also the compute_52 PTX); the host value sizes smem.
    tight: a quantized kernel of a head_dim known only at run time; dense: dense_tiles
    (cuda/tuning.cuh)."""
    if dense:
        return 4096 // dmax if dmax >= 128 else 32
    if not device or wide_tile(gt, dmax, exact):
        return 2048 // dmax
    return (1024 if gt >= 8 or (gt >= 4 and tight) else 2048) // dmax


def pv_columns(gt, wide=False):
    """wide: 4 heads over a quantized V at a head_dim of its class (cuda/tuning.cuh)."""
    return 8 if gt == 1 else 4 if gt == 2 or (gt == 4 and wide) else 2


def v_columns(gt, dmax, exact, vfmt):
    """cuda/attention_fp32.cuh's v_columns: a wide tile over a V of 4 bits or fewer takes 4."""
    if vfmt == "KvF16":
        return pv_columns(gt, False)
    return 4 if vfmt != "KvQ8" and wide_tile(gt, dmax, exact) else pv_columns(gt, exact)


def smem_bytes(gt, dmax, head_dim, vfmt="KvF16", dense=False):
    t = tile_rows(gt, dmax, device=False, dense=dense)
    a = gt * (dmax + t)
    cols = v_columns(gt, dmax, head_dim == dmax, vfmt)
    rg = THREADS // (head_dim // cols) // (2 if gt * cols >= 32 else 1)  # partial_row_groups
    return 4 * max(a, rg * gt * head_dim)


# ---- formats: bytes a value, as read (codes + group parameters) ----
FMT = {"KvF16": ("F16", 2.0), "KvQ8": ("Q8", 1.0 + 2 / 32), "KvQ4": ("Q4", 0.5 + 4 / 32),
       "KvQ3": ("Q3", 0.375 + 4 / 32), "KvQ2": ("Q2", 0.25 + 4 / 32)}
PAIRS = [("KvF16", "KvF16"), ("KvQ8", "KvQ8"), ("KvQ4", "KvQ4"), ("KvQ8", "KvQ4"), ("KvQ4", "KvQ3"),
         ("KvQ4", "KvQ2")]
PAIR_NAME = {("KvF16", "KvF16"): "F16", ("KvQ8", "KvQ8"): "Q8", ("KvQ4", "KvQ4"): "Q4",
             ("KvQ8", "KvQ4"): "Q8Q4", ("KvQ4", "KvQ3"): "Q4Q3", ("KvQ4", "KvQ2"): "Q4Q2"}

# bench/formats.sh's shapes (B, H, Hkv, D, L)
SHAPES = [(1, 32, 32, 128, 8192), (1, 32, 32, 128, 32768), (8, 32, 32, 128, 8192), (8, 32, 8, 128, 8192),
          (1, 32, 8, 128, 32768), (8, 64, 8, 128, 8192), (8, 32, 8, 64, 8192), (32, 32, 8, 128, 2048),
          (1, 32, 8, 128, 1024)]

# H100, compute_52 PTX build (the M40's code through the JIT), µs a call: bench/RESULTS.md,
# "Wide 8-head tiles share each q load between two rows", gpu_check.sh abformats
# (bench/results_m40q/wide8_q2/abformats/*/ab.md, the new side; B8 64/8's Q4, Q4_plain and Q8Q4
# from q4_dense/, the second run). "_plain": no rotation, no protected tokens (what the codes
# kernel alone does); Q8, Q4, Q8Q4: the defaults (rotated, protected).
H100_MEASURED = {
    (1, 32, 32, 128, 8192): dict(F16=52.96, Q8=35.84, Q4=32.88, Q8Q4=34.69, Q8_plain=33.25, Q4_plain=28.72),
    (1, 32, 32, 128, 32768): dict(F16=186.80, Q8=113.47, Q4=95.58, Q8Q4=105.47, Q8_plain=109.71, Q4_plain=90.38),
    (8, 32, 32, 128, 8192): dict(F16=360.08, Q8=214.66, Q4=190.66, Q8Q4=199.23, Q8_plain=202.37, Q4_plain=172.72),
    (8, 32, 8, 128, 8192): dict(F16=110.66, Q8=100.11, Q4=105.78, Q8Q4=103.01, Q8_plain=88.61, Q4_plain=93.04),
    (1, 32, 8, 128, 32768): dict(F16=59.39, Q8=52.10, Q4=55.07, Q8Q4=54.18, Q8_plain=48.60, Q4_plain=51.79),
    (8, 64, 8, 128, 8192): dict(F16=115.31, Q8=135.54, Q4=163.76, Q8Q4=146.80, Q8_plain=121.94, Q4_plain=150.00),
    (8, 32, 8, 64, 8192): dict(F16=60.98, Q8=57.89, Q4=65.69, Q8Q4=61.45, Q8_plain=51.89, Q4_plain=59.32),
    (32, 32, 8, 128, 2048): dict(F16=111.52, Q8=114.54, Q4=117.63, Q8Q4=116.06, Q8_plain=89.23, Q4_plain=94.12),
    (1, 32, 8, 128, 1024): dict(F16=9.31, Q8=10.93, Q4=9.67, Q8Q4=9.98, Q8_plain=10.04, Q4_plain=8.60),
}
# The protected tokens' fixed cost: the combine every protected call has, and where the kernel is
# not a lean one (8-head tiles, runtime head_dims), their second launch. The H100 PTX run's step
# from Q8-plain to Q8 at B1 32/8 D128 L1K, where the work of 132 FP16 rows is negligible: +0.8
# µs in one launch (a 4-head tile); +9.8 µs in two (before issue 14's fourth part); the M40's
# launch gaps are no shorter.
PROTECT_FIXED_US = dict(one_launch=1.0, two_launches=10.0)

KRE = re.compile(r"attn_fp32_kernel<KvPair<(\w+), (\w+)>, (\d+), (\d+), (true|false)"
                 r"(?:, (true|false))?>")


# ---- SASS analysis ----
def branch_target(ins):
    if ins.op != "BRA":
        return None
    m = re.search(r"0x([0-9a-f]+)", ins.args)
    return int(m.group(1), 16) if m else None


def backward_loops(instrs):
    """(first, last) instruction indices of each backward branch's loop."""
    out = []
    for n, x in enumerate(instrs):
        t = branch_target(x)
        if t is not None and t <= x.addr:  # a target may be a control word: the next instruction
            out.append((next(j for j, y in enumerate(instrs) if y.addr >= t), n))
    return out


def at_addr(instrs, addr):
    """The index of the first instruction at or after addr."""
    return next(j for j, y in enumerate(instrs) if y.addr >= addr)


def slots(instrs, lo, hi):
    """Instructions and issue slots in instrs[lo:hi]; a dual-issue pair is one slot."""
    n = hi - lo
    pairs = sum(1 for j in range(lo, hi) if instrs[j].pair and j + 1 < hi)
    return n, n - pairs


def class_slots(instrs, lo, hi, skip=()):
    """Issue slots by class in instrs[lo:hi] but those in skip (a pair's slot goes half to each)."""
    c = collections.Counter()
    for j in range(lo, hi):
        if j in skip:
            continue
        x = instrs[j]
        paired = x.pair and j + 1 < hi or (j > lo and instrs[j - 1].pair)
        c[sc.op_class(x.op)] += 0.5 if paired else 1.0
    return c


def class_instrs(instrs, lo, hi, skip=()):
    return collections.Counter(sc.op_class(instrs[j].op) for j in range(lo, hi) if j not in skip)


def scale(c, f):
    return collections.Counter({k: v * f for k, v in c.items()})


def add(*cs):
    out = collections.Counter()
    for c in cs:
        for k, v in c.items():
            out[k] += v
    return out


def block_path(instrs, a, b):
    """Instructions a warp runs outside the main loop [a, b], estimated as one path: conditional
    branches not taken, each other loop once, subroutines (CAL: slow paths) not entered.
    An estimate: if/else takes whichever arm falls through, loops of several trips count once."""
    at = lambda t: next(j for j, y in enumerate(instrs) if y.addr >= t)
    pc, n, ssy, pbk, seen = 0, 0, [], [], set()
    for _ in range(50000):
        if pc >= len(instrs):
            break
        if pc == a:
            pc = b + 1
            continue
        x = instrs[pc]
        seen.add(pc)
        n += 1
        if x.op in ("EXIT", "RET") and not x.pred:
            break
        if x.op in ("SSY", "PBK"):
            (ssy if x.op == "SSY" else pbk).append(int(x.args.split()[0], 16))
        elif x.op in ("SYNC", "BRK") and not x.pred and (ssy if x.op == "SYNC" else pbk):
            pc = at((ssy if x.op == "SYNC" else pbk).pop())
            continue
        elif x.op == "BRA" and not x.pred and not re.search(r"\.(DIV|CONV)\b", x.opcode):
            # (BRA.DIV: to the out-of-line code of a diverged warp's shuffle, sm_70+: not taken)
            t = branch_target(x)
            if t is None:
                break
            if at(t) not in seen:  # forward, or back from an out-of-line block (sm_70+)
                pc = at(t)
                continue
            # a loop's unconditional back edge: leave the loop (once)
        pc += 1
    return n


def analyse(instrs, gt, dmax, tight, quantized=False, exact=True, dense=False):
    """Warp-instructions and issue slots a block spends on one full tile, by class and phase."""
    loops = backward_loops(instrs)
    with_bars = [(a, b, [j for j in range(a, b + 1) if instrs[j].op == "BAR"]) for a, b in loops]
    # The innermost loop around three barriers (sm_90 code also branches back from out-of-line
    # blocks placed after the kernel: those loops are larger and hold more barriers). A lean
    # quantized kernel (up to 4 heads, or a wide 8-head tile) has a second such loop, over the FP16
    # slots of a protected cache's kept rows: the codes' loop is the one with the fewer FP16
    # conversions (F2F.F32.F16 on sm_52, HADD2.F32 on sm_90).
    cand = [l for l in with_bars if len(l[2]) == 3]
    if not cand:
        raise RuntimeError("no loop around three barriers")

    def f16_widens(l):
        return sum(1 for j in range(l[0], l[1] + 1)
                   if instrs[j].op == "F2F" and ".F32.F16" in instrs[j].opcode
                   or instrs[j].op == "HADD2" and ".F32" in instrs[j].opcode) if quantized else 0
    a, b, bars = min(cand, key=lambda l: (f16_widens(l), l[1] - l[0]))
    b1, b2, b3 = bars
    # The softmax pass: after the score pass's barrier (and its MEMBAR), up to the output pass's.
    s_lo = b2 + 1 + (1 if instrs[b2 + 1].op == "MEMBAR" else 0)
    s_hi = b3
    t = tile_rows(gt, dmax, tight=tight, exact=exact, dense=dense)
    # A thread a (head, position): ceil(GT x LH / 32) warps run the pass, each once (more often
    # where GT x T exceeds the block's threads: the pass's loop body again); the others skip it
    # at their first predicated branch.
    vals = gt * (32 if gt == 1 else t)  # LH lanes a head: a whole warp for a one-head tile
    busy = min(WARPS, -(-vals // 32))
    iters = -(-vals // (32 * WARPS))
    # The lazy rescale's branch (a warp vote, then a conditional branch over the max's reduction
    # and the rescale) is taken on a block's first tile and rarely after: counted as not taken.
    rare = []
    for j in range(s_lo, s_hi):
        if instrs[j].op == "VOTE" and ".ANY" in instrs[j].opcode:
            k = next((k for k in range(j + 1, min(j + 8, s_hi)) if instrs[k].op == "BRA"), None)
            target = branch_target(instrs[k]) if k is not None else None
            if target is not None and target > instrs[k].addr:
                rare.append((k + 1, at_addr(instrs, target)))
    skip = {j for x, y in rare for j in range(x, y)}
    soft_slots = class_slots(instrs, s_lo, s_hi, skip)
    soft_instr = class_instrs(instrs, s_lo, s_hi, skip)
    inner = [(x, y) for x, y in loops if s_lo <= x and y < s_hi]
    if inner and iters > 1:
        x, y = max(inner, key=lambda l: l[1] - l[0])
        soft_slots = add(soft_slots, scale(class_slots(instrs, x, y + 1), iters - 1))
        soft_instr = add(soft_instr, scale(class_instrs(instrs, x, y + 1), iters - 1))
    g = next((j for j in range(s_lo, s_hi) if instrs[j].pred and instrs[j].op in ("SYNC", "BRA", "BSYNC")),
             s_hi - 1)
    soft_slots = add(scale(soft_slots, busy), scale(class_slots(instrs, s_lo, g + 1), WARPS - busy))
    soft_instr = add(scale(soft_instr, busy), scale(class_instrs(instrs, s_lo, g + 1), WARPS - busy))
    phases = {"loads": (a, b1 + 1), "score": (b1 + 1, s_lo), "output": (b3, b + 1)}
    # The output's rescale, where some head's max rose: the instructions a warp skips where the
    # barrier's result (B2R.RESULT's predicate) is false, up to the SSY target around them; as
    # rare as the softmax's branch.
    rescale = set()
    b2r = next((j for j in range(b3, b + 1) if instrs[j].op == "B2R"), None)
    if b2r is not None:
        p = re.search(r"P\d", instrs[b2r].args).group(0)
        skip = next((j for j in range(b2r, b + 1) if instrs[j].op == "SYNC"
                     and (instrs[j].pred or "").strip() == "@!" + p), None)
        if skip is not None:
            ssy = max(j for j in range(b3, skip) if instrs[j].op == "SSY")
            rescale = set(range(skip + 1, at_addr(instrs, int(instrs[ssy].args.split()[0], 16))))
    ph_slots = {k: scale(class_slots(instrs, lo, hi, rescale), WARPS)
                for k, (lo, hi) in phases.items()}
    ph_instr = {k: scale(class_instrs(instrs, lo, hi, rescale), WARPS)
                for k, (lo, hi) in phases.items()}
    ph_slots["softmax"], ph_instr["softmax"] = soft_slots, soft_instr
    tile_slots = add(*ph_slots.values())
    tile_instr = add(*ph_instr.values())
    outside = block_path(instrs, a, b)
    return dict(T=t, loop_first=instrs[a].addr, loop_last=instrs[b].addr, loop_instrs=b - a + 1,
                loop_pairs=slots(instrs, a, b + 1)[0] - slots(instrs, a, b + 1)[1],
                tile_slots=tile_slots, tile_instr=tile_instr, phase_slots=ph_slots,
                total_slots=sum(tile_slots.values()), total_instr=sum(tile_instr.values()),
                block_overhead=WARPS * outside, block_path=outside, kernel_instrs=len(instrs))


def res_usage(path, arch):
    out = subprocess.run(["cuobjdump", "-res-usage", "-arch", arch, path], capture_output=True, text=True,
                         check=True).stdout
    res, name = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and name:
            res[name] = dict(zip(("regs", "stack", "smem", "local"), map(int, m.groups())))
    names = sc.demangle_all(res)
    return {names[k]: v for k, v in res.items()}


def kernels_of(path, arch):
    """{(K, V, GT, DMAX): analysis} of every attn_fp32_kernel in path's SASS for arch."""
    sass = sc.parse(path, arch)
    res = res_usage(path, arch)
    out = {}
    for name, instrs in sass.items():
        m = KRE.search(name)
        if not m:
            continue
        k, v, gt, dmax = m.group(1), m.group(2), int(m.group(3)), int(m.group(4))
        # The kernel of a head_dim equal to its class's (true) where it is built, else the general one.
        exact = m.group(5) == "true"
        if m.group(6) == "true":  # the instance of calls with weights (kScores)
            continue
        if not exact and (k, v, gt, dmax) in out:
            continue
        quantized = (k, v) != ("KvF16", "KvF16")
        r = analyse(instrs, gt, dmax, tight=not exact and quantized, quantized=quantized, exact=exact,
                    dense=dense_tiles(gt, dmax, k, v, exact))
        r.update(res.get(name, {}))
        r["exact"] = exact
        out[(k, v, gt, dmax)] = r
    return out


def sm90_kernels_from_ptx(lib):
    """kernels_of() the sm_90 SASS of the library's compute_52 PTX of attention_fp32.cu (CUDA 11.8's
    ptxas stands in for the driver's JIT); None where the library has no such PTX."""
    txt = subprocess.run(["cuobjdump", "-ptx", lib], capture_output=True, text=True).stdout
    chunks = re.split(r"\n(?=member |Fatbin (?:ptx|elf) code:)", txt)
    # attention_fp32.cu's: the most plain instances (kScores false), ahead of the other
    # translation units that instantiate the template (scores, tiers).
    plain = lambda c: len(re.findall(r"\.entry \S*attn_fp32_kernel\S*Lb0EEEv", c))
    ptx = max(chunks, key=plain, default=None)
    if ptx is None or plain(ptx) == 0:
        return None
    with tempfile.TemporaryDirectory(prefix="m40model") as d:
        src, cubin = os.path.join(d, "attention_fp32.ptx"), os.path.join(d, "attention_fp32.sm_90.cubin")
        with open(src, "w") as f:
            f.write(ptx[ptx.index(".version"):])
        subprocess.run(["ptxas", "-arch=sm_90", "-O3", src, "-o", cubin], check=True, capture_output=True)
        return kernels_of(cubin, "sm_90")


# ---- the planner (c/src/attention_plan.c), for whole-call slot counts ----
def plan_chunks(lens, units, target, min_blocks, min_chunk, tile):
    total, max_len = sum(lens), max(max(lens), 1)
    chunk = max_len
    if len(lens) * units < target and total > 0:
        want = -(-(total * units) // target)
        fill = -(-(total * units) // min_blocks)
        if fill < min_chunk:
            min_chunk = fill
        want = max(want, min_chunk)
        pieces = max(1, (2 * max_len + want) // (2 * want))
        want = -(-max_len // pieces)
        want = -(-want // tile) * tile
        chunk = min(chunk, want)
    return [[min(chunk, n - s) for s in range(0, n, chunk)] for n in lens]


def occupancy(kern, gt, dmax, head_dim, kfmt, dev, vfmt="KvF16"):
    sm = smem_bytes(gt, dmax, head_dim, vfmt,
                    dense_tiles(gt, dmax, kfmt, vfmt, head_dim == dmax)) + kern.get("smem", 0)
    return m40_resources.occupancy(kern.get("regs", 64), sm, THREADS, dev)["blocks_per_sm"], sm


def model_call(shape, kern, dev, bytes_per_val, protected, occ, eff=1.0):
    """Modeled µs of one call: max(bytes / bw, busiest SM's issue slots / (its issue rate x eff))."""
    b, h, hkv, d, l = shape
    gt = kern["gt"]
    units = hkv * (-(-(h // hkv) // gt))
    t = kern["T"]
    rate = dev["schedulers"] * dev["clock_ghz"] * 1e3 * eff  # slots per µs per SM
    kept = min(l, SINKS + WINDOW) if protected else 0
    codes = l - kept
    min_chunk = max(SPLIT_ROWS_PER_HEAD * gt, t)
    split_rows = [r for seq in plan_chunks([codes] * b, units, dev["sms"] * occ * WAVES, dev["sms"], min_chunk, t)
                  for r in seq] if codes else []
    n_blocks = len(split_rows) * units
    block_slots = [kern["total_slots"] * -(-r // t) + kern["block_overhead"] for r in split_rows]
    total_slots = sum(block_slots) * units
    per_sm = -(-n_blocks // dev["sms"]) * total_slots / n_blocks if n_blocks else 0.0
    kv_bytes = b * hkv * codes * d * bytes_per_val
    t_mem = (kv_bytes + grid.qo_bytes_f32(shape)) / (dev["bw_gbps"] * 1e3)
    t_issue = per_sm / rate
    return dict(kv_bytes=kv_bytes, t_mem=t_mem, t_issue=t_issue, blocks=n_blocks, slots=total_slots,
                overhead_share=n_blocks * kern["block_overhead"] / max(total_slots, 1),
                latency=n_blocks < LATENCY_BLOCKS_PER_SM * dev["sms"], time=max(t_mem, t_issue),
                bound="issue" if t_issue > t_mem else "bandwidth")


def model_kept(shape, f16, dev, eff=1.0):
    """The protected tokens' F16 launch: (sinks + window) rows a sequence, in 32-row splits."""
    b, h, hkv, d, l = shape
    units = hkv * (-(-(h // hkv) // f16["gt"]))
    kept, t = min(l, SINKS + WINDOW), f16["T"]
    chunk = t if t >= KEPT_SPLIT_ROWS else KEPT_SPLIT_ROWS // t * t
    parts = [min(l, SINKS), kept - min(l, SINKS)]  # the sinks, the window
    rows = [min(chunk, p - s) for p in parts for s in range(0, p, chunk)]
    n_blocks = len(rows) * units * b
    total = sum(f16["total_slots"] * -(-r // t) + f16["block_overhead"] for r in rows) * units * b
    rate = dev["schedulers"] * dev["clock_ghz"] * 1e3 * eff
    t_issue = -(-n_blocks // dev["sms"]) * (total / n_blocks) / rate
    t_mem = b * hkv * kept * d * 2 * 2 / (dev["bw_gbps"] * 1e3)
    return dict(t_mem=t_mem, t_issue=t_issue, time=max(t_mem, t_issue), blocks=n_blocks)


def model_mixed(shape, kern, f16, dev, bytes_per_val, occ, eff=1.0):
    """A lean kernel's MIXED plan (splits of MIXED_MIN_ROWS rows or more): the unprotected
    cache's plan over all L positions, each split reading its kept rows from the FP16 slots in its
    own block: their bytes FP16's, their tiles the F16 kernel's at the same GT (a run each for the
    sinks and the window, whole tiles), no launch or combine of their own."""
    b, h, hkv, d, l = shape
    plain = model_call(shape, kern, dev, bytes_per_val, False, occ, eff)
    units = hkv * (-(-(h // hkv) // kern["gt"]))
    kept = min(l, SINKS + WINDOW)
    runs = [r for r in (min(l, SINKS), kept - min(l, SINKS)) if r]
    extra = sum(f16["total_slots"] * -(-r // f16["T"]) - kern["total_slots"] * r / kern["T"]
                for r in runs) * units * b
    slots = plain["slots"] + extra
    t_issue = plain["t_issue"] * slots / plain["slots"]
    kv_bytes = b * hkv * d * ((l - kept) * bytes_per_val + kept * 2 * 2)
    t_mem = (kv_bytes + grid.qo_bytes_f32(shape)) / (dev["bw_gbps"] * 1e3)
    return dict(plain, kv_bytes=kv_bytes, t_mem=t_mem, t_issue=t_issue, slots=slots,
                time=max(t_mem, t_issue), bound="issue" if t_issue > t_mem else "bandwidth",
                plan="MIXED")


def mixed_plan(shape, kern, dev, occ):
    """Whether the library gives this call a MIXED plan: a lean kernel whose unprotected plan's
    splits take MIXED_MIN_ROWS rows or more."""
    b, h, hkv, d, l = shape
    units = hkv * (-(-(h // hkv) // kern["gt"]))
    t = kern["T"]
    chunks = plan_chunks([l] * b, units, dev["sms"] * occ * WAVES, dev["sms"],
                         max(SPLIT_ROWS_PER_HEAD * kern["gt"], t), t)
    return max(max(c) for c in chunks) >= MIXED_MIN_ROWS


def group_tile(h, hkv):
    return min(8, 1 << (max(1, h // hkv) - 1).bit_length())


def model_all(kerns, dev, shapes, eff=1.0, mixed=True):
    """mixed=False: PARTS plans throughout (what the library ran before MIXED plans for the lean
    FP32 kernels: the H100 measurements below)."""
    rows = []
    for s in shapes:
        b, h, hkv, d, l = s
        gt = group_tile(h, hkv)
        dmax = next(x for x in (64, 128, 256) if d <= x)
        row = dict(shape=s, gt=gt, formats={})
        for pair in PAIRS:
            kern = kerns.get(pair + (gt, dmax))
            if kern is None:
                continue
            kern = dict(kern, gt=gt)
            occ, _ = occupancy(kern, gt, dmax, d, pair[0], dev, pair[1])
            bpv = FMT[pair[0]][1] + FMT[pair[1]][1]
            r = dict(plain=model_call(s, kern, dev, bpv, False, occ, eff), occ=occ)
            if pair != ("KvF16", "KvF16"):
                f16 = dict(kerns[("KvF16", "KvF16", gt, dmax)], gt=gt)
                lean = (gt <= 4 or wide_tile(gt, dmax)) and d == dmax
                if mixed and lean and mixed_plan(s, kern, dev, occ):
                    mixed = model_mixed(s, kern, f16, dev, bpv, occ, eff)
                    r["protected"] = dict(mixed=mixed, time=mixed["time"])
                else:
                    codes = model_call(s, kern, dev, bpv, True, occ, eff)
                    kept = model_kept(s, f16, dev, eff)
                    fixed = PROTECT_FIXED_US["one_launch" if lean else "two_launches"]
                    r["protected"] = dict(codes=codes, kept=kept,
                                          time=codes["time"] + kept["time"] + fixed)
            row["formats"][PAIR_NAME[pair]] = r
        f16t = row["formats"]["F16"]["plain"]["time"]
        for r in row["formats"].values():
            r["speedup_plain"] = f16t / r["plain"]["time"]
            if "protected" in r:
                r["speedup_protected"] = f16t / r["protected"]["time"]
        rows.append(row)
    return rows


def issue_efficiency(h100rows):
    """Median of modeled issue time / measured time over the H100's issue-bound plain calls that
    fill the GPU: the share of the modeled issue rate the PTX code reached there."""
    r = []
    for row in h100rows:
        m = H100_MEASURED.get(row["shape"], {})
        for name, f in row["formats"].items():
            meas = m.get(name if name == "F16" else name + "_plain")
            p = f["plain"]
            if meas and p["bound"] == "issue" and not p["latency"]:
                r.append(p["t_issue"] / meas)
    r.sort()
    return (r[len(r) // 2] if len(r) % 2 else (r[len(r) // 2 - 1] + r[len(r) // 2]) / 2) if r else None, r


# ---- report ----
CLS = ["FFMA", "FP32", "MUFU", "CVT", "INT", "LDG", "LDS", "ST", "SHFL", "CTRL"]


def per_elem(kern, dmax, c):
    """Thread-level slots (or instructions) per K/V element of a tile's warp count c."""
    return c * 32 / (2 * kern["T"] * dmax)


def fmt_us(x):
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def pipe_share(k):
    """The busier 32-lane pipe (MUFU + conversions; loads, stores, shuffles: a warp instruction
    a clock a SM, so 4 issue slots' time) against the issue slots."""
    c = k["tile_instr"]
    return max(c["MUFU"] + c["CVT"], c["LDG"] + c["LDS"] + c["ST"] + c["SHFL"]) * 4 / k["total_slots"]


def report(args, m40k, m40rows, variants, h100k, h100rows, eff, effs):
    L = []
    f = M40["clock_ghz"]
    rate = M40["sms"] * M40["schedulers"] * f
    room = {n: rate * 32 / (M40["bw_gbps"] / b) for n, b in (("F16", 2.0), ("Q8", FMT["KvQ8"][1]),
                                                             ("Q4", FMT["KvQ4"][1]),
                                                             ("Q8Q4", (FMT["KvQ8"][1] + FMT["KvQ4"][1]) / 2))}
    L.append("# The FP32 split kernel on the Tesla M40: SASS counts and a time model\n")
    L.append("Generated by `bench/m40_model.py` (no GPU); do not edit by hand. What it says: "
             "`bench/RESULTS.md`, \"M40 model\". Regenerate (CUDA 11.8; `52-virtual` adds the H100 "
             "cross-check):\n")
    L.append("    cmake -S . -B /tmp/m40-sm52 -G Ninja \"-DCMAKE_CUDA_ARCHITECTURES=52-real;52-virtual\" "
             "-DM40LLM_BUILD_TESTS=OFF -DM40LLM_BUILD_EXAMPLES=OFF")
    L.append("    cmake --build /tmp/m40-sm52 -j2 && python3 bench/m40_model.py /tmp/m40-sm52\n")
    L.append(f"- SASS: `attn_fp32_kernel<KvPair<K, V>, GT, DMAX>`, sm_52, {args.nvcc}, `{args.lib_shown}`; "
             "registers and spills from `cuobjdump -res-usage`, blocks/SM from the GM200 occupancy model "
             "(`m40_resources.py`) with the kernel's dynamic shared memory.")
    L.append("- Main loop: the innermost backward branch around a tile's three `__syncthreads` (loads and "
             "score pass | softmax | output pass). On a full tile every warp runs all of it except the "
             "softmax pass, a thread a (head, position): ceil(GT x T / 32) warps run it (one for a one-head tile), the others skip it. "
             "The output's rescale (only on tiles where some head's max rose) and the wide tiles' lazy "
             "rescale (a warp vote's branch over the max's reduction: taken where a score passes the "
             "max by more than 8 in log2 units, so on a block's first tile and rarely after) are "
             "counted as not taken.")
    L.append("- Element: one dim of one position of K, or of V, for one K/V head; a tile holds 2 x T x DMAX. "
             "Per element = a tile's warp instructions (or issue slots) x 32 / its elements: thread-level, idle "
             "lanes included. Issue slots = instructions less dual-issued pairs (`{ }` in sm_5x SASS: two "
             "instructions, one slot). Budget (issue 14): group size + 2 slots per element; the FMAs alone "
             "are GT per element (one per query head, for K and for V).")
    L.append(f"- M40: {M40['sms']} SMs x 4 schedulers x {f * 1000:.0f} MHz, its boost clock (the base, 948 MHz, "
             f"makes issue-bound times 1.18x longer) = {rate:.1f} G warp slots/s; {M40['bw_gbps']:.0f} GB/s, "
             f"the datasheet peak (bench/RESULTS.md has no M40 copy measurement), and 80% of it beside it. At "
             f"{M40['bw_gbps']:.0f} GB/s an element may take {room['F16']:.1f} slots in F16 (2 B), "
             f"{room['Q8']:.1f} in Q8 (1.0625 B), {room['Q8Q4']:.1f} in Q8Q4, {room['Q4']:.1f} in Q4 (0.625 B) "
             f"before issue binds.")
    L.append("- A call: time = max((K/V + q/out bytes) / bandwidth, issue slots of the busiest SM / 4 x clock). "
             "Slots: the library's split plan (ported; its 2 waves of the blocks/SM below) x (tiles x slots a "
             "tile + the block's own: one path through the code outside the loop, x 4 warps). Not modeled: "
             "latency (calls of fewer than 2 blocks an SM are marked: 2 warps a scheduler hide little), barrier "
             "stalls, the combine and its partials (about 3% of the bytes), launch gaps; and max() is optimistic "
             "where the two times are close (a call then pays for both in part).")
    L.append(f"- Protected tokens (the quantized formats' defaults: 4 sinks + a 128-token window kept FP16; "
             f"the rotation costs nothing measurable). Where the kernel is a lean one (up to 4 heads at "
             f"head_dim 64, 128, 256; 8 at 128, 256) and the unprotected plan's splits take "
             f"{MIXED_MIN_ROWS} rows or more, the library's MIXED plan: that plan over all L positions, "
             f"the 132 kept rows' bytes FP16's and their tiles (a run for the sinks, one for the window, "
             f"whole tiles) the F16 kernel's at the same GT, in the codes' splits' blocks. Elsewhere "
             f"(PARTS): the codes of L - 132 positions, plus the F16 launch over 132 positions a sequence "
             f"(32-row splits, F16 slots a tile at the same GT), plus a fixed "
             f"{PROTECT_FIXED_US['one_launch']:.0f} us for the combine where the kernel takes them in one launch, "
             f"{PROTECT_FIXED_US['two_launches']:.0f} us for a second launch and the combine elsewhere (the H100 "
             f"PTX run's steps at B1 32/8 D128 L1K, where those rows' work is negligible).\n")

    for dmax in (128, 64, 256):
        L.append(f"## Per K/V element, DMAX {dmax} (head_dim {dmax})\n")
        L.append("Instructions per element by class, then all instructions and issue slots; pipes = the busier "
                 "quarter-rate pipe (MUFU + CVT, or LDG + LDS + ST + SHFL) in issue-slot time, against the slots.\n")
        L.append("| format | GT | T | loop | " + " | ".join(CLS) + " | instrs | **slots** | budget | meets | softmax "
                 "| pipes | regs | spills | blocks/SM |")
        L.append("|---|---|---|---|" + "---|" * len(CLS) + "---|---|---|---|---|---|---|---|---|")
        for pair in PAIRS:
            for gt in (1, 2, 4, 8):
                k = m40k.get(pair + (gt, dmax))
                if not k:
                    continue
                occ, _ = occupancy(k, gt, dmax, dmax, pair[0], M40, pair[1])
                tot = per_elem(k, dmax, k["total_slots"])
                soft = sum(k["phase_slots"]["softmax"].values()) / k["total_slots"]
                sp = "none" if not (k.get("stack") or k.get("local")) else f"{k.get('stack')}/{k.get('local')} B"
                L.append(f"| {PAIR_NAME[pair]} | {gt} | {k['T']} | {k['loop_instrs']} | "
                         + " | ".join(f"{per_elem(k, dmax, k['tile_instr'].get(c, 0)):.2f}" for c in CLS)
                         + f" | {per_elem(k, dmax, k['total_instr']):.2f} | **{tot:.2f}** | {gt + 2} | "
                         f"{'yes' if tot <= gt + 2 else 'no'} | {100 * soft:.0f}% | {100 * pipe_share(k):.0f}% | "
                         f"{k.get('regs', '?')} | {sp} | {occ} |")
        L.append("")
        if dmax == 128:
            L.append("Issue slots per element by phase (where the compiler put a tile's global loads and their "
                     "addresses before the first barrier, they are under loads; else under score):\n")
            L.append("| format | GT | loads | score (K) | softmax | output (V) | total | block's own, a warp |")
            L.append("|---|---|---|---|---|---|---|---|")
            for pair in PAIRS:
                for gt in (1, 2, 4, 8):
                    k = m40k.get(pair + (gt, dmax))
                    if not k:
                        continue
                    ph = {p: per_elem(k, dmax, sum(v.values())) for p, v in k["phase_slots"].items()}
                    L.append(f"| {PAIR_NAME[pair]} | {gt} | {ph['loads']:.2f} | {ph['score']:.2f} | "
                             f"{ph['softmax']:.2f} | {ph['output']:.2f} | {per_elem(k, dmax, k['total_slots']):.2f} | "
                             f"{k['block_path']} |")
            L.append("")

    def shape_table(rows, measured=None, rows_eff=None):
        hdr = "| shape | GT | format | K/V MB | bytes us | issue us | bound | model us | vs F16 | protected us | vs F16 |"
        sep = "|---|---|---|---|---|---|---|---|---|---|---|"
        if measured:
            hdr += " measured us (plain / default) | vs F16 | model / measured |"
            sep += "---|---|---|"
            if rows_eff:
                hdr += f" x{eff:.2f} issue: model / measured | vs F16 |"
                sep += "---|---|"
        L.append(hdr)
        L.append(sep)
        for i, row in enumerate(rows):
            for name, r in row["formats"].items():
                p, pr = r["plain"], r.get("protected")
                bound = p["bound"] + (f" (latency: {p['blocks']} blocks)" if p["latency"] else "")
                line = (f"| {grid.shape_str(row['shape'])} | {row['gt']} | {name} | {p['kv_bytes'] / 1e6:.1f} | "
                        f"{fmt_us(p['t_mem'])} | {fmt_us(p['t_issue'])} | {bound} | **{fmt_us(p['time'])}** | "
                        f"{r['speedup_plain']:.2f}x | "
                        + (f"{fmt_us(pr['time'])} | {r['speedup_protected']:.2f}x |" if pr else "- | - |"))
                if measured:
                    m = measured.get(row["shape"], {})
                    mp = m.get(name if name == "F16" else name + "_plain")
                    md = m.get(name) if name != "F16" else None
                    f16m = m.get("F16")
                    sp = [f"{f16m / x:.2f}x" if x and f16m else "-" for x in (mp, md)]
                    line += (" " + " / ".join(f"{x:.1f}" if x else "-" for x in (mp, md)) + " | "
                             + " / ".join(sp) + " | "
                             + (f"{p['time'] / mp:.2f}" if mp else "-") + " / "
                             + (f"{pr['time'] / md:.2f}" if pr and md else "-") + " |")
                    if rows_eff:
                        re_ = rows_eff[i]["formats"][name]
                        pe, pre = re_["plain"], re_.get("protected")
                        line += (" " + (f"{pe['time'] / mp:.2f}" if mp else "-") + " / "
                                 + (f"{pre['time'] / md:.2f}" if pre and md else "-") + " | "
                                 + f"{re_['speedup_plain']:.2f}x"
                                 + (f" / {re_['speedup_protected']:.2f}x" if pre else "") + " |")
                L.append(line)
        L.append("")

    L.append(f"## M40, modeled per shape ({M40['bw_gbps']:.0f} GB/s, {f * 1000:.0f} MHz)\n")
    shape_table(m40rows)
    L.append("## Expected speed-up over F16 on the M40 (plain; with the default protected tokens)\n")
    L.append("| shape | GT | assumption | Q8 | Q4 | Q8Q4 | bound: F16, Q8, Q4, Q8Q4 |")
    L.append("|---|---|---|---|---|---|---|")
    for i, row in enumerate(m40rows):
        for label, rows in variants:
            vr = rows[i]
            cells = [f"{vr['formats'][n]['speedup_plain']:.2f}x ({vr['formats'][n]['speedup_protected']:.2f}x)"
                     for n in ("Q8", "Q4", "Q8Q4")]
            bounds = ", ".join(vr["formats"][n]["plain"]["bound"][0] for n in ("F16", "Q8", "Q4", "Q8Q4"))
            L.append(f"| {grid.shape_str(row['shape'])} | {row['gt']} | {label} | " + " | ".join(cells)
                     + f" | {bounds} |")
    L.append("\n(b = bandwidth-bound, i = issue-bound.)\n")
    if h100k:
        L.append("## Cross-check: the same model for the H100 that ran the compute_52 PTX\n")
        L.append(f"sm_90 SASS of the library's compute_52 PTX from CUDA 11.8's ptxas (the driver's JIT is newer; "
                 f"its code may differ a little); {H100['sms']} SMs x 4 schedulers x {H100['clock_ghz']:.2f} GHz "
                 f"(maximum boost), {H100['bw_gbps']:.0f} GB/s (the copy measured in that run); no dual issue. "
                 f"Measured: bench/RESULTS.md, \"The M40's FP32 kernel for GQA (issue 20)\", compute_52 PTX (plain: no "
                 f"rotation, no protected tokens; default: both, measured before MIXED plans, and modeled "
                 f"here as then: PARTS throughout).\n")
        L.append("| format | GT | slots per element, sm_90 | sm_52 | sm_52 instructions |")
        L.append("|---|---|---|---|---|")
        for pair in PAIRS:
            for gt in (1, 4, 8):
                k, k52 = h100k.get(pair + (gt, 128)), m40k.get(pair + (gt, 128))
                if k and k52:
                    L.append(f"| {PAIR_NAME[pair]} | {gt} | {per_elem(k, 128, k['total_slots']):.2f} | "
                             f"{per_elem(k52, 128, k52['total_slots']):.2f} | "
                             f"{per_elem(k52, 128, k52['total_instr']):.2f} |")
        L.append("")
        shape_table(h100rows, measured=H100_MEASURED,
                    rows_eff=model_all(h100k, H100, SHAPES, eff, mixed=False) if eff else None)
        if eff:
            L.append(f"Issue efficiency reached on the H100 (modeled issue time / measured, over the plain calls "
                     f"the model calls issue-bound that fill the GPU): median {eff:.2f} "
                     f"({min(effs):.2f} to {max(effs):.2f}, {len(effs)} calls). The M40 rows \"x{eff:.2f} "
                     f"issue\" above assume the M40 reaches the same share of its issue rate.\n")
    return "\n".join(L) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("lib", help="libm40llm.a (or its build directory) with sm_52 SASS")
    p.add_argument("--md", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "m40_model.md"))
    p.add_argument("--json", default="")
    p.add_argument("--clock-ghz", type=float, default=M40["clock_ghz"])
    p.add_argument("--bw-gbps", type=float, default=M40["bw_gbps"])
    p.add_argument("--ptx", default="", help="library with the compute_52 PTX (default: LIB)")
    p.add_argument("--no-h100", action="store_true", help="skip the H100 cross-check")
    args = p.parse_args()
    lib = args.lib
    if os.path.isdir(lib):
        lib = os.path.join(lib, "libm40llm.a")
    M40["clock_ghz"], M40["bw_gbps"] = args.clock_ghz, args.bw_gbps
    args.lib_shown = os.path.basename(lib)
    try:
        v = subprocess.run(["cuobjdump", "--version"], capture_output=True, text=True).stdout
        args.nvcc = "CUDA " + re.search(r"release ([\d.]+)", v).group(1)
    except (OSError, AttributeError):
        args.nvcc = "CUDA ?"
    m40k = kernels_of(lib, "sm_52")
    if not m40k:
        sys.exit(f"m40_model: no sm_52 attn_fp32_kernel in {lib} (CMAKE_CUDA_ARCHITECTURES must include 52-real)")
    h100k, h100rows, eff, effs = {}, [], None, []
    if not args.no_h100:
        h100k = sm90_kernels_from_ptx(args.ptx or lib) or {}
        if h100k:
            h100rows = model_all(h100k, H100, SHAPES, mixed=False)
            eff, effs = issue_efficiency(h100rows)
        else:
            print("m40_model: no compute_52 PTX (52-virtual) in the library: no H100 cross-check", file=sys.stderr)
    m40rows = model_all(m40k, M40, SHAPES)
    variants = [(f"{M40['bw_gbps']:.0f} GB/s", m40rows),
                (f"{0.8 * M40['bw_gbps']:.0f} GB/s", model_all(m40k, dict(M40, bw_gbps=0.8 * M40["bw_gbps"]), SHAPES))]
    if eff:
        variants.append((f"{M40['bw_gbps']:.0f} GB/s, x{eff:.2f} issue", model_all(m40k, M40, SHAPES, eff)))
    md = report(args, m40k, m40rows, variants, h100k, h100rows, eff, effs)
    with open(args.md, "w") as f:
        f.write(md)
    if args.json:
        def clean(o):
            if isinstance(o, dict):
                return {str(k): clean(v) for k, v in o.items()}
            if isinstance(o, (list, tuple)):
                return [clean(v) for v in o]
            return o
        with open(args.json, "w") as f:
            json.dump(clean(dict(m40=m40k, m40_shapes=m40rows, variants=variants, h100=h100k,
                                 h100_shapes=h100rows, h100_issue_efficiency=eff)), f, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
