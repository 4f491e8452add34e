// The Python module of the native CPU kernels (nanobind): one function per kernel, and the CPU
// decode step's decoder (models/decoder/cpu).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "attend.h"
#include "decode_step.h"
#include "embed_rows.h"
#include "kernels.h"
#include "kv_store.h"
#include "prefill.h"
#include "qdot.h"

namespace nb = nanobind;
namespace ms = mlx_serving;
using mlx::core::array;

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
  m.doc() = "Native CPU kernels for MLX (mlx-serving): quantized matmul, paged attention, the CPU decode step";
  m.def("quantized_matmul", &ms::quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"),
        "x (..., K) float32 @ dequantize(w, scales, biases).T -> (..., N) float32 (MLX's affine layout).");
  m.def("paged_attention", &ms::paged_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("block_table"), nb::arg("start"), nb::arg("n_valid"), nb::arg("scale"), nb::arg("block_size"),
        nb::arg("k_scales").none() = nb::none(), nb::arg("k_biases").none() = nb::none(),
        nb::arg("v_scales").none() = nb::none(), nb::arg("v_biases").none() = nb::none(), nb::arg("group_size") = 0,
        nb::arg("bits") = 0, nb::arg("threads") = 0,
        "Causal GQA attention of q (B, H, T, D) over the paged cache k, v (R, Hkv, D) -> (B, T, H, D) float32; "
        "with the scales and biases, k and v are MLX's affine layout (R, Hkv, D * bits / 32) uint32; threads > 0: "
        "on the native prefill's pool of that many threads (else OpenMP's).");
  m.def("paged_attention_store", &ms::paged_attention_store, nb::arg("q"), nb::arg("new_k"), nb::arg("new_v"),
        nb::arg("rows"), nb::arg("k"), nb::arg("v"), nb::arg("block_table"), nb::arg("start"), nb::arg("n_valid"),
        nb::arg("scale"), nb::arg("block_size"), nb::arg("k_scales").none() = nb::none(),
        nb::arg("k_biases").none() = nb::none(), nb::arg("v_scales").none() = nb::none(),
        nb::arg("v_biases").none() = nb::none(), nb::arg("group_size") = 0, nb::arg("bits") = 0,
        nb::arg("threads") = 0,
        "paged_attention after storing new_k, new_v (N, Hkv, D) float32 at the cache rows (N,) int32 as the CPU "
        "decode step stores them (a quantized cache's queries and output rotated here) -> [(B, T, H, D) float32, "
        "then the cache arrays, written in place: k, v (and k/v scales and biases when quantized)].");
  m.def("isa", []() { return ms::cpu_has_avx2() ? "avx2+fma" : "portable"; },
        "The instruction set the kernels run with on this CPU: 'avx2+fma' or 'portable'.");
  m.def("force_portable", &ms::force_portable,
        "Run the portable loops even where AVX2 + FMA are present (for tests; no effect off x86-64).");

  nb::class_<ms::QMatrix>(m, "QMatrix", "An affine-quantized matrix (MLX's layout), packed once for the CPU decoder's int8 products.")
      .def(nb::init<array, array, array, std::optional<array>, int, int>(), nb::arg("w"), nb::arg("scales"),
           nb::arg("biases"), nb::arg("bias").none(), nb::arg("bits"), nb::arg("group_size"));
  nb::class_<ms::LayerWeights>(m, "LayerWeights", "One decoder layer's weights for the CPU decoder.")
      .def("__init__",
           [](ms::LayerWeights* self, array input_norm, array post_norm, ms::QMatrix qkv, ms::QMatrix o,
              ms::QMatrix gate_up, ms::QMatrix down, std::optional<array> q_norm, std::optional<array> k_norm) {
             new (self) ms::LayerWeights{input_norm, post_norm, qkv, o, gate_up, down, q_norm, k_norm};
           },
           nb::arg("input_norm"), nb::arg("post_norm"), nb::arg("qkv"), nb::arg("o"), nb::arg("gate_up"),
           nb::arg("down"), nb::arg("q_norm").none(), nb::arg("k_norm").none());
  nb::class_<ms::DecoderHandle>(m, "Decoder", "A built CPU decoder (decode_step runs it).");
  m.def(
      "make_decoder",
      [](int hidden, int heads, int kv_heads, int head_dim, int intermediate, float eps, bool rope_traditional,
         float rope_scale, const std::vector<ms::LayerWeights>& layers, const array& norm, const ms::QMatrix& head,
         const array& inv_freq, int threads) {
        return ms::make_decoder({hidden, heads, kv_heads, head_dim, intermediate, eps, rope_traditional, rope_scale},
                                layers, norm, head, inv_freq, threads);
      },
      nb::arg("hidden"), nb::arg("heads"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("intermediate"),
      nb::arg("eps"), nb::arg("rope_traditional"), nb::arg("rope_scale"), nb::arg("layers"), nb::arg("norm"),
      nb::arg("head"), nb::arg("inv_freq"), nb::arg("threads"),
      "The CPU decoder over the model's weights (shared, not copied), with a pool of ``threads``.");
  m.def("decode_step", &ms::decode_step, nb::arg("decoder"), nb::arg("h"), nb::arg("start"), nb::arg("n_valid"),
        nb::arg("block_table"), nb::arg("keys"), nb::arg("values"), nb::arg("block_size"),
        nb::arg("scales") = std::vector<array>{}, nb::arg("bits") = 0, nb::arg("group") = 0,
        "One decode token per row -> [logits (B, vocab), keys..., values..., scales...] (the K/V written in place; "
        "float32/float16/bfloat16 K/V, or with bits 4 / 8 the quantized layout and its scales and biases).");
  m.def("attend", &ms::attend, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("rows"), nb::arg("g"),
        nb::arg("scales") = std::vector<array>{}, nb::arg("bits") = 0, nb::arg("group") = 0,
        nb::arg("lengths") = std::vector<int>{},
        "The decode step's attention of q (m, D), the query heads of KV head g, over the cache rows ``rows`` of k / v "
        "(head j over the first lengths[j]; empty: all) -> (m, D) float32 (tests).");
  m.def("kv_quantize", &ms::kv_quantize, nb::arg("x"), nb::arg("bits"), nb::arg("group"),
        "The decode step's quantized K/V store of x (N, D) float32 -> [w, scales, biases] (tests).");
  m.def("int8_matmul", &ms::int8_matmul, nb::arg("m"), nb::arg("x"),
        "x (M, K) @ dequantize(m).T (+ bias) with x quantized to int8 per block of 32 (one thread).");
  m.def("int8_quantized_matmul", &ms::int8_quantized_matmul, nb::arg("x"), nb::arg("w"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("group_size"), nb::arg("bits"), nb::arg("threads"),
        "x (..., K) float32 @ dequantize(w).T -> (..., N) with x quantized to int8 per block of 32 (the int8 GEMM "
        "of the native prefill, on a pool of ``threads``).");
  m.def("int8_packed_matmul", &ms::int8_packed_matmul, nb::arg("m"), nb::arg("x"), nb::arg("threads"),
        "x (..., K) float32 @ dequantize(m).T (+ bias) -> (..., N) with x quantized to int8 per block of 32 (the "
        "int8 GEMM over m's weights packed at load, on a pool of ``threads``).");
  m.def("int8_swiglu_matmul", &ms::int8_swiglu_matmul, nb::arg("m"), nb::arg("gate_up"), nb::arg("threads"),
        "gate_up (..., 2K) = [gate | up] float32 -> silu(gate) * up @ dequantize(m).T (+ bias) -> (..., N), the "
        "SwiGLU fused with the int8 product over m's packed weights (the native prefill's down projection).");
  m.def("packed_rows", &ms::packed_rows, nb::arg("m"), nb::arg("ids"),
        "Rows ids (any shape, integers) of dequantize(m) -> (*ids.shape, K) float32, read from m's packed copy: "
        "bit for bit mx.dequantize of the table m was made from (a tied model's embedding lookup).");
  m.def("decoder_isa", &ms::decoder_isa, "The instruction set of the int8 products: avx512vnni, avx2 or portable.");
  m.def("set_decoder_isa", &ms::set_isa_override, nb::arg("isa"),
        "Force a lesser instruction set for the int8 products: 'auto', 'avx2' or 'portable' (tests).");
}
