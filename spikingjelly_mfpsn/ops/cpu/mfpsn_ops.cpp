// The fused CPU kernels of mfpsn_cpu.cpp as torch operators, torch.ops.spikingjelly_mfpsn.cpp_*, built by
// torch.utils.cpp_extension (cpp_ops.py) against the installed torch.
//
//   cpp_charge(x, weight, bias?, dilation, time_last, kind, alpha) -> H (kind 0) or the spikes (kind: a
//       surrogate's code: its gradient in the backward); differentiable (C++ autograd node, H recomputed)
//   cpp_stats(x, weight, dilation, time_last) -> (mean, biased var) of the bias-free charge; differentiable
//   cpp_bn_fire(x, weight, gamma, beta, running_mean?, running_var?, given_mean?, given_var?, eps, ste,
//       dilation, time_last, kind, alpha, factor) -> [spikes, mean, var] ([spikes] with given statistics)
//       in one autograd node; [] where it cannot run the arguments (see bn_runnable: it checks every
//       tensor, so a caller may pass anything) or the folding is not finite: nothing written, nothing
//       updated, and the caller takes its general path, which reports them
//   cpp_step_fire(taps, weight, bias?, gamma?, beta?, mean?, var?, eps, quantize) -> [spikes] of one
//       single step without gradient, or [] where it does not apply
// and the kernels behind them (cpp_charge_backward, cpp_stats_backward, cpp_bn_forward, cpp_bn_backward),
// each called through the dispatcher, so that torch.compile (with the fake kernels of cpp_ops.py) and
// dispatch modes see them. The backward nodes compute first-order gradients only.
#include "mfpsn_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace {

using namespace mfpsn;
using at::Tensor;
using c10::optional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Geometry geometry_of(const Tensor& x, const Tensor& w, int64_t d, bool time_last) {
    TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && x.scalar_type() == w.scalar_type(),
                "backend 'cpp': expected x and weight on the CPU, of one dtype");
    TORCH_CHECK(x.dim() >= 3 && x.dim() <= 6 && w.dim() == 2 && w.size(1) >= 1 && d >= 1 &&
                    w.size(0) == x.size(time_last ? 1 : 2),
                "backend 'cpp': expected x of 3-6 dims with weight (C, k >= 1) of its channels, got ", x.sizes(),
                " and ", w.sizes());
    int64_t F = 1;
    const int64_t first = time_last ? 2 : 3, end = time_last ? x.dim() - 1 : x.dim();
    for (int64_t i = first; i < end; ++i) F *= x.size(i);
    return Geometry{time_last ? x.size(-1) : x.size(0), time_last ? x.size(0) : x.size(1),
                    x.size(time_last ? 1 : 2), F, int(w.size(1)), int(d), time_last};
}

template <typename S>
S* ptr(const Tensor& t) {
    return t.defined() ? t.data_ptr<S>() : nullptr;
}

Tensor defined(const optional<Tensor>& t) { return t ? t->contiguous() : Tensor(); }

void first_order_only() {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "backend 'cpp' computes first-order gradients only, and this backward runs with "
                "create_graph=True (a double backward); use a torch method for it, e.g. method='shift_add' "
                "(the same results and first-order gradients)");
}

// An operator's handle (each call site keeps it in a static: the lookup by name runs once).
template <typename F>
c10::TypedOperatorHandle<F> op(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

// ------------------------------------------------------------------ CPU kernels
Tensor charge_cpu(const Tensor& x_, const Tensor& w_, const optional<Tensor>& b_, int64_t d, bool time_last,
                  int64_t kind, double alpha) {
    const Tensor x = x_.contiguous(), w = w_.contiguous(), b = defined(b_);
    const Geometry g = geometry_of(x, w, d, time_last);
    Tensor out = at::empty_like(x);
    if (x.numel() == 0) return out;
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "cpp_charge", [&] {
        using S = scalar_t;
        run_forward<S>(g, x.data_ptr<S>(), w.data_ptr<S>(), ptr<S>(b), out.data_ptr<S>(), kind != MODE_CHARGE, nullptr,
                       nullptr, at::get_num_threads());
    });
    return out;
}

