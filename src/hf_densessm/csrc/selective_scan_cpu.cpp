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
// Layout: token-major. The (batch, dim, length) tensors u, delta, z, dy are read in place when their channel
// stride is 1 (the transposed views of (batch, length, dim) tensors the model passes), with any batch and token
// strides; others are copied to that layout once. B and C (batch, state, length) are read in place when their state
// stride is 1 and the state size is a power of two, else copied to a padded (batch, length, state) buffer. The
// outputs y, du, ddelta, dz are (batch, dim, length) views of fresh (batch, length, dim) tensors (stride
// (length * dim, 1, dim)), dB and dC views of (batch, length, state) tensors: their `.transpose(1, 2)` is
// contiguous. last_state, dinitial_state are contiguous (batch, dim, state); chunk_states, the state entering every
// kCheckpoint-token chunk (before a reset at the chunk's first token), contiguous (batch, dim, n_chunks, state).
//
// Work (docs/kernels.md, "The C++ CPU kernel", for why): channels go in blocks of W (one at::vec::Vectorized<T>:
// 16 floats on AVX-512, 8 on AVX2), blocks in tiles of kTileBytes of a token's row. A task (at::parallel_for) is a
// batch row and a slice of whole tiles, about two per thread. It walks the chunks; per chunk and tile it (1) copies
// the tile's rows of u, delta (then dt = softplus(delta + bias) in place), z, dy to per-thread buffers, row by row
// (never a block's column: one line per row, a row apart); (2) runs each block's recurrence through the chunk from
// those buffers, its state (padded to a power of two `ns` with A = B = C = 0, which keeps the padded states at 0)
// as ns vectors in registers, broadcasting B[t, n] and C[t, n], its A one contiguous (ns, W) array; (3) writes the
// tile's rows of the outputs. The backward pass walks the chunks in reverse, recomputes one block's states and
// decays of the chunk from its checkpoint into a per-thread buffer, and runs the adjoint recurrence
//   g_t = dL/dh_t = exp(dt_{t+1} A) g_{t+1} + C_t gy_t      (0 across a reset)
// reading every gradient off g_t, h_{t-1} and the decay: du, ddelta, dz per channel (sums over the state); dB, dC
// per lane over all blocks of the task, then over the lanes once per token and task, into per-task (length, state)
// partials; dA, dD, ddelta_bias into per-(batch row, channel) partials. The partials are reduced at the end in a
// fixed order (deterministic, whatever the threads).
//
// The instruction set is the one PyTorch detected (torch.backends.cpu.get_cpu_capability()); the Python loader
// passes -DCPU_CAPABILITY_<ISA> and the matching -m flags, which select ATen's vec256/vec512 implementation. The
// exp of the decay (and of softplus and sigmoid) is an inlined Cephes-style polynomial (about 1 ulp) on AVX-512 /
// AVX2 floats, so that the state vectors stay in registers across the states of a token; ATen's (Sleef's) exp
// elsewhere.

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
// Bytes of a token's row that a tile of channel blocks covers.
constexpr int64_t kTileBytes = 256;

#define HFD_UNROLL _Pragma("GCC unroll 64")

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
  // the clamps take x second: max/min return their second operand when either is NaN, so NaN stays NaN
#if defined(CPU_CAPABILITY_AVX512)
  x = VOP(max_ps)(VOP(set1_ps)(-103.9f), x);
#else
  x = VOP(max_ps)(VOP(set1_ps)(-87.33654f), x);  // 2^k stays a normal number below
#endif
  x = VOP(min_ps)(VOP(set1_ps)(88.72283f), x);
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
  return Vec(T(1)) / (Vec(T(1)) + fexp(-x));
}

// F.softplus with its default threshold: x where x > 20, else log1p(exp(x)).
template <typename T>
inline at::vec::Vectorized<T> vsoftplus(const at::vec::Vectorized<T>& x) {
  using Vec = at::vec::Vectorized<T>;
  return Vec::blendv(fexp(x).log1p(), x, x > Vec(T(20)));
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
  int64_t tile, slices, per_slice;  // blocks per tile; tasks per batch row (slices); blocks per slice
};

// A (batch, dim, length) tensor read token-major: element (b, d, t) at p[b * sb + t * st + d].
template <typename T>
struct TM {
  const T* p;
  int64_t sb, st;
  const T* at(int64_t b, int64_t t) const { return p + b * sb + t * st; }
};

// The prepared inputs: u, delta, z token-major; B, C as (b, t, k) at p[b * sb + t * st + k] (k < ns);
// A blocked and padded, (nb, ns, W); D, bias padded (dimp,); init (batch, dim, n) contiguous.
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

// Checks every argument and returns the shapes; the blocks, tiles and tasks depend on the vector width.
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
  const bool f32 = u.scalar_type() == at::kFloat;
  const int64_t width = f32 ? at::vec::Vectorized<float>::size() : at::vec::Vectorized<double>::size();
  s.ns = 1;
  while (s.ns < s.n) s.ns *= 2;
  s.nb = (s.dim + width - 1) / width;
  s.dimp = s.nb * width;
  s.nc = (s.length + kCheckpoint - 1) / kCheckpoint;
  s.tile = std::max<int64_t>(1, kTileBytes / (width * (f32 ? 4 : 8)));
  // about two tasks per thread, each a whole number of tiles
  const int64_t tiles = (s.nb + s.tile - 1) / s.tile;
  const int64_t want = std::min(tiles, std::max<int64_t>(1, (2 * at::get_num_threads() + s.batch - 1) / s.batch));
  s.per_slice = (tiles + want - 1) / want * s.tile;
  s.slices = (s.nb + s.per_slice - 1) / s.per_slice;
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

