// A BN-threshold neuron's step as one C++ autograd node: the kernels of mfpsn_cpu.cpp (bn_forward,
// bn_backward) behind a torch operator, spikingjelly_mfpsn_cpu::bn_fire_f32 (or _f64), compiled against
// the installed torch's headers. The same node as the Python autograd Function _CppBNFire of cpp_ops.py,
// which calls the same kernels through ctypes: this one saves that Function's Python work on every
// training step (about 30 us per call on a 2-core x86-64 CPU), and runs where it builds.
//
// bn_fire(x, weight, gamma, beta, running_mean?, running_var?, given_mean?, given_var?, eps, ste,
//         dilation, time_last, kind, alpha, factor) -> [spikes, mean, var], or [spikes] with given
//         statistics; [] where it cannot run them (nothing written, nothing updated): arguments it does not
//         take (see runnable: it checks every tensor itself, so a caller may pass anything) or a folding
//         the kernel refused (NaN or inf). The caller then takes its general path, which reports them.
#include "mfpsn_cpu.cpp"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Geometry geometry_of(const Tensor& x, int64_t K, int64_t d, bool time_last) {
    int64_t F = 1;
    const int64_t first = time_last ? 2 : 3, end = time_last ? x.dim() - 1 : x.dim();
    for (int64_t i = first; i < end; ++i) F *= x.size(i);
    return geometry(time_last ? x.size(-1) : x.size(0), time_last ? x.size(0) : x.size(1), x.size(time_last ? 1 : 2),
                    F, int(K), int(d), time_last);
}

template <typename S>
S* ptr(const c10::optional<Tensor>& t) {
    return t && t->defined() ? t->data_ptr<S>() : nullptr;
}

template <typename S>
struct BNFire : public torch::autograd::Function<BNFire<S>> {
    static variable_list forward(AutogradContext* ctx, Tensor x, Tensor w, Tensor gamma, Tensor beta,
                                 c10::optional<Tensor> running_mean, c10::optional<Tensor> running_var,
                                 c10::optional<Tensor> given_mean, c10::optional<Tensor> given_var, double eps,
                                 int64_t ste, int64_t d, bool time_last, int64_t kind, double alpha, double factor) {
        const Geometry g = geometry_of(x, w.size(1), d, time_last);
        const int64_t C = w.size(0);
        const bool given = given_mean.has_value();
        Tensor out = at::empty_like(x), wq = at::empty_like(w), b = at::empty({C}, w.options());
        Tensor mean = given ? *given_mean : at::empty({C}, w.options());
        Tensor var = given ? *given_var : at::empty({C}, w.options());
        S* rm = ptr<S>(running_mean);
        int refused = 0;
#define MFPSN_NODE_FWD(KT, KP)                                                                                  \
    refused = bn_forward<S, KT>(g, KP, x.data_ptr<S>(), w.data_ptr<S>(), gamma.data_ptr<S>(), beta.data_ptr<S>(), \
                                eps, ste != 0, given, out.data_ptr<S>(), mean.data_ptr<S>(), var.data_ptr<S>(),   \
                                wq.data_ptr<S>(), b.data_ptr<S>(), rm, ptr<S>(running_var), factor,               \
                                at::get_num_threads())
        MFPSN_DISPATCH_K(g.taps(), MFPSN_NODE_FWD)
#undef MFPSN_NODE_FWD
        if (refused) return {};
        if (rm) {  // written through raw pointers: let autograd know, as an in-place op would
            running_mean->unsafeGetTensorImpl()->bump_version();
            running_var->unsafeGetTensorImpl()->bump_version();
        }
        ctx->save_for_backward({x, w, gamma, mean, var});
        ctx->saved_data["wq"] = wq;
        ctx->saved_data["b"] = b;
        ctx->saved_data["cfg"] = std::vector<double>{eps, double(ste), double(d), double(time_last), double(kind),
                                                     alpha, double(given)};
        if (given) return {out};
        ctx->mark_non_differentiable({mean, var});
        ctx->set_materialize_grads(false);  // no zero tensors for mean and var (only the spikes carry a gradient)
        return {out, mean, var};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        TORCH_CHECK(!at::GradMode::is_enabled(),
                    "backend 'cpp' computes first-order gradients only, and this backward runs with "
                    "create_graph=True (a double backward); use a torch method for it, e.g. method='shift_add' "
                    "(the same results and first-order gradients)");
        const auto saved = ctx->get_saved_variables();
        const Tensor &x = saved[0], &w = saved[1], &gamma = saved[2], &mean = saved[3], &var = saved[4];
        const Tensor wq = ctx->saved_data["wq"].toTensor(), b = ctx->saved_data["b"].toTensor();
        const std::vector<double> cfg = ctx->saved_data["cfg"].toDoubleVector();
        const Geometry g = geometry_of(x, w.size(1), int64_t(cfg[2]), cfg[3] != 0.0);
        const Tensor grad = grads[0].defined() ? grads[0].to(x.scalar_type()).contiguous() : at::zeros_like(x);
        Tensor gx = ctx->needs_input_grad(0) ? at::empty_like(x) : Tensor();
        Tensor g_w = at::empty_like(w), g_gamma = at::empty_like(gamma), g_beta = at::empty_like(gamma);
#define MFPSN_NODE_BWD(KT, KP)                                                                                   \
    bn_backward<S, KT>(g, KP, x.data_ptr<S>(), w.data_ptr<S>(), gamma.data_ptr<S>(), mean.data_ptr<S>(),         \
                       var.data_ptr<S>(), wq.data_ptr<S>(), b.data_ptr<S>(), grad.data_ptr<S>(), int(cfg[4]),     \
                       S(cfg[5]), cfg[0], int(cfg[1]), int(cfg[6]), gx.defined() ? gx.data_ptr<S>() : nullptr, \
                       g_w.data_ptr<S>(), g_gamma.data_ptr<S>(), g_beta.data_ptr<S>(), at::get_num_threads())
        MFPSN_DISPATCH_K(g.taps(), MFPSN_NODE_BWD)
#undef MFPSN_NODE_BWD
        const Tensor none;
        return {gx, g_w, g_gamma, g_beta, none, none, none, none, none, none, none, none, none, none, none};
    }
};

