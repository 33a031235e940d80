// Reduction kernels: element-wise dst = a op b for every (dtype, op), written as plain loops
// the compiler vectorises. f16 and bf16 are widened to f32, reduced, and rounded back (round to
// nearest even). kAvg reduces as kSum; the division happens once, in DivideInPlace.
//
// Thread-safety: pure functions.
#ifndef COLLECTIVES_SRC_CORE_KERNELS_H_
#define COLLECTIVES_SRC_CORE_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "collectives/types.h"

namespace collectives::core {

// dst[i] = a[i] op b[i] for i < count. dst may alias a or b exactly (not partially).
void Reduce(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b, size_t count);

// data[i] = data[i] / divisor for i < count (integer division for integer types): the final
// step of kAvg.
void DivideInPlace(DataType dtype, void* data, size_t count, size_t divisor);

// The instruction set the kernels run with: Reduce's loops over the plain types are compiled for
// each; with kAvx2 and above, f16 and bf16 use F16C where the CPU has it.
enum class KernelIsa { kBaseline, kAvx2, kAvx512 };

// "baseline", "avx2", "avx512".
const char* KernelIsaName(KernelIsa isa);

// What this CPU offers the kernels (all false off x86-64): AVX2; AVX-512 F, BW, VL and DQ
// together; AVX-VNNI (the 256-bit VEX form, CPUID leaf 7 subleaf 1 EAX bit 4: Intel cores
// from Sapphire Rapids and Alder Lake on); and whether Intel made it.
struct KernelCpu {
  bool avx2 = false;
  bool avx512 = false;
  bool avx_vnni = false;
  bool intel = false;
};
KernelCpu DetectKernelCpu();

// The set this process runs with, chosen on first use: ChooseKernelIsa of
// $COLLECTIVES_KERNEL_ISA and DetectKernelCpu().
KernelIsa ActiveKernelIsa();

// The set to run with, given `asked` (the variable's value, null when unset) and what `cpu`
// has. Unset: the best the CPU has, except AVX-512 on an Intel CPU without AVX-VNNI (one whose
// clock 512-bit instructions may lower; see kernels.cc), which only `asked` = "avx512" picks. A
// set the CPU lacks gives the best it has below that one; an unknown name, the default. Either
// writes a line on stderr naming the variable and its value.
KernelIsa ChooseKernelIsa(const char* asked, const KernelCpu& cpu);

// Conversions of the 16-bit float types (round to nearest even). A NaN stays a NaN of its sign
// and gets the quiet bit, except in BFloat16ToFloat, which widens every code exactly (a shift:
// a signalling NaN stays signalling, as the AVX2 loop's widening does); f16 keeps its payload
// (the top 10 bits when narrowing), as F16C does.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_KERNELS_H_
