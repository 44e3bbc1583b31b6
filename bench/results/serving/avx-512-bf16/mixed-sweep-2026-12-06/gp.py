import json, sys, glob
from loadtest.metrics import summarize
from loadtest.records import RequestRecord
T, P = float(sys.argv[1]), float(sys.argv[2])
rows = {}
for f in sorted(glob.glob(sys.argv[3] + "/*--mixed.json")):
    k = f.split("/")[-1].split("--")[0]
    d = json.load(open(f))
    for run in d["runs"]:
        recs = [RequestRecord.from_dict(r) for r in run["records"]]
        s = summarize(recs, run["summary"]["wall_time_s"], T, P)
        rows.setdefault(run["config"]["rate"], {})[k] = (s['goodput']['requests_per_s'], s['goodput']['fraction'], s['itl_s']['p99'], s['itl_s']['max'])
for rate, r in sorted(rows.items()):
    print(rate, "  ".join(f"{k} {g:.3f} ({100*fr:.0f}%) p99 {p:.3f} max {m:.2f}" for k, (g, fr, p, m) in r.items()))
    if "ratio" in r:
        best = max((g for k, (g, *_ ) in r.items() if k != "ratio"), default=None)
        if best: print("   ratio / best other:", f"{r['ratio'][0] / best:.2f}")
