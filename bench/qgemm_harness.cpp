// The CPU decoder's int8 GEMM (models/decoder/cpu/qgemm.cpp) alone, on one thread, in CPU time:
// no Python, MLX or pool in the timed loop, so a busy machine moves it little (issue 41,
// docs/benchmarks.md "Multi-row products"). Random 4/8-bit weights (float32 scales, group 32)
// packed once, ``copies`` of them used in turn (enough to exceed L3 makes a one-row product stream
// its weights from memory, as a decode step does); prints the best of 5 rounds of ``reps`` calls.
//
//   MLX_INC=$(.venv/bin/python -c "import mlx.core as mx, pathlib; print(pathlib.Path(mx.__file__).parent / 'include')")
//   D=src/mlx_serving/models/decoder/cpu
//   g++ -O3 -std=c++20 -fopenmp -I$D -I$MLX_INC bench/qgemm_harness.cpp $D/qgemm.cpp $D/pack.cpp $D/qdot.cpp -o /tmp/qgemm
//   /tmp/qgemm N K BITS ROWS REPS [COPIES]      # e.g. /tmp/qgemm 960 576 4 5 600
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>

#include "qgemm.h"

namespace mlx_serving {
bool cpu_has_avx2() { return true; }  // module.cpp's, for qdot.cpp (x86-64 with AVX2 assumed)
}  // namespace mlx_serving

using namespace mlx_serving;

static double thread_cpu() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s N K BITS ROWS REPS [COPIES]\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atol(argv[1]), k = std::atol(argv[2]), rows = std::atol(argv[4]);
  const int bits = std::atoi(argv[3]), reps = std::atoi(argv[5]), copies = argc > 6 ? std::atoi(argv[6]) : 1;
  std::mt19937 rng(1);
  std::vector<uint8_t> w(n * k * bits / 8);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  std::vector<float> s(n * k / 32), b(n * k / 32), x(rows * k);
  for (auto& v : s) v = static_cast<float>(rng() % 1000) * 1e-4f;
  for (auto& v : b) v = -static_cast<float>(rng() % 1000) * 1e-4f;
  for (auto& v : x) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) * 1e-3f;
  const QMatrixView view{w.data(), s.data(), b.data(), nullptr, false, bits, 32, n, k};
  std::vector<PackedMatrix> packed;
  for (int c = 0; c < copies; ++c) packed.push_back(pack(view));
  Pool pool(1);
  QuantRows q;
  q.quantize(x.data(), rows, k, pool);
  std::vector<float> y(rows * n);
  const Isa isa = best_isa();
  double best = 1e9;
  for (int round = 0; round < 5; ++round) {
    const double t0 = thread_cpu();
    for (int i = 0; i < reps; ++i) qgemm(packed[i % copies], q, y.data(), isa, pool);
    best = std::min(best, (thread_cpu() - t0) / reps);
  }
  double checksum = 0;
  for (float v : y) checksum += v;
  std::printf("%ldx%ldx%ld q%d %s: %.2f us, %.1f GMAC/s (checksum %.6g)\n", static_cast<long>(rows),
              static_cast<long>(n), static_cast<long>(k), bits, isa_name(isa), best * 1e6,
              static_cast<double>(rows * n * k) / best * 1e-9, checksum);
}
