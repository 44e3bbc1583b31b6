"""Saturated decode (closed loop of 12, 128/128, 36 measured after a wave of 12), pdserve `ratio` and `single`
and vLLM-CPU with its preloads (`peer_preloads`), alternating, two rounds, on the servers `pdserve bench report`
starts."""
import argparse, json, subprocess, sys
from pathlib import Path
from pdserve.bench.serving import add_arguments, resolve_model_and_dtype, served

p = argparse.ArgumentParser(); add_arguments(p); args = p.parse_args([])
resolve_model_and_dtype(args)
out = Path(sys.argv[1])
for i in (1, 2):
    for kind in ("vllm", "single", "ratio"):
        with served(kind, args, out, log_name=f"{kind}-{i}") as (base, _):
            res = out / f"{kind}-{i}.json"
            subprocess.run([sys.executable, "-m", "pdserve", "bench", "serve", "--target", base, "--workload",
                            "fixed:128:128", "--concurrency", "12", "--num-requests", "36", "--num-warmups", "12",
                            "--no-progress", "--model", "model", "--out", str(res)], check=True,
                           stdout=subprocess.DEVNULL)
            s = json.loads(res.read_text())["runs"][0]["summary"]
            print(kind, i, round(s["throughput"]["output_tokens_per_s"], 1), "ITL p50",
                  round(s["itl_s"]["p50"] * 1000, 1), flush=True)
