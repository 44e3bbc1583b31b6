// `torch.ops.pdserve_cpu.paged_decode` and `torch.ops.pdserve_cpu.linear`: the paged decode kernel and
// the small-batch linear kernel as real torch operators, so a compiled decode step calls them through
// the dispatcher with no Python in between. One library per process; `pdserve_bind` points it at the
// loaded kernel build's entry points (see __init__.py).
// `torch.ops.pdserve_cpu.blocked_linear`: the linear kernel on a weight's blocked copy (any number of rows).
// `torch.ops.pdserve_cpu.rms_norm` and `silu_mul`: the pointwise kernels of an eager step's decoder layers.
// `torch.ops.pdserve_cpu.packed_linear`: a linear layer whose weight oneDNN holds packed (an opaque
// tensor a compiled graph cannot take as an input): the graph passes a handle, `hold_packed` gave it.
// Like the Python op it replaces, it writes the new K/V into `kv_layer` without declaring the
// mutation: a declared one would make the compiled graph copy the pool; nothing else in the graph
// reads the pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace {

using DecodeFn = void (*)(const void*, const void*, const void*, const int64_t*, void*, void*, const int64_t*,
                          const int64_t*, void*, int, int, int, int, int, int, int, float, int);
DecodeFn f32_fn = nullptr;
DecodeFn bf16_fn = nullptr;

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                        const at::Tensor& slots, const at::Tensor& kv_layer, const at::Tensor& tables,
                        const at::Tensor& ctx, double scale) {
    TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(0) == 2 && kv_layer.is_contiguous(),
                "kv_layer must be a contiguous [2, KVH, blocks, block_size, D] tensor");
    TORCH_CHECK(q.scalar_type() == kv_layer.scalar_type(), "q and kv_layer must have one dtype");
    const DecodeFn fn = q.scalar_type() == at::kFloat ? f32_fn : q.scalar_type() == at::kBFloat16 ? bf16_fn : nullptr;
    TORCH_CHECK(fn != nullptr, "no paged decode kernel bound for ", q.scalar_type());
    const int64_t b = q.size(0);
    TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && k_new.sizes() == v_new.sizes() && k_new.size(1) == b &&
                    k_new.size(0) == kv_layer.size(1) && k_new.size(2) == q.size(2) && q.size(2) == kv_layer.size(4),
                "q [B, H, D], k_new / v_new [KVH, B, D] and kv_layer [2, KVH, blocks, block_size, D] disagree");
    TORCH_CHECK(slots.numel() == b && ctx.numel() == b && tables.dim() == 2 && tables.size(0) == b,
                "slots [B], ctx [B] and tables [B, max_blocks] must match the batch");
    const at::Tensor qc = q.contiguous(), kc = k_new.contiguous(), vc = v_new.contiguous();
    const at::Tensor sc = slots.contiguous(), tc = tables.contiguous(), cc = ctx.contiguous();
    at::Tensor out = at::empty_like(qc);
    char* k_pool = static_cast<char*>(kv_layer.data_ptr());
    char* v_pool = k_pool + kv_layer.stride(0) * kv_layer.element_size();
    fn(qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), sc.data_ptr<int64_t>(), k_pool, v_pool, tc.data_ptr<int64_t>(),
       cc.data_ptr<int64_t>(), out.data_ptr(), qc.size(0), qc.size(1), kv_layer.size(1), qc.size(2), kv_layer.size(2),
       kv_layer.size(3), tc.size(1), static_cast<float>(scale), at::get_num_threads());
    return out;
}

using LinearFn = void (*)(const void*, const void*, const void*, void*, int, int, int, int);
LinearFn linear_f32_fn = nullptr, linear_bf16_fn = nullptr;
// More rows than this: torch's own linear (bound with the kernel, per dtype).
int64_t linear_f32_max_rows = 0, linear_bf16_max_rows = 0;

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    const bool f32 = x.scalar_type() == at::kFloat;
    TORCH_CHECK(f32 || x.scalar_type() == at::kBFloat16, "linear: float32 or bfloat16, got ", x.scalar_type());
    const LinearFn fn = f32 ? linear_f32_fn : linear_bf16_fn;
    TORCH_CHECK(fn != nullptr, "no ", x.scalar_type(), " linear kernel bound (fp32: a build with AVX2 + FMA; bf16: "
                "a build with AVX-512 BF16)");
    TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight must have one dtype");
    TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
                "x [..., K] and weight [N, K] disagree");
    const int64_t max_rows = f32 ? linear_f32_max_rows : linear_bf16_max_rows;
    if (x.numel() / x.size(-1) > max_rows) return at::linear(x, weight, bias);
    const at::Tensor xc = x.reshape({-1, x.size(-1)}).contiguous(), wc = weight.contiguous();
    at::Tensor bc;
    if (bias.has_value()) {
        bc = bias->contiguous();
        TORCH_CHECK(bc.scalar_type() == x.scalar_type() && bc.numel() == wc.size(0), "bias must be [N] of x's dtype");
    }
    at::Tensor out = at::empty({xc.size(0), wc.size(0)}, xc.options());
    fn(xc.data_ptr(), wc.data_ptr(), bias.has_value() ? bc.data_ptr() : nullptr, out.data_ptr(), xc.size(0), wc.size(0),
       wc.size(1), at::get_num_threads());
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = wc.size(0);
    return out.view(sizes);
}

