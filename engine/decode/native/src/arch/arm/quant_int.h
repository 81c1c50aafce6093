// Integer dots of block-quantized rows with a fixed-point input (arm64, SDOT).
#pragma once

#include <cstdint>

#include "../../base/features.h"
#include "../../dots/fixed_input.h"

namespace moescope {}  // namespace moescope
