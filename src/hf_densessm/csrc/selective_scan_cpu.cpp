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
// casts to the compute dtype and back). Inputs may have any strides (copied to the layouts below).
//
// Work split: at::parallel_for over (batch x channel) in the forward pass and over (batch x channel block) in the
// backward pass; within a channel the sequence is walked once with the state vector h[0:n] held in
// at::vec::Vectorized registers (n padded to a multiple of the vector width with A = B = C = 0, which keeps the
// padded lanes at 0). The forward pass saves the state entering every kCheckpoint-token chunk:
// chunk_states (batch, dim, n_chunks, state). The backward pass walks the chunks in reverse, recomputes the states
// of one chunk from its checkpoint into a per-thread buffer, and runs the adjoint recurrence
//   g_t = dL/dh_t = exp(dt_{t+1} A) g_{t+1} + C_t gy_t      (0 across a reset)
// reading every gradient off g_t, h_{t-1} and the decay. dB and dC (sums over channels), dA, dD and ddelta_bias
// (sums over the batch) are accumulated in per-task partial buffers and reduced at the end (deterministic).
//
// The instruction set is the one PyTorch detected (torch.backends.cpu.get_cpu_capability()); the Python loader
// passes -DCPU_CAPABILITY_<ISA> and the matching -m flags, which select ATen's vec256/vec512 implementation.

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

namespace {

using at::Tensor;

// Tokens per checkpoint; hf_densessm/ops/cpu_kernel.py's CHECKPOINT must be the same (the fake implementations).
constexpr int64_t kCheckpoint = 64;
// Largest supported number of vectors per state (n <= kMaxVecs * Vectorized<T>::size(), at least 64 states).
constexpr int kMaxVecs = 16;

template <typename T>
inline at::vec::Vectorized<T> vexp(const at::vec::Vectorized<T>& x) {
  return x.exp();  // Sleef's 1-ULP exp on AVX2 / AVX512
}

// out[t] = f(in[t] + shift) for t < L, vectorized (the tail through a partial load/store).
template <typename T, typename F>
inline void map_row(T* out, const T* in, T shift, int64_t L, const F& f) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  int64_t t = 0;
  for (; t + W <= L; t += W) f(Vec::loadu(in + t) + Vec(shift)).store(out + t);
  if (t < L) f(Vec::loadu(in + t, L - t) + Vec(shift)).store(out + t, L - t);
}

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

// dt row of one channel: softplus(delta + bias) (or delta + bias) into out[0:L].
template <typename T>
inline void dt_row(T* out, const T* delta, T bias, bool softplus, int64_t L) {
  using Vec = at::vec::Vectorized<T>;
  if (softplus) {
    map_row(out, delta, bias, L, [](const Vec& x) { return vsoftplus(x); });
  } else {
    map_row(out, delta, bias, L, [](const Vec& x) { return x; });
  }
}

template <typename T>
inline T hsum(const at::vec::Vectorized<T>& v) {
  using Vec = at::vec::Vectorized<T>;
  return at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, v);
}

struct Shapes {
  int64_t batch, dim, length, n, np, nc;
};

// Raw pointers of the prepared inputs (contiguous; B, C token-major (batch, length, np); A (dim, np)).
template <typename T>
struct Inputs {
  const T *u, *delta, *A, *B, *C, *D, *z, *bias, *init;
  const bool* reset;
  bool softplus;
};

void check_same(const Tensor& t, const char* name, const Tensor& u) {
  TORCH_CHECK(t.device().is_cpu(), "selective_scan_cpu: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == u.scalar_type(), "selective_scan_cpu: ", name, " has dtype ", t.scalar_type(),
              " but u has ", u.scalar_type(), ": all floating tensors must have one dtype (float32 or float64)");
}

void check_shape(const Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, "selective_scan_cpu: ", name, " must have shape ", shape, ", got ", t.sizes());
}