LinearFn blocked_f32_fn = nullptr, blocked_bf16_fn = nullptr;
int64_t blocked_f32_cols = 8;  // the bound build's fp32 block columns (engine.kernels.Kernel.block_shape)

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& blocked, const std::optional<at::Tensor>& bias,
                          int64_t out_features) {
    const bool f32 = x.scalar_type() == at::kFloat;
    TORCH_CHECK(f32 || x.scalar_type() == at::kBFloat16, "blocked_linear: float32 or bfloat16, got ", x.scalar_type());
    TORCH_CHECK(blocked.scalar_type() == x.scalar_type(), "x and the blocked weight must have one dtype");
    const LinearFn fn = f32 ? blocked_f32_fn : blocked_bf16_fn;
    TORCH_CHECK(fn != nullptr, "no ", x.scalar_type(), " blocked linear kernel bound (fp32: a build with AVX2 + FMA; "
                "bf16: a build with AVX-512 BF16)");
    const int64_t k = x.size(-1);
    const int64_t cols = f32 ? blocked_f32_cols : 16, per_row = f32 ? 1 : 2;  // engine.kernels.Kernel.block_shape
    TORCH_CHECK(blocked.dim() == 4 && blocked.is_contiguous() && blocked.size(0) == (out_features + cols - 1) / cols &&
                    blocked.size(1) == (k + per_row - 1) / per_row && blocked.size(2) == cols &&
                    blocked.size(3) == per_row,
                "the blocked weight must be a contiguous [ceil(N / ", cols, "), ceil(K / ", per_row, "), ", cols, ", ",
                per_row, "] for N = out_features ", out_features, " and K = x.size(-1) ", k);
    const at::Tensor xc = x.reshape({-1, k}).contiguous();
    at::Tensor bc;
    if (bias.has_value()) {
        bc = bias->contiguous();
        TORCH_CHECK(bc.scalar_type() == x.scalar_type() && bc.numel() == out_features, "bias must be [N] of x's dtype");
    }
    at::Tensor out = at::empty({xc.size(0), out_features}, xc.options());
    fn(xc.data_ptr(), blocked.data_ptr(), bias.has_value() ? bc.data_ptr() : nullptr, out.data_ptr(), xc.size(0),
       out_features, k, at::get_num_threads());
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = out_features;
    return out.view(sizes);
}

using NormFn = void (*)(const void*, const void*, void*, int64_t, int64_t, float, int);
using SiluMulFn = void (*)(const void*, const void*, void*, int64_t, int);
NormFn norm_f32_fn = nullptr, norm_bf16_fn = nullptr;
SiluMulFn silu_mul_f32_fn = nullptr, silu_mul_bf16_fn = nullptr;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
    const bool f32 = x.scalar_type() == at::kFloat;
    const NormFn fn = f32 ? norm_f32_fn : x.scalar_type() == at::kBFloat16 ? norm_bf16_fn : nullptr;
    TORCH_CHECK(fn != nullptr, "no ", x.scalar_type(), " rms_norm kernel bound (a build with AVX2 or AVX-512)");
    const int64_t k = x.dim() > 0 ? x.size(-1) : 0;
    TORCH_CHECK(k > 0 && weight.dim() == 1 && weight.size(0) == k && weight.scalar_type() == x.scalar_type(),
                "rms_norm: weight must be [x.size(-1)] of x's dtype, got ", weight.sizes(), " for x ", x.sizes());
    const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
    at::Tensor out = at::empty_like(xc);
    fn(xc.data_ptr(), wc.data_ptr(), out.data_ptr(), xc.numel() / k, k, static_cast<float>(eps), at::get_num_threads());
    return out;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
    const bool f32 = gate.scalar_type() == at::kFloat;
    const SiluMulFn fn = f32 ? silu_mul_f32_fn : gate.scalar_type() == at::kBFloat16 ? silu_mul_bf16_fn : nullptr;
    TORCH_CHECK(fn != nullptr, "no ", gate.scalar_type(), " silu_mul kernel bound (a build with AVX2 or AVX-512)");
    TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
                "silu_mul: gate and up must have one shape and dtype, got ", gate.sizes(), " and ", up.sizes());
    const at::Tensor gc = gate.contiguous(), uc = up.contiguous();
    at::Tensor out = at::empty_like(gc);
    fn(gc.data_ptr(), uc.data_ptr(), out.data_ptr(), gc.numel(), at::get_num_threads());
    return out;
}