// A (dim, n) -> (nb, ns, W), zero-padded: one block's A is one contiguous (ns, W) array (transposed: lanes are
// channels).
Tensor blocked_A(const Tensor& A, const Shapes& s) {
  auto out = at::zeros({s.dimp, s.ns}, A.options());
  out.narrow(0, 0, s.dim).narrow(1, 0, s.n).copy_(A);
  return out.view({s.nb, s.dimp / s.nb, s.ns}).transpose(1, 2).contiguous();
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
Inputs<T> make_inputs(const Tensor& u, const Tensor& delta, const Tensor& AB, const Tensor& B, const Tensor& C,
                      const std::optional<Tensor>& D, const std::optional<Tensor>& z,
                      const std::optional<Tensor>& bias, const std::optional<Tensor>& init,
                      const std::optional<Tensor>& reset, bool softplus) {
  Inputs<T> in;
  in.u = tm_of<T>(u);
  in.delta = tm_of<T>(delta);
  in.z = z ? tm_of<T>(*z) : TM<T>{nullptr, 0, 0};
  in.B = tm_of<T>(B);
  in.C = tm_of<T>(C);
  in.A = AB.const_data_ptr<T>();
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

// A task's place: batch row b, channel blocks [blk0, blk1).
struct Task {
  int64_t b, blk0, blk1;
  Task(const Shapes& s, int64_t task)
      : b(task / s.slices), blk0(task % s.slices * s.per_slice), blk1(std::min(s.nb, blk0 + s.per_slice)) {}
};

// Per-thread buffers of one tile and chunk: `slots` arrays per block, each kCheckpoint vectors (one per token),
// slot k of the tile's block j at token i at at(k, j) + i * W. The arrays are one vector longer than needed, so
// that one token's vectors of two arrays are not a multiple of 4 KiB apart (on Intel cores a load waits for an
// earlier store whose address has the same low 12 bits: "4K aliasing").
template <typename T>
struct Staged {
  std::vector<T> buf;
  int64_t tile, W;
  Staged(int slots, int64_t tile, int64_t W) : buf(slots * tile * (kCheckpoint + 1) * W), tile(tile), W(W) {}
  T* at(int k, int64_t j) { return buf.data() + (k * tile + j) * (kCheckpoint + 1) * W; }
};

// Copies the tile's rows of a token-major tensor (null: zeros) for tokens t0 .. t0 + cl into slot k: plain loads
// and stores, so that many loads are in flight.
template <typename T>
inline void stage_rows(const TM<T>& x, int64_t b, int64_t t0, int64_t cl, int64_t tb, int64_t nt, int64_t dim,
                       Staged<T>& st, int k) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  for (int64_t i = 0; i < cl; ++i) {
    const T* row = x.p ? x.at(b, t0 + i) : nullptr;
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t d0 = (tb + j) * W;
      (row ? Vec::loadu(row + d0, std::min(W, dim - d0)) : Vec(T(0))).store(st.at(k, j) + i * W);
    }
  }
}

// Writes slot k of the tile back to the rows of a (batch, length, dim) tensor.
template <typename T>
inline void write_rows(Staged<T>& st, int k, T* out, int64_t b, int64_t L, int64_t t0, int64_t cl, int64_t tb,
                       int64_t nt, int64_t dim) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  for (int64_t i = 0; i < cl; ++i)
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t d0 = (tb + j) * W;
      Vec::loadu(st.at(k, j) + i * W).store(out + (b * L + t0 + i) * dim + d0, std::min(W, dim - d0));
    }
}

// In place over a block's cl staged vectors of delta: dt = softplus(delta + bias) (or delta + bias); with sg, also
// sigmoid(delta + bias) (softplus' derivative) there.
template <typename T>
inline void prepare_dt(const Inputs<T>& in, int64_t d0, int64_t cl, T* dt, T* sg) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec vb = in.bias ? Vec::loadu(in.bias + d0) : Vec(T(0));
  for (int64_t i = 0; i < cl; ++i) {
    const Vec x = Vec::loadu(dt + i * W) + vb;
    (in.softplus ? vsoftplus(x) : x).store(dt + i * W);
    if (sg && in.softplus) vsigmoid(x).store(sg + i * W);
  }
}

// ------------------------------------------------------------------------------------------------ forward

enum { kDt, kU, kZ, kSz, kSg, kDy, kYp, kDu, kDdt, kDz, kSlots };  // staged slots (forward: kDt, kU)

// One block over one chunk: h (ns vectors at hb, updated) through tokens t0 .. t0 + cl; dt (kDt) is overwritten
// with the output before the skip and the gate, sum_n C_{t,n} h_{t,n}.
template <typename T, int NS>
inline void scan_block(const Inputs<T>& in, const T* Ab, T* hb, T* dt, const T* u, int64_t b, int64_t t0,
                       int64_t cl, const bool* rr) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  Vec h[NS];
  for (int k = 0; k < NS; ++k) h[k] = Vec::loadu(hb + k * W);
  for (int64_t i = 0; i < cl; ++i) {
    const Vec vdt = Vec::loadu(dt + i * W), vdtu = vdt * Vec::loadu(u + i * W);
    const T* Bt = in.B.at(b, t0 + i);
    const T* Ct = in.C.at(b, t0 + i);
    Vec acc(T(0));
    if (rr && rr[t0 + i]) {
      HFD_UNROLL for (int k = 0; k < NS; ++k) {
        h[k] = vdtu * Vec(Bt[k]);
        acc = at::vec::fmadd(Vec(Ct[k]), h[k], acc);
      }
    } else {
      HFD_UNROLL for (int k = 0; k < NS; ++k) {
        h[k] = at::vec::fmadd(fexp(vdt * Vec::loadu(Ab + k * W)), h[k], vdtu * Vec(Bt[k]));
        acc = at::vec::fmadd(Vec(Ct[k]), h[k], acc);
      }
    }
    acc.store(dt + i * W);
  }
  for (int k = 0; k < NS; ++k) h[k].store(hb + k * W);
}

