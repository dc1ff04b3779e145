// Block-scaled fp8 (e4m3) on the CPU (loaded by kernels/_fp8_native.py).
#include <torch/extension.h>

#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>
#include <cstring>
#include <algorithm>
#include <optional>
#include <vector>

namespace {

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

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float fp8_scale(float amax) {  // reference.fp8_scales, from the bits (no libm call)
  const uint32_t u = float_bits(amax);
  if (u == 0u) return 1.0f;
  const int32_t e = static_cast<int32_t>(u >> 23);  // biased exponent (amax >= 0, finite)
  // amax = m 2^x, m in [0.5, 1): x = e - 126 for a normal amax; m <= 0.875 iff the
  // mantissa bits are <= 0x600000 (1.75 / 2); a subnormal amax clamps to -126 anyway
  int32_t k = ((u & 0x7FFFFFu) <= 0x600000u) ? e - 135 : e - 134;
  if (e == 0 || k < -126) k = -126;
  return bits_float(static_cast<uint32_t>(k + 127) << 23);
}

const float* checked_x(const at::Tensor& x) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(), "fastddp native fp8: x must be contiguous fp32 on the CPU");
  return x.data_ptr<float>();
}

// The error-feedback residual (nullptr: none), checked against x's n elements.
float* residual_ptr(const std::optional<at::Tensor>& residual, int64_t n) {
  if (!residual.has_value()) return nullptr;
  TORCH_CHECK(residual->is_cpu() && residual->scalar_type() == at::kFloat && residual->is_contiguous() &&
              residual->numel() == n, "fastddp native fp8: the residual must be contiguous fp32 like x");
  return residual->data_ptr<float>();
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
  const uint32_t bits = float_bits(y * inv);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t a = bits & 0x7FFFFFFFu;
  const float t = (bits_float(a) * 512.0f + 8388608.0f) - 8388608.0f;
  const uint32_t sub = static_cast<uint32_t>(static_cast<int32_t>(t));
  const uint32_t tbits = float_bits(t * 0.001953125f);
  const uint32_t kept = (a + 0x7FFFFu + ((a >> 20) & 1u)) & 0xFFF00000u;
  const uint32_t nor = (kept >> 20) - (120u << 3);
  const uint32_t m = 0u - static_cast<uint32_t>(a < 0x3C800000u);  // |v| < 2^-6
  const uint32_t mb = (tbits & m) | (kept & ~m) | sign;
  *back = bits_float(mb) * s;
  return static_cast<uint8_t>((sign >> 24) | (sub & m) | (nor & ~m));
}

// One e4m3 code's fp32 value from its bits (no table: the loops vectorize):
// exponent field 0 is m * 2^-9 (e4m3's subnormals, exact in fp32); the two
// NaN codes take the table's NaN bits (what the cast gives), so every code
// decodes to the table's value, bit for bit.
inline float fp8_decode(uint8_t c, uint32_t nan_pos, uint32_t nan_neg) {
  const uint32_t u = c;
  const uint32_t sign = (u & 0x80u) << 24;
  const uint32_t e = (u >> 3) & 0xFu;
  const uint32_t m = u & 7u;
  const uint32_t subb = float_bits(static_cast<float>(static_cast<int32_t>(m)) * 0.001953125f);  // m * 2^-9
  const uint32_t nor = ((e + 120u) << 23) | (m << 20);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(e == 0u);
  const uint32_t is_nan = 0u - static_cast<uint32_t>((u & 0x7Fu) == 0x7Fu);
  const uint32_t nan = nan_pos ^ ((nan_pos ^ nan_neg) & (0u - (u >> 7)));
  const uint32_t v = (((subb & is_sub) | (nor & ~is_sub)) | sign) & ~is_nan;
  return bits_float(v | (nan & is_nan));
}

// The same value times a scale s, in fewer operations (the loops' cost on
// the CPU is these operations, not memory): the code's 7 magnitude bits put
// where fp32's exponent and mantissa start ARE an fp32 with the code's
// exponent field and mantissa, biased by 127 instead of 7 (exponent field 0:
// an fp32 subnormal, m * 2^-129), so times 2^120 it is the code's value,
// exactly, subnormal codes included; the scale rides in that multiply
// (s2 = s * 2^120, exact while s < 2^8: foldable), one rounding
// either way, so the product is fp8_decode(c) * s bit for bit.  NaN codes
// take the table's NaN, as there.  Valid only where the CPU reads fp32
// subnormal inputs as themselves (subnormals_read).
inline float fp8_decode_times(uint8_t c, float s2, uint32_t nan_pos, uint32_t nan_neg) {
  const uint32_t u = c;
  const uint32_t mag = u & 0x7Fu;
  const float v = bits_float((mag << 20) | ((u & 0x80u) << 24)) * s2;
  const uint32_t is_nan = 0u - static_cast<uint32_t>(mag == 0x7Fu);
  const uint32_t nan = nan_pos ^ ((nan_pos ^ nan_neg) & (0u - (u >> 7)));
  return bits_float((float_bits(v) & ~is_nan) | (nan & is_nan));
}

