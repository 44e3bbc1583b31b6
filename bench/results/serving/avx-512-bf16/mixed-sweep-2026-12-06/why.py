import json, sys
from loadtest.records import RequestRecord
from loadtest.metrics import request_tpot
T, P = float(sys.argv[2]), float(sys.argv[3])
for f in sys.argv[4:]:
    d = json.load(open(f))
    for run in d["runs"]:
        if run["config"]["mode"] != "open": continue
        recs = [RequestRecord.from_dict(r) for r in run["records"]]
        out = {}
        for r in recs:
            shape = r.prompt_tokens > 500 and "long" or "short"
            tp = request_tpot(r)
            bad = ("T" if (r.ttft_s or 99) > T else "") + ("P" if tp is not None and tp > P else "")
            out.setdefault(shape, []).append(bad or ".")
        print(f.split("/")[-1], run["config"]["rate"], {k: "".join(v) for k, v in out.items()})