template <typename T, int NS>
void forward_kernel(const Inputs<T>& in, const Shapes& s, T* y, T* last, T* ck) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t SW = NS * W;
  const int64_t L = s.length, dim = s.dim, n = s.n, nc = s.nc;
  at::parallel_for(0, s.batch * s.slices, 1, [&](int64_t begin, int64_t end) {
    Staged<T> st(2, s.tile, W);
    std::vector<T> hs(s.per_slice * SW);  // the states of the task's blocks
    for (int64_t task = begin; task < end; ++task) {
      const Task tk(s, task);
      const int64_t b = tk.b;
      for (int64_t blk = tk.blk0; blk < tk.blk1; ++blk)
        gather_state(in.init ? in.init + (b * dim + blk * W) * n : nullptr, std::min(W, dim - blk * W), n, s.ns,
                     W, n, hs.data() + (blk - tk.blk0) * SW);
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t t0 = c * kCheckpoint, cl = std::min(kCheckpoint, L - t0);
        for (int64_t tb = tk.blk0; tb < tk.blk1; tb += s.tile) {
          const int64_t nt = std::min(s.tile, tk.blk1 - tb);
          // 1. the tile's rows of delta and u
          stage_rows(in.delta, b, t0, cl, tb, nt, dim, st, kDt);
          stage_rows(in.u, b, t0, cl, tb, nt, dim, st, kU);
          // 2. each block's dt and recurrence, from the state entering the chunk (saved first, before its reset)
          for (int64_t j = 0; j < nt; ++j) {
            const int64_t blk = tb + j, d0 = blk * W;
            T* hb = hs.data() + (blk - tk.blk0) * SW;
            prepare_dt(in, d0, cl, st.at(kDt, j), static_cast<T*>(nullptr));
            scatter_state(hb, std::min(W, dim - d0), n, W, ck + ((b * dim + d0) * nc + c) * n, nc * n);
            scan_block<T, NS>(in, in.A + blk * SW, hb, st.at(kDt, j), st.at(kU, j), b, t0, cl,
                              in.reset ? in.reset + b * L : nullptr);
          }
          // 3. the skip and the gate, y = (y + D u) * silu(z), row by row
          for (int64_t i = 0; i < cl; ++i) {
            const int64_t t = t0 + i;
            for (int64_t j = 0; j < nt; ++j) {
              const int64_t d0 = (tb + j) * W, cnt = std::min(W, dim - d0);
              const Vec vu = Vec::loadu(st.at(kU, j) + i * W), yp = Vec::loadu(st.at(kDt, j) + i * W);
              Vec out = in.D ? at::vec::fmadd(Vec::loadu(in.D + d0), vu, yp) : yp;
              if (in.has_z) {
                const Vec zv = Vec::loadu(in.z.at(b, t) + d0, cnt);
                out = out * zv * vsigmoid(zv);
              }
              out.store(y + (b * L + t) * dim + d0, cnt);
            }
          }
        }
      }
      for (int64_t blk = tk.blk0; blk < tk.blk1; ++blk)
        scatter_state(hs.data() + (blk - tk.blk0) * SW, std::min(W, dim - blk * W), n, W,
                      last + (b * dim + blk * W) * n, n);
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
  const Tensor B = state_major(B_, s.ns), C = state_major(C_, s.ns), AB = blocked_A(A, s);
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
    const Inputs<T> in = make_inputs<T>(u, delta, AB, B, C, D, z, bias, init, reset, delta_softplus);
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
};

// The chunk's states h_t (Hs) and decays exp(dt_t A) (Ex, not at a reset) of one block, from the state entering it
// (entry); with yp, also the output before the skip and the gate (for dz).
template <typename T, int NS>
inline void recompute_block(const Inputs<T>& in, const T* Ab, const T* entry, const T* dt, const T* u, int64_t b,
                            int64_t t0, int64_t cl, const bool* rr, T* Hs, T* Ex, T* yp) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t SW = NS * W;
  Vec h[NS];
  for (int k = 0; k < NS; ++k) h[k] = Vec::loadu(entry + k * W);
  for (int64_t i = 0; i < cl; ++i) {
    const Vec vdt = Vec::loadu(dt + i * W), vdtu = vdt * Vec::loadu(u + i * W);
    const T* Bt = in.B.at(b, t0 + i);
    const T* Ct = in.C.at(b, t0 + i);
    T* He = Hs + i * SW;
    T* Ee = Ex + i * SW;
    Vec acc(T(0));
    if (rr && rr[t0 + i]) {
      HFD_UNROLL for (int k = 0; k < NS; ++k) {
        h[k] = vdtu * Vec(Bt[k]);
        h[k].store(He + k * W);
        acc = at::vec::fmadd(Vec(Ct[k]), h[k], acc);
      }
    } else {
      HFD_UNROLL for (int k = 0; k < NS; ++k) {
        const Vec decay = fexp(vdt * Vec::loadu(Ab + k * W));
        decay.store(Ee + k * W);
        h[k] = at::vec::fmadd(decay, h[k], vdtu * Vec(Bt[k]));
        h[k].store(He + k * W);
        acc = at::vec::fmadd(Vec(Ct[k]), h[k], acc);
      }
    }
    if (yp) acc.store(yp + i * W);
  }
}