// |s| < 2^8 (and finite): s * 2^120 is finite and exact.
inline bool foldable(float s) { return (float_bits(s) & 0x7FFFFFFFu) < 0x43800000u; }

// Whether this thread's floating point reads fp32 subnormals as themselves
// (x86's DAZ flag, or ARM's FZ, which torch.set_flush_denormal(True) sets,
// reads them as 0): asked at every call, in the calling thread (the flags are
// per thread).  volatile: the product is computed here, not by the compiler.
inline bool subnormals_read() {
  volatile uint32_t tiny = 1u << 20;  // 2^-129, an fp32 subnormal
  volatile float big = 0x1p120f;
  return bits_float(tiny) * big == 0x1p-9f;
}

// fp8_round in fewer operations where the block's scale folds (s2 = s *
// 2^120, foldable): the subnormal code is read from the bits of the sum that
// rounds it (|v| * 2^9 + 2^23 is 2^23 + the code, nearest even: no float to
// int conversion), and the rounded value times s is the code's value times s
// (fp8_decode_times' rule), from the code's bits: the same code and the same
// value bit for bit (every fp32 with |v| <= 448 checked against fp8_round).
inline uint8_t fp8_round_folded(float y, float inv, float s2, float* back) {
  const uint32_t bits = float_bits(y * inv);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t a = bits & 0x7FFFFFFFu;
  const uint32_t sub = float_bits(bits_float(a) * 512.0f + 8388608.0f) - 0x4B000000u;
  const uint32_t kept = (a + 0x7FFFFu + ((a >> 20) & 1u)) & 0xFFF00000u;
  const uint32_t nor = (kept >> 20) - (120u << 3);
  const uint32_t m = 0u - static_cast<uint32_t>(a < 0x3C800000u);  // |v| < 2^-6
  const uint32_t mag = (sub & m) | (nor & ~m);
  *back = bits_float((mag << 20) | sign) * s2;
  return static_cast<uint8_t>((sign >> 24) | mag);
}

// One block's codes from y (its scale s, inv = 1 / s) and, RES, the
// residual's new value in the same loop (no branch inside: it vectorizes).
template <bool RES, bool FOLD>
inline void round_block(const float* __restrict y, float* __restrict rb, uint8_t* __restrict qb, float inv, float s,
                        int64_t block) {
  const float s2 = s * 0x1p120f;  // (used where FOLD: foldable(s))
  for (int64_t i = 0; i < block; ++i) {
    float back;
    qb[i] = FOLD ? fp8_round_folded(y[i], inv, s2, &back) : fp8_round(y[i], inv, s, &back);
    if (RES) {
      // the contract's residual is 0 where it is not finite: a value near
      // fp32's max rounds to a code whose value times s overflows
      const uint32_t db = float_bits(y[i] - back);
      rb[i] = bits_float(db & (0u - static_cast<uint32_t>((db & 0x7F800000u) != 0x7F800000u)));
    }
  }
}

// max |x| as bits: for |x| (sign cleared) the integer order is the float
// order, NaN/inf sit above 0x7F800000 (so one reduction finds both), and an
// integer max vectorizes where a float one may not (NaN rules).
inline uint32_t max_abs_bits(const float* __restrict y, int64_t block) {
  uint32_t top = 0;
  for (int64_t i = 0; i < block; ++i) {
    const uint32_t u = float_bits(y[i]) & 0x7FFFFFFFu;
    top = u > top ? u : top;
  }
  return top;
}

// The loops, compiled twice (AVX2 and the x86-64 baseline; the loader picks
// one per machine): the same IEEE operations either way, no contraction.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTDDP_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FASTDDP_CLONES
#endif

