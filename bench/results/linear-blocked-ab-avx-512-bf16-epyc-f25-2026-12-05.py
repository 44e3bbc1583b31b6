"""A/B in one process: the old auto linear split (packed down/gate/up/lm_head, kernel q/k/v/o) vs the new
auto (which may pick blocked), compiled bf16, 2 threads. Decode steps at fixed batches (alternating windows)
and a closed loop of 12 in flight of 128/128 (alternating passes)."""
import json, logging, random, statistics, sys, time
import torch
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, hardware, packed_linear
from engine.auto_dtype import load_for
logging.basicConfig(level=logging.INFO, format="%(message)s")
logging.getLogger("torch").setLevel(logging.WARNING)
MODEL = "/root/.cache/pdserve/models/SmolLM2-135M-Instruct"
torch.set_num_threads(2)
OLD = hardware.LinearChoice(frozenset({"down_proj 576x1536", "gate_proj 1536x576", "lm_head 49152x576", "up_proj 1536x576"}),
                            "old auto", kernel=frozenset({"k_proj 192x576", "o_proj 576x576", "q_proj 576x576", "v_proj 192x576"}))
engines = {}
for name in ("old", "new"):
    model, tok, _ = load_for("bfloat16", MODEL, "cpu")
    if name == "old":
        packed_linear.pack(model, OLD)
    cfg = EngineConfig(model=MODEL, dtype="bfloat16", num_threads=2, compile=True, linear="auto",
                       cache=CacheConfig(memory_gib=1.0, enable_prefix_caching=False))
    engines[name] = LLMEngine(cfg, model=model, tokenizer=tok)
    print(name, engines[name].describe()["linear"], flush=True)
rng = random.Random(0)
V = engines["old"].vocab_size
def prompt(n): return [rng.randrange(100, V) for _ in range(n)]
res = {"choice": {k: e.describe()["linear"] for k, e in engines.items()}, "reason": engines["new"].linear_choice.reason}
# fixed batches
steps, reps = 6, 5
for batch in [int(b) for b in sys.argv[1].split(",")]:
    prompts = [prompt(200) for _ in range(batch)]
    held = {}
    for s, eng in engines.items():
        held[s] = [eng.add_request(p, SamplingParams(max_tokens=steps * reps + 8, ignore_eos=True)) for p in prompts]
        while eng.scheduler.has_prefill_work():
            eng.step()
        eng.step()
    times = {s: [] for s in engines}
    for _ in range(reps):
        for s, eng in engines.items():
            for _ in range(steps):
                t0 = time.perf_counter(); eng.step(); times[s].append(time.perf_counter() - t0)
    for s, eng in engines.items():
        for r in held[s]: eng.abort(r)
        while eng.has_unfinished(): eng.step()
    med = {s: statistics.median(v) for s, v in times.items()}
    res.setdefault("step_ms", {})[batch] = {s: m * 1e3 for s, m in med.items()}
    print(f"batch {batch}: " + "  ".join(f"{s} {m*1e3:.1f} ms ({batch/m:.0f} tok/s)" for s, m in med.items()) + f"  new/old {med['old']/med['new']:.2f}x", flush=True)
# closed loop 12 x 128/128, 36 measured after 12 warm-up, two passes each, alternating
def closed(eng, n_meas=36, warm=12, conc=12):
    total = warm + n_meas; started = 0; done = 0; t_start = None; toks = 0
    live = set()
    def add():
        nonlocal started
        live.add(eng.add_request(prompt(128), SamplingParams(max_tokens=128, ignore_eos=True))); started += 1
    for _ in range(conc): add()
    while live:
        outs = eng.step()
        for o in outs:
            if o.finished:
                live.discard(o.request_id); done += 1
                if done == warm: t_start = time.perf_counter()
                elif done > warm: toks += len(o.output_token_ids)
                if started < total: add()
    return toks / (time.perf_counter() - t_start)
for p in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    for s, eng in engines.items():
        r = closed(eng); res.setdefault("closed_tok_s", {}).setdefault(s, []).append(r)
        print(f"closed loop pass {p} {s}: {r:.1f} tok/s", flush=True)
json.dump(res, open("/tmp/sat/ab.json", "w"), indent=1)
