"""Prompt-heavy (1024/16) with 40 requests per rate (a TTFT p99 that is not just the worst of 12),
graded by the report's prompt-heavy SLO, pdserve told it.
Usage (from the repository): .venv/bin/python THIS OUT_DIR 0.3,0.6 vllm,ratio"""
import argparse
import sys
from pathlib import Path

from pdserve.bench.serving import Slo, Workload, add_arguments, bench_server, resolve_model_and_dtype

p = argparse.ArgumentParser()
add_arguments(p)
args = p.parse_args(["--num-requests", "40"])
resolve_model_and_dtype(args)
out = Path(sys.argv[1])
slos = {"prompt-heavy": Slo(1.6732995200000005, 0.03585812835008255, "the report's prompt-heavy SLO (told run, 2026-12-05)")}
w = Workload("prompt-heavy", ((1024, 16),), tuple(float(x) for x in sys.argv[2].split(",")))
for kind in sys.argv[3].split(","):
    bench_server(kind, [w], args, out, slos)
