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

// Conversions of the 16-bit float types (round to nearest even; NaN stays NaN).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_KERNELS_H_