// __restrict: a uint8_t store may alias anything, so without it nothing vectorizes.
// One block: fill(o, y) puts its values in y, plus the residual where there is
// one -> their max -> codes, and the residual's new value in the same loop as
// the codes (RES: no branch inside the loops, each vectorizes).
template <bool RES, class Fill>
inline int64_t quantize_blocks(Fill&& fill, float* __restrict rp, uint8_t* __restrict qp, float* __restrict sp,
                               int64_t nb, int64_t block, float* __restrict y, bool fold) {
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t o = b * block;
    fill(o, y);
    if (RES) {
      for (int64_t i = 0; i < block; ++i) y[i] = y[i] + rp[o + i];
    }
    const uint32_t top = max_abs_bits(y, block);
    if (top >= 0x7F800000u) return b;  // a NaN or inf
    const float s = fp8_scale(bits_float(top));
    const float inv = 1.0f / s;  // a power of two: exact
    sp[b] = s;
    uint8_t* __restrict qb = qp + o;
    float* __restrict rb = RES ? rp + o : nullptr;
    if (fold && foldable(s)) {
      round_block<RES, true>(y, rb, qb, inv, s, block);
    } else {
      round_block<RES, false>(y, rb, qb, inv, s, block);
    }
  }
  return nb;
}

FASTDDP_CLONES int64_t quantize_loop(const float* __restrict xp, float* __restrict rp, uint8_t* __restrict qp,
                                     float* __restrict sp, int64_t nb, int64_t block, float* __restrict y, bool fold) {
  auto fill = [xp, block](int64_t o, float* __restrict yy) {
    for (int64_t i = 0; i < block; ++i) yy[i] = xp[o + i];
  };
  return rp ? quantize_blocks<true>(fill, rp, qp, sp, nb, block, y, fold) : quantize_blocks<false>(fill, rp, qp, sp, nb, block, y, fold);
}

// A stretch of the range being quantized: ``src`` times the scale (a
// gradient the pack would have copied there), or the stage itself (nullptr:
// what the pack leaves alone, zeros of exempt slots and padding).
struct Seg {
  int64_t start, len;
  const float* src;
};

// The pack's product (src * scale in fp32, rounded once: the bits the pack
// stores) read straight from the gradients into the block, so the stage is
// neither written nor read again: one pass instead of two.
FASTDDP_CLONES int64_t quantize_gather_loop(const Seg* segs, float fs, const float* __restrict xp,
                                            float* __restrict rp, uint8_t* __restrict qp, float* __restrict sp,
                                            int64_t nb, int64_t block, float* __restrict y, bool fold) {
  size_t p = 0;  // the first segment not wholly before the block
  auto fill = [&p, segs, fs, xp, block](int64_t o, float* __restrict yy) {
    for (int64_t pos = o; pos < o + block;) {
      const Seg& g = segs[p];
      const int64_t end = std::min(g.start + g.len, o + block);
      float* __restrict out = yy + (pos - o);
      const int64_t m = end - pos;
      if (g.src) {
        const float* __restrict in = g.src + (pos - g.start);
        for (int64_t i = 0; i < m; ++i) out[i] = in[i] * fs;
      } else {
        const float* __restrict in = xp + pos;
        for (int64_t i = 0; i < m; ++i) out[i] = in[i];
      }
      pos = end;
      if (pos == g.start + g.len) ++p;
    }
  };
  return rp ? quantize_blocks<true>(fill, rp, qp, sp, nb, block, y, fold) : quantize_blocks<false>(fill, rp, qp, sp, nb, block, y, fold);
}

FASTDDP_CLONES void dequantize_loop(const uint8_t* __restrict qp, const float* __restrict sp, float* __restrict op,
                                    int64_t nb, int64_t block, bool fold) {
  const uint32_t np = float_bits(g_fp8_lut[0x7F]), nn = float_bits(g_fp8_lut[0xFF]);
  for (int64_t b = 0; b < nb; ++b) {
    const float s = sp[b];
    const uint8_t* __restrict qb = qp + b * block;
    float* __restrict ob = op + b * block;
    if (fold && foldable(s)) {
      const float s2 = s * 0x1p120f;
      for (int64_t i = 0; i < block; ++i) ob[i] = fp8_decode_times(qb[i], s2, np, nn);
    } else {
      for (int64_t i = 0; i < block; ++i) ob[i] = fp8_decode(qb[i], np, nn) * s;
    }
  }
}

