// Selective scan of Mamba on the CPU (Mamba paper, Algorithm 2; eq. 2a/2b with the discretization of eq. 4 as
// the authors' code applies it: ZOH for A, Euler for B), forward and recompute backward, as the torch.library ops
//
//   hf_densessm::selective_scan_cpu_fwd(u, delta, A, B, C, D?, z?, delta_bias?, delta_softplus, initial_state?,
//                                       reset?) -> (y, last_state, chunk_states)
//   hf_densessm::selective_scan_cpu_bwd(dy?, dlast?, u, delta, A, B, C, D?, z?, delta_bias?, delta_softplus,
//                                       initial_state?, reset?, chunk_states)
//       -> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state)
//
// The recurrence, per batch row b, channel d and state index n:
//
//   dt_t = softplus(delta_t + delta_bias)                  (bias and softplus optional)
//   h_t  = exp(dt_t A) h_{t-1} + dt_t B_t u_t              (h_{t-1} := 0 where reset[b, t]; h_{-1} = initial state)
//   y_t  = (sum_n C_{t,n} h_{t,n} + D u_t) * silu(z_t)     (D and z optional)
//
// Every floating tensor must have one dtype, float32 or float64 (the Python wrapper, hf_densessm/ops/cpu_kernel.py,
// casts to the compute dtype and back).
//
// Layout: token-major. The kernel works on blocks of W channels (W = one at::vec::Vectorized<T>: 16 floats on
// AVX-512, 8 on AVX2) and walks the tokens; at each token it loads u, delta, z (and dy) of the block, contiguous in
// memory, broadcasts B[t, n] and C[t, n] per state n and keeps h as `state` vectors of the block (state padded to
// a power of two with A = B = C = 0, which keeps the padded states at 0). So the (batch, dim, length) tensors u,
// delta, z, dy are read in place, without a copy, when their channel stride is 1 (the transposed views of
// (batch, length, dim) tensors the model passes), with any batch and token strides; others are copied to that
// layout once. B and C (batch, state, length) are read in place when their state stride is 1 and the state size
// is a power of two, else copied to a padded (batch, length, state) buffer. The outputs y, du, ddelta, dz are
// (batch, dim, length) views of fresh (batch, length, dim) tensors (stride (length * dim, 1, dim)), dB and dC
// views of (batch, length, state) tensors: their `.transpose(1, 2)` is contiguous. last_state, dinitial_state
// are contiguous (batch, dim, state); chunk_states, the state entering every kCheckpoint-token chunk (before a
// reset at the chunk's first token), contiguous (batch, dim, n_chunks, state).
//
// Work split: at::parallel_for over (batch x channel block) in the forward pass and over (batch x group of
// channel blocks) in the backward pass. The backward pass walks the chunks in reverse, recomputes the states and
// decays of one chunk from its checkpoint into a per-thread buffer, and runs the adjoint recurrence
//   g_t = dL/dh_t = exp(dt_{t+1} A) g_{t+1} + C_t gy_t      (0 across a reset)
// reading every gradient off g_t, h_{t-1} and the decay: du, ddelta, dz are per channel (sums over the state,
// vector FMAs); dB and dC sum over the channels of the block (a transposing reduction of the `state` vectors)
// into per-task (length, state) partials; dA, dD, ddelta_bias into per-(batch row, channel) partials. The
// partials are reduced at the end in a fixed order (deterministic).
//
// The instruction set is the one PyTorch detected (torch.backends.cpu.get_cpu_capability()); the Python loader
// passes -DCPU_CAPABILITY_<ISA> and the matching -m flags, which select ATen's vec256/vec512 implementation. The
// exp of the decay is an inlined Cephes-style polynomial (about 1 ulp) on AVX-512 / AVX2 floats, so that the state
// vectors stay in registers across the states of a token; ATen's (Sleef's) exp elsewhere.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

using at::Tensor;

// Tokens per checkpoint; hf_densessm/ops/cpu_kernel.py's CHECKPOINT must be the same (the fake implementations).
constexpr int64_t kCheckpoint = 64;
// Largest supported state size (hf_densessm/ops/cpu_kernel.py's MAX_STATE).
constexpr int64_t kMaxState = 64;