// The adjoint recurrence of one block backwards through the chunk,
//   g_t = dL/dh_t = exp(dt_{t+1} A) g_{t+1} + C_t gy_t      (0 across a reset),
// with g (ns vectors) and dA (ns vectors) at gb, gb + SW, updated; dD, dbias (vectors) updated; du, ddelta, dz
// into their slots; dB, dC per lane into aB, aC (i * SW + k * W, summed over the task's blocks).
template <typename T, int NS>
inline void adjoint_block(const Inputs<T>& in, Staged<T>& st, int64_t j, const T* Ab, const T* entry, const T* Hs,
                          const T* Ex, T* gb, at::vec::Vectorized<T>& dD, at::vec::Vectorized<T>& dbias,
                          const at::vec::Vectorized<T>& vD, T* aB, T* aC, int64_t b, int64_t t0, int64_t cl,
                          const bool* rr) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t SW = NS * W;
  T* dAb = gb + SW;
  Vec g[NS];
  for (int k = 0; k < NS; ++k) g[k] = Vec::loadu(gb + k * W);
  for (int64_t i = cl - 1; i >= 0; --i) {
    const int64_t t = t0 + i, o = i * W;
    const Vec ut = Vec::loadu(st.at(kU, j) + o);
    Vec gy = Vec::loadu(st.at(kDy, j) + o);
    if (in.has_z) {  // d silu(z)/dz = sg (1 + z (1 - sg))
      const Vec zt = Vec::loadu(st.at(kZ, j) + o), sg = Vec::loadu(st.at(kSz, j) + o);
      const Vec yp = at::vec::fmadd(vD, ut, Vec::loadu(st.at(kYp, j) + o));
      (gy * yp * sg * (Vec(T(1)) + zt * (Vec(T(1)) - sg))).store(st.at(kDz, j) + o);
      gy = gy * zt * sg;
    }
    dD = at::vec::fmadd(gy, ut, dD);
    const Vec vdt = Vec::loadu(st.at(kDt, j) + o), vdtu = vdt * ut;
    const T* Bt = in.B.at(b, t);
    const T* Ct = in.C.at(b, t);
    const T* He = Hs + i * SW;
    const T* Ee = Ex + i * SW;
    const T* hprev = i > 0 ? Hs + (i - 1) * SW : entry;
    T* bB = aB + i * SW;
    T* bC = aC + i * SW;
    Vec wacc(T(0)), xacc(T(0));
    if (rr && rr[t]) {  // nothing flows into the state before a reset
      HFD_UNROLL for (int k = 0; k < NS; ++k) {
        const Vec gk = at::vec::fmadd(Vec(Ct[k]), gy, g[k]);  // g_t
        at::vec::fmadd(gy, Vec::loadu(He + k * W), Vec::loadu(bC + k * W)).store(bC + k * W);
        at::vec::fmadd(gk, vdtu, Vec::loadu(bB + k * W)).store(bB + k * W);
        wacc = at::vec::fmadd(Vec(Bt[k]), gk, wacc);
        g[k] = Vec(T(0));
      }
    } else {
      HFD_UNROLL for (int k = 0; k < NS; ++k) {
        const Vec gk = at::vec::fmadd(Vec(Ct[k]), gy, g[k]);
        at::vec::fmadd(gy, Vec::loadu(He + k * W), Vec::loadu(bC + k * W)).store(bC + k * W);
        at::vec::fmadd(gk, vdtu, Vec::loadu(bB + k * W)).store(bB + k * W);
        wacc = at::vec::fmadd(Vec(Bt[k]), gk, wacc);
        const Vec decay = Vec::loadu(Ee + k * W);
        const Vec x = gk * decay * Vec::loadu(hprev + k * W);  // dL/d(dt_t A)
        xacc = at::vec::fmadd(x, Vec::loadu(Ab + k * W), xacc);
        at::vec::fmadd(x, vdt, Vec::loadu(dAb + k * W)).store(dAb + k * W);
        g[k] = gk * decay;
      }
    }
    at::vec::fmadd(wacc, vdt, gy * vD).store(st.at(kDu, j) + o);
    Vec ddt = at::vec::fmadd(wacc, ut, xacc);
    if (in.softplus) ddt = ddt * Vec::loadu(st.at(kSg, j) + o);  // d softplus(x)/dx = sigmoid(x)
    ddt.store(st.at(kDdt, j) + o);
    dbias = dbias + ddt;
  }
  for (int k = 0; k < NS; ++k) g[k].store(gb + k * W);
}

