// The int8 products of one native CPU decode step alone (issue 39): SmolLM2-135M's 30 layers of
// q/k/v (960 x 576), o (576 x 576), gate/up (3072 x 576) and down (576 x 1536), 4-bit, and the
// 8-bit tied head (49,152 x 576), each layer its own matrices (so a step streams ~81 MB of weights
// as the real one does), group size 32, float16 scales; activations rounded per product
// (QuantRows::quantize) then qgemm over a Pool of T threads, in the decode step's order. What
// bench/cpu_kernels.py cannot show: its one matrix per call through an MLX primitive hides the
// small shapes' scaling under the per-call cost, and one matrix stays in the caches.
//
// Built from the module's own sources (no MLX library needed, only its headers for float16):
//   MLX=$(.venv/bin/python -c "import mlx.core, pathlib; print(pathlib.Path(mlx.core.__file__).parent)")
//   D=src/mlx_serving/models/decoder/cpu
//   c++ -O3 -std=c++20 -fopenmp -I$D -I$MLX/include -pthread -o /tmp/cpu_gemm_step
//       bench/cpu_gemm_step.cpp $D/qgemm.cpp $D/qdot.cpp $D/pack.cpp        (one command line)
//   /tmp/cpu_gemm_step THREADS ROWS[,ROWS...] [REPEATS]     e.g. /tmp/cpu_gemm_step 2 1,2,4,8,32 7
//   HASH=1 /tmp/cpu_gemm_step 2 1,3,8,32                    a hash of every rounding and product
//
// Prints per row count: GMAC/s per matrix kind, wall / per process CPU-second (the latter counts a
// waiting pool thread's spinning), the roundings' ms, and the products' ms and GMAC/s for the
// step (medians of REPEATS steps). HASH=1 prints one hash of the rounded activations and outputs
// per row count instead (compare two builds: the same hash, the same bytes). On a shared machine
// run it under ``chrt -f 5`` (docs/benchmarks.md).

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "qgemm.h"

namespace mlx_serving {
bool cpu_has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); }
}  // namespace mlx_serving

using namespace mlx_serving;

namespace {

constexpr int kLayers = 30;
constexpr int kKinds = 5;  // q/k/v, o, gate/up, down, head
const char* kNames[kKinds] = {"qkv", "o", "gate_up", "down", "head"};

double wall() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

double process_cpu() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A random (n, k) matrix in MLX's affine layout, packed: values uniform, float16 scales ~1e-2 and
// offsets ~-1e-2 (the magnitudes do not change the work).
PackedMatrix matrix(int64_t n, int64_t k, int bits, std::mt19937& rng) {
  std::vector<uint8_t> w(n * k * bits / 8);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  std::vector<uint16_t> s(n * k / 32), b(n * k / 32);
  for (auto& v : s) v = static_cast<uint16_t>(0x2000 + (rng() & 0x3ff));
  for (auto& v : b) v = static_cast<uint16_t>(0xa000 + (rng() & 0x3ff));
  return pack({w.data(), s.data(), b.data(), nullptr, true, bits, 32, n, k});
}

int kind_of(size_t i, size_t count) { return i + 1 == count ? 4 : static_cast<int>(i % 4); }

// Activations (rows, 1536): normal values, one zero block and one block of exact ties (x.5).
std::vector<float> activations(int rows, std::mt19937& rng) {
  std::vector<float> x(rows * 1536);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(rng);
  std::fill(x.begin(), x.begin() + 64, 0.f);
  for (int j = 64; j < 96; ++j) x[j] = static_cast<float>(j % 7) + 0.5f - 3.f;
  x[95] = 127.f;
  return x;
}

void hash_step(const std::vector<PackedMatrix>& ms, const std::vector<float>& x, int rows, Pool& pool, Isa isa) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  };
  std::vector<float> y(rows * 49152);
  QuantRows q;
  for (const PackedMatrix& m : ms) {
    q.quantize(x.data(), rows, m.k, pool);
    mix(q.q.data(), q.q.size());
    mix(q.dx.data(), q.dx.size() * sizeof(float));
    mix(q.sum.data(), q.sum.size() * sizeof(float));
    qgemm(m, q, y.data(), isa, pool);
    mix(y.data(), rows * m.n * sizeof(float));
  }
  std::printf("T=%d M=%d hash %016llx\n", pool.threads(), rows, static_cast<unsigned long long>(h));
}