// (dL/dX, dL/dW, dL/db); dL/dX empty unless need_gx.
std::tuple<Tensor, Tensor, Tensor> charge_backward_cpu(const Tensor& x_, const Tensor& w_, const optional<Tensor>& b_,
                                                       const Tensor& grad_, int64_t d, bool time_last, int64_t kind,
                                                       double alpha, bool need_gx) {
    const Tensor x = x_.contiguous(), w = w_.contiguous(), b = defined(b_);
    const Tensor grad = grad_.to(x.scalar_type()).contiguous();
    const Geometry g = geometry_of(x, w, d, time_last);
    Tensor gx = need_gx ? at::empty_like(x) : x.new_empty({0});
    Tensor gw = at::zeros_like(w), gb = w.new_zeros({w.size(0)});
    if (x.numel() == 0) return {need_gx ? gx.zero_() : gx, gw, gb};
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "cpp_charge_backward", [&] {
        using S = scalar_t;
        run_backward<S>(g, x.data_ptr<S>(), w.data_ptr<S>(), ptr<S>(b), grad.data_ptr<S>(), int(kind), S(alpha), nullptr,
                        nullptr, nullptr, need_gx ? gx.data_ptr<S>() : nullptr, 0, gw.data_ptr<S>(), gb.data_ptr<S>(),
                        at::get_num_threads());
    });
    return {gx, gw, gb};
}

std::tuple<Tensor, Tensor> stats_cpu(const Tensor& x_, const Tensor& w_, int64_t d, bool time_last) {
    const Tensor x = x_.contiguous(), w = w_.contiguous();
    const Geometry g = geometry_of(x, w, d, time_last);
    Tensor mean = w.new_zeros({w.size(0)}), var = w.new_zeros({w.size(0)});
    if (x.numel() == 0) return {mean, var};
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "cpp_stats", [&] {
        using S = scalar_t;
        run_forward<S>(g, x.data_ptr<S>(), w.data_ptr<S>(), nullptr, nullptr, 0, mean.data_ptr<S>(), var.data_ptr<S>(),
                       at::get_num_threads());
    });
    return {mean, var};
}

// (dL/dX, dL/dW) of the statistics: dL/dY = a[c] * Y + b[c] pushed through the charge, Y recomputed.
std::tuple<Tensor, Tensor> stats_backward_cpu(const Tensor& x_, const Tensor& w_, const Tensor& mean,
                                              const Tensor& g_mean_, const Tensor& g_var_, int64_t d, bool time_last,
                                              bool need_gx) {
    const Tensor x = x_.contiguous(), w = w_.contiguous();
    const Tensor g_mean = g_mean_.to(w.scalar_type()).contiguous(), g_var = g_var_.to(w.scalar_type()).contiguous();
    const Tensor m = mean.contiguous();
    const Geometry g = geometry_of(x, w, d, time_last);
    Tensor gx = need_gx ? at::empty_like(x) : x.new_empty({0}), gw = at::zeros_like(w);
    if (x.numel() == 0) return {need_gx ? gx.zero_() : gx, gw};
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "cpp_stats_backward", [&] {
        using S = scalar_t;
        run_backward<S>(g, x.data_ptr<S>(), w.data_ptr<S>(), nullptr, nullptr, MODE_STATS, S(0), m.data_ptr<S>(),
                        g_mean.data_ptr<S>(), g_var.data_ptr<S>(), need_gx ? gx.data_ptr<S>() : nullptr, 0,
                        gw.data_ptr<S>(), nullptr, at::get_num_threads());
    });
    return {gx, gw};
}

