"""python cmp.py A.json A_WORK B.json B_WORK: differences of two pipeline digests, work dirs and loopback ports
normalised; the RNG states of Python / NumPy (seeded by nothing flowforge sets) are not compared."""
import json, re, sys
def load(p, work):
    return json.loads(re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:<port>", open(p).read().replace(work, "<work>")))
a = load(sys.argv[1], sys.argv[2]); b = load(sys.argv[3], sys.argv[4])
out = []
def walk(x, y, path):
    if len(path) > 2 and str(path[1]).endswith("rng/rank_0.json") and path[2] in ("python", "numpy"): return
    if path and path[-1] == "config_fingerprint": return  # a hash of the config, which holds the work dir
    if type(x) != type(y): out.append(("TYPE", path)); return
    if isinstance(x, dict):
        for k in sorted(set(x) | set(y)):
            if k not in x or k not in y: out.append(("KEY", path, k, k in x, k in y)); continue
            walk(x[k], y[k], path + [k])
    elif isinstance(x, list):
        if len(x) != len(y): out.append(("LEN", path, len(x), len(y)))
        for i, (u, v) in enumerate(zip(x, y)): walk(u, v, path + [i])
    elif x != y: out.append(("DIFF", path, x, y))
walk(a, b, [])
for o in out: print(*[str(v)[:300] for v in o])
def count(d):
    if isinstance(d, dict): return sum(count(v) for v in d.values())
    if isinstance(d, list): return sum(count(v) for v in d)
    return 1
print("compared", {k: count(a[k]) for k in a}, "leaf values;", len(out), "differences")
