"""CPU seconds to simulate 1,000-request traces on a measured cost model (1P:2D, ratio)."""
import json, sys, time
from planner.profiles import load_cost_model
from planner.sim import Layout, WorkerSpec, simulate
from planner.traces import from_workload
from router.config import RouterConfig
cost = load_cost_model(sys.argv[1])
for name, rate in (("chat", 4.0), ("prompt-heavy", 0.5), ("mixed", 2.0), ("decode-heavy", 1.0)):
    tr = from_workload(name, 1000, rate, 0)
    t0 = time.process_time()
    r = simulate(tr, cost, Layout(1, 2), WorkerSpec(20000, max_num_seqs=256), RouterConfig(policy="ratio"))
    print(f"{name}: {time.process_time() - t0:.2f} s CPU, {r.decode_steps} decode steps")