// [spikes, mean, var, Wq, b] of a BN-threshold step on checked contiguous tensors (see bn_runnable), or []
// where the weights or their folding are not finite (nothing written, nothing updated).
std::vector<Tensor> bn_forward_cpu(const Tensor& x, const Tensor& w, const Tensor& gamma, const Tensor& beta,
                                   const optional<Tensor>& running_mean, const optional<Tensor>& running_var,
                                   const optional<Tensor>& given_mean, const optional<Tensor>& given_var, double eps,
                                   bool quantize, int64_t d, bool time_last, double factor) {
    TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "cpp_bn_forward: expected contiguous x and weight");
    const Geometry g = geometry_of(x, w, d, time_last);
    const int64_t C = w.size(0);
    const bool given = given_mean.has_value();
    Tensor out = at::empty_like(x), wq = at::empty_like(w), b = w.new_empty({C});
    Tensor mean = given ? *given_mean : w.new_empty({C}), var = given ? *given_var : w.new_empty({C});
    const Tensor rm = running_mean ? *running_mean : Tensor(), rv = running_var ? *running_var : Tensor();
    int refused = 0;
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "cpp_bn_forward", [&] {
        using S = scalar_t;
        refused = run_bn_forward<S>(g, x.data_ptr<S>(), w.data_ptr<S>(), gamma.data_ptr<S>(), beta.data_ptr<S>(), eps,
                                     quantize, given, out.data_ptr<S>(), mean.data_ptr<S>(), var.data_ptr<S>(),
                                     wq.data_ptr<S>(), b.data_ptr<S>(), ptr<S>(rm), ptr<S>(rv), factor,
                                     at::get_num_threads());
    });
    if (refused) return {};
    if (rm.defined()) {  // written through raw pointers: let autograd know, as an in-place op would
        rm.unsafeGetTensorImpl()->bump_version();
        rv.unsafeGetTensorImpl()->bump_version();
    }
    return {out, mean, var, wq, b};
}

// (dL/dX or empty, dL/dweight, dL/dgamma, dL/dbeta); ste 0 (no quantiser), 1 (whole), 2 (round); given: the
// statistics were given (constants: no gradient through them).
std::tuple<Tensor, Tensor, Tensor, Tensor> bn_backward_cpu(
    const Tensor& x, const Tensor& w, const Tensor& gamma, const Tensor& mean, const Tensor& var, const Tensor& wq,
    const Tensor& b, const Tensor& grad_, int64_t d, bool time_last, int64_t kind, double alpha, double eps,
    int64_t ste, bool given, bool need_gx) {
    const Geometry g = geometry_of(x, w, d, time_last);
    const Tensor grad = grad_.to(x.scalar_type()).contiguous();
    Tensor gx = need_gx ? at::empty_like(x) : x.new_empty({0});
    Tensor g_w = at::empty_like(w), g_gamma = at::empty_like(gamma), g_beta = at::empty_like(gamma);
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "cpp_bn_backward", [&] {
        using S = scalar_t;
        run_bn_backward<S>(g, x.data_ptr<S>(), w.data_ptr<S>(), gamma.data_ptr<S>(), mean.data_ptr<S>(),
                           var.data_ptr<S>(), wq.data_ptr<S>(), b.data_ptr<S>(), grad.data_ptr<S>(), int(kind),
                           S(alpha), eps, int(ste), int(given), need_gx ? gx.data_ptr<S>() : nullptr,
                           g_w.data_ptr<S>(), g_gamma.data_ptr<S>(), g_beta.data_ptr<S>(), at::get_num_threads());
    });
    return {gx, g_w, g_gamma, g_beta};
}

// ------------------------------------------------------------------ autograd
Tensor or_undefined(const Tensor& gx, bool needed) { return needed ? gx : Tensor(); }

struct Charge : public torch::autograd::Function<Charge> {
    static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const optional<Tensor>& b,
                          int64_t d, bool time_last, int64_t kind, double alpha) {
        at::AutoDispatchBelowADInplaceOrView guard;
        ctx->save_for_backward({x, w, b ? *b : Tensor()});
        ctx->saved_data["cfg"] = std::vector<double>{double(d), double(time_last), double(kind), alpha};
        static const auto charge_op = op<decltype(charge_cpu)>("spikingjelly_mfpsn::cpp_charge");
        return charge_op.call(x, w, b, d, time_last, kind, alpha);
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        first_order_only();
        const auto saved = ctx->get_saved_variables();
        const std::vector<double> cfg = ctx->saved_data["cfg"].toDoubleVector();
        const optional<Tensor> b = saved[2].defined() ? optional<Tensor>(saved[2]) : c10::nullopt;
        static const auto charge_backward_op =
            op<decltype(charge_backward_cpu)>("spikingjelly_mfpsn::cpp_charge_backward");
        auto [gx, gw, gb] = charge_backward_op
                                .call(saved[0], saved[1], b, grads[0], int64_t(cfg[0]), cfg[1] != 0.0,
                                      int64_t(cfg[2]), cfg[3], ctx->needs_input_grad(0));
        const Tensor none;
        return {or_undefined(gx, ctx->needs_input_grad(0)), gw, b ? gb.to(b->scalar_type()) : none, none, none, none,
                none};
    }
};