// exp of the decay: inlined on AVX-512 / AVX2 floats (Cephes expf: x = k ln2 + r, |r| <= ln2 / 2, degree-6
// polynomial, about 1 ulp; inputs below -103 give 0 or a denormal, as exp does), ATen's exp otherwise.
template <typename T>
inline at::vec::Vectorized<T> fexp(const at::vec::Vectorized<T>& x) {
  return x.exp();
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
using VF = __m512;
#define VOP(name) _mm512_##name
#else
using VF = __m256;
#define VOP(name) _mm256_##name
#endif
template <>
inline at::vec::Vectorized<float> fexp<float>(const at::vec::Vectorized<float>& xv) {
  VF x = xv;
#if defined(CPU_CAPABILITY_AVX512)
  x = VOP(max_ps)(x, VOP(set1_ps)(-103.9f));
#else
  x = VOP(max_ps)(x, VOP(set1_ps)(-87.33654f));  // 2^k stays a normal number below
#endif
  x = VOP(min_ps)(x, VOP(set1_ps)(88.72283f));
#if defined(CPU_CAPABILITY_AVX512)
  const VF k = _mm512_roundscale_ps(VOP(mul_ps)(x, VOP(set1_ps)(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const VF k = _mm256_round_ps(VOP(mul_ps)(x, VOP(set1_ps)(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  VF r = VOP(fnmadd_ps)(k, VOP(set1_ps)(0.693359375f), x);
  r = VOP(fnmadd_ps)(k, VOP(set1_ps)(-2.12194440e-4f), r);
  VF p = VOP(set1_ps)(1.9875691500e-4f);
  p = VOP(fmadd_ps)(p, r, VOP(set1_ps)(1.3981999507e-3f));
  p = VOP(fmadd_ps)(p, r, VOP(set1_ps)(8.3334519073e-3f));
  p = VOP(fmadd_ps)(p, r, VOP(set1_ps)(4.1665795894e-2f));
  p = VOP(fmadd_ps)(p, r, VOP(set1_ps)(1.6666665459e-1f));
  p = VOP(fmadd_ps)(p, r, VOP(set1_ps)(5.0000001201e-1f));
  const VF y = VOP(fmadd_ps)(p, VOP(mul_ps)(r, r), VOP(add_ps)(r, VOP(set1_ps)(1.0f)));
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_scalef_ps(y, k);
#else
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
#endif
}
#undef VOP
#endif

template <typename T>
inline at::vec::Vectorized<T> vsigmoid(const at::vec::Vectorized<T>& x) {
  using Vec = at::vec::Vectorized<T>;
  return Vec(T(1)) / (Vec(T(1)) + (-x).exp());
}

// F.softplus with its default threshold: x where x > 20, else log1p(exp(x)).
template <typename T>
inline at::vec::Vectorized<T> vsoftplus(const at::vec::Vectorized<T>& x) {
  using Vec = at::vec::Vectorized<T>;
  return Vec::blendv(x.exp().log1p(), x, x > Vec(T(20)));
}

template <typename T>
inline T hsum(const at::vec::Vectorized<T>& v) {
  using Vec = at::vec::Vectorized<T>;
  return at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, v);
}

// out[k] += (sum of the lanes of v[k]) for k < NS: the sum over the channels of a block, for dB and dC.
template <typename T, int NS>
inline void reduce_lanes_add(const at::vec::Vectorized<T>* v, T* out) {
  for (int k = 0; k < NS; ++k) out[k] += hsum(v[k]);
}

#if defined(CPU_CAPABILITY_AVX512)
// 16 vectors of 16 floats -> one vector of their 16 lane sums (a transposing butterfly: 45 shuffles and adds
// instead of 16 horizontal sums).
inline __m512 transpose_sum16(const __m512* v) {
  __m512 s[8], q[4], r[2];
  for (int i = 0; i < 8; ++i)  // (a0+a2, b0+b2, a1+a3, b1+b3) per 128-bit lane
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // (a, b, c, d) per 128-bit lane
    const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
    q[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x88), _mm512_shuffle_f32x4(r[0], r[1], 0xDD));
}
template <>
inline void reduce_lanes_add<float, 16>(const at::vec::Vectorized<float>* v, float* out) {
  __m512 x[16];
  for (int k = 0; k < 16; ++k) x[k] = v[k];
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), transpose_sum16(x)));
}
template <>
inline void reduce_lanes_add<float, 32>(const at::vec::Vectorized<float>* v, float* out) {
  reduce_lanes_add<float, 16>(v, out);
  reduce_lanes_add<float, 16>(v + 16, out + 16);
}
template <>
inline void reduce_lanes_add<float, 64>(const at::vec::Vectorized<float>* v, float* out) {
  reduce_lanes_add<float, 32>(v, out);
  reduce_lanes_add<float, 32>(v + 32, out + 32);
}
#endif

struct Shapes {
  int64_t batch, dim, length, n, ns, nc, nb, dimp;  // ns: padded state; nb: channel blocks; dimp = nb * W
};

// A (batch, dim, length) tensor read token-major: element (b, d, t) at p[b * sb + t * st + d].
template <typename T>
struct TM {
  const T* p;
  int64_t sb, st;
  const T* at(int64_t b, int64_t t) const { return p + b * sb + t * st; }
};

// The prepared inputs: u, delta, z token-major; B, C as (b, t, k) at p[b * sb + t * st + k] (k < ns);
// A transposed and padded, (ns, dimp); D, bias padded (dimp,); init (batch, dim, n) contiguous.
template <typename T>
struct Inputs {
  TM<T> u, delta, z, B, C;
  const T *A, *D, *bias, *init;
  const bool* reset;
  bool softplus, has_z;
};

void check_same(const Tensor& t, const char* name, const Tensor& u) {
  TORCH_CHECK(t.device().is_cpu(), "selective_scan_cpu: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == u.scalar_type(), "selective_scan_cpu: ", name, " has dtype ", t.scalar_type(),
              " but u has ", u.scalar_type(), ": all floating tensors must have one dtype (float32 or float64)");
}

void check_shape(const Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, "selective_scan_cpu: ", name, " must have shape ", shape, ", got ", t.sizes());
}

// Checks every argument and returns the shapes; the channel block width depends on the vector width.
Shapes check_args(const Tensor& u, const Tensor& delta, const Tensor& A, const Tensor& B, const Tensor& C,
                  const std::optional<Tensor>& D, const std::optional<Tensor>& z,
                  const std::optional<Tensor>& delta_bias, const std::optional<Tensor>& initial_state,
                  const std::optional<Tensor>& reset) {
  TORCH_CHECK(u.dim() == 3, "selective_scan_cpu: u must be (batch, dim, length), got ", u.sizes());
  TORCH_CHECK(u.device().is_cpu(), "selective_scan_cpu: u must be a CPU tensor, got ", u.device());
  TORCH_CHECK(u.scalar_type() == at::kFloat || u.scalar_type() == at::kDouble,
              "selective_scan_cpu: tensors must be float32 or float64, got ", u.scalar_type());
  TORCH_CHECK(A.dim() == 2, "selective_scan_cpu: A must be (dim, state), got ", A.sizes());
  Shapes s;
  s.batch = u.size(0);
  s.dim = u.size(1);
  s.length = u.size(2);
  s.n = A.size(1);
  TORCH_CHECK(s.length >= 1, "selective_scan_cpu: length must be >= 1");
  TORCH_CHECK(s.dim >= 1, "selective_scan_cpu: dim must be >= 1");
  TORCH_CHECK(s.n >= 1, "selective_scan_cpu: state size must be >= 1");
  TORCH_CHECK(s.n <= kMaxState, "selective_scan_cpu: state size ", s.n, " exceeds the supported ", kMaxState);
  check_same(delta, "delta", u);
  check_shape(delta, "delta", u.sizes());
  check_same(A, "A", u);
  check_shape(A, "A", {s.dim, s.n});
  check_same(B, "B", u);
  check_shape(B, "B", {s.batch, s.n, s.length});
  check_same(C, "C", u);
  check_shape(C, "C", {s.batch, s.n, s.length});
  if (D.has_value()) {
    check_same(*D, "D", u);
    check_shape(*D, "D", {s.dim});
  }
  if (z.has_value()) {
    check_same(*z, "z", u);
    check_shape(*z, "z", u.sizes());
  }
  if (delta_bias.has_value()) {
    check_same(*delta_bias, "delta_bias", u);
    check_shape(*delta_bias, "delta_bias", {s.dim});
  }
  if (initial_state.has_value()) {
    check_same(*initial_state, "initial_state", u);
    check_shape(*initial_state, "initial_state", {s.batch, s.dim, s.n});
  }
  if (reset.has_value()) {
    TORCH_CHECK(reset->scalar_type() == at::kBool, "selective_scan_cpu: reset must be bool, got ",
                reset->scalar_type());
    TORCH_CHECK(reset->device().is_cpu(), "selective_scan_cpu: reset must be a CPU tensor");
    check_shape(*reset, "reset", {s.batch, s.length});
  }
  const int64_t width = u.scalar_type() == at::kFloat ? at::vec::Vectorized<float>::size()
                                                      : at::vec::Vectorized<double>::size();
  s.ns = 1;
  while (s.ns < s.n) s.ns *= 2;
  s.nb = (s.dim + width - 1) / width;
  s.dimp = s.nb * width;
  s.nc = (s.length + kCheckpoint - 1) / kCheckpoint;
  return s;
}

// A (batch, dim, length) tensor with channel stride 1 (read in place), or a token-major copy of it.
Tensor channel_contiguous(const Tensor& x) {
  if (x.stride(1) == 1 || x.size(1) == 1) return x;
  return x.transpose(1, 2).contiguous().transpose(1, 2);
}

template <typename T>
TM<T> tm_of(const Tensor& x) {
  return {x.const_data_ptr<T>(), x.stride(0), x.stride(2)};
}

// B or C (batch, n, length): in place when its state stride is 1 and n is the padded width, else a zero-padded
// contiguous (batch, length, ns) copy. Returns the tensor to keep alive.
Tensor state_major(const Tensor& x, int64_t ns) {
  if (x.size(1) == ns && (x.stride(1) == 1 || ns == 1)) return x;
  auto out = at::zeros({x.size(0), x.size(2), ns}, x.options());
  out.narrow(2, 0, x.size(1)).copy_(x.transpose(1, 2));
  return out.transpose(1, 2);
}

// A (dim, n) -> (ns, dimp) transposed, zero-padded.
Tensor padded_AT(const Tensor& A, const Shapes& s) {
  auto out = at::zeros({s.ns, s.dimp}, A.options());
  out.narrow(0, 0, s.n).narrow(1, 0, s.dim).copy_(A.t());
  return out;
}

// (dim,) -> (dimp,) zero-padded (so a full vector can be loaded at the last block).
std::optional<Tensor> padded_vec(const std::optional<Tensor>& v, const Shapes& s) {
  if (!v) return std::nullopt;
  auto out = at::zeros({s.dimp}, v->options());
  out.narrow(0, 0, s.dim).copy_(*v);
  return out;
}

template <typename T>
const T* ptr_or_null(const std::optional<Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<T>() : nullptr;
}

template <typename T>
Inputs<T> make_inputs(const Tensor& u, const Tensor& delta, const Tensor& AT, const Tensor& B, const Tensor& C,
                      const std::optional<Tensor>& D, const std::optional<Tensor>& z,
                      const std::optional<Tensor>& bias, const std::optional<Tensor>& init,
                      const std::optional<Tensor>& reset, bool softplus) {
  Inputs<T> in;
  in.u = tm_of<T>(u);
  in.delta = tm_of<T>(delta);
  in.z = z ? tm_of<T>(*z) : TM<T>{nullptr, 0, 0};
  in.B = tm_of<T>(B);
  in.C = tm_of<T>(C);
  in.A = AT.const_data_ptr<T>();
  in.D = ptr_or_null<T>(D);
  in.bias = ptr_or_null<T>(bias);
  in.init = ptr_or_null<T>(init);
  in.reset = reset ? reset->const_data_ptr<bool>() : nullptr;
  in.softplus = softplus;
  in.has_z = z.has_value();
  return in;
}

// The states of one channel block's cnt channels (channel l at src[l * row_stride + k], k < n; src null: zeros)
// <-> its ns vectors (buf[k * W + lane], zero-padded).
template <typename T>
inline void gather_state(const T* src, int64_t cnt, int64_t n, int64_t ns, int64_t W, int64_t row_stride, T* buf) {
  std::fill(buf, buf + ns * W, T(0));
  if (!src) return;
  for (int64_t l = 0; l < cnt; ++l)
    for (int64_t k = 0; k < n; ++k) buf[k * W + l] = src[l * row_stride + k];
}

template <typename T>
inline void scatter_state(const T* buf, int64_t cnt, int64_t n, int64_t W, T* dst, int64_t row_stride) {
  for (int64_t l = 0; l < cnt; ++l)
    for (int64_t k = 0; k < n; ++k) dst[l * row_stride + k] = buf[k * W + l];
}

// dt of one block for tokens t0 .. t0 + cl: softplus(delta + bias) (or delta + bias) into out[i * W].
template <typename T>
inline void dt_chunk(const Inputs<T>& in, int64_t b, int64_t d0, int64_t cnt, int64_t t0, int64_t cl, T* out) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec vb = in.bias ? Vec::loadu(in.bias + d0) : Vec(T(0));
  for (int64_t i = 0; i < cl; ++i) {
    const Vec x = Vec::loadu(in.delta.at(b, t0 + i) + d0, cnt) + vb;
    (in.softplus ? vsoftplus(x) : x).store(out + i * W);
  }
}

