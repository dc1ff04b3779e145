"""Native code: the per-parameter readiness countdown in C++, as torch's
reducer keeps it, and the CPU loops of block-scaled fp8.

Torch's reducer puts a C++ post hook on every parameter's ``AccumulateGrad``
node; a Python hook per parameter costs a GIL round trip and a Python call
each (measured: 600 tensors, ~2.5 ms of a 27 ms backward on one core).  This
module compiles (once, cached by torch's extension builder) a hook that
counts a bucket down without Python and calls into Python once per bucket,
when its last gradient is in.

Three modes, set by the reducer between steps (never inside a backward):

``PY``     every hook calls the Python hook body (``on_hook(i, False)``): the
           iterations that track something (unused parameters, static
           graph's first backward, the ready order of the rebuild, debug
           checks, a second backward, the bucket tuner)
``FAST``   the countdown: ``on_bucket(b)`` when bucket ``b``'s last
           parameter is ready; a parameter ready twice calls
           ``on_hook(i, True)`` (the Python side raises torch's error)
``IDLE``   nothing: backwards that are not reduced and track nothing
           (``no_sync()`` without find_unused_parameters/static_graph)

Compiled autograd collects the hooks of the nodes it traces: each native
hook hands it ``ca_hooks[i]``, a Python post hook (the reducer's readiness
hook, run eagerly), so a compiled backward sees what eager autograd sees.

The same module holds the CPU twin of the fp8 kernels
(:func:`fastddp.kernels.torch_path.quantize_fp8` and its siblings call it):
one pass per block, bit for bit the contract of ``kernels/reference.py`` where
every value is finite (each call hands the first block holding a NaN/inf back
to the torch path, which applies the contract's NaN and health rules).

``FASTDDP_NATIVE=0`` turns it off (Python hooks, same gradients);
``FASTDDP_NATIVE=require`` makes a failed build an error instead of a
warning and the Python fallback.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings

import torch

__all__ = ["countdown_module", "enabled", "PY", "FAST", "IDLE"]

PY, FAST, IDLE = 0, 1, 2

_SOURCE = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/utils/object_ptr.h>

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

namespace {

using torch::autograd::variable_list;

struct State {
  std::mutex mu;
  int mode = 0;                 // 0 PY, 1 FAST, 2 IDLE
  std::vector<int> bucket_of;   // per parameter
  std::vector<int> pending;     // per bucket
  std::vector<uint8_t> marked;  // per parameter, this iteration (FAST)
  PyObject* on_bucket = nullptr;
  PyObject* on_hook = nullptr;
  std::vector<PyObject*> ca_hooks;
  // the early copy (CPU buckets of large tensors, FAST iterations only):
  // each gradient goes into its bucket slot as it arrives, scaled (torch's
  // mark_variable_ready_dense), read while still in cache; with
  // gradient_as_bucket_view .grad becomes the slot and the fresh tensor is freed
  std::vector<at::Tensor> vars;   // the parameters
  std::vector<at::Tensor> dst;    // per parameter: its bucket view (undefined: never)
  bool early = false;             // this iteration copies early
  bool alias = false;             // then .grad = the view (gradient_as_bucket_view)
  at::Tensor scale;               // wrapped 1/W (torch's mul_out); undefined: none
  at::Tensor divisor;             // wrapped W (batched_grad_copy's division); undefined: none
  std::vector<uint8_t> filled;    // per parameter, this iteration
  std::vector<int> nfilled;       // per bucket, this iteration

  ~State() {
    if (!Py_IsInitialized()) return;  // interpreter gone: leak, never touch it
    pybind11::gil_scoped_acquire gil;
    Py_XDECREF(on_bucket);
    Py_XDECREF(on_hook);
    for (auto* h : ca_hooks) Py_XDECREF(h);
  }
};

void call(PyObject* fn, int arg, bool flag, bool two) {
  pybind11::gil_scoped_acquire gil;
  THPObjectPtr res(two ? PyObject_CallFunction(fn, "iO", arg, flag ? Py_True : Py_False)
                       : PyObject_CallFunction(fn, "i", arg));
  if (!res) throw python_error();
}

struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(std::shared_ptr<State> st, int index) : st_(std::move(st)), index_(index) {}

  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    int bucket = -1;
    int python = 0;  // 1: the Python hook body, 2: marked twice
    bool early = false;
    {
      std::lock_guard<std::mutex> lock(st_->mu);
      if (st_->mode == 2) return outputs;
      if (st_->mode == 0) {
        python = 1;
      } else if (st_->marked[index_]) {
        python = 2;
      } else {
        st_->marked[index_] = 1;
        early = st_->early && st_->dst[index_].defined();
      }
    }
    if (python) {
      call(st_->on_hook, index_, python == 2, true);
      return outputs;
    }
    const bool copied = early && copy_early();
    {
      std::lock_guard<std::mutex> lock(st_->mu);
      int b = st_->bucket_of[index_];
      if (copied) {
        st_->filled[index_] = 1;
        ++st_->nfilled[b];
      }
      if (--st_->pending[b] == 0) bucket = b;
    }
    if (bucket >= 0) call(st_->on_bucket, bucket, false, false);
    return outputs;
  }

  // torch's mark_variable_ready_dense for a gradient that is not yet its
  // bucket view: view = grad * (1/W), grad / W (batched_grad_copy's copy and
  // division in one pass, the same bits) or a plain copy (a comm hook), then
  // .grad = view with gradient_as_bucket_view.  Anything unusual (aliased
  // already, create_graph, another dtype or shape, not strided) is left to
  // the Python pack, which applies torch's rules.
  bool copy_early() {
    const at::Tensor& dst = st_->dst[index_];
    at::Tensor& grad = st_->vars[index_].mutable_grad();
    if (!grad.defined() || grad.layout() != at::kStrided || grad.requires_grad() || !grad.device().is_cpu() ||
        grad.scalar_type() != dst.scalar_type() || grad.sizes() != dst.sizes() || grad.is_alias_of(dst))
      return false;
    at::NoGradGuard no_grad;
    at::Tensor& out = const_cast<at::Tensor&>(dst);
    if (st_->divisor.defined()) at::div_out(out, grad, st_->divisor);
    else if (st_->scale.defined()) at::mul_out(out, grad, st_->scale);
    else out.copy_(grad);
    if (st_->alias) grad = dst;
    return true;
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    PyObject* fn = st_->ca_hooks.at(index_);
    Py_INCREF(fn);
    args.add_post_hook(c10::SafePyObject(fn, getPyInterpreter()));
  }

 private:
  std::shared_ptr<State> st_;
  int index_;
};

using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

struct Countdown {
  Countdown(const std::vector<at::Tensor>& params, pybind11::object on_bucket,
            pybind11::object on_hook, std::vector<pybind11::object> ca_hooks)
      : st_(std::make_shared<State>()) {
    TORCH_CHECK(ca_hooks.size() == params.size(), "fastddp native: one compiled-autograd hook per parameter");
    st_->on_bucket = on_bucket.release().ptr();
    st_->on_hook = on_hook.release().ptr();
    for (auto& h : ca_hooks) st_->ca_hooks.push_back(h.release().ptr());
    st_->bucket_of.assign(params.size(), 0);
    st_->marked.assign(params.size(), 0);
    st_->vars = params;
    st_->dst.assign(params.size(), at::Tensor());
    st_->filled.assign(params.size(), 0);
    params_ = params;
    for (size_t i = 0; i < params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params[i]);
      TORCH_CHECK(acc, "fastddp native: parameter ", i, " has no gradient accumulator (requires_grad=False?)");
      keys_.push_back(acc->add_post_hook(std::make_unique<ReadyHook>(st_, static_cast<int>(i))));
      nodes_.push_back(std::move(acc));
    }
  }

  // A parameter's AccumulateGrad node is replaced when its data changes
  // dtype or device (``p.data = p.half()``, mixed_precision's swap): the
  // hook moves to the node the graph now uses.  Called after each forward.
  int refresh() {
    int moved = 0;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      auto cur = torch::autograd::impl::try_get_grad_accumulator(params_[i]);
      if (!cur) cur = torch::autograd::impl::grad_accumulator(params_[i]);
      if (!cur || cur.get() == nodes_[i].get()) continue;
      nodes_[i]->del_post_hook(keys_[i]);
      keys_[i] = cur->add_post_hook(std::make_unique<ReadyHook>(st_, static_cast<int>(i)));
      nodes_[i] = std::move(cur);
      ++moved;
    }
    return moved;
  }

  ~Countdown() { remove(); }

  void remove() {
    for (size_t i = 0; i < nodes_.size(); ++i) nodes_[i]->del_post_hook(keys_[i]);
    nodes_.clear();
    keys_.clear();
    params_.clear();
    std::lock_guard<std::mutex> lock(st_->mu);
    st_->early = false;
    for (auto& t : st_->dst) t.reset();
    for (auto& t : st_->vars) t.reset();
  }

  // Each parameter's bucket view for the early copy (None: that parameter
  // never); called when the buckets or the bucket mode change.
  void set_views(const std::vector<std::optional<at::Tensor>>& views) {
    std::lock_guard<std::mutex> lock(st_->mu);
    TORCH_CHECK(views.size() == st_->dst.size(), "fastddp native: one view (or None) per parameter");
    for (size_t i = 0; i < views.size(); ++i) st_->dst[i] = views[i].has_value() ? *views[i] : at::Tensor();
  }

  int filled(int b) {
    std::lock_guard<std::mutex> lock(st_->mu);
    return st_->nfilled.at(b);
  }

  pybind11::bytes filled_marks() {
    std::lock_guard<std::mutex> lock(st_->mu);
    return pybind11::bytes(reinterpret_cast<const char*>(st_->filled.data()), st_->filled.size());
  }

  void set_buckets(const std::vector<int>& bucket_of) {
    std::lock_guard<std::mutex> lock(st_->mu);
    TORCH_CHECK(bucket_of.size() == st_->bucket_of.size(), "fastddp native: bucket_of has the wrong length");
    st_->bucket_of = bucket_of;
  }

  static at::Tensor wrapped(double v) {  // a Python number as an operand: the tensor's dtype wins
    auto t = at::scalar_tensor(v, at::TensorOptions().dtype(at::kDouble));
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    return t;
  }

  // early: < 0 no early copy this iteration, 0 a plain copy, else the scale
  // (1/W, torch's mul_out); divide > 0: divide by it instead (batched);
  // alias: .grad becomes the view (gradient_as_bucket_view)
  void arm(int mode, const std::vector<int>& sizes, double early, double divide, bool alias) {
    std::lock_guard<std::mutex> lock(st_->mu);
    st_->mode = mode;
    st_->pending = sizes;
    std::fill(st_->marked.begin(), st_->marked.end(), 0);
    st_->early = mode == 1 && early >= 0;
    st_->alias = alias;
    st_->scale = st_->early && early > 0 && !(divide > 0) ? wrapped(early) : at::Tensor();
    st_->divisor = st_->early && divide > 0 ? wrapped(divide) : at::Tensor();
    std::fill(st_->filled.begin(), st_->filled.end(), 0);
    st_->nfilled.assign(sizes.size(), 0);
  }

  void set_mode(int mode) {
    std::lock_guard<std::mutex> lock(st_->mu);
    st_->mode = mode;
  }

  int mode() {
    std::lock_guard<std::mutex> lock(st_->mu);
    return st_->mode;
  }

  pybind11::bytes marked() {
    std::lock_guard<std::mutex> lock(st_->mu);
    return pybind11::bytes(reinterpret_cast<const char*>(st_->marked.data()), st_->marked.size());
  }

  bool attached() const { return !nodes_.empty(); }

 private:
  std::shared_ptr<State> st_;
  std::vector<at::Tensor> params_;
  std::vector<NodePtr> nodes_;
  std::vector<uintptr_t> keys_;
};

// ------------------------------------------------ block-scaled fp8 (e4m3)
// The CPU twin of kernels/fp8_kernel.py, bit for bit the rule written in
// kernels/reference.py, for the steady state: every value finite.  Each call
// returns the first block it did not do (a non-finite value there); the
// caller's torch path does the rest with the contract's NaN/health rules.

float g_fp8_lut[256];
bool g_fp8_lut_ready = [] {
  for (int i = 0; i < 256; ++i)
    g_fp8_lut[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  return true;
}();

inline float fp8_scale(float amax) {  // reference.fp8_scales
  if (amax == 0.0f) return 1.0f;
  int e;
  float m = std::frexp(amax, &e);
  int k = (m <= 0.875f) ? e - 9 : e - 8;
  if (k < -126) k = -126;
  return std::ldexp(1.0f, k);
}

void check_fp8_args(const at::Tensor& q, const at::Tensor& scales, int64_t n, int64_t block) {
  TORCH_CHECK(block > 0 && n % block == 0, "fastddp native fp8: ", n, " elements are not whole blocks of ", block);
  TORCH_CHECK(q.is_cpu() && q.scalar_type() == at::kByte && q.is_contiguous() && q.numel() == n,
              "fastddp native fp8: q must be contiguous uint8 of ", n, " elements on the CPU");
  TORCH_CHECK(scales.is_cpu() && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.numel() == n / block, "fastddp native fp8: scales must be contiguous fp32, one per block");
}

// One element: the e4m3 code of y * inv (|y * inv| <= 448, finite) and its
// value times s, both from the bits (no table, no branch: the loops
// vectorize): the cast rounds to 3 mantissa bits, nearest even, and the
// rounded fp32 value IS the e4m3 value; below 2^-6 (e4m3's subnormals) it
// rounds to a multiple of 2^-9 (adding and taking away 2^23 rounds to an
// integer, nearest even; code 8 is 2^-6 itself).
inline uint8_t fp8_round(float y, float inv, float s, float* back) {
  const float v = y * inv;
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t a = bits & 0x7FFFFFFFu;
  float av;
  std::memcpy(&av, &a, 4);
  const float t = (av * 512.0f + 8388608.0f) - 8388608.0f;
  const uint32_t sub = static_cast<uint32_t>(static_cast<int32_t>(t));
  const float tm = t * 0.001953125f;
  uint32_t tbits;
  std::memcpy(&tbits, &tm, 4);
  const uint32_t kept = (a + 0x7FFFFu + ((a >> 20) & 1u)) & 0xFFF00000u;
  const uint32_t nor = (kept >> 20) - (120u << 3);
  const uint32_t m = 0u - static_cast<uint32_t>(a < 0x3C800000u);  // |v| < 2^-6
  const uint32_t mb = (tbits & m) | (kept & ~m) | sign;
  float dec;
  std::memcpy(&dec, &mb, 4);
  *back = dec * s;
  return static_cast<uint8_t>((sign >> 24) | (sub & m) | (nor & ~m));
}

// max |x| as bits: for |x| (sign cleared) the integer order is the float
// order, NaN/inf sit above 0x7F800000 (so one reduction finds both), and an
// integer max vectorizes where a float one may not (NaN rules).
inline uint32_t max_abs_bits(const float* __restrict y, int64_t block) {
  uint32_t top = 0;
  for (int64_t i = 0; i < block; ++i) {
    uint32_t u;
    std::memcpy(&u, &y[i], 4);
    u &= 0x7FFFFFFFu;
    top = u > top ? u : top;
  }
  return top;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The loops, compiled twice (AVX2 and the x86-64 baseline; the loader picks
// one per machine): the same IEEE operations either way, no contraction.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTDDP_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FASTDDP_CLONES
#endif

// __restrict: a uint8_t store may alias anything, so without it nothing vectorizes
FASTDDP_CLONES int64_t quantize_loop(const float* __restrict xp, float* __restrict rp, uint8_t* __restrict qp,
                                     float* __restrict sp, int64_t nb, int64_t block, float* __restrict y,
                                     float* __restrict back) {
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t o = b * block;
    if (rp) {
      for (int64_t i = 0; i < block; ++i) y[i] = xp[o + i] + rp[o + i];
    } else {
      for (int64_t i = 0; i < block; ++i) y[i] = xp[o + i];
    }
    const uint32_t top = max_abs_bits(y, block);
    if (top >= 0x7F800000u) return b;  // a NaN or inf
    const float s = fp8_scale(bits_float(top));
    const float inv = 1.0f / s;  // a power of two: exact
    sp[b] = s;
    uint8_t* __restrict qb = qp + o;
    for (int64_t i = 0; i < block; ++i) qb[i] = fp8_round(y[i], inv, s, &back[i]);
    if (rp) {
      for (int64_t i = 0; i < block; ++i) rp[o + i] = y[i] - back[i];
    }
  }
  return nb;
}

FASTDDP_CLONES void dequantize_loop(const uint8_t* __restrict qp, const float* __restrict sp, float* __restrict op,
                                    int64_t nb, int64_t block) {
  for (int64_t b = 0; b < nb; ++b) {
    const float s = sp[b];
    for (int64_t i = b * block; i < (b + 1) * block; ++i) op[i] = g_fp8_lut[qp[i]] * s;
  }
}

FASTDDP_CLONES int64_t reduce_loop(const uint8_t* sq, const float* ss, uint8_t* oq, float* os, int64_t n, int64_t nb,
                                   int64_t world, int64_t block, float* __restrict acc, float* __restrict back) {
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t o = b * block;
    const float s0 = ss[b];
    for (int64_t i = 0; i < block; ++i) acc[i] = g_fp8_lut[sq[o + i]] * s0;
    for (int64_t k = 1; k < world; ++k) {
      const float sk = ss[k * nb + b];
      const uint8_t* qk = sq + k * n + o;
      for (int64_t i = 0; i < block; ++i) acc[i] = acc[i] + g_fp8_lut[qk[i]] * sk;
    }
    const uint32_t top = max_abs_bits(acc, block);
    if (top >= 0x7F800000u) return b;  // NaN/inf: nothing of block b written yet (out may alias slice 0)
    const float s = fp8_scale(bits_float(top));
    const float inv = 1.0f / s;
    os[b] = s;
    for (int64_t i = 0; i < block; ++i) oq[o + i] = fp8_round(acc[i], inv, s, &back[i]);
  }
  return nb;
}

int64_t fp8_quantize(const at::Tensor& x, const std::optional<at::Tensor>& residual, at::Tensor q,
                     at::Tensor scales, int64_t block) {
  const int64_t n = x.numel();
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(), "fastddp native fp8: x must be contiguous fp32 on the CPU");
  check_fp8_args(q, scales, n, block);
  const float* xp = x.data_ptr<float>();
  float* rp = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_cpu() && residual->scalar_type() == at::kFloat && residual->is_contiguous() &&
                residual->numel() == n, "fastddp native fp8: the residual must be contiguous fp32 like x");
    rp = residual->data_ptr<float>();
  }
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  std::vector<float> y(block), back(block);
  pybind11::gil_scoped_release nogil;
  return quantize_loop(xp, rp, qp, sp, n / block, block, y.data(), back.data());
}

void fp8_dequantize(const at::Tensor& q, const at::Tensor& scales, at::Tensor out, int64_t block) {
  const int64_t n = out.numel();
  TORCH_CHECK(out.is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous(), "fastddp native fp8: out must be contiguous fp32 on the CPU");
  check_fp8_args(q, scales, n, block);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  pybind11::gil_scoped_release nogil;
  dequantize_loop(qp, sp, op, n / block, block);
}

int64_t fp8_reduce_shards(const at::Tensor& src_q, const at::Tensor& src_s, at::Tensor out_q, at::Tensor out_s,
                          int64_t world, int64_t block) {
  const int64_t n = out_q.numel();
  check_fp8_args(out_q, out_s, n, block);
  const int64_t nb = n / block;
  TORCH_CHECK(src_q.is_cpu() && src_q.scalar_type() == at::kByte && src_q.is_contiguous() && src_q.numel() >= world * n &&
              src_s.is_cpu() && src_s.scalar_type() == at::kFloat && src_s.is_contiguous() && src_s.numel() >= world * nb,
              "fastddp native fp8: the shards must hold world x the output");
  const uint8_t* sq = src_q.data_ptr<uint8_t>();
  const float* ss = src_s.data_ptr<float>();
  uint8_t* oq = out_q.data_ptr<uint8_t>();
  float* os = out_s.data_ptr<float>();
  std::vector<float> acc(block), back(block);
  pybind11::gil_scoped_release nogil;
  return reduce_loop(sq, ss, oq, os, n, nb, world, block, acc.data(), back.data());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_quantize", &fp8_quantize);
  m.def("fp8_dequantize", &fp8_dequantize);
  m.def("fp8_reduce_shards", &fp8_reduce_shards);
  pybind11::class_<Countdown>(m, "Countdown")
      .def(pybind11::init<const std::vector<at::Tensor>&, pybind11::object, pybind11::object,
                          std::vector<pybind11::object>>())
      .def("remove", &Countdown::remove)
      .def("refresh", &Countdown::refresh)
      .def("set_buckets", &Countdown::set_buckets)
      .def("arm", &Countdown::arm, pybind11::arg("mode"), pybind11::arg("sizes"), pybind11::arg("early") = -1.0,
           pybind11::arg("divide") = 0.0, pybind11::arg("alias") = true)
      .def("set_mode", &Countdown::set_mode)
      .def("mode", &Countdown::mode)
      .def("marked", &Countdown::marked)
      .def("set_views", &Countdown::set_views)
      .def("filled", &Countdown::filled)
      .def("filled_marks", &Countdown::filled_marks)
      .def_property_readonly("attached", &Countdown::attached);
}
"""