template <typename T, int NS>
void backward_kernel(const Inputs<T>& in, const Shapes& s, const Grads<T>& gr) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t K = kCheckpoint;
  constexpr int64_t SW = NS * W;
  constexpr int64_t PB = 2 * SW + 2 * W;  // per block of a task: g, dA, dD, dbias
  const int64_t L = s.length, dim = s.dim, n = s.n, nc = s.nc, dimp = s.dimp;
  at::parallel_for(0, s.batch * s.slices, 1, [&](int64_t begin, int64_t end) {
    // per-thread buffers: the staged tile; one block's states and decays; dB, dC per lane; the blocks' sums
    Staged<T> st(kSlots, s.tile, W);
    // (states and decays, dB and dC: each pair one vector more than 4 KiB-multiple apart, see Staged)
    std::vector<T> he(2 * K * SW + W), acc(2 * K * SW + W), per(s.per_slice * PB);
    T *Hs = he.data(), *Ex = Hs + K * SW + W, *aB = acc.data(), *aC = aB + K * SW + W;
    alignas(64) T entry[SW];
    for (int64_t task = begin; task < end; ++task) {
      const Task tk(s, task);
      const int64_t b = tk.b;
      const bool* rr = in.reset ? in.reset + b * L : nullptr;
      T* dBp = gr.dBp + task * L * NS;  // (L, NS) partial sums over this task's channels
      T* dCp = gr.dCp + task * L * NS;
      std::fill(dBp, dBp + L * NS, T(0));
      std::fill(dCp, dCp + L * NS, T(0));
      std::fill(per.begin(), per.end(), T(0));
      for (int64_t blk = tk.blk0; blk < tk.blk1; ++blk)
        gather_state(gr.dlast ? gr.dlast + (b * dim + blk * W) * n : nullptr, std::min(W, dim - blk * W), n, s.ns,
                     W, n, per.data() + (blk - tk.blk0) * PB);
      for (int64_t c = nc - 1; c >= 0; --c) {
        const int64_t t0 = c * K, cl = std::min(K, L - t0);
        std::fill(acc.begin(), acc.end(), T(0));
        for (int64_t tb = tk.blk0; tb < tk.blk1; tb += s.tile) {
          const int64_t nt = std::min(s.tile, tk.blk1 - tb);
          // 1. the tile's rows of delta, u, z, dy
          stage_rows(in.delta, b, t0, cl, tb, nt, dim, st, kDt);
          stage_rows(in.u, b, t0, cl, tb, nt, dim, st, kU);
          if (in.has_z) stage_rows(in.z, b, t0, cl, tb, nt, dim, st, kZ);
          stage_rows(gr.dy, b, t0, cl, tb, nt, dim, st, kDy);
          // 2. per block: dt, the sigmoids, the chunk's states from its checkpoint, then the adjoint
          for (int64_t j = 0; j < nt; ++j) {
            const int64_t blk = tb + j, d0 = blk * W;
            T* pb = per.data() + (blk - tk.blk0) * PB;
            prepare_dt(in, d0, cl, st.at(kDt, j), st.at(kSg, j));
            if (in.has_z)
              for (int64_t i = 0; i < cl; ++i) vsigmoid(Vec::loadu(st.at(kZ, j) + i * W)).store(st.at(kSz, j) + i * W);
            Vec dD = Vec::loadu(pb + 2 * SW), dbias = Vec::loadu(pb + 2 * SW + W);
            gather_state(gr.ck + ((b * dim + d0) * nc + c) * n, std::min(W, dim - d0), n, s.ns, W, nc * n, entry);
            recompute_block<T, NS>(in, in.A + blk * SW, entry, st.at(kDt, j), st.at(kU, j), b, t0, cl, rr, Hs, Ex,
                                   in.has_z ? st.at(kYp, j) : nullptr);
            adjoint_block<T, NS>(in, st, j, in.A + blk * SW, entry, Hs, Ex, pb, dD, dbias,
                                 in.D ? Vec::loadu(in.D + d0) : Vec(T(0)), aB, aC, b, t0, cl, rr);
            dD.store(pb + 2 * SW);
            dbias.store(pb + 2 * SW + W);
          }
          // 3. the tile's rows of du, ddelta, dz
          write_rows(st, kDu, gr.du, b, L, t0, cl, tb, nt, dim);
          write_rows(st, kDdt, gr.ddelta, b, L, t0, cl, tb, nt, dim);
          if (in.has_z) write_rows(st, kDz, gr.dz, b, L, t0, cl, tb, nt, dim);
        }
        // dB, dC of the chunk's tokens: the sums over lanes
        for (int64_t i = 0; i < cl; ++i) {
          Vec vb[NS], vc[NS];
          for (int k = 0; k < NS; ++k) {
            vb[k] = Vec::loadu(aB + i * SW + k * W);
            vc[k] = Vec::loadu(aC + i * SW + k * W);
          }
          reduce_lanes_add<T, NS>(vb, dBp + (t0 + i) * NS);
          reduce_lanes_add<T, NS>(vc, dCp + (t0 + i) * NS);
        }
      }
      for (int64_t blk = tk.blk0; blk < tk.blk1; ++blk) {
        const int64_t d0 = blk * W;
        const T* pb = per.data() + (blk - tk.blk0) * PB;
        scatter_state(pb, std::min(W, dim - d0), n, W, gr.dinit + (b * dim + d0) * n, n);
        for (int k = 0; k < NS; ++k) Vec::loadu(pb + SW + k * W).store(gr.dAp + (b * NS + k) * dimp + d0);
        Vec::loadu(pb + 2 * SW).store(gr.dDp + b * dimp + d0);
        Vec::loadu(pb + 2 * SW + W).store(gr.dbiasp + b * dimp + d0);
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
  const Tensor B = state_major(B_, s.ns), C = state_major(C_, s.ns), AB = blocked_A(A, s);
  const std::optional<Tensor> D = padded_vec(D_, s), bias = padded_vec(delta_bias_, s);
  std::optional<Tensor> z, reset, dy, dlast;
  if (z_) z = channel_contiguous(*z_);
  if (reset_) reset = reset_->contiguous();
  if (dy_) dy = channel_contiguous(*dy_);
  if (dlast_) dlast = dlast_->contiguous();
  const auto opt = u.options();
  auto du = at::empty({s.batch, s.length, s.dim}, opt);  // token-major, returned as (batch, dim, length) views
  auto ddelta = at::empty({s.batch, s.length, s.dim}, opt);
  auto dz = z ? at::empty({s.batch, s.length, s.dim}, opt) : at::empty({0}, opt);
  auto dBp = at::empty({s.batch, s.slices, s.length, s.ns}, opt);  // per task: sums over its channels
  auto dCp = at::empty({s.batch, s.slices, s.length, s.ns}, opt);
  auto dAp = at::empty({s.batch, s.ns, s.dimp}, opt);
  auto dDp = at::empty({s.batch, s.dimp}, opt);
  auto dbiasp = at::empty({s.batch, s.dimp}, opt);
  auto dinit = at::empty({s.batch, s.dim, s.n}, opt);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "selective_scan_cpu_bwd", [&] {
    using T = scalar_t;
    const Inputs<T> in = make_inputs<T>(u, delta, AB, B, C, D, z, bias, std::nullopt, reset, delta_softplus);
    Grads<T> gr{dy ? tm_of<T>(*dy) : TM<T>{nullptr, 0, 0}, ptr_or_null<T>(dlast), ck.const_data_ptr<T>(),
                du.mutable_data_ptr<T>(), ddelta.mutable_data_ptr<T>(), z ? dz.mutable_data_ptr<T>() : nullptr,
                dBp.mutable_data_ptr<T>(), dCp.mutable_data_ptr<T>(), dAp.mutable_data_ptr<T>(),
                dDp.mutable_data_ptr<T>(), dbiasp.mutable_data_ptr<T>(), dinit.mutable_data_ptr<T>()};
    DISPATCH_NS(s.ns, backward_kernel, in, s, gr);
  });
  // reduce the partials: dB, dC over a row's tasks into (batch, length, state) (returned as (batch, state, length)
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

// ---------------------------------------------------------------------------------------------------------------
// One decoding step (eager batch-1 decoding, issue 35): the selective state update and the convolution's step, as
// ops dispatched in C++, called by the public functions without a Python op in between (ops/cpu_kernel.py).
//
//   hf_densessm::selective_state_update_cpu(state!, x, dt, A, B, C, D?, z?, dt_bias?, dt_softplus) -> y
//       dt = softplus(dt + dt_bias); h = exp(dt A) h + dt B x (state updated in place); y = (C.h + D x) silu(z)
//   hf_densessm::causal_conv1d_step_cpu(x, taps, bias?, window, silu) -> out
//       out = act(bias + sum_{k < K-1} taps[:, k] window[:, :, k + 1] + taps[:, K-1] x)     (x: one token)
//
// Computed in the state's dtype (float32 or float64) / in float32 (float64 for float64 x); inputs of other dtypes
// are converted once. Inputs need unit stride along their last dimension only.

// Elementwise over n contiguous values, in place, vectorized (ATen's Sleef exp / log1p): softplus with
// torch.nn.functional.softplus's threshold (20), and silu.
template <typename S>
void softplus_inplace(S* v, int64_t n) {
  using Vec = at::vec::Vectorized<S>;
  at::vec::map([](Vec a) { return Vec::blendv(a.exp().log1p(), a, a > Vec(S(20))); }, v, v, n);
}

template <typename S>
void silu_inplace(S* v, int64_t n) {
  using Vec = at::vec::Vectorized<S>;
  at::vec::map([](Vec a) { return a / (Vec(S(1)) + a.neg().exp()); }, v, v, n);
}

Tensor as_dtype(const Tensor& t, at::ScalarType dtype) {
  Tensor r = t.scalar_type() == dtype ? t : t.to(dtype);
  return r.stride(-1) == 1 ? r : r.contiguous();
}

Tensor selective_state_update_cpu(Tensor state, const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B,
                                  const Tensor& C, const std::optional<Tensor>& D, const std::optional<Tensor>& z,
                                  const std::optional<Tensor>& dt_bias, bool dt_softplus) {
  TORCH_CHECK(state.dim() == 3 && state.is_contiguous() && state.device().is_cpu(),
              "selective_state_update_cpu: state must be a contiguous CPU (batch, dim, state) tensor");
  TORCH_CHECK(state.scalar_type() == at::kFloat || state.scalar_type() == at::kDouble,
              "selective_state_update_cpu: state must be float32 or float64, got ", state.scalar_type());
  const int64_t batch = state.size(0), dim = state.size(1), n = state.size(2);
  TORCH_CHECK(n <= kMaxState, "selective_state_update_cpu: state size ", n, " exceeds ", kMaxState);
  const auto S_ = state.scalar_type();
  const Tensor xs = as_dtype(x, S_), dts = as_dtype(dt, S_), As = as_dtype(A, S_).contiguous();
  const Tensor Bs = as_dtype(B, S_), Cs = as_dtype(C, S_);
  const Tensor Ds = D ? as_dtype(*D, S_) : Tensor(), zs = z ? as_dtype(*z, S_) : Tensor();
  const Tensor bs = dt_bias ? as_dtype(*dt_bias, S_) : Tensor();
  TORCH_CHECK(xs.sizes() == at::IntArrayRef({batch, dim}) && dts.sizes() == xs.sizes() &&
                  As.sizes() == at::IntArrayRef({dim, n}) && Bs.sizes() == at::IntArrayRef({batch, n}) &&
                  Cs.sizes() == Bs.sizes(),
              "selective_state_update_cpu: shapes do not match state ", state.sizes());
  auto y = at::empty({batch, dim}, state.options());
  AT_DISPATCH_FLOATING_TYPES(S_, "selective_state_update_cpu", [&] {
    using S = scalar_t;
    S* h = state.mutable_data_ptr<S>();
    const S *xp = xs.const_data_ptr<S>(), *dtp = dts.const_data_ptr<S>(), *Ap = As.const_data_ptr<S>();
    const S *Bp = Bs.const_data_ptr<S>(), *Cp = Cs.const_data_ptr<S>();
    const S* Dp = Ds.defined() ? Ds.const_data_ptr<S>() : nullptr;
    const S* zp = zs.defined() ? zs.const_data_ptr<S>() : nullptr;
    const S* bp = bs.defined() ? bs.const_data_ptr<S>() : nullptr;
    S* yp = y.mutable_data_ptr<S>();
    // per batch row: the steps (softplus), the decays exp(dt A) of every (channel, state), then the recurrence
    // (rows in parallel when there is enough work; each task its own buffers)
    at::parallel_for(0, batch, std::max<int64_t>(1, 32768 / (dim * n)), [&](int64_t begin, int64_t end) {
      std::vector<S> steps(dim), decay(dim * n), gate(dim);
      for (int64_t b = begin; b < end; ++b) {
        const S* xb = xp + b * xs.stride(0);
        for (int64_t d = 0; d < dim; ++d) steps[d] = dtp[b * dts.stride(0) + d] + (bp ? bp[d] : S(0));
        if (dt_softplus) softplus_inplace(steps.data(), dim);
        for (int64_t d = 0; d < dim; ++d)
          for (int64_t k = 0; k < n; ++k) decay[d * n + k] = steps[d] * Ap[d * n + k];
        at::vec::map([](at::vec::Vectorized<S> v) { return v.exp(); }, decay.data(), decay.data(), dim * n);
        const S* Bb = Bp + b * Bs.stride(0);
        const S* Cb = Cp + b * Cs.stride(0);
        S* yb = yp + b * dim;
        for (int64_t d = 0; d < dim; ++d) {
          S* hd = h + (b * dim + d) * n;
          const S* ed = decay.data() + d * n;
          const S su = steps[d] * xb[d];
          S acc = 0;
          for (int64_t k = 0; k < n; ++k) {
            hd[k] = ed[k] * hd[k] + su * Bb[k];
            acc += Cb[k] * hd[k];
          }
          yb[d] = Dp ? acc + Dp[d] * xb[d] : acc;
        }
        if (zp) {
          std::copy(zp + b * zs.stride(0), zp + b * zs.stride(0) + dim, gate.begin());
          silu_inplace(gate.data(), dim);
          for (int64_t d = 0; d < dim; ++d) yb[d] *= gate[d];
        }
      }
    });
  });
  return y.to(x.scalar_type());
}

Tensor causal_conv1d_step_cpu(const Tensor& x, const Tensor& taps, const std::optional<Tensor>& bias,
                              const Tensor& window, bool silu) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.device().is_cpu(),
              "causal_conv1d_step_cpu: x must be a CPU (batch, 1, channels) tensor, got ", x.sizes());
  const int64_t batch = x.size(0), channels = x.size(2), K = taps.size(1);
  TORCH_CHECK(taps.dim() == 2 && taps.size(0) == channels && window.sizes() == at::IntArrayRef({batch, channels, K}),
              "causal_conv1d_step_cpu: taps (channels, K) and window (batch, channels, K) expected");
  const auto S_ = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const Tensor xs = as_dtype(x, S_), ts = as_dtype(taps, S_).contiguous(), ws = as_dtype(window, S_).contiguous();
  const Tensor bs = bias ? as_dtype(*bias, S_) : Tensor();
  auto out = at::empty({batch, 1, channels}, x.options().dtype(S_));
  AT_DISPATCH_FLOATING_TYPES(S_, "causal_conv1d_step_cpu", [&] {
    using S = scalar_t;
    const S *xp = xs.const_data_ptr<S>(), *tp = ts.const_data_ptr<S>(), *wp = ws.const_data_ptr<S>();
    const S* bp = bs.defined() ? bs.const_data_ptr<S>() : nullptr;
    S* op = out.mutable_data_ptr<S>();
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t c = 0; c < channels; ++c) {
        const S* tc = tp + c * K;
        const S* wc = wp + (b * channels + c) * K;
        S acc = (bp ? bp[c] : S(0)) + tc[K - 1] * xp[b * xs.stride(0) + c];
        for (int64_t k = 0; k + 1 < K; ++k) acc += tc[k] * wc[k + 1];
        op[b * channels + c] = acc;
      }
    if (silu) silu_inplace(op, batch * channels);
  });
  return out.to(x.scalar_type());
}