// Whether the node runs these arguments: x (T, N, C, ...) or time-last (N, C, ..., T) with 0-3 feature
// dims, not empty; weight (C, K >= 1) with x's C; gamma, beta and the statistics given or updated of
// shape (C,) and contiguous (read and written through raw pointers); all on the CPU, of dtype S; an
// order, surrogate and quantiser it knows.
template <typename S>
bool runnable(const Tensor& x, const Tensor& w, const Tensor& gamma, const Tensor& beta,
              const c10::optional<Tensor>& running_mean, const c10::optional<Tensor>& running_var,
              const c10::optional<Tensor>& given_mean, const c10::optional<Tensor>& given_var, double eps,
              int64_t ste, int64_t d, bool time_last, int64_t kind) {
    const auto dtype = c10::CppTypeToScalarType<S>::value;
    const auto on_cpu = [&](const Tensor& t) { return t.defined() && t.device().is_cpu() && t.scalar_type() == dtype; };
    if (!on_cpu(x) || x.dim() < 3 || x.dim() > 6 || x.numel() == 0) return false;
    if (!on_cpu(w) || w.dim() != 2 || w.size(1) < 1 || w.size(0) != x.size(time_last ? 1 : 2)) return false;
    const int64_t C = w.size(0);
    const auto per_channel = [&](const Tensor& t) { return on_cpu(t) && t.dim() == 1 && t.size(0) == C && t.is_contiguous(); };
    const auto optional = [&](const c10::optional<Tensor>& a, const c10::optional<Tensor>& b) {
        return a.has_value() == b.has_value() && (!a || (per_channel(*a) && per_channel(*b)));
    };
    return per_channel(gamma) && per_channel(beta) && optional(running_mean, running_var) &&
           optional(given_mean, given_var) && eps > 0 && d >= 1 && ste >= 0 && ste <= 2 && (kind == MODE_ATAN || kind == MODE_SIGMOID);
}

template <typename S>
std::vector<Tensor> bn_fire(const Tensor& x, const Tensor& w, const Tensor& gamma, const Tensor& beta,
                            const c10::optional<Tensor>& running_mean, const c10::optional<Tensor>& running_var,
                            const c10::optional<Tensor>& given_mean, const c10::optional<Tensor>& given_var,
                            double eps, int64_t ste, int64_t d, bool time_last, int64_t kind, double alpha,
                            double factor) {
    if (!runnable<S>(x, w, gamma, beta, running_mean, running_var, given_mean, given_var, eps, ste, d, time_last,
                     kind))
        return {};
    return BNFire<S>::apply(x.contiguous(), w.contiguous(), gamma, beta, running_mean, running_var, given_mean,
                            given_var, eps, ste, d, time_last, kind, alpha, factor);
}

}  // namespace

#define MFPSN_NODE_SCHEMA(suffix)                                                                              \
    "bn_fire_" #suffix "(Tensor x, Tensor weight, Tensor gamma, Tensor beta, Tensor(a!)? running_mean, "       \
    "Tensor(b!)? running_var, Tensor? given_mean, Tensor? given_var, float eps, int ste, int dilation, "       \
    "bool time_last, int kind, float alpha, float factor) -> Tensor[]"

TORCH_LIBRARY_FRAGMENT(spikingjelly_mfpsn_cpu, m) {
#ifndef MFPSN_ONLY_F64
    m.def(MFPSN_NODE_SCHEMA(f32), torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, &bn_fire<float>));
#endif
#ifndef MFPSN_ONLY_F32
    m.def(MFPSN_NODE_SCHEMA(f64), torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, &bn_fire<double>));
#endif
}
