"""Each request of a `pdserve plan --validate --out` run: simulated vs measured TPOT, and the client's gaps
over 60 ms (steps that carried a prompt chunk). Usage: .venv/bin/python requests.py 0p1d/mixed.json"""
import json
import statistics
import sys

doc = json.load(open(sys.argv[1]))["requests"]
print(f"{'req':>3} {'arrival s':>9} {'shape':>9} {'TPOT sim':>9} {'TPOT meas':>9} {'gaps>60ms':>9} {'their s':>7} {'median gap ms':>13}")
for s, m in zip(doc["simulated"], doc["measured"]):
    if m["error"] or m["output_tokens"] < 2:
        continue
    tpot = lambda r: (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) * 1e3
    t = m["chunk_times_s"]
    gaps = [b - a for a, b in zip(t, t[1:])]
    big = [g for g in gaps if g > 0.06]
    print(f"{m['index']:>3} {s['start_s']:>9.1f} {m['prompt_tokens']:>4}/{m['requested_output_tokens']:<4} "
          f"{tpot(s):>9.1f} {tpot(m):>9.1f} {len(big):>9} {sum(big):>7.2f} {statistics.median(gaps) * 1e3:>13.1f}")
