"""`pdserve plan --validate` against a running server: the trace is replayed through the load generator,
simulated on the server's own cost model and layout, and both sides are written, each request shape
of a mix apart."""
from __future__ import annotations

import json
import subprocess
import sys


def test_validate_replays_a_mix_and_compares_each_shape(server, tmp_path):
    out = tmp_path / "validate.json"
    res = subprocess.run([sys.executable, "-m", "pdserve", "plan", "--validate", server.http,
                          "--trace", "mix:48:6,16:12", "--rate", "4", "--num-requests", "8",
                          "--ttft-target", "30", "--tpot-target", "5", "--out", str(out)],
                         check=False, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["measured"]["ok"] == doc["simulated"]["ok"] == 8
    assert doc["measured"]["good_fraction"] == 1.0  # targets no run on this server misses
    shapes = {(c["prompt_tokens"], c["output_tokens"]): c for c in doc["by_class"]}
    assert set(shapes) == {(48, 6), (16, 12)}
    assert all(c["measured"]["ok"] == c["simulated"]["ok"] == 4 for c in shapes.values())
    assert all(c["measured"]["tpot_p50_s"] > 0 and c["simulated"]["tpot_p50_s"] > 0 for c in shapes.values())
    assert "by request shape" in res.stdout and "  48/6 TPOT p50" in res.stdout
    # each request of both runs, in trace order: the simulated one beside the one the client measured
    sim, meas = doc["requests"]["simulated"], doc["requests"]["measured"]
    assert [r["index"] for r in sim] == [r["index"] for r in meas] == list(range(8))
    assert [(r["prompt_tokens"], r["requested_output_tokens"]) for r in sim] == \
        [(r["prompt_tokens"], r["requested_output_tokens"]) for r in meas]
    assert all(r["error"] is None and r["ttft_s"] > 0 and len(r["chunk_times_s"]) >= 2 for r in meas)
    assert all(r["timings"]["path"] in ("local", "remote") for r in sim)