std::mutex packed_mu;
std::vector<at::Tensor> packed_weights;  // by handle; a dropped one is undefined

int64_t hold_packed(const at::Tensor& packed) {
    std::lock_guard<std::mutex> lock(packed_mu);
    packed_weights.push_back(packed);
    return static_cast<int64_t>(packed_weights.size()) - 1;
}

void drop_packed(int64_t handle) {
    std::lock_guard<std::mutex> lock(packed_mu);
    TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(packed_weights.size()), "no packed weight ", handle);
    packed_weights[handle] = at::Tensor();
}

int64_t held_packed() {
    std::lock_guard<std::mutex> lock(packed_mu);
    int64_t n = 0;
    for (const at::Tensor& w : packed_weights) n += w.defined();
    return n;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& handle, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
    TORCH_CHECK(handle.numel() == 1 && handle.scalar_type() == at::kLong, "handle must be one int64");
    const int64_t h = handle.item<int64_t>();
    at::Tensor w;
    {
        std::lock_guard<std::mutex> lock(packed_mu);
        TORCH_CHECK(h >= 0 && h < static_cast<int64_t>(packed_weights.size()), "no packed weight ", h);
        w = packed_weights[h];
    }
    TORCH_CHECK(w.defined(), "packed weight ", h, " was dropped");
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack;
    stack.reserve(6);
    stack.emplace_back(x.reshape({-1, x.size(-1)}).contiguous());
    stack.emplace_back(w);
    stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::List<std::optional<at::Scalar>>());
    stack.emplace_back(c10::IValue());
    op.callBoxed(&stack);
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = out_features;
    return stack[0].toTensor().view(sizes);
}

}  // namespace

extern "C" void pdserve_bind(void* f32, void* bf16, void* lin_f32, void* lin_bf16, int64_t lin_f32_max_rows,
                             int64_t lin_bf16_max_rows, void* blk_f32, void* blk_bf16, int64_t blk_f32_cols,
                             void* norm_f32, void* norm_bf16, void* silu_f32, void* silu_bf16) {
    f32_fn = reinterpret_cast<DecodeFn>(f32);
    bf16_fn = reinterpret_cast<DecodeFn>(bf16);
    linear_f32_fn = reinterpret_cast<LinearFn>(lin_f32);
    linear_bf16_fn = reinterpret_cast<LinearFn>(lin_bf16);
    linear_f32_max_rows = lin_f32_max_rows;
    linear_bf16_max_rows = lin_bf16_max_rows;
    blocked_f32_fn = reinterpret_cast<LinearFn>(blk_f32);
    blocked_bf16_fn = reinterpret_cast<LinearFn>(blk_bf16);
    blocked_f32_cols = blk_f32_cols;
    norm_f32_fn = reinterpret_cast<NormFn>(norm_f32);
    norm_bf16_fn = reinterpret_cast<NormFn>(norm_bf16);
    silu_mul_f32_fn = reinterpret_cast<SiluMulFn>(silu_f32);
    silu_mul_bf16_fn = reinterpret_cast<SiluMulFn>(silu_bf16);
}

TORCH_LIBRARY(pdserve_cpu, m) {
    m.def("paged_decode(Tensor q, Tensor k_new, Tensor v_new, Tensor slots, Tensor kv_layer, Tensor tables, "
          "Tensor ctx, float scale) -> Tensor");
    m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("packed_linear(Tensor x, Tensor handle, Tensor? bias, int out_features) -> Tensor");
    m.def("blocked_linear(Tensor x, Tensor blocked, Tensor? bias, int out_features) -> Tensor");
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
    // Catch-all kernels: the packed weight is an opaque (MKLDNN-layout) tensor.
    m.def("hold_packed(Tensor packed) -> int", &hold_packed);
    m.def("drop_packed(int handle) -> ()", &drop_packed);
    m.def("held_packed() -> int", &held_packed);
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
    m.impl("paged_decode", &paged_decode);
    m.impl("linear", &linear);
    m.impl("packed_linear", &packed_linear);
    m.impl("blocked_linear", &blocked_linear);
    m.impl("rms_norm", &rms_norm);
    m.impl("silu_mul", &silu_mul);
}