// ---------------------------------------------------------------------------------------------------------------
// Multi-scale retention over a few tokens (speculative decoding's verification forwards, issue 37), the recurrent
// form of DenseSSM Eq. 18, 19, as an op dispatched in C++ that chunk_retention calls without a Python op in between:
//
//   hf_densessm::chunk_retention_cpu(q, k, v, scale, initial_state?) -> (o, final_state)
//       per batch row and head h, gamma_h = 1 - 2^(-5 - h):  S_t = gamma_h S_{t-1} + k_t^T v_t  (S_{-1}: the initial
//       state, else 0);  o_t = scale q_t S_t
//
// q, k (batch, length, heads, key_dim), v (batch, length, heads, value_dim); computed in float32 (float64 for float64
// v), inputs of other dtypes converted once; they need unit stride along their last dimension only. o (batch, length,
// heads, value_dim) contiguous in v's dtype; final_state (batch, heads, key_dim, value_dim) contiguous, a new tensor.
// Each token costs 2 key_dim x value_dim multiply-adds: cheaper than the chunked form's products only for a few tokens
// (the caller chooses, ops/retention/__init__.py). A token reads only earlier ones, so a non-finite input reaches only
// its own and later outputs (docs/kernels.md, "Non-finite values").

std::tuple<Tensor, Tensor> chunk_retention_cpu(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                               const std::optional<Tensor>& initial_state) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3)
                  && q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "chunk_retention_cpu: CPU q, k (batch, length, heads, key_dim) and v (batch, length, heads, value_dim) "
              "expected, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t batch = q.size(0), length = q.size(1), heads = q.size(2), K = q.size(3), V = v.size(3);
  const auto S_ = v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const Tensor qs = as_dtype(q, S_), ks = as_dtype(k, S_), vs = as_dtype(v, S_);
  Tensor state;
  if (initial_state) {
    TORCH_CHECK(initial_state->sizes() == at::IntArrayRef({batch, heads, K, V}) && initial_state->device().is_cpu(),
                "chunk_retention_cpu: initial_state must be a CPU (batch, heads, key_dim, value_dim) tensor");
    state = initial_state->to(S_, /*non_blocking=*/false, /*copy=*/true).contiguous();
  } else {
    state = at::zeros({batch, heads, K, V}, v.options().dtype(S_));
  }
  auto o = at::zeros({batch, length, heads, V}, v.options().dtype(S_));
  AT_DISPATCH_FLOATING_TYPES(S_, "chunk_retention_cpu", [&] {
    using S = scalar_t;
    const S *qp = qs.const_data_ptr<S>(), *kp = ks.const_data_ptr<S>(), *vp = vs.const_data_ptr<S>();
    S *sp = state.mutable_data_ptr<S>(), *op = o.mutable_data_ptr<S>();
    const S sc = static_cast<S>(scale);
    at::parallel_for(0, batch * heads, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, length * K * V)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / heads, h = bh % heads;
        const S gamma = static_cast<S>(1.0 - std::exp2(-5.0 - static_cast<double>(h)));
        S* st = sp + bh * K * V;
        for (int64_t t = 0; t < length; ++t) {
          const S* qt = qp + b * qs.stride(0) + t * qs.stride(1) + h * qs.stride(2);
          const S* kt = kp + b * ks.stride(0) + t * ks.stride(1) + h * ks.stride(2);
          const S* vt = vp + b * vs.stride(0) + t * vs.stride(1) + h * vs.stride(2);
          S* __restrict__ ot = op + ((b * length + t) * heads + h) * V;
          for (int64_t i = 0; i < K; ++i) {  // row i of S_t, then its share of o_t
            S* __restrict__ row = st + i * V;
            const S ki = kt[i], qi = sc * qt[i];
            for (int64_t j = 0; j < V; ++j) {
              row[j] = gamma * row[j] + ki * vt[j];
              ot[j] += qi * row[j];
            }
          }
        }
      }
    });
  });
  return {o.to(v.scalar_type()), state};
}

