#!/usr/bin/env python3
"""Checks hazards.py on reports in racecheck's two formats: a split-dims kernel's hazards pass
only when not judged, any other kernel's fail, a clean report passes, and a report that is not
whole (no summary, hazards not printed or not read) fails. No GPU."""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MMA = "void <unnamed>::attn_mma_kernel<KvPair<KvQ8, KvQ8>, (int){}, (int)0, (int)0, (int)4>(AttnArgs, m40llm_attn_plan)"
RACE = ("========= Error: Race reported between Write access at {a}+0x58b0\n"
        "=========     and Read access at {b}+0x59c0 [64 hazards]\n"
        "=========     and Write access at {b}+0x58d0 [64 hazards]\n=========\n")
OLD = ("========= ERROR: Potential WAW hazard detected at __shared__ 0x10 in block (0,0,0) :\n"
       "=========     Write Thread (0,0,0) at 0x00000120 in {a}\n"
       "=========     Write Thread (32,0,0) at 0x00000140 in {b}\n=========\n")
SUMMARY = "========= RACECHECK SUMMARY: {} hazards displayed ({} errors, 0 warnings)\n"


def rc(report, *flags, shown=None, errors=None, summary=True):
    """hazards.py's exit code on report, its summary counting the report's hazards unless
    told otherwise."""
    n = report.count("Race reported") + report.count("Potential")
    tail = SUMMARY.format(n if shown is None else shown, n if errors is None else errors)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("========= COMPUTE-SANITIZER\n" + report + (tail if summary else ""))
    try:
        return subprocess.run([sys.executable, os.path.join(HERE, "hazards.py"), f.name, *flags],
                              stdout=subprocess.DEVNULL).returncode
    finally:
        os.unlink(f.name)


def main():
    d256, d128 = MMA.format(8), MMA.format(4)
    other = "void <unnamed>::attn_fp32_kernel<KvPair<KvF16, KvF16>, (int)4>(AttnArgs, m40llm_attn_plan)"
    cases = [
        ("clean", "", [], 0),
        ("split dims, judged", RACE.format(a=d256, b=d256), [], 1),
        ("split dims, not judged", RACE.format(a=d256, b=d256), ["--pair-barriers-unjudged"], 0),
        ("head_dim 128", RACE.format(a=d128, b=d128), ["--pair-barriers-unjudged"], 1),
        ("one access elsewhere", RACE.format(a=d256, b=other), ["--pair-barriers-unjudged"], 1),
        ("split dims then another", RACE.format(a=d256, b=d256) + RACE.format(a=other, b=other),
         ["--pair-barriers-unjudged"], 1),
        ("old format, split dims", OLD.format(a=d256, b=d256), ["--pair-barriers-unjudged"], 0),
        ("old format, elsewhere", OLD.format(a=other, b=other), ["--pair-barriers-unjudged"], 1),
    ]
    split = RACE.format(a=d256, b=d256)
    cases += [
        ("no summary", split, ["--pair-barriers-unjudged", {"summary": False}], 1),
        ("clean, no summary", "", [{"summary": False}], 1),
        ("hazards not printed", split, ["--pair-barriers-unjudged", {"errors": 9}], 1),
        ("hazards printed, not read", split, ["--pair-barriers-unjudged", {"shown": 2}], 1),
    ]
    bad = []
    for name, text, flags, want in cases:
        opts = next((f for f in flags if isinstance(f, dict)), {})
        got = rc(text, *[f for f in flags if isinstance(f, str)], **opts)
        if got != want:
            bad.append((name, want, got))
    for name, want, got in bad:
        print(f"test_hazards: {name}: exit {got}, want {want}")
    print(f"test_hazards: {len(cases) - len(bad)} of {len(cases)} cases pass")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
