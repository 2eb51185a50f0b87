#!/usr/bin/env python3
"""Reads a compute-sanitizer racecheck report and fails on its hazards, except, with
--pair-barriers-unjudged, those whose every access is in a tensor-core split kernel that splits
head_dim between pairs of warps (attn_mma_kernel at head_dims over 128, which exchange scores
at barriers of two warps): racecheck reports races across the __syncthreads() that follows such
barriers where there are none, as pair_barrier_probe.cu shows. gpu_check.sh's sanitize step
passes the flag only where the probe is flagged, so a fixed tool judges those kernels again.
A report it cannot read whole (no summary, hazards not printed, a format it does not parse)
fails.

  hazards.py REPORT [--pair-barriers-unjudged]
"""
import re
import sys

# attn_mma_kernel<KvPair<..>, NC, TAIL, V, W>: head_dim 32 NC + 16 TAIL
MMA = re.compile(r"attn_mma_kernel<KvPair<[^>]*>, \(int\)(\d+), \(int\)(\d+),")
# an access's kernel: "Write access at <kernel>+0x..", or "Write Thread (..) at 0x.. in <kernel>"
KERNEL = re.compile(r"(?:access at|at 0x[0-9a-fA-F]+ in) (?:void )?(?:<unnamed>::)?([A-Za-z_]\w*)")


def split_dims(text):
    """Whether every kernel the hazard names is a split-dims attn_mma_kernel."""
    heads = [32 * int(nc) + 16 * int(tail) for nc, tail in MMA.findall(text)]
    names = KERNEL.findall(text)
    return bool(heads) and all(h > 128 for h in heads) and len(heads) == len(names)


def hazards(lines):
    """The report's hazards, each as its lines of text."""
    out, cur = [], None
    for line in lines:
        if re.search(r"Race reported|Potential \w+ hazard", line):
            if cur:
                out.append("".join(cur))
            cur = [line]
        elif cur is not None:
            if line.strip() in ("=========", ""):
                out.append("".join(cur))
                cur = None
            else:
                cur.append(line)
    if cur:
        out.append("".join(cur))
    return out


SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def summary_problem(text, found):
    """Why the report cannot be judged by its printed hazards, or None: no summary (the run
    ended early), more hazards than it printed, or printed ones this parser did not see."""
    sums = SUMMARY.findall(text)
    if not sums:
        return "no RACECHECK SUMMARY: the run did not finish"
    shown = sum(int(d) for d, _, _ in sums)
    total = sum(int(e) + int(w) for _, e, w in sums)
    if total > shown:
        return f"{total} hazards, {shown} printed: run with a larger --print-limit"
    if shown != len(found):
        return f"{shown} hazards printed, {len(found)} read: the report's format is not this parser's"
    return None


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    unjudged_ok = "--pair-barriers-unjudged" in sys.argv[2:]
    with open(sys.argv[1], errors="replace") as f:
        text = f.read()
    found = hazards(text.splitlines(keepends=True))
    problem = summary_problem(text, found)
    if problem:
        print(f"racecheck: {problem}")
        return 1
    unjudged = [h for h in found if unjudged_ok and split_dims(h)]
    judged = [h for h in found if not (unjudged_ok and split_dims(h))]
    print(f"racecheck: {len(found)} hazards reported, {len(judged)} judged"
          + (f", {len(unjudged)} in split-dims tensor-core kernels not judged (the tool "
             "flags pair_barrier_probe.cu)" if unjudged_ok else ""))
    for h in judged[:5]:
        print(h, end="")
    return 1 if judged else 0


if __name__ == "__main__":
    sys.exit(main())