// Checks every argument and returns the shapes; the padded state width np depends on the vector width.
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
  TORCH_CHECK(s.n >= 1, "selective_scan_cpu: state size must be >= 1");
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
  int64_t nv = 1;
  while (nv * width < s.n) nv *= 2;
  TORCH_CHECK(nv <= kMaxVecs, "selective_scan_cpu: state size ", s.n, " exceeds the supported ",
              kMaxVecs * width);
  s.np = nv * width;
  s.nc = (s.length + kCheckpoint - 1) / kCheckpoint;
  return s;
}

// (batch, n, length) -> contiguous (batch, length, np), zero-padded states.
Tensor token_major(const Tensor& x, int64_t np) {
  auto out = at::zeros({x.size(0), x.size(2), np}, x.options());
  out.narrow(2, 0, x.size(1)).copy_(x.transpose(1, 2));
  return out;
}

Tensor padded_A(const Tensor& A, int64_t np) {
  auto out = at::zeros({A.size(0), np}, A.options());
  out.narrow(1, 0, A.size(1)).copy_(A);
  return out;
}

template <typename T>
const T* ptr_or_null(const std::optional<Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<T>() : nullptr;
}

// ------------------------------------------------------------------------------------------------ forward

template <typename T, int NV>
void forward_kernel(const Inputs<T>& in, const Shapes& s, T* y, T* last, T* ck) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const int64_t L = s.length, np = s.np, n = s.n, nc = s.nc;
  const int64_t grain = std::max<int64_t>(1, 16384 / (L * NV * W));
  at::parallel_for(0, s.batch * s.dim, grain, [&](int64_t begin, int64_t end) {
    alignas(64) T tmp[NV * W];
    std::vector<T> dtb(L);  // this channel's time steps
    for (int64_t bd = begin; bd < end; ++bd) {
      const int64_t b = bd / s.dim, d = bd % s.dim;
      Vec h[NV], a[NV];
      std::fill(tmp, tmp + NV * W, T(0));
      if (in.init) std::memcpy(tmp, in.init + bd * n, n * sizeof(T));
      for (int j = 0; j < NV; ++j) {
        h[j] = Vec::loadu(tmp + j * W);
        a[j] = Vec::loadu(in.A + d * np + j * W);
      }
      const T* ur = in.u + bd * L;
      const T* dr = in.delta + bd * L;
      const T* zr = in.z ? in.z + bd * L : nullptr;
      const bool* rr = in.reset ? in.reset + b * L : nullptr;
      const T bias = in.bias ? in.bias[d] : T(0);
      const T Dd = in.D ? in.D[d] : T(0);
      T* yr = y + bd * L;
      T* ckr = ck + bd * nc * n;
      dt_row(dtb.data(), dr, bias, in.softplus, L);
      for (int64_t t = 0; t < L; ++t) {
        if (t % kCheckpoint == 0) {  // the state entering this chunk (before its reset)
          for (int j = 0; j < NV; ++j) h[j].store(tmp + j * W);
          std::memcpy(ckr + (t / kCheckpoint) * n, tmp, n * sizeof(T));
        }
        const T dt = dtb[t];
        const Vec vdt(dt), vdtu(dt * ur[t]);
        const T* Bt = in.B + (b * L + t) * np;
        const T* Ct = in.C + (b * L + t) * np;
        const bool rs = rr && rr[t];
        Vec acc(T(0));
        for (int j = 0; j < NV; ++j) {
          const Vec decay = vexp(vdt * a[j]);
          const Vec hin = vdtu * Vec::loadu(Bt + j * W);
          h[j] = rs ? hin : at::vec::fmadd(decay, h[j], hin);
          acc = at::vec::fmadd(Vec::loadu(Ct + j * W), h[j], acc);
        }
        yr[t] = hsum(acc);
      }
      // the skip and the gate, vectorized over the row: y = (y + D u) * silu(z)
      {
        int64_t t = 0;
        const Vec vD(Dd);
        auto finish = [&](const Vec& y, int64_t t0, int64_t cnt) {
          Vec out = at::vec::fmadd(vD, Vec::loadu(ur + t0, cnt), y);
          if (zr) {
            const Vec zv = Vec::loadu(zr + t0, cnt);
            out = out * zv * vsigmoid(zv);
          }
          return out;
        };
        for (; t + W <= L; t += W) finish(Vec::loadu(yr + t), t, W).store(yr + t);
        if (t < L) finish(Vec::loadu(yr + t, L - t), t, L - t).store(yr + t, L - t);
      }
      for (int j = 0; j < NV; ++j) h[j].store(tmp + j * W);
      std::memcpy(last + bd * n, tmp, n * sizeof(T));
    }
  });
}