FASTDDP_CLONES int64_t reduce_loop(const uint8_t* sq, const float* ss, uint8_t* oq, float* os, int64_t n, int64_t nb,
                                   int64_t world, int64_t block, float* __restrict acc, bool fold) {
  const uint32_t np = float_bits(g_fp8_lut[0x7F]), nn = float_bits(g_fp8_lut[0xFF]);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t o = b * block;
    const float s0 = ss[b];
    if (fold && foldable(s0)) {
      const float s2 = s0 * 0x1p120f;
      for (int64_t i = 0; i < block; ++i) acc[i] = fp8_decode_times(sq[o + i], s2, np, nn);
    } else {
      for (int64_t i = 0; i < block; ++i) acc[i] = fp8_decode(sq[o + i], np, nn) * s0;
    }
    for (int64_t k = 1; k < world; ++k) {
      const float sk = ss[k * nb + b];
      const uint8_t* qk = sq + k * n + o;
      if (fold && foldable(sk)) {
        const float s2 = sk * 0x1p120f;
        for (int64_t i = 0; i < block; ++i) acc[i] = acc[i] + fp8_decode_times(qk[i], s2, np, nn);
      } else {
        for (int64_t i = 0; i < block; ++i) acc[i] = acc[i] + fp8_decode(qk[i], np, nn) * sk;
      }
    }
    const uint32_t top = max_abs_bits(acc, block);
    if (top >= 0x7F800000u) return b;  // NaN/inf: nothing of block b written yet (out may alias slice 0)
    const float s = fp8_scale(bits_float(top));
    const float inv = 1.0f / s;
    os[b] = s;
    if (fold && foldable(s)) {
      round_block<false, true>(acc, nullptr, oq + o, inv, s, block);
    } else {
      round_block<false, false>(acc, nullptr, oq + o, inv, s, block);
    }
  }
  return nb;
}

int64_t fp8_quantize(const at::Tensor& x, const std::optional<at::Tensor>& residual, at::Tensor q,
                     at::Tensor scales, int64_t block) {
  const int64_t n = x.numel();
  const float* xp = checked_x(x);
  check_fp8_args(q, scales, n, block);
  float* rp = residual_ptr(residual, n);
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  std::vector<float> y(block);
  pybind11::gil_scoped_release nogil;
  return quantize_loop(xp, rp, qp, sp, n / block, block, y.data(), subnormals_read());
}

int64_t fp8_quantize_gather(const std::vector<at::Tensor>& parts, const std::vector<int64_t>& offs, double scale,
                            const at::Tensor& x, const std::optional<at::Tensor>& residual, at::Tensor q,
                            at::Tensor scales, int64_t block) {
  const int64_t n = x.numel();
  const float* xp = checked_x(x);
  check_fp8_args(q, scales, n, block);
  float* rp = residual_ptr(residual, n);
  TORCH_CHECK(parts.size() == offs.size(), "fastddp native fp8: one offset per part");
  std::vector<Seg> segs;
  int64_t pos = 0;
  for (size_t k = 0; k < parts.size(); ++k) {
    const at::Tensor& t = parts[k];
    const int64_t a = offs[k], len = t.numel();
    TORCH_CHECK(t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "fastddp native fp8: part ", k, " must be contiguous fp32 on the CPU");
    TORCH_CHECK(a >= pos && a + len <= n, "fastddp native fp8: part ", k, " at ", a, " (", len,
                " elements) is not after the previous one and inside x (", n, ")");
    if (a > pos) segs.push_back({pos, a - pos, nullptr});
    if (len > 0) segs.push_back({a, len, t.data_ptr<float>()});
    pos = a + len;
  }
  if (pos < n) segs.push_back({pos, n - pos, nullptr});
  std::vector<float> y(block);
  const float fs = static_cast<float>(scale);  // the pack's C(scale)
  pybind11::gil_scoped_release nogil;
  return quantize_gather_loop(segs.data(), fs, xp, rp, q.data_ptr<uint8_t>(),
                              scales.data_ptr<float>(), n / block, block, y.data(), subnormals_read());
}

void fp8_dequantize(const at::Tensor& q, const at::Tensor& scales, at::Tensor out, int64_t block) {
  const int64_t n = out.numel();
  TORCH_CHECK(out.is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous(), "fastddp native fp8: out must be contiguous fp32 on the CPU");
  check_fp8_args(q, scales, n, block);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  pybind11::gil_scoped_release nogil;
  dequantize_loop(qp, sp, op, n / block, block, subnormals_read());
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
  std::vector<float> acc(block);
  pybind11::gil_scoped_release nogil;
  return reduce_loop(sq, ss, oq, os, n, nb, world, block, acc.data(), subnormals_read());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_quantize", &fp8_quantize);
  m.def("fp8_dequantize", &fp8_dequantize);
  m.def("fp8_reduce_shards", &fp8_reduce_shards);
  m.def("fp8_quantize_gather", &fp8_quantize_gather);
}