struct Stats : public torch::autograd::Function<Stats> {
    static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, int64_t d, bool time_last) {
        at::AutoDispatchBelowADInplaceOrView guard;
        static const auto stats_op = op<decltype(stats_cpu)>("spikingjelly_mfpsn::cpp_stats");
        auto [mean, var] = stats_op.call(x, w, d, time_last);
        ctx->save_for_backward({x, w, mean});
        ctx->saved_data["cfg"] = std::vector<int64_t>{d, int64_t(time_last)};
        return {mean, var};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        first_order_only();
        const auto saved = ctx->get_saved_variables();
        const std::vector<int64_t> cfg = ctx->saved_data["cfg"].toIntVector();
        const auto dense = [&](const Tensor& g) { return g.defined() ? g : at::zeros_like(saved[2]); };
        static const auto stats_backward_op =
            op<decltype(stats_backward_cpu)>("spikingjelly_mfpsn::cpp_stats_backward");
        auto [gx, gw] = stats_backward_op
                            .call(saved[0], saved[1], saved[2], dense(grads[0]), dense(grads[1]), cfg[0],
                                  cfg[1] != 0, ctx->needs_input_grad(0));
        const Tensor none;
        return {or_undefined(gx, ctx->needs_input_grad(0)), gw, none, none};
    }
};

Tensor charge_autograd(const Tensor& x, const Tensor& w, const optional<Tensor>& b, int64_t d, bool time_last,
                       int64_t kind, double alpha) {
    return Charge::apply(x, w, b, d, time_last, kind, alpha);
}

std::tuple<Tensor, Tensor> stats_autograd(const Tensor& x, const Tensor& w, int64_t d, bool time_last) {
    auto out = Stats::apply(x, w, d, time_last);
    return {out[0], out[1]};
}

// The BN-threshold step as one node: Wq and b, which never leave it, kept in saved_data.
struct BNFire : public torch::autograd::Function<BNFire> {
    static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const Tensor& gamma,
                                 const Tensor& beta, const optional<Tensor>& running_mean,
                                 const optional<Tensor>& running_var, const optional<Tensor>& given_mean,
                                 const optional<Tensor>& given_var, double eps, int64_t ste, int64_t d, bool time_last,
                                 int64_t kind, double alpha, double factor) {
        at::AutoDispatchBelowADInplaceOrView guard;
        static const auto bn_forward_op = op<decltype(bn_forward_cpu)>("spikingjelly_mfpsn::cpp_bn_forward");
        const auto outs = bn_forward_op
                              .call(x, w, gamma, beta, running_mean, running_var, given_mean, given_var, eps,
                                    ste != 0, d, time_last, factor);
        if (outs.empty()) return {};
        const bool given = given_mean.has_value();
        ctx->save_for_backward({x, w, gamma, outs[1], outs[2]});
        ctx->saved_data["wq"] = outs[3];
        ctx->saved_data["b"] = outs[4];
        ctx->saved_data["cfg"] = std::vector<double>{eps, double(ste), double(d), double(time_last), double(kind),
                                                     alpha, double(given)};
        if (given) return {outs[0]};
        ctx->mark_non_differentiable({outs[1], outs[2]});
        ctx->set_materialize_grads(false);  // no zero tensors for mean and var (only the spikes carry a gradient)
        return {outs[0], outs[1], outs[2]};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        first_order_only();
        const auto s = ctx->get_saved_variables();
        const std::vector<double> cfg = ctx->saved_data["cfg"].toDoubleVector();
        const Tensor grad = grads[0].defined() ? grads[0] : at::zeros_like(s[0]);
        static const auto bn_backward_op = op<decltype(bn_backward_cpu)>("spikingjelly_mfpsn::cpp_bn_backward");
        auto [gx, g_w, g_gamma, g_beta] =
            bn_backward_op
                .call(s[0], s[1], s[2], s[3], s[4], ctx->saved_data["wq"].toTensor(), ctx->saved_data["b"].toTensor(),
                      grad, int64_t(cfg[2]), cfg[3] != 0.0, int64_t(cfg[4]), cfg[5], cfg[0], int64_t(cfg[1]),
                      cfg[6] != 0.0, ctx->needs_input_grad(0));
        const Tensor none;
        return {or_undefined(gx, ctx->needs_input_grad(0)), g_w, g_gamma, g_beta, none, none, none, none,
                none, none, none, none, none, none, none};
    }
};

