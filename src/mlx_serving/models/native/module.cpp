// The Python module of the native CPU kernels (nanobind): one function per kernel.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include "kernels.h"

namespace nb = nanobind;

namespace mlx_serving {

namespace {
bool portable_only = false;  // set by force_portable(): the tests' way to run the portable loops here
}

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool yes =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return yes && !portable_only;
#else
  return false;
#endif
}

void force_portable(bool on) { portable_only = on; }

}  // namespace mlx_serving

NB_MODULE(_kernels, m) {
  m.doc() = "Native CPU kernels for MLX (mlx-serving): quantized matmul, paged attention";
  m.def("quantized_matmul", &mlx_serving::quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        "x (..., K) float32 @ dequantize(w, scales, biases).T -> (..., N) float32 (MLX's affine layout).");
  m.def("paged_attention", &mlx_serving::paged_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("block_table"), nb::arg("start"), nb::arg("n_valid"), nb::arg("scale"), nb::arg("block_size"),
        "Causal GQA attention of q (B, H, T, D) over the paged cache k, v (R, Hkv, D) -> (B, T, H, D) float32.");
  m.def("isa", []() { return mlx_serving::cpu_has_avx2() ? "avx2+fma" : "portable"; },
        "The instruction set the kernels run with on this CPU: 'avx2+fma' or 'portable'.");
  m.def("force_portable", &mlx_serving::force_portable,
        "Run the portable loops even where AVX2 + FMA are present (for tests; no effect off x86-64).");
}