// ------------------------------------------------------------------------------------------------ forward

template <typename T, int NS>
void forward_kernel(const Inputs<T>& in, const Shapes& s, T* y, T* last, T* ck) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const int64_t L = s.length, dim = s.dim, n = s.n, nc = s.nc, dimp = s.dimp;
  at::parallel_for(0, s.batch * s.nb, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> dtb(kCheckpoint * W);
    alignas(64) T hb[NS * W];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.nb, d0 = (task % s.nb) * W, cnt = std::min(W, dim - d0);
      Vec h[NS];
      gather_state(in.init ? in.init + (b * dim + d0) * n : nullptr, cnt, n, s.ns, W, n, hb);
      for (int k = 0; k < NS; ++k) h[k] = Vec::loadu(hb + k * W);
      const T* Ab = in.A + d0;
      const bool* rr = in.reset ? in.reset + b * L : nullptr;
      const Vec vD = in.D ? Vec::loadu(in.D + d0) : Vec(T(0));
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t t0 = c * kCheckpoint, cl = std::min(kCheckpoint, L - t0);
        // the state entering this chunk (before its reset)
        for (int k = 0; k < NS; ++k) h[k].store(hb + k * W);
        scatter_state(hb, cnt, n, W, ck + ((b * dim + d0) * nc + c) * n, nc * n);
        dt_chunk(in, b, d0, cnt, t0, cl, dtb.data());
        for (int64_t i = 0; i < cl; ++i) {
          const int64_t t = t0 + i;
          const Vec vdt = Vec::loadu(dtb.data() + i * W);
          const Vec vdtu = vdt * Vec::loadu(in.u.at(b, t) + d0, cnt);
          const T* Bt = in.B.at(b, t);
          const T* Ct = in.C.at(b, t);
          Vec acc(T(0));
          if (rr && rr[t]) {
            for (int k = 0; k < NS; ++k) {
              h[k] = vdtu * Vec(Bt[k]);
              acc = at::vec::fmadd(Vec(Ct[k]), h[k], acc);
            }
          } else {
            for (int k = 0; k < NS; ++k) {
              const Vec decay = fexp(vdt * Vec::loadu(Ab + k * dimp));
              h[k] = at::vec::fmadd(decay, h[k], vdtu * Vec(Bt[k]));
              acc = at::vec::fmadd(Vec(Ct[k]), h[k], acc);
            }
          }
          acc.store(dtb.data() + i * W);  // dt is no longer needed: the pre-skip output
        }
        // the skip and the gate: y = (y + D u) * silu(z)
        for (int64_t i = 0; i < cl; ++i) {
          const int64_t t = t0 + i;
          Vec out = at::vec::fmadd(vD, Vec::loadu(in.u.at(b, t) + d0, cnt), Vec::loadu(dtb.data() + i * W));
          if (in.has_z) {
            const Vec zv = Vec::loadu(in.z.at(b, t) + d0, cnt);
            out = out * zv * vsigmoid(zv);
          }
          out.store(y + (b * L + t) * dim + d0, cnt);
        }
      }
      for (int k = 0; k < NS; ++k) h[k].store(hb + k * W);
      scatter_state(hb, cnt, n, W, last + (b * dim + d0) * n, n);
    }
  });
}