// Whether cpp_bn_fire runs these arguments: x (T, N, C, ...) or time-last (N, C, ..., T) with 0-3 feature
// dims, not empty; weight (C, K >= 1) with x's C; gamma, beta and the statistics given or updated of shape
// (C,) and contiguous (read and written through raw pointers); all on the CPU, of x's dtype (float32 or
// float64); an order, surrogate and quantiser it knows.
bool bn_runnable(const Tensor& x, const Tensor& w, const Tensor& gamma, const Tensor& beta,
                 const optional<Tensor>& running_mean, const optional<Tensor>& running_var,
                 const optional<Tensor>& given_mean, const optional<Tensor>& given_var, double eps, int64_t ste,
                 int64_t d, bool time_last, int64_t kind) {
    const auto dtype = x.scalar_type();
    if (dtype != at::kFloat && dtype != at::kDouble) return false;
    const auto on_cpu = [&](const Tensor& t) { return t.defined() && t.device().is_cpu() && t.scalar_type() == dtype; };
    if (!on_cpu(x) || x.dim() < 3 || x.dim() > 6 || x.numel() == 0) return false;
    if (!on_cpu(w) || w.dim() != 2 || w.size(1) < 1 || w.size(0) != x.size(time_last ? 1 : 2)) return false;
    const int64_t C = w.size(0);
    const auto per_channel = [&](const Tensor& t) {
        return on_cpu(t) && t.dim() == 1 && t.size(0) == C && t.is_contiguous();
    };
    const auto pair = [&](const optional<Tensor>& a, const optional<Tensor>& b) {
        return a.has_value() == b.has_value() && (!a || (per_channel(*a) && per_channel(*b)));
    };
    return per_channel(gamma) && per_channel(beta) && pair(running_mean, running_var) && pair(given_mean, given_var) &&
           eps > 0 && d >= 1 && ste >= 0 && ste <= 2 && (kind == MODE_ATAN || kind == MODE_SIGMOID);
}

std::vector<Tensor> bn_fire(const Tensor& x, const Tensor& w, const Tensor& gamma, const Tensor& beta,
                            const optional<Tensor>& running_mean, const optional<Tensor>& running_var,
                            const optional<Tensor>& given_mean, const optional<Tensor>& given_var, double eps,
                            int64_t ste, int64_t d, bool time_last, int64_t kind, double alpha, double factor) {
    if (!bn_runnable(x, w, gamma, beta, running_mean, running_var, given_mean, given_var, eps, ste, d, time_last,
                     kind))
        return {};
    return BNFire::apply(x.contiguous(), w.contiguous(), gamma, beta, running_mean, running_var, given_mean,
                         given_var, eps, ste, d, time_last, kind, alpha, factor);
}