_lock = threading.Lock()
_module = None
_failed: str | None = None


def enabled() -> bool:
    return os.environ.get("FASTDDP_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def _name() -> str:
    h = hashlib.sha1((_SOURCE + torch.__version__).encode()).hexdigest()[:12]
    return f"fastddp_native_{h}"


def countdown_module():
    """The compiled module (built on first use, then loaded from torch's
    extension cache), or None where it is off or cannot be built."""
    global _module, _failed
    if not enabled():
        return None
    if _module is not None or _failed is not None:
        if _failed is not None and _required():
            raise RuntimeError(_failed)
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                _module = _import_built() or _build()
            except Exception as e:  # no compiler, no ninja, headers of another torch ...
                _failed = (f"fastddp: the native readiness hooks could not be built ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}); the Python hooks "
                           "are used (same gradients, ~3 us more per parameter per backward). "
                           "Set FASTDDP_NATIVE=0 to skip the build.")
                if _required():
                    raise RuntimeError(_failed) from e
                warnings.warn(_failed, RuntimeWarning, stacklevel=3)
    return _module


def _build():
    """torch's JIT builder where ninja is at hand; else the compiler directly,
    with the flags torch's builder would pass (machines with a compiler but
    no ninja, e.g. one with only triton's runtime needs installed)."""
    from torch.utils import cpp_extension
    if _has_ninja():
        return cpp_extension.load_inline(name=_name(), cpp_sources=[_SOURCE], extra_cflags=["-O3", "-ffp-contract=off"], verbose=False)
    return _build_direct()


def _has_ninja() -> bool:
    import shutil
    try:
        import ninja  # noqa: F401  (pip's ninja puts the binary on PATH)
        return True
    except ImportError:
        return shutil.which("ninja") is not None


def _build_direct():
    import fcntl
    import shutil
    import subprocess
    import sysconfig
    import tempfile
    from torch.utils import cpp_extension
    name, d, so = _built_path()
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++/g++) on PATH and no ninja")
    with open(os.path.join(d, "direct.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then import its result
        if not os.path.isfile(so):
            src = os.path.join(d, "main.cpp")
            with open(src, "w") as f:
                f.write("#include <torch/extension.h>\n" + _SOURCE)
            std = "-std=c++20" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 12) else "-std=c++17"
            incs = [a for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]] for a in ("-isystem", p)]
            libs = [f"-L{p}" for p in cpp_extension.library_paths()]
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
            os.close(fd)
            cmd = [cxx, f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H", *incs, "-fPIC", std,
                   "-O3", "-ffp-contract=off", "-shared", src, *libs, "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python", "-o", tmp]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                os.unlink(tmp)
                raise RuntimeError(f"{cxx} failed: {(out.stderr or out.stdout).strip()[-800:]}")
            os.replace(tmp, so)  # never a half-written module for another process to import
    mod = _import_built()
    if mod is None:
        raise RuntimeError(f"built {so} but could not import it")
    return mod


def _built_path() -> tuple[str, str, str]:
    """The module's name, its build folder (torch's extension cache) and
    the shared object's path there."""
    import importlib.machinery
    from torch.utils import cpp_extension
    name = _name()
    d = cpp_extension._get_build_directory(name, verbose=False)
    return name, d, os.path.join(d, name + importlib.machinery.EXTENSION_SUFFIXES[-1])


def _import_built():
    """The module a previous process built (the name hashes the source and
    torch's version), imported without re-running the build check (~0.5 s
    per process: every rank of every run pays it); None while absent or
    while another process holds the build lock."""
    import importlib.util
    name, d, so = _built_path()
    if not os.path.isfile(so) or os.path.exists(os.path.join(d, "lock")):
        return None
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _required() -> bool:
    return os.environ.get("FASTDDP_NATIVE", "").strip().lower() == "require"


def main() -> None:
    """``python -c "import fastddp._native as n; n.main()"``: build it now
    (CI and the GPU check do, before timed tests)."""
    import time
    t = time.perf_counter()
    mod = countdown_module()
    print(f"fastddp native readiness hooks: {'ready' if mod is not None else 'off (Python hooks)'} "
          f"in {time.perf_counter() - t:.1f} s")
