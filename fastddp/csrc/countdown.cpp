// The per-parameter readiness countdown (loaded by fastddp/_native.py): a
// C++ post hook on every parameter's AccumulateGrad node, as torch's reducer
// keeps it.  It counts each bucket down without Python and calls into Python
// once per bucket, when its last gradient is in (modes PY / FAST / IDLE: see
// the loader's docstring).
// narrow headers, not <torch/extension.h> (which pulls in all of libtorch's
// C++ frontend): the first build takes ~40% less compiler time
#include <torch/csrc/utils/pybind.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/div.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/utils/object_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using torch::autograd::variable_list;

// The CPU data path of one bucket (the default, batched_grad_copy and comm
// hook copies), as torch's reducer does it in C++: its grads read and checked
// here instead of one Python attribute read and check each, the same ATen ops
// as the Python pack (kernels/torch_path.py: _pack_plain, unpack_views), so
// the same bits.  Only fp32/fp64 buckets whose views tile the flat buffer;
// anything unusual is left to Python (the fallback and the oracle).
struct Slots {
  std::vector<int> idx;          // parameter index per position
  std::vector<at::Tensor> views;  // per position: its slot, shaped (and strided) as the parameter
  at::Tensor flat;
  bool few_large = false;         // _few_large: one op per tensor beats copy-then-scale
};

enum PackCode { PACKED = 0, PYTHON = 1, ALL_VIEWS = 2 };

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
  double scale_v = 0.0, divisor_v = 0.0;  // their values (0: none)
  double view_div = 0.0;          // > 0: a gradient that is its view already is divided by it in place
  std::vector<uint8_t> filled;    // per parameter, this iteration
  std::vector<int> nfilled;       // per bucket, this iteration
  std::vector<Slots> slots;       // per bucket: the native data path's (none: Python)
  std::vector<int> sizes;         // per bucket: its parameters
  // the issue chain (CPU, plain all-reduce): bucket complete -> pack ->
  // issued in bucket order, then wait -> unpack in an engine callback, with
  // no Python, as torch's reducer; Python is called once a step, after the
  // callback's unpacks (or to take the iteration over: chain_state)
  std::mutex chain_mu;            // held across pack and issue: one order
  bool chain = false;             // this iteration
  int chain_scaling = 0;
  double chain_w = 1.0;
  int chain_next = 0;             // buckets [0, chain_next) issued
  int chain_taken = 0;            // ... and [0, chain_taken) handed to Python
  // since the countdown was made (Countdown.served; Python reads them, it never adds them up): the
  // chain's collectives and their bytes, its native packs, and unpacks (not with gradient_as_bucket_view)
  int64_t issued_total = 0, bytes_total = 0, packs_total = 0, unpacks_total = 0;
  double chain_issued_at = 0.0;   // the last issue, CLOCK_MONOTONIC seconds (Python's perf_counter)
  double chain_first_at = 0.0;    // the first bucket complete this iteration (0: none yet), the same clock
  std::vector<uint8_t> chain_packed;
  std::vector<c10::intrusive_ptr<c10d::Work>> chain_works;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  PyObject* on_chain = nullptr;
  PyObject* on_output = nullptr;  // SecondBackward's hook (watch)

  ~State() {
    if (!Py_IsInitialized()) return;  // interpreter gone: leak, never touch it
    pybind11::gil_scoped_acquire gil;
    Py_XDECREF(on_bucket);
    Py_XDECREF(on_hook);
    Py_XDECREF(on_chain);
    Py_XDECREF(on_output);
    for (auto* h : ca_hooks) Py_XDECREF(h);
  }
};

// on_chain(b, at): at is the last issue's time (perf_counter's clock) where every bucket was issued
void call_chain(PyObject* fn, int arg, double at) {
  pybind11::gil_scoped_acquire gil;
  THPObjectPtr res(PyObject_CallFunction(fn, "id", arg, at));
  if (!res) throw python_error();
}

void call(PyObject* fn, int arg, bool flag, bool two) {
  pybind11::gil_scoped_acquire gil;
  THPObjectPtr res(two ? PyObject_CallFunction(fn, "iO", arg, flag ? Py_True : Py_False)
                       : PyObject_CallFunction(fn, "i", arg));
  if (!res) throw python_error();
}