std::tuple<Tensor, Tensor, Tensor> selective_scan_cpu_fwd(
    const Tensor& u_, const Tensor& delta_, const Tensor& A, const Tensor& B, const Tensor& C,
    const std::optional<Tensor>& D_, const std::optional<Tensor>& z_, const std::optional<Tensor>& delta_bias_,
    bool delta_softplus, const std::optional<Tensor>& initial_state_, const std::optional<Tensor>& reset_) {
  const Shapes s = check_args(u_, delta_, A, B, C, D_, z_, delta_bias_, initial_state_, reset_);
  const Tensor u = u_.contiguous(), delta = delta_.contiguous();
  const Tensor Bt = token_major(B, s.np), Ct = token_major(C, s.np), Ap = padded_A(A, s.np);
  std::optional<Tensor> D, z, bias, init, reset;
  if (D_) D = D_->contiguous();
  if (z_) z = z_->contiguous();
  if (delta_bias_) bias = delta_bias_->contiguous();
  if (initial_state_) init = initial_state_->contiguous();
  if (reset_) reset = reset_->contiguous();
  auto y = at::empty({s.batch, s.dim, s.length}, u.options());
  auto last = at::empty({s.batch, s.dim, s.n}, u.options());
  auto ck = at::empty({s.batch, s.dim, s.nc, s.n}, u.options());
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "selective_scan_cpu_fwd", [&] {
    using T = scalar_t;
    Inputs<T> in{u.const_data_ptr<T>(), delta.const_data_ptr<T>(), Ap.const_data_ptr<T>(),
                 Bt.const_data_ptr<T>(), Ct.const_data_ptr<T>(), ptr_or_null<T>(D), ptr_or_null<T>(z),
                 ptr_or_null<T>(bias), ptr_or_null<T>(init),
                 reset ? reset->const_data_ptr<bool>() : nullptr, delta_softplus};
    const int64_t nv = s.np / at::vec::Vectorized<T>::size();
    T *py = y.mutable_data_ptr<T>(), *pl = last.mutable_data_ptr<T>(), *pc = ck.mutable_data_ptr<T>();
    switch (nv) {
      case 1: forward_kernel<T, 1>(in, s, py, pl, pc); break;
      case 2: forward_kernel<T, 2>(in, s, py, pl, pc); break;
      case 4: forward_kernel<T, 4>(in, s, py, pl, pc); break;
      case 8: forward_kernel<T, 8>(in, s, py, pl, pc); break;
      case 16: forward_kernel<T, 16>(in, s, py, pl, pc); break;
      default: TORCH_CHECK(false, "selective_scan_cpu: unsupported state width ", s.np);
    }
  });
  return {y, last, ck};
}

// ----------------------------------------------------------------------------------------------- backward

template <typename T>
struct Grads {
  const T *dy, *dlast, *ck;
  T *du, *ddelta, *dz, *dBp, *dCp, *dAp, *dDp, *dbiasp, *dinit;  // *p: partial buffers
  int64_t nblk, blk;  // channel blocks per batch row, channels per block
};

