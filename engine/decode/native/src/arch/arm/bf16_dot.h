// bf16 weight rows times a bf16 x (arm64): BFDOT where the CPU has it, else widened to float32.
#pragma once

#include <cstdint>

#include "../../base/features.h"
#include "../../base/scalar.h"

namespace moescope {}  // namespace moescope