void time_step(const std::vector<PackedMatrix>& ms, const std::vector<float>& x, int rows, int repeats, Pool& pool,
               Isa isa) {
  std::vector<float> y(rows * 49152);
  QuantRows q;
  std::vector<double> cpu[kKinds + 1], time[kKinds + 1];  // [kKinds]: the roundings
  for (int r = 0; r <= repeats; ++r) {
    double c[kKinds + 1] = {0}, t[kKinds + 1] = {0};
    for (size_t i = 0; i < ms.size(); ++i) {
      const int kind = kind_of(i, ms.size());
      const double c0 = process_cpu(), t0 = wall();
      q.quantize(x.data(), rows, ms[i].k, pool);
      const double c1 = process_cpu(), t1 = wall();
      qgemm(ms[i], q, y.data(), isa, pool);
      c[kind] += process_cpu() - c1;
      t[kind] += wall() - t1;
      c[kKinds] += c1 - c0;
      t[kKinds] += t1 - t0;
    }
    if (r > 0)  // the first step warms up
      for (int k = 0; k <= kKinds; ++k) {
        cpu[k].push_back(c[k]);
        time[k].push_back(t[k]);
      }
  }
  const double macs[kKinds] = {960. * 576 * kLayers, 576. * 576 * kLayers, 3072. * 576 * kLayers,
                               576. * 1536 * kLayers, 49152. * 576};
  double total_t = 0, total_c = 0, total_macs = 0;
  std::printf("T=%d M=%3d GMAC/s wall/cpu:", pool.threads(), rows);
  for (int k = 0; k < kKinds; ++k) {
    const double tk = median(time[k]), ck = median(cpu[k]);
    std::printf(" %s %.1f/%.1f", kNames[k], macs[k] * rows / tk / 1e9, macs[k] * rows / ck / 1e9);
    total_t += tk;
    total_c += ck;
    total_macs += macs[k] * rows;
  }
  std::printf(" | roundings %.2f ms | products %.2f ms wall %.2f ms cpu, %.1f GMAC/s wall %.1f per cpu-s\n",
              median(time[kKinds]) * 1e3, total_t * 1e3, total_c * 1e3, total_macs / total_t / 1e9,
              total_macs / total_c / 1e9);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s THREADS ROWS[,ROWS...] [REPEATS]\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[1]), repeats = argc > 3 ? std::atoi(argv[3]) : 5;
  std::vector<int> rows;
  for (char* s = std::strtok(argv[2], ","); s; s = std::strtok(nullptr, ",")) rows.push_back(std::atoi(s));
  std::mt19937 rng(1);
  std::vector<PackedMatrix> ms;
  const int64_t shapes[4][3] = {{960, 576, 4}, {576, 576, 4}, {3072, 576, 4}, {576, 1536, 4}};
  for (int l = 0; l < kLayers; ++l)
    for (const auto& s : shapes) ms.push_back(matrix(s[0], s[1], static_cast<int>(s[2]), rng));
  ms.push_back(matrix(49152, 576, 8, rng));
  Pool pool(threads);
  const Isa isa = best_isa();
  const bool hash = std::getenv("HASH") != nullptr;
  for (int m : rows) {
    std::mt19937 xr(static_cast<unsigned>(m));
    const std::vector<float> x = activations(m, xr);
    if (hash) hash_step(ms, x, m, pool, isa);
    else time_step(ms, x, m, repeats, pool, isa);
  }
}
