"""Mixed load past the knee: servers (e.g. vllm,ratio,single) at higher rates, graded by the report's mixed SLO.
Usage (from the repository): .venv/bin/python THIS OUT_DIR 1.2,1.6 vllm,ratio,single,fixed,colocated"""
import argparse, sys
from pathlib import Path
from pdserve.bench.serving import Slo, Workload, add_arguments, bench_server, resolve_model_and_dtype
p = argparse.ArgumentParser(); add_arguments(p)
args = p.parse_args(["--num-requests", "16"])
resolve_model_and_dtype(args)
out = Path(sys.argv[1])
slos = {"mixed": Slo(1.6230465240005287, 0.03413168904990016, "the report's mixed SLO (told run, 2026-12-05)")}
w = Workload("mixed", ((1024, 16), (128, 128)), tuple(float(x) for x in sys.argv[2].split(",")))
for kind in sys.argv[3].split(","):
    bench_server(kind, [w], args, out, slos)