template <typename T, int NV>
void backward_kernel(const Inputs<T>& in, const Shapes& s, const Grads<T>& gr) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t S = NV * W;  // padded state width
  const int64_t L = s.length, n = s.n, nc = s.nc, K = kCheckpoint;
  at::parallel_for(0, s.batch * gr.nblk, 1, [&](int64_t begin, int64_t end) {
    // per-thread buffers: the states and decays of one chunk, its time steps and pre-gate outputs
    std::vector<T> Hs(K * S), Ex(K * S), ypre(K);
    // per-channel rows: time steps, softplus'(delta + bias) = sigmoid, sigmoid(z)
    std::vector<T> dtb(L), sgb(in.softplus ? L : 0), zsg(in.z ? L : 0);
    alignas(64) T tmp[S];
    alignas(64) T entry[S];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / gr.nblk, blk = task % gr.nblk;
      const int64_t d0 = blk * gr.blk, d1 = std::min(s.dim, d0 + gr.blk);
      T* dBp = gr.dBp + task * L * S;  // (L, S) partial sums over this block's channels
      T* dCp = gr.dCp + task * L * S;
      std::fill(dBp, dBp + L * S, T(0));
      std::fill(dCp, dCp + L * S, T(0));
      const bool* rr = in.reset ? in.reset + b * L : nullptr;
      for (int64_t d = d0; d < d1; ++d) {
        const int64_t bd = b * s.dim + d;
        const T* ur = in.u + bd * L;
        const T* dr = in.delta + bd * L;
        const T* zr = in.z ? in.z + bd * L : nullptr;
        const T* dyr = gr.dy ? gr.dy + bd * L : nullptr;
        const T bias = in.bias ? in.bias[d] : T(0);
        const T Dd = in.D ? in.D[d] : T(0);
        Vec a[NV], g[NV], dA[NV];
        std::fill(tmp, tmp + S, T(0));
        if (gr.dlast) std::memcpy(tmp, gr.dlast + bd * n, n * sizeof(T));
        for (int j = 0; j < NV; ++j) {
          a[j] = Vec::loadu(in.A + d * S + j * W);
          g[j] = Vec::loadu(tmp + j * W);
          dA[j] = Vec(T(0));
        }
        T dD = 0, dbias = 0;
        dt_row(dtb.data(), dr, bias, in.softplus, L);
        if (in.softplus) map_row(sgb.data(), dr, bias, L, [](const Vec& x) { return vsigmoid(x); });
        if (zr) map_row(zsg.data(), zr, T(0), L, [](const Vec& x) { return vsigmoid(x); });
        for (int64_t c = nc - 1; c >= 0; --c) {
          const int64_t t0 = c * K, cl = std::min(K, L - t0);
          // 1. recompute the chunk's states from its checkpoint
          std::fill(entry, entry + S, T(0));
          std::memcpy(entry, gr.ck + (bd * nc + c) * n, n * sizeof(T));
          Vec h[NV];
          for (int j = 0; j < NV; ++j) h[j] = Vec::loadu(entry + j * W);
          for (int64_t i = 0; i < cl; ++i) {
            const int64_t t = t0 + i;
            const T dt = dtb[t];
            const Vec vdt(dt), vdtu(dt * ur[t]);
            const T* Bt = in.B + (b * L + t) * S;
            const T* Ct = in.C + (b * L + t) * S;
            const bool rs = rr && rr[t];
            Vec acc(T(0));
            for (int j = 0; j < NV; ++j) {
              const Vec decay = vexp(vdt * a[j]);
              decay.store(Ex.data() + i * S + j * W);
              const Vec hin = vdtu * Vec::loadu(Bt + j * W);
              h[j] = rs ? hin : at::vec::fmadd(decay, h[j], hin);
              h[j].store(Hs.data() + i * S + j * W);
              if (zr) acc = at::vec::fmadd(Vec::loadu(Ct + j * W), h[j], acc);
            }
            if (zr) ypre[i] = hsum(acc) + Dd * ur[t];
          }
          // 2. the adjoint recurrence backwards through the chunk
          for (int64_t i = cl - 1; i >= 0; --i) {
            const int64_t t = t0 + i;
            const T dt = dtb[t], ut = ur[t];
            T gy = dyr ? dyr[t] : T(0);
            if (zr) {
              const T zt = zr[t], sg = zsg[t];
              gr.dz[bd * L + t] = gy * ypre[i] * sg * (T(1) + zt * (T(1) - sg));  // d silu(z)/dz
              gy *= zt * sg;
            }
            dD += gy * ut;
            const bool rs = rr && rr[t];
            const T* Bt = in.B + (b * L + t) * S;
            const T* Ct = in.C + (b * L + t) * S;
            const T* hprev = i > 0 ? Hs.data() + (i - 1) * S : entry;
            const Vec vgy(gy), vdt(dt), vdtu(dt * ut);
            Vec wacc(T(0)), xacc(T(0));
            for (int j = 0; j < NV; ++j) {
              g[j] = at::vec::fmadd(Vec::loadu(Ct + j * W), vgy, g[j]);  // g_t = dL/dh_t
              T* dCt = dCp + t * S + j * W;
              at::vec::fmadd(vgy, Vec::loadu(Hs.data() + i * S + j * W), Vec::loadu(dCt)).store(dCt);
              T* dBt = dBp + t * S + j * W;
              at::vec::fmadd(g[j], vdtu, Vec::loadu(dBt)).store(dBt);
              wacc = at::vec::fmadd(Vec::loadu(Bt + j * W), g[j], wacc);
              const Vec decay = Vec::loadu(Ex.data() + i * S + j * W);
              if (rs) {
                g[j] = Vec(T(0));  // nothing flows into the state before a reset
              } else {
                const Vec x = g[j] * decay * Vec::loadu(hprev + j * W);  // dL/d(dt_t A)
                xacc = at::vec::fmadd(x, a[j], xacc);
                dA[j] = at::vec::fmadd(x, vdt, dA[j]);
                g[j] = g[j] * decay;
              }
            }
            const T w = hsum(wacc);
            gr.du[bd * L + t] = w * dt + gy * Dd;
            T ddt = w * ut + hsum(xacc);
            if (in.softplus) ddt *= sgb[t];  // d softplus(x)/dx = sigmoid(x)
            gr.ddelta[bd * L + t] = ddt;
            dbias += ddt;
          }
        }
        for (int j = 0; j < NV; ++j) g[j].store(tmp + j * W);
        std::memcpy(gr.dinit + bd * n, tmp, n * sizeof(T));
        for (int j = 0; j < NV; ++j) dA[j].store(gr.dAp + bd * S + j * W);
        gr.dDp[bd] = dD;
        gr.dbiasp[bd] = dbias;
      }
    }
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> selective_scan_cpu_bwd(
    const std::optional<Tensor>& dy_, const std::optional<Tensor>& dlast_, const Tensor& u_, const Tensor& delta_,
    const Tensor& A, const Tensor& B, const Tensor& C, const std::optional<Tensor>& D_,
    const std::optional<Tensor>& z_, const std::optional<Tensor>& delta_bias_, bool delta_softplus,
    const std::optional<Tensor>& initial_state_, const std::optional<Tensor>& reset_, const Tensor& chunk_states_) {
  const Shapes s = check_args(u_, delta_, A, B, C, D_, z_, delta_bias_, initial_state_, reset_);
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
  const Tensor u = u_.contiguous(), delta = delta_.contiguous(), ck = chunk_states_.contiguous();
  const Tensor Bt = token_major(B, s.np), Ct = token_major(C, s.np), Ap = padded_A(A, s.np);
  std::optional<Tensor> D, z, bias, init, reset, dy, dlast;
  if (D_) D = D_->contiguous();
  if (z_) z = z_->contiguous();
  if (delta_bias_) bias = delta_bias_->contiguous();
  if (reset_) reset = reset_->contiguous();
  if (dy_) dy = dy_->contiguous();
  if (dlast_) dlast = dlast_->contiguous();
  const auto opt = u.options();
  // channel blocks: enough tasks to keep every thread busy; each task owns an (L, np) partial of dB and dC
  const int64_t threads = at::get_num_threads();
  const int64_t nblk = std::min<int64_t>(s.dim, std::max<int64_t>(1, (2 * threads + s.batch - 1) / s.batch));
  const int64_t blk = (s.dim + nblk - 1) / nblk;
  const int64_t nblk_used = (s.dim + blk - 1) / blk;
  auto du = at::empty({s.batch, s.dim, s.length}, opt);
  auto ddelta = at::empty({s.batch, s.dim, s.length}, opt);
  auto dz = z ? at::empty({s.batch, s.dim, s.length}, opt) : at::empty({0}, opt);
  auto dBp = at::empty({s.batch, nblk_used, s.length, s.np}, opt);
  auto dCp = at::empty({s.batch, nblk_used, s.length, s.np}, opt);
  auto dAp = at::empty({s.batch, s.dim, s.np}, opt);
  auto dDp = at::empty({s.batch, s.dim}, opt);
  auto dbiasp = at::empty({s.batch, s.dim}, opt);
  auto dinit = at::empty({s.batch, s.dim, s.n}, opt);
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "selective_scan_cpu_bwd", [&] {
    using T = scalar_t;
    Inputs<T> in{u.const_data_ptr<T>(), delta.const_data_ptr<T>(), Ap.const_data_ptr<T>(),
                 Bt.const_data_ptr<T>(), Ct.const_data_ptr<T>(), ptr_or_null<T>(D), ptr_or_null<T>(z),
                 ptr_or_null<T>(bias), nullptr, reset ? reset->const_data_ptr<bool>() : nullptr, delta_softplus};
    Grads<T> gr{ptr_or_null<T>(dy), ptr_or_null<T>(dlast), ck.const_data_ptr<T>(),
                du.mutable_data_ptr<T>(), ddelta.mutable_data_ptr<T>(), z ? dz.mutable_data_ptr<T>() : nullptr,
                dBp.mutable_data_ptr<T>(), dCp.mutable_data_ptr<T>(), dAp.mutable_data_ptr<T>(),
                dDp.mutable_data_ptr<T>(), dbiasp.mutable_data_ptr<T>(), dinit.mutable_data_ptr<T>(),
                nblk_used, blk};
    const int64_t nv = s.np / at::vec::Vectorized<T>::size();
    switch (nv) {
      case 1: backward_kernel<T, 1>(in, s, gr); break;
      case 2: backward_kernel<T, 2>(in, s, gr); break;
      case 4: backward_kernel<T, 4>(in, s, gr); break;
      case 8: backward_kernel<T, 8>(in, s, gr); break;
      case 16: backward_kernel<T, 16>(in, s, gr); break;
      default: TORCH_CHECK(false, "selective_scan_cpu: unsupported state width ", s.np);
    }
  });
  // reduce the partials: dB, dC over channel blocks (back to (batch, state, length)); dA, dD, dbias over the batch
  auto dB = dBp.sum(1).narrow(2, 0, s.n).transpose(1, 2).contiguous();
  auto dC = dCp.sum(1).narrow(2, 0, s.n).transpose(1, 2).contiguous();
  auto dA = dAp.sum(0).narrow(1, 0, s.n).contiguous();
  auto dD = D ? dDp.sum(0) : at::empty({0}, opt);
  auto dbias = bias ? dbiasp.sum(0) : at::empty({0}, opt);
  return {du, ddelta, dA, dB, dC, dD, dz, dbias, dinit};
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