// ------------------------------------------------------------------ single step
// [spikes] of one step, or [] for a gradient to record, tensors it cannot read raw (another device or dtype,
// not contiguous) or weights (or their folding) that are not finite. taps[i]: the input (K-1-i)*d steps back
// (None before the first step), the last one the current input; shapes checked by the caller.
std::vector<Tensor> step_fire_op(const c10::List<optional<Tensor>>& taps_, const Tensor& w, const optional<Tensor>& bias,
                              const optional<Tensor>& gamma, const optional<Tensor>& beta,
                              const optional<Tensor>& mean, const optional<Tensor>& var, double eps, bool quantize) {
    std::vector<optional<Tensor>> taps;
    for (size_t i = 0; i < taps_.size(); ++i) taps.push_back(taps_.get(i));
    if (taps.empty() || !taps.back()) return {};
    const Tensor& x = *taps.back();
    const auto dtype = x.scalar_type();
    const bool grad = at::GradMode::is_enabled();
    const auto raw = [&](const Tensor& t) {
        return t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && !(grad && t.requires_grad());
    };
    bool ok = (dtype == at::kFloat || dtype == at::kDouble) && raw(w) && x.dim() >= 2 &&
              int64_t(taps.size()) == w.size(1);
    for (const auto* t : {&bias, &gamma, &beta, &mean, &var}) ok = ok && (!*t || raw(**t));
    ok = ok && (!gamma || (beta && mean && var));  // (a batch norm comes whole)
    for (const auto& t : taps) ok = ok && (!t || raw(*t));
    if (!ok) return {};
    Tensor out = at::empty_like(x);
    int refused = 0;
    AT_DISPATCH_FLOATING_TYPES(dtype, "cpp_step_fire", [&] {
        using S = scalar_t;
        std::vector<const S*> xs;
        for (const auto& t : taps) xs.push_back(t ? t->data_ptr<S>() : nullptr);
        const auto p = [](const optional<Tensor>& t) { return t ? t->data_ptr<S>() : nullptr; };
        refused = run_step<S>(xs.data(), w.data_ptr<S>(), p(gamma), p(beta), p(mean), p(var), eps, quantize, p(bias),
                               out.data_ptr<S>(), x.size(0), x.size(1), x.numel() / std::max<int64_t>(x.size(0) * x.size(1), 1),
                               int(w.size(1)), at::get_num_threads());
    });
    if (refused) return {};
    return {out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spikingjelly_mfpsn, m) {
    m.def("cpp_charge(Tensor x, Tensor weight, Tensor? bias, int dilation, bool time_last, int kind, float alpha) "
          "-> Tensor");
    m.def("cpp_charge_backward(Tensor x, Tensor weight, Tensor? bias, Tensor grad, int dilation, bool time_last, "
          "int kind, float alpha, bool need_gx) -> (Tensor, Tensor, Tensor)");
    m.def("cpp_stats(Tensor x, Tensor weight, int dilation, bool time_last) -> (Tensor, Tensor)");
    m.def("cpp_stats_backward(Tensor x, Tensor weight, Tensor mean, Tensor g_mean, Tensor g_var, int dilation, "
          "bool time_last, bool need_gx) -> (Tensor, Tensor)");
    m.def("cpp_bn_forward(Tensor x, Tensor weight, Tensor gamma, Tensor beta, Tensor(a!)? running_mean, "
          "Tensor(b!)? running_var, Tensor? given_mean, Tensor? given_var, float eps, bool quantize, int dilation, "
          "bool time_last, float factor) -> Tensor[]");
    m.def("cpp_bn_backward(Tensor x, Tensor weight, Tensor gamma, Tensor mean, Tensor var, Tensor wq, Tensor b, "
          "Tensor grad, int dilation, bool time_last, int kind, float alpha, float eps, int ste, bool given, "
          "bool need_gx) -> (Tensor, Tensor, Tensor, Tensor)");
    m.def("cpp_bn_fire(Tensor x, Tensor weight, Tensor gamma, Tensor beta, Tensor(a!)? running_mean, "
          "Tensor(b!)? running_var, Tensor? given_mean, Tensor? given_var, float eps, int ste, int dilation, "
          "bool time_last, int kind, float alpha, float factor) -> Tensor[]",
          torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, &bn_fire));
    m.def("cpp_step_fire(Tensor?[] taps, Tensor weight, Tensor? bias, Tensor? gamma, Tensor? beta, Tensor? mean, "
          "Tensor? var, float eps, bool quantize) -> Tensor[]",
          torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, &step_fire_op));
    m.def("cpp_vec_bytes() -> int", []() -> int64_t { return vec_bytes<float>(); });
}

TORCH_LIBRARY_IMPL(spikingjelly_mfpsn, CPU, m) {
    m.impl("cpp_charge", &charge_cpu);
    m.impl("cpp_charge_backward", &charge_backward_cpu);
    m.impl("cpp_stats", &stats_cpu);
    m.impl("cpp_stats_backward", &stats_backward_cpu);
    m.impl("cpp_bn_forward", &bn_forward_cpu);
    m.impl("cpp_bn_backward", &bn_backward_cpu);
}

TORCH_LIBRARY_IMPL(spikingjelly_mfpsn, Autograd, m) {
    m.impl("cpp_charge", &charge_autograd);
    m.impl("cpp_stats", &stats_autograd);
}
