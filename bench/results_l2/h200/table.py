# The table of a directory of this run's benches (first/ or variants/): µs a call (the faster of
# rounds r1 and r2) of main (base) and each build's time over base's, per shape.
#   python3 table.py DIR
import glob, json, os, sys

d = sys.argv[1]
cfgs = sorted({os.path.basename(p)[3:-5] for p in glob.glob(f"{d}/r1_*.json")},
              key=lambda c: (c != "base", c))


def times(c):
    out = {}
    for r in (1, 2):
        for s in json.load(open(f"{d}/r{r}_{c}.json"))["shapes"]:
            k = (s["batch"], s["n_heads"], s["n_kv_heads"], s["head_dim"], s["ctx"])
            assert s["check"] == "pass", (c, k)
            out[k] = min(out.get(k, 1e30), s["time_us"])
    return out


t = {c: times(c) for c in cfgs}
print("| shape | base µs | " + " | ".join(cfgs[1:]) + " |")
print("|---" * (len(cfgs) + 1) + "|")
for k in t["base"]:
    print(f"| B{k[0]} {k[1]}/{k[2]} D{k[3]} L{k[4]} | {t['base'][k]:.2f} | " +
          " | ".join(f"{t[c][k] / t['base'][k]:.3f}" for c in cfgs[1:]) + " |")
