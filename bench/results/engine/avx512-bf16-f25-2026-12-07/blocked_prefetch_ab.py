"""The blocked linear kernel before and after (tag=path[:extra -D flag]), on cold weights, alternating pass by pass:
bf16 (AB_DTYPE=bf16, the default) or the fp32 kernel of the builds with AVX-512, 16 columns a block (AB_DTYPE=f32)."""
import ctypes, os, subprocess, sys, time, statistics, torch
sys.path.insert(0, '.')  # run from the repository root
from engine import kernels
torch.set_num_threads(2)
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=fast", "-fassociative-math",
         "-fno-signed-zeros", "-fno-trapping-math", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mavx512bf16", "-mavx2", "-mfma", "-mf16c"]
def build(spec, tag):
    src, *defs = spec.split(":")
    out = f"/tmp/lx/{tag}.so"
    subprocess.check_call(["gcc", *FLAGS, *defs, src, "-o", out, "-lm"])
    return ctypes.CDLL(out)
DT, ENTRY, PAIR = ((torch.float32, "pdserve_linear_f32_blocked", 1) if os.environ.get("AB_DTYPE") == "f32" else
                   (torch.bfloat16, "pdserve_linear_bf16_blocked", 2))
libs = {tag: build(spec, tag) for tag, spec in (a.split("=", 1) for a in sys.argv[1:])}
shapes = [(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
g = torch.Generator().manual_seed(0)
W = [[kernels.block_weight(torch.randn(n, k, generator=g).to(DT), (16, PAIR)) for n, k in shapes] for _ in range(30)]
lm = kernels.block_weight(torch.randn(49152, 576, generator=g).to(DT), (16, PAIR))
p = ctypes.c_void_p
def stepper(lib, M):
    f = getattr(lib, ENTRY)
    gx = torch.Generator().manual_seed(M)
    xs = {k: torch.randn(M, k, generator=gx).to(DT) for k in (576, 1536)}
    ys = {n: torch.empty(M, n, dtype=DT) for n in (192, 576, 1536, 49152)}
    def step():
        for layer in W:
            for (n, k), w in zip(shapes, layer):
                f(p(xs[k].data_ptr()), p(w.data_ptr()), None, p(ys[n].data_ptr()), M, n, k, 2)
        f(p(xs[576].data_ptr()), p(lm.data_ptr()), None, p(ys[49152].data_ptr()), M, 49152, 576, 2)
    return step, ys
outs = {}
for M in (1, 4, 8, 16, 32, 64):
    steps = {tag: stepper(lib, M) for tag, lib in libs.items()}
    for tag, (st, ys) in steps.items():  # the builds agree bit for bit
        st(); outs[tag] = ys[49152].clone()
    ref = next(iter(outs.values()))
    assert all(torch.equal(ref, o) for o in outs.values()), "builds disagree"
    ts = {tag: [] for tag in libs}
    for i in range(25):
        for tag, (st, _) in steps.items():
            t = time.perf_counter(); st(); ts[tag].append(time.perf_counter() - t)
    print(f"M={M:2d} " + "  ".join(f"{tag}: median {statistics.median(v)*1e3:6.2f} p10 {sorted(v)[2]*1e3:6.2f} ms" for tag, v in ts.items()), flush=True)
