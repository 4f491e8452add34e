// The int8 products' common parts (issue 39): the instruction set they run with, picked at run
// time (the activations' rounding to int8 per block of 32 and the products: qgemm.cpp).

#include "qdot.h"

#include <stdexcept>

namespace mlx_serving {

bool cpu_has_avx2();  // module.cpp (false when the portable loops are forced)

namespace {

int isa_override = -1;  // -1: auto; else the Isa value forced

}  // namespace

Isa best_isa() {
  Isa best = Isa::portable;
#if defined(__x86_64__) || defined(_M_X64)
  if (cpu_has_avx2()) {
    static const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f");
    best = vnni ? Isa::avx512vnni : Isa::avx2;
  }
#endif
  if (isa_override >= 0 && isa_override < static_cast<int>(best)) return static_cast<Isa>(isa_override);
  return best;
}

void set_isa_override(const std::string& name) {
  if (name == "auto") isa_override = -1;
  else if (name == "avx2") isa_override = static_cast<int>(Isa::avx2);
  else if (name == "portable") isa_override = static_cast<int>(Isa::portable);
  else throw std::invalid_argument("isa must be 'auto', 'avx2' or 'portable', got '" + name + "'");
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512vnni: return "avx512vnni";
    case Isa::avx2: return "avx2";
    default: return "portable";
  }
}

}  // namespace mlx_serving