// ------------------------------------------------------------------------------------------ meta (fake) kernels
// The outputs' shapes, dtypes and strides only, from symbolic sizes (torch.compile, torch.library.opcheck).

Tensor token_major_meta(const Tensor& u, const c10::SymInt& channels) {  // (batch, channels, length), token-major
  return at::empty_symint({u.sym_size(0), u.sym_size(2), channels}, u.options()).transpose(1, 2);
}

std::tuple<Tensor, Tensor, Tensor> selective_scan_cpu_fwd_meta(
    const Tensor& u, const Tensor& delta, const Tensor& A, const Tensor& B, const Tensor& C,
    const std::optional<Tensor>& D, const std::optional<Tensor>& z, const std::optional<Tensor>& delta_bias,
    bool delta_softplus, const std::optional<Tensor>& initial_state, const std::optional<Tensor>& reset) {
  const c10::SymInt dim = u.sym_size(1), n = A.sym_size(1), nc = (u.sym_size(2) + kCheckpoint - 1) / kCheckpoint;
  return {token_major_meta(u, dim), at::empty_symint({u.sym_size(0), dim, n}, u.options()),
          at::empty_symint({u.sym_size(0), dim, nc, n}, u.options())};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> selective_scan_cpu_bwd_meta(
    const std::optional<Tensor>& dy, const std::optional<Tensor>& dlast, const Tensor& u, const Tensor& delta,
    const Tensor& A, const Tensor& B, const Tensor& C, const std::optional<Tensor>& D, const std::optional<Tensor>& z,
    const std::optional<Tensor>& delta_bias, bool delta_softplus, const std::optional<Tensor>& initial_state,
    const std::optional<Tensor>& reset, const Tensor& chunk_states) {
  const c10::SymInt dim = A.sym_size(0), n = A.sym_size(1);
  const auto opt = u.options();
  const auto vec = [&](bool has) { return at::empty_symint({has ? dim : c10::SymInt(0)}, opt); };
  return {token_major_meta(u, dim), token_major_meta(u, dim), at::empty_symint({dim, n}, opt),
          token_major_meta(u, n), token_major_meta(u, n), vec(D.has_value()),
          z ? token_major_meta(u, dim) : at::empty({0}, opt), vec(delta_bias.has_value()),
          at::empty_symint({u.sym_size(0), dim, n}, opt)};
}

Tensor selective_state_update_cpu_meta(Tensor state, const Tensor& x, const Tensor& dt, const Tensor& A,
                                       const Tensor& B, const Tensor& C, const std::optional<Tensor>& D,
                                       const std::optional<Tensor>& z, const std::optional<Tensor>& dt_bias,
                                       bool dt_softplus) {
  return at::empty_symint(x.sym_sizes(), x.options());
}

Tensor causal_conv1d_step_cpu_meta(const Tensor& x, const Tensor& taps, const std::optional<Tensor>& bias,
                                   const Tensor& window, bool silu) {
  return at::empty_symint(x.sym_sizes(), x.options());
}

std::tuple<Tensor, Tensor> chunk_retention_cpu_meta(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                                    const std::optional<Tensor>& initial_state) {
  const auto S_ = v.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return {at::empty_symint(v.sym_sizes(), v.options()),
          at::empty_symint({q.sym_size(0), q.sym_size(2), q.sym_size(3), v.sym_size(3)}, v.options().dtype(S_))};
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
  m.def(
      "selective_state_update_cpu(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, "
      "Tensor? z, Tensor? dt_bias, bool dt_softplus) -> Tensor");
  m.def("causal_conv1d_step_cpu(Tensor x, Tensor taps, Tensor? bias, Tensor window, bool silu) -> Tensor");
  m.def("chunk_retention_cpu(Tensor q, Tensor k, Tensor v, float scale, Tensor? initial_state) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hf_densessm, CPU, m) {
  m.impl("selective_scan_cpu_fwd", &selective_scan_cpu_fwd);
  m.impl("selective_scan_cpu_bwd", &selective_scan_cpu_bwd);
  m.impl("selective_state_update_cpu", &selective_state_update_cpu);
  m.impl("causal_conv1d_step_cpu", &causal_conv1d_step_cpu);
  m.impl("chunk_retention_cpu", &chunk_retention_cpu);
}

TORCH_LIBRARY_IMPL(hf_densessm, Meta, m) {
  m.impl("selective_scan_cpu_fwd", &selective_scan_cpu_fwd_meta);
  m.impl("selective_scan_cpu_bwd", &selective_scan_cpu_bwd_meta);
  m.impl("selective_state_update_cpu", &selective_state_update_cpu_meta);
  m.impl("causal_conv1d_step_cpu", &causal_conv1d_step_cpu_meta);
  m.impl("chunk_retention_cpu", &chunk_retention_cpu_meta);
}