double now() {  // CLOCK_MONOTONIC seconds: Python's time.perf_counter on Linux
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

at::Tensor wrapped(double v) {  // a Python number as an operand: the tensor's dtype wins
  auto t = at::scalar_tensor(v, at::TensorOptions().dtype(at::kDouble));
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

// The bucket's grads, each checked to be what the plain path copies:
// defined, dense, on the CPU, the slot's dtype and shape, not a graph
// (create_graph), not already the slot.  Returns false where one is not.
bool plain(State& st, const Slots& s, std::vector<at::Tensor>& grads, bool& all_views) {
  grads.clear();
  grads.reserve(s.idx.size());
  all_views = true;
  bool any_view = false;
  for (size_t k = 0; k < s.idx.size(); ++k) {
    const at::Tensor& g = st.vars[s.idx[k]].grad();
    const at::Tensor& v = s.views[k];
    if (!g.defined()) return all_views = false;
    if (g.is_same(v)) {
      any_view = true;
      continue;
    }
    all_views = false;
    if (any_view || g.layout() != at::kStrided || !g.device().is_cpu() || g.requires_grad() ||
        g.scalar_type() != v.scalar_type() || g.sizes() != v.sizes())
      return false;
    grads.push_back(g);
  }
  return !any_view;
}

// scaling: 0 a plain copy, 1 multiply by 1/w, 2 divide by w (the Python
// Scaling); alias: gradient_as_bucket_view, .grad becomes its slot.
int pack_bucket(State& st, int b, int scaling, double w, bool alias) {
  if (b < 0 || static_cast<size_t>(b) >= st.slots.size() || !st.slots[b].flat.defined()) return PYTHON;
  const Slots& s = st.slots[b];
  std::vector<at::Tensor> grads;
  bool all_views = false;
  if (!plain(st, s, grads, all_views)) return all_views ? ALL_VIEWS : PYTHON;
  at::NoGradGuard no_grad;
  const double scale = 1.0 / w;
  if (s.few_large) {  // torch.mul(g, 1/W, out=v) / torch.div(g, W, out=v) / v.copy_(g)
    for (size_t k = 0; k < grads.size(); ++k) {
      at::Tensor& v = const_cast<at::Tensor&>(s.views[k]);
      if (scaling == 2) at::div_out(v, grads[k], wrapped(w));
      else if (scaling == 1 && scale != 1.0) at::mul_out(v, grads[k], wrapped(scale));
      else v.copy_(grads[k]);
    }
  } else {  // _foreach_copy_ then one op on the whole flat buffer
    at::_foreach_copy_(s.views, grads);
    at::Tensor& flat = const_cast<at::Tensor&>(s.flat);
    if (scaling == 2) flat.div_(w);
    else if (scaling == 1 && scale != 1.0) flat.mul_(scale);
  }
  if (alias)
    for (size_t k = 0; k < s.idx.size(); ++k) st.vars[s.idx[k]].mutable_grad() = s.views[k];
  return PACKED;
}

// The reduced flat buffer back into .grad (torch's finalize_bucket_dense).
// Without bucket views: one _foreach_copy_ into the grads; returns -1, or
// -2 where one is missing or not plain (Python).  With them: a missing
// grad becomes its view; returns the position of a grad that is neither
// (Python names it), else -1.
int unpack_bucket(State& st, int b, bool views) {
  if (b < 0 || static_cast<size_t>(b) >= st.slots.size() || !st.slots[b].flat.defined()) return -2;
  const Slots& s = st.slots[b];
  at::NoGradGuard no_grad;
  if (views) {
    for (size_t k = 0; k < s.idx.size(); ++k) {
      at::Tensor& g = st.vars[s.idx[k]].mutable_grad();
      if (!g.defined()) g = s.views[k];
      else if (!g.is_same(s.views[k])) return static_cast<int>(k);
    }
    return -1;
  }
  std::vector<at::Tensor> grads;
  grads.reserve(s.idx.size());
  for (size_t k = 0; k < s.idx.size(); ++k) {
    const at::Tensor& g = st.vars[s.idx[k]].grad();
    const at::Tensor& v = s.views[k];
    if (!g.defined() || g.layout() != at::kStrided || !g.device().is_cpu() ||
        g.scalar_type() != v.scalar_type() || g.sizes() != v.sizes() || g.is_alias_of(s.flat))
      return -2;
    grads.push_back(g);
  }
  at::_foreach_copy_(grads, s.views);
  return -1;
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
    if (bucket >= 0 && !chain(bucket)) call(st_->on_bucket, bucket, false, false);
    return outputs;
  }

  // The issue chain for complete bucket b: its pack (the early copy's, or
  // one native pack), then every packed bucket from the next to issue on,
  // in bucket order (every rank issues the same collectives in the same
  // order).  False: no chain this iteration (Python's on_bucket).  A bucket
  // it cannot pack (a missing grad, a partial early copy, ...) hands the
  // iteration over to Python: on_chain(b) takes the chain's state
  // (Countdown.chain_state) and packs b itself; later buckets call
  // on_bucket.  Every bucket issued: the engine callback (finish) is
  // queued; an error: on_chain(-2).
  bool chain(int b) {
    std::unique_lock<std::mutex> lk(st_->chain_mu);
    if (!st_->chain) return false;
    State& st = *st_;
    if (st.chain_first_at == 0.0) st.chain_first_at = now();
    int handed = -3;  // -3: nothing for Python now, else: Python takes b
    try {
      int filled;
      {
        std::lock_guard<std::mutex> lock(st.mu);
        filled = st.nfilled.at(b);
      }
      int code = PYTHON;
      if (filled == st.sizes.at(b)) {
        code = PACKED;  // the early copy put every grad in its slot, scaled
      } else if (filled == 0) {
        code = pack_bucket(st, b, st.chain_scaling, st.chain_w, st.alias);
        if (code == PACKED) ++st.packs_total;
        if (code == ALL_VIEWS) {  // the grads are the bucket already (torch: one flat div_)
          at::NoGradGuard no_grad;
          if (st.chain_scaling != 0) const_cast<at::Tensor&>(st.slots[b].flat).div_(st.chain_w);
          code = PACKED;
        }
      }
      if (code != PACKED) {
        st.chain = false;
        handed = b;
      } else {
        st.chain_packed[b] = 1;
        const int n = static_cast<int>(st.chain_packed.size());
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::SUM;
        while (st.chain_next < n && st.chain_packed[st.chain_next]) {
          std::vector<at::Tensor> one{st.slots[st.chain_next].flat};
          st.chain_works[st.chain_next] = st.pg->allreduce(one, opts);
          ++st.issued_total;
          st.bytes_total += static_cast<int64_t>(one[0].nbytes());
          ++st.chain_next;
        }
        if (st.chain_next == n) {
          st.chain_issued_at = now();
          std::shared_ptr<State> keep = st_;
          torch::autograd::Engine::get_default_engine().queue_callback([keep]() { finish(*keep); });
        }
        handed = -3;
      }
    } catch (...) {
      st.chain = false;
      lk.unlock();
      try {
        call_chain(st.on_chain, -2, 0.0);  // Python drops the iteration (abort)
      } catch (...) {
      }
      throw;
    }
    lk.unlock();
    if (handed != -3) call_chain(st.on_chain, handed, 0.0);
    return true;
  }

  // The end of a backward whose buckets the chain issued (an engine
  // callback, as torch's finalize_backward; no GIL held): wait for every
  // Work, unpack each bucket in order, then Python once (on_chain(-3 - k):
  // the reducer's bookkeeping and finalize; buckets from k on, which the
  // native unpack declined, go to Python's unpack; k = every bucket: the
  // hooks are set idle here, as Arming.finished(idle=True) would).  Nothing else runs on
  // this thread between the last issue and the wait, so on a busy host the
  // collective's threads get the cores.  A failed wait or unpack:
  // on_chain(-2) (Python drops the iteration), then the error is the
  // backward's.
  static void finish(State& st) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    {
      std::lock_guard<std::mutex> lk(st.chain_mu);
      works.swap(st.chain_works);
      st.chain_works.assign(works.size(), c10::intrusive_ptr<c10d::Work>());
    }
    const int n = static_cast<int>(works.size());
    int done = n;
    try {  // a failed wait or unpack: Python drops the iteration, as _finalize's own errors do
      for (auto& w : works)
        if (w) w->wait();
      for (int b = 0; b < n; ++b)
        if (unpack_bucket(st, b, st.alias) != -1) {
          done = b;
          break;
        }
    } catch (...) {
      try {
        call_chain(st.on_chain, -2, 0.0);
      } catch (...) {
      }
      throw;
    }
    double at;
    {
      std::lock_guard<std::mutex> lk(st.chain_mu);
      if (!st.alias) st.unpacks_total += done;
      at = st.chain_issued_at;
      if (done == n) {  // every bucket reduced into .grad: the hooks idle until the next arm (finished(idle))
        st.chain = false;
        st.chain_taken = n;
        std::lock_guard<std::mutex> lock(st.mu);
        st.mode = 2;
      }
    }
    call_chain(st.on_chain, -3 - done, at);
  }

  // torch's mark_variable_ready_dense for a gradient that is not yet its
  // bucket view: view = grad * (1/W), grad / W (batched_grad_copy's copy and
  // division in one pass, the same bits) or a plain copy (a comm hook), then
  // .grad = view with gradient_as_bucket_view.  A gradient that is its view
  // already (gradient_as_bucket_view after the first step): view.div_(W)
  // where the mode multiplies (torch's per-view div_, read while the
  // gradient is still in cache, not by one pass over the flat bucket after
  // its last gradient); batched_grad_copy and a comm hook leave it to the
  // pack (torch: one flat div_, or none).  Anything unusual (create_graph,
  // another dtype or shape, not strided) is left to the Python pack, which
  // applies torch's rules.
  bool copy_early() {
    const at::Tensor& dst = st_->dst[index_];
    at::Tensor& grad = st_->vars[index_].mutable_grad();
    if (!grad.defined() || grad.layout() != at::kStrided || grad.requires_grad() || !grad.device().is_cpu() ||
        grad.scalar_type() != dst.scalar_type() || grad.sizes() != dst.sizes())
      return false;
    at::NoGradGuard no_grad;
    at::Tensor& out = const_cast<at::Tensor&>(dst);
    if (grad.is_alias_of(dst)) {
      if (!(st_->view_div > 0.0) || !grad.is_same(dst)) return false;
      out.div_(st_->view_div);
      return true;
    }
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

// A pre hook on each output node of a synced forward (Countdown.watch, for
// SecondBackward): a later backward through these outputs, after the
// forward's first one was reduced, re-arms the reducer from Python.  While
// the iteration is armed FAST (its first backward, not reduced yet) nothing
// can need re-arming: no Python call then.  One C++ object per node, not
// Python's hook dict and handle (~30 us a step on the transformer).
struct WatchHook : torch::autograd::FunctionPreHook {
  explicit WatchHook(std::shared_ptr<State> st) : st_(std::move(st)) {}

  variable_list operator()(const variable_list& grads) override {
    {
      std::lock_guard<std::mutex> lock(st_->mu);
      if (st_->mode == 1 || st_->on_output == nullptr) return grads;
    }
    pybind11::gil_scoped_acquire gil;
    THPObjectPtr res(PyObject_CallFunctionObjArgs(st_->on_output, Py_None, nullptr));
    if (!res) throw python_error();
    return grads;
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    Py_INCREF(st_->on_output);  // compiled autograd calls the Python hook (it returns None)
    args.add_pre_hook(c10::SafePyObject(st_->on_output, getPyInterpreter()));
  }

 private:
  std::shared_ptr<State> st_;
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
    std::lock_guard<std::mutex> lk(st_->chain_mu);
    st_->chain = false;
    st_->pg.reset();
    st_->chain_works.clear();
    st_->slots.clear();
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

  // early: < 0 no early copy this iteration, 0 a plain copy, else the scale
  // (1/W, torch's mul_out); divide > 0: divide by it instead (batched);
  // alias: .grad becomes the view (gradient_as_bucket_view)
  // chain, scaling, w: this iteration's issue chain (arm_chain_locked)
  // refresh: refresh() first (a synced forward's hooks follow replaced nodes in the same call)
  // view_div: W, by which the early copy divides a gradient that is its view already (0: none)
  void arm(int mode, const std::vector<int>& sizes, double early, double divide, bool alias, bool chain,
           int scaling, double w, bool refresh_nodes, double view_div) {
    if (refresh_nodes) refresh();
    std::lock_guard<std::mutex> lk(st_->chain_mu);
    {
      std::lock_guard<std::mutex> lock(st_->mu);
      st_->mode = mode;
      st_->pending = sizes;
      std::fill(st_->marked.begin(), st_->marked.end(), 0);
      st_->early = mode == 1 && early >= 0;
      st_->alias = alias;
      // the same wrapped number as last step where the value is (no allocation a step)
      const double sv = st_->early && early > 0 && !(divide > 0) ? early : 0.0;
      const double dv = st_->early && divide > 0 ? divide : 0.0;
      if (sv == 0.0) st_->scale.reset();
      else if (!st_->scale.defined() || st_->scale_v != sv) st_->scale = wrapped(sv);
      if (dv == 0.0) st_->divisor.reset();
      else if (!st_->divisor.defined() || st_->divisor_v != dv) st_->divisor = wrapped(dv);
      st_->scale_v = sv;
      st_->divisor_v = dv;
      st_->view_div = st_->early && alias ? view_div : 0.0;
      std::fill(st_->filled.begin(), st_->filled.end(), 0);
      st_->nfilled.assign(sizes.size(), 0);
    }
    arm_chain_locked(chain, scaling, w);
  }

  // The chain's process group (a C++ one: dist's gloo group); false where
  // this object is not one this module can call (then no chain).
  bool set_group(pybind11::object pg, pybind11::object on_chain) {
    c10::intrusive_ptr<c10d::ProcessGroup> p;
    try {
      p = pg.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
    } catch (const pybind11::cast_error&) {
      return false;
    }
    std::lock_guard<std::mutex> lk(st_->chain_mu);
    st_->pg = p;
    Py_XDECREF(st_->on_chain);
    st_->on_chain = on_chain.release().ptr();
    return true;
  }

  // This iteration's chain (arm's): scaling and w as pack's; off: none.  chain_mu held.
  void arm_chain_locked(bool on, int scaling, double w) {
    std::lock_guard<std::mutex> lock(st_->mu);
    const size_t n = st_->pending.size();
    st_->chain = on && st_->pg && st_->on_chain && st_->slots.size() == n;
    for (size_t b = 0; st_->chain && b < n; ++b) st_->chain = st_->slots[b].flat.defined();
    st_->chain_scaling = scaling;
    st_->chain_w = w;
    st_->chain_next = 0;
    st_->chain_taken = 0;
    st_->chain_first_at = 0.0;
    st_->chain_packed.assign(n, 0);
    st_->chain_works.assign(n, c10::intrusive_ptr<c10d::Work>());
    st_->sizes = st_->pending;
  }

  // When this iteration's first bucket was complete (perf_counter's clock;
  // None: none yet): what a probe of the Python pack would have stamped.
  std::optional<double> chain_first_ready() {
    std::lock_guard<std::mutex> lk(st_->chain_mu);
    if (st_->chain_first_at == 0.0) return std::nullopt;
    return st_->chain_first_at;
  }

  // (collectives, bytes, native packs, native unpacks) since the countdown was made
  std::tuple<int64_t, int64_t, int64_t, int64_t> served() {
    std::lock_guard<std::mutex> lk(st_->chain_mu);
    return {st_->issued_total, st_->bytes_total, st_->packs_total, st_->unpacks_total};
  }

  // (issued, packed per bucket, the issued buckets' Works not waited for
  // yet, the last issue's time): what Python takes over.
  pybind11::tuple chain_state() {
    std::lock_guard<std::mutex> lk(st_->chain_mu);
    pybind11::list works;
    for (int k = 0; k < st_->chain_next && static_cast<size_t>(k) < st_->chain_works.size(); ++k)
      if (st_->chain_works[k]) works.append(pybind11::cast(st_->chain_works[k]));
    for (auto& w : st_->chain_works) w.reset();
    st_->chain_taken = st_->chain_next;
    auto packed = pybind11::bytes(reinterpret_cast<const char*>(st_->chain_packed.data()), st_->chain_packed.size());
    return pybind11::make_tuple(st_->chain_next, packed, works, st_->chain_issued_at);
  }

  void set_mode(int mode) {
    std::lock_guard<std::mutex> lk(st_->chain_mu);
    if (mode != 1) st_->chain = false;  // every hook to Python (a second backward, an error) or none
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

  // SecondBackward's hook, called by the WatchHook of each watched output node.
  void set_on_output(pybind11::object hook) {
    pybind11::object old = pybind11::reinterpret_steal<pybind11::object>(st_->on_output);
    st_->on_output = hook.release().ptr();
  }

  // A WatchHook on the node of each output (once per node).
  void watch(const std::vector<at::Tensor>& outputs) {
    std::vector<const torch::autograd::Node*> seen;
    for (const auto& t : outputs) {
      const auto& fn = t.grad_fn();
      if (!fn || std::find(seen.begin(), seen.end(), fn.get()) != seen.end()) continue;
      seen.push_back(fn.get());
      fn->add_pre_hook(std::make_unique<WatchHook>(st_));
    }
  }

  // Bucket b's slots (None: bucket b takes the Python path); called when
  // the buckets change.
  void set_slots(int b, std::optional<std::vector<int>> idx, std::optional<std::vector<at::Tensor>> views,
                 std::optional<at::Tensor> flat) {
    if (b < 0) throw pybind11::index_error("fastddp native: bucket index < 0");
    if (st_->slots.size() <= static_cast<size_t>(b)) st_->slots.resize(b + 1);
    Slots& s = st_->slots[b];
    s = Slots();
    if (!idx || !views || !flat || nodes_.empty()) return;  // (removed: the parameters are gone)
    TORCH_CHECK(idx->size() == views->size(), "fastddp native: one view per parameter of the bucket");
    for (int i : *idx) TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < st_->vars.size(), "fastddp native: bad index");
    s.idx = *idx;
    s.views = *views;
    s.flat = *flat;
    int64_t total = 0;
    for (auto& v : s.views) total += v.numel();
    const int64_t n = static_cast<int64_t>(s.views.size());
    s.few_large = n <= 64 && total >= n * (int64_t(1) << 18);
  }

  void clear_slots(int count) { st_->slots.assign(std::max(count, 0), Slots()); }

  int pack(int b, int scaling, double w, bool alias) { return pack_bucket(*st_, b, scaling, w, alias); }

  int unpack(int b, bool views) { return unpack_bucket(*st_, b, views); }

 private:
  std::shared_ptr<State> st_;
  std::vector<at::Tensor> params_;
  std::vector<NodePtr> nodes_;
  std::vector<uintptr_t> keys_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Countdown>(m, "Countdown")
      .def(pybind11::init<const std::vector<at::Tensor>&, pybind11::object, pybind11::object,
                          std::vector<pybind11::object>>())
      .def("remove", &Countdown::remove)
      .def("refresh", &Countdown::refresh)
      .def("set_buckets", &Countdown::set_buckets)
      .def("arm", &Countdown::arm, pybind11::arg("mode"), pybind11::arg("sizes"), pybind11::arg("early") = -1.0,
           pybind11::arg("divide") = 0.0, pybind11::arg("alias") = true, pybind11::arg("chain") = false,
           pybind11::arg("scaling") = 0, pybind11::arg("w") = 1.0, pybind11::arg("refresh") = false,
           pybind11::arg("view_div") = 0.0)
      .def("set_mode", &Countdown::set_mode)
      .def("set_group", &Countdown::set_group)
      .def("chain_first_ready", &Countdown::chain_first_ready)
      .def("chain_state", &Countdown::chain_state)
      .def("served", &Countdown::served)
      .def("mode", &Countdown::mode)
      .def("marked", &Countdown::marked)
      .def("set_views", &Countdown::set_views)
      .def("filled", &Countdown::filled)
      .def("filled_marks", &Countdown::filled_marks)
      .def("set_slots", &Countdown::set_slots)
      .def("clear_slots", &Countdown::clear_slots)
      .def("pack", &Countdown::pack, pybind11::arg("bucket"), pybind11::arg("scaling"), pybind11::arg("w"),
           pybind11::arg("alias"))
      .def("unpack", &Countdown::unpack, pybind11::arg("bucket"), pybind11::arg("views"))
      .def("set_on_output", &Countdown::set_on_output)
      .def("watch", &Countdown::watch)
      .def_property_readonly("attached", &Countdown::attached);
}