#define DISPATCH_NS(ns, KERNEL, ...)                                                  \
  switch (ns) {                                                                       \
    case 1: KERNEL<T, 1>(__VA_ARGS__); break;                                         \
    case 2: KERNEL<T, 2>(__VA_ARGS__); break;                                         \
    case 4: KERNEL<T, 4>(__VA_ARGS__); break;                                         \
    case 8: KERNEL<T, 8>(__VA_ARGS__); break;                                         \
    case 16: KERNEL<T, 16>(__VA_ARGS__); break;                                       \
    case 32: KERNEL<T, 32>(__VA_ARGS__); break;                                       \
    case 64: KERNEL<T, 64>(__VA_ARGS__); break;                                       \
    default: TORCH_CHECK(false, "selective_scan_cpu: unsupported padded state ", ns); \
  }

std::tuple<Tensor, Tensor, Tensor> selective_scan_cpu_fwd(
    const Tensor& u_, const Tensor& delta_, const Tensor& A, const Tensor& B_, const Tensor& C_,
    const std::optional<Tensor>& D_, const std::optional<Tensor>& z_, const std::optional<Tensor>& delta_bias_,
    bool delta_softplus, const std::optional<Tensor>& initial_state_, const std::optional<Tensor>& reset_) {
  const Shapes s = check_args(u_, delta_, A, B_, C_, D_, z_, delta_bias_, initial_state_, reset_);
  const Tensor u = channel_contiguous(u_), delta = channel_contiguous(delta_);
  const Tensor B = state_major(B_, s.ns), C = state_major(C_, s.ns), AT = padded_AT(A, s);
  std::optional<Tensor> z, init, reset;
  const std::optional<Tensor> D = padded_vec(D_, s), bias = padded_vec(delta_bias_, s);
  if (z_) z = channel_contiguous(*z_);
  if (initial_state_) init = initial_state_->contiguous();
  if (reset_) reset = reset_->contiguous();
  const auto opt = u.options();
  auto y = at::empty({s.batch, s.length, s.dim}, opt);  // token-major; returned as its (batch, dim, length) view
  auto last = at::empty({s.batch, s.dim, s.n}, opt);
  auto ck = at::empty({s.batch, s.dim, s.nc, s.n}, opt);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "selective_scan_cpu_fwd", [&] {
    using T = scalar_t;
    const Inputs<T> in = make_inputs<T>(u, delta, AT, B, C, D, z, bias, init, reset, delta_softplus);
    T *py = y.mutable_data_ptr<T>(), *pl = last.mutable_data_ptr<T>(), *pc = ck.mutable_data_ptr<T>();
    DISPATCH_NS(s.ns, forward_kernel, in, s, py, pl, pc);
  });
  return {y.transpose(1, 2), last, ck};
}

// ----------------------------------------------------------------------------------------------- backward

template <typename T>
struct Grads {
  TM<T> dy;
  const T *dlast, *ck;
  T *du, *ddelta, *dz, *dBp, *dCp, *dAp, *dDp, *dbiasp, *dinit;  // du, ddelta, dz (batch, length, dim); *p: partials
  int64_t ngroups, per_group;  // channel-block groups per batch row (one task each), blocks per group
};

template <typename T, int NS>
void backward_kernel(const Inputs<T>& in, const Shapes& s, const Grads<T>& gr) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t K = kCheckpoint;
  constexpr int64_t SW = NS * W;  // one token's states of a block
  const int64_t L = s.length, dim = s.dim, n = s.n, nc = s.nc, dimp = s.dimp;
  at::parallel_for(0, s.batch * gr.ngroups, 1, [&](int64_t begin, int64_t end) {
    // per-thread buffers: one chunk's states and decays; its time steps, softplus'(delta + bias) = sigmoid,
    // sigmoid(z) and pre-gate outputs
    std::vector<T> Hs(K * SW), Ex(K * SW), dtb(K * W), sgb(K * W), szb(K * W), ypre(K * W);
    alignas(64) T entry[SW];
    alignas(64) T tmp[SW];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / gr.ngroups, grp = task % gr.ngroups;
      const int64_t blk0 = grp * gr.per_group, blk1 = std::min(s.nb, blk0 + gr.per_group);
      T* dBp = gr.dBp + task * L * NS;  // (L, NS) partial sums over this group's channels
      T* dCp = gr.dCp + task * L * NS;
      std::fill(dBp, dBp + L * NS, T(0));
      std::fill(dCp, dCp + L * NS, T(0));
      const bool* rr = in.reset ? in.reset + b * L : nullptr;
      for (int64_t blk = blk0; blk < blk1; ++blk) {
        const int64_t d0 = blk * W, cnt = std::min(W, dim - d0);
        const T* Ab = in.A + d0;
        const Vec vD = in.D ? Vec::loadu(in.D + d0) : Vec(T(0));
        const Vec vb = in.bias ? Vec::loadu(in.bias + d0) : Vec(T(0));
        Vec g[NS], dA[NS];
        gather_state(gr.dlast ? gr.dlast + (b * dim + d0) * n : nullptr, cnt, n, s.ns, W, n, tmp);
        for (int k = 0; k < NS; ++k) {
          g[k] = Vec::loadu(tmp + k * W);
          dA[k] = Vec(T(0));
        }
        Vec dD(T(0)), dbias(T(0));
        for (int64_t c = nc - 1; c >= 0; --c) {
          const int64_t t0 = c * K, cl = std::min(K, L - t0);
          // 1. the chunk's time steps and sigmoids, its states and decays recomputed from its checkpoint
          dt_chunk(in, b, d0, cnt, t0, cl, dtb.data());
          for (int64_t i = 0; i < cl; ++i) {
            if (in.softplus)
              vsigmoid(Vec::loadu(in.delta.at(b, t0 + i) + d0, cnt) + vb).store(sgb.data() + i * W);
            if (in.has_z) vsigmoid(Vec::loadu(in.z.at(b, t0 + i) + d0, cnt)).store(szb.data() + i * W);
          }
          // the state entering the chunk, from its checkpoint
          gather_state(gr.ck + ((b * dim + d0) * nc + c) * n, cnt, n, s.ns, W, nc * n, entry);
          {
            Vec h[NS];
            for (int k = 0; k < NS; ++k) h[k] = Vec::loadu(entry + k * W);
            for (int64_t i = 0; i < cl; ++i) {
              const int64_t t = t0 + i;
              const Vec vdt = Vec::loadu(dtb.data() + i * W);
              const Vec vdtu = vdt * Vec::loadu(in.u.at(b, t) + d0, cnt);
              const T* Bt = in.B.at(b, t);
              const T* Ct = in.C.at(b, t);
              const bool rs = rr && rr[t];
              T* He = Hs.data() + i * SW;
              T* Ee = Ex.data() + i * SW;
              Vec acc(T(0));
              for (int k = 0; k < NS; ++k) {
                const Vec decay = fexp(vdt * Vec::loadu(Ab + k * dimp));
                decay.store(Ee + k * W);
                const Vec hin = vdtu * Vec(Bt[k]);
                h[k] = rs ? hin : at::vec::fmadd(decay, h[k], hin);
                h[k].store(He + k * W);
                if (in.has_z) acc = at::vec::fmadd(Vec(Ct[k]), h[k], acc);
              }
              if (in.has_z) acc.store(ypre.data() + i * W);
            }
          }
          // 2. the adjoint recurrence backwards through the chunk
          for (int64_t i = cl - 1; i >= 0; --i) {
            const int64_t t = t0 + i;
            const Vec ut = Vec::loadu(in.u.at(b, t) + d0, cnt);
            Vec gy = gr.dy.p ? Vec::loadu(gr.dy.at(b, t) + d0, cnt) : Vec(T(0));
            if (in.has_z) {
              const Vec zt = Vec::loadu(in.z.at(b, t) + d0, cnt), sg = Vec::loadu(szb.data() + i * W);
              const Vec yp = at::vec::fmadd(vD, ut, Vec::loadu(ypre.data() + i * W));
              (gy * yp * sg * (Vec(T(1)) + zt * (Vec(T(1)) - sg))).store(gr.dz + (b * L + t) * dim + d0, cnt);
              gy = gy * zt * sg;  // dz: d silu(z)/dz = sg (1 + z (1 - sg))
            }
            dD = at::vec::fmadd(gy, ut, dD);
            const Vec vdt = Vec::loadu(dtb.data() + i * W);
            const Vec vdtu = vdt * ut;
            const bool rs = rr && rr[t];
            const T* Bt = in.B.at(b, t);
            const T* Ct = in.C.at(b, t);
            const T* He = Hs.data() + i * SW;
            const T* Ee = Ex.data() + i * SW;
            const T* hprev = i > 0 ? Hs.data() + (i - 1) * SW : entry;
            Vec cv[NS], bv[NS];
            Vec wacc(T(0)), xacc(T(0));
            for (int k = 0; k < NS; ++k) {
              const Vec gk = at::vec::fmadd(Vec(Ct[k]), gy, g[k]);  // g_t = dL/dh_t
              cv[k] = gy * Vec::loadu(He + k * W);
              bv[k] = gk * vdtu;
              wacc = at::vec::fmadd(Vec(Bt[k]), gk, wacc);
              if (rs) {
                g[k] = Vec(T(0));  // nothing flows into the state before a reset
              } else {
                const Vec decay = Vec::loadu(Ee + k * W);
                const Vec x = gk * decay * Vec::loadu(hprev + k * W);  // dL/d(dt_t A)
                xacc = at::vec::fmadd(x, Vec::loadu(Ab + k * dimp), xacc);
                dA[k] = at::vec::fmadd(x, vdt, dA[k]);
                g[k] = gk * decay;
              }
            }
            reduce_lanes_add<T, NS>(cv, dCp + t * NS);
            reduce_lanes_add<T, NS>(bv, dBp + t * NS);
            at::vec::fmadd(wacc, vdt, gy * vD).store(gr.du + (b * L + t) * dim + d0, cnt);
            Vec ddt = at::vec::fmadd(wacc, ut, xacc);
            if (in.softplus) ddt = ddt * Vec::loadu(sgb.data() + i * W);  // d softplus(x)/dx = sigmoid(x)
            ddt.store(gr.ddelta + (b * L + t) * dim + d0, cnt);
            dbias = dbias + ddt;
          }
        }
        for (int k = 0; k < NS; ++k) {
          g[k].store(tmp + k * W);
          dA[k].store(gr.dAp + (b * NS + k) * dimp + d0);
        }
        scatter_state(tmp, cnt, n, W, gr.dinit + (b * dim + d0) * n, n);
        dD.store(gr.dDp + b * dimp + d0);
        dbias.store(gr.dbiasp + b * dimp + d0);
      }
    }
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> selective_scan_cpu_bwd(
    const std::optional<Tensor>& dy_, const std::optional<Tensor>& dlast_, const Tensor& u_, const Tensor& delta_,
    const Tensor& A, const Tensor& B_, const Tensor& C_, const std::optional<Tensor>& D_,
    const std::optional<Tensor>& z_, const std::optional<Tensor>& delta_bias_, bool delta_softplus,
    const std::optional<Tensor>& initial_state_, const std::optional<Tensor>& reset_, const Tensor& chunk_states_) {
  const Shapes s = check_args(u_, delta_, A, B_, C_, D_, z_, delta_bias_, initial_state_, reset_);
  if (dy_) {
    check_same(*dy_, "dy", u_);
    check_shape(*dy_, "dy", u_.sizes());
  }
  if (dlast_) {
    check_same(*dlast_, "dlast", u_);
    check_shape(*dlast_, "dlast", {s.batch, s.dim, s.n});
  }
  check_same(chunk_states_, "chunk_states", u_);
  TORCH_CHECK(chunk_states_.sizes() == at::IntArrayRef({s.batch, s.dim, s.nc, s.n}),
              "selective_scan_cpu_bwd: chunk_states must be the (batch, dim, n_chunks, state) = ",
              at::IntArrayRef({s.batch, s.dim, s.nc, s.n}),
              " checkpoints of selective_scan_cpu_fwd (one every ", kCheckpoint, " tokens), got ",
              chunk_states_.sizes(), " (states of another path?)");
  const Tensor u = channel_contiguous(u_), delta = channel_contiguous(delta_), ck = chunk_states_.contiguous();
  const Tensor B = state_major(B_, s.ns), C = state_major(C_, s.ns), AT = padded_AT(A, s);
  const std::optional<Tensor> D = padded_vec(D_, s), bias = padded_vec(delta_bias_, s);
  std::optional<Tensor> z, reset, dy, dlast;
  if (z_) z = channel_contiguous(*z_);
  if (reset_) reset = reset_->contiguous();
  if (dy_) dy = channel_contiguous(*dy_);
  if (dlast_) dlast = dlast_->contiguous();
  const auto opt = u.options();
  // groups of channel blocks: enough tasks to keep every thread busy; each task owns (L, ns) partials of dB, dC
  const int64_t threads = at::get_num_threads();
  const int64_t want = std::min<int64_t>(s.nb, std::max<int64_t>(1, (2 * threads + s.batch - 1) / s.batch));
  const int64_t per_group = (s.nb + want - 1) / want;
  const int64_t ngroups = (s.nb + per_group - 1) / per_group;
  auto du = at::empty({s.batch, s.length, s.dim}, opt);  // token-major, returned as (batch, dim, length) views
  auto ddelta = at::empty({s.batch, s.length, s.dim}, opt);
  auto dz = z ? at::empty({s.batch, s.length, s.dim}, opt) : at::empty({0}, opt);
  auto dBp = at::empty({s.batch, ngroups, s.length, s.ns}, opt);
  auto dCp = at::empty({s.batch, ngroups, s.length, s.ns}, opt);
  auto dAp = at::empty({s.batch, s.ns, s.dimp}, opt);
  auto dDp = at::empty({s.batch, s.dimp}, opt);
  auto dbiasp = at::empty({s.batch, s.dimp}, opt);
  auto dinit = at::empty({s.batch, s.dim, s.n}, opt);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "selective_scan_cpu_bwd", [&] {
    using T = scalar_t;
    const Inputs<T> in = make_inputs<T>(u, delta, AT, B, C, D, z, bias, std::nullopt, reset, delta_softplus);
    Grads<T> gr{dy ? tm_of<T>(*dy) : TM<T>{nullptr, 0, 0}, ptr_or_null<T>(dlast), ck.const_data_ptr<T>(),
                du.mutable_data_ptr<T>(), ddelta.mutable_data_ptr<T>(), z ? dz.mutable_data_ptr<T>() : nullptr,
                dBp.mutable_data_ptr<T>(), dCp.mutable_data_ptr<T>(), dAp.mutable_data_ptr<T>(),
                dDp.mutable_data_ptr<T>(), dbiasp.mutable_data_ptr<T>(), dinit.mutable_data_ptr<T>(),
                ngroups, per_group};
    DISPATCH_NS(s.ns, backward_kernel, in, s, gr);
  });
  // reduce the partials: dB, dC over channel groups into (batch, length, state) (returned as (batch, state, length)
  // views); dA, dD, dbias over the batch
  auto dB = at::empty({s.batch, s.length, s.n}, opt);
  auto dC = at::empty({s.batch, s.length, s.n}, opt);
  if (s.ns == s.n) {
    at::sum_out(dB, dBp, {1});
    at::sum_out(dC, dCp, {1});
  } else {
    dB.copy_(dBp.sum(1).narrow(2, 0, s.n));
    dC.copy_(dCp.sum(1).narrow(2, 0, s.n));
  }
  auto dA = dAp.sum(0).narrow(0, 0, s.n).narrow(1, 0, s.dim).t().contiguous();
  auto dD = D ? dDp.sum(0).narrow(0, 0, s.dim).contiguous() : at::empty({0}, opt);
  auto dbias = bias ? dbiasp.sum(0).narrow(0, 0, s.dim).contiguous() : at::empty({0}, opt);
  return {du.transpose(1, 2), ddelta.transpose(1, 2), dA, dB.transpose(1, 2), dC.transpose(1, 2), dD,
          z ? dz.transpose(1, 2) : dz, dbias, dinit};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_densessm, m) {
  m.def(
      "selective_scan_cpu_fwd(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, "
      "Tensor? delta_bias, bool delta_softplus, Tensor? initial_state, Tensor? reset) -> (Tensor, Tensor, Tensor)");
  m.def(
      "selective_scan_cpu_bwd(Tensor? dy, Tensor? dlast, Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, "
      "Tensor? D, Tensor? z, Tensor? delta_bias, bool delta_softplus, Tensor? initial_state, Tensor? reset, "
      "Tensor chunk_states) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_densessm, CPU, m) {
  m.impl("selective_scan_cpu_fwd", &selective_scan_cpu_fwd);
  m.impl("selective_scan_cpu_bwd", &selective_scan_cpu_bwd);
}
