#!/usr/bin/env bash
# Builds the native kernels' variant libraries and holds each to the reference with kernel_check.
#
#   check_arm64.sh [build-dir]            aarch64: cross-compiled, run under qemu-aarch64
#   check_arm64.sh --native [build-dir]   this machine's architecture, the variants its CPU runs
#
# Under qemu this is correctness only (emulated instructions say nothing of speed). `-cpu max`
# offers every extension the variants ask for; the armv8-a variant runs once more on a
# Cortex-A53 model, which has no dot products, to show the base variant needs none.
# Needs cmake, a C++ compiler (aarch64-linux-gnu-g++ for the cross build), qemu-user for aarch64,
# and ninja (else make).
set -euo pipefail

native=0
if [[ "${1:-}" == "--native" ]]; then
  native=1
  shift
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
src="$root/engine/decode/native"
if ((native)); then
  dir="${1:-/tmp/moescope-native}"
else
  dir="${1:-/tmp/moescope-arm64}"
fi
jobs="${MOESCOPE_JOBS:-2}"

# ninja from the project's environment where it is not on PATH
if ! command -v ninja >/dev/null && [[ -x "$root/.venv/bin/ninja" ]]; then
  PATH="$root/.venv/bin:$PATH"
fi
generator=(-G Ninja)
command -v ninja >/dev/null || generator=(-G "Unix Makefiles")
if [[ -f "$dir/CMakeCache.txt" ]]; then
  generator=()  # a configured folder keeps its generator
fi

cross=()
cxx=g++
run=()
if ((!native)); then
  cxx=aarch64-linux-gnu-g++
  cross=(-DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_CXX_COMPILER="$cxx")
  run=(qemu-aarch64 -cpu max -L /usr/aarch64-linux-gnu)
fi

echo "== configure and build ($dir)"
mkdir -p "$dir"
cmake -S "$src" -B "$dir" "${generator[@]}" "${cross[@]}" -DCMAKE_BUILD_TYPE=Release >"$dir/configure.log" 2>&1 ||
  { cat "$dir/configure.log"; exit 1; }
cmake --build "$dir" -j "$jobs"

# The checker at the architecture's baseline, contraction off as the libraries (its reference
# must round a weight's product and difference separately).
"$cxx" -std=c++17 -O2 -Wall -Wextra -ffp-contract=off "$src/tests/kernel_check.cpp" -o "$dir/kernel_check" -ldl

# The variant libraries this machine can run, from the build's manifest (each one's "requires")
# and, natively, the CPU probe the loader asks; under qemu -cpu max, all of them.
mapfile -t libs < <(python3 - "$dir" "$native" <<'EOF'
import ctypes, json, os, sys
folder, native = sys.argv[1], sys.argv[2] == "1"
manifest = json.load(open(os.path.join(folder, "variants.json")))
have = None
if native:
    probe = ctypes.CDLL(os.path.join(folder, manifest["probe"]))
    probe.moescope_cpu_features.restype = ctypes.c_char_p
    have = set(probe.moescope_cpu_features().decode().split())
for v in manifest["variants"]:
    if have is None or set(v["requires"]) <= have:
        print(v["name"] + " " + os.path.join(folder, v["file"]))
    else:
        print(v["name"] + " -")
EOF
)

status=0
summary=()
runnable=()
for entry in "${libs[@]}"; do
  name="${entry%% *}"
  lib="${entry#* }"
  if [[ "$lib" == "-" ]]; then
    summary+=("SKIP $name (this CPU lacks its features)")
    continue
  fi
  runnable+=("$lib")
done
((${#runnable[@]})) || { echo "no variant library to check"; exit 1; }

check() {  # check <label> <command...>: runs kernel_check, records its verdict
  local label="$1"
  shift
  echo "== $label"
  if "$@"; then
    summary+=("PASS $label")
  else
    summary+=("FAIL $label")
    status=1
  fi
}

for lib in "${runnable[@]}"; do
  check "$(basename "$lib")${run:+ (qemu -cpu max)}" "${run[@]}" "$dir/kernel_check" "$lib"
done
if ((!native)); then
  base="$dir/libmoescope_kernels_armv8_a.so"
  check "$(basename "$base") (qemu -cpu cortex-a53)" qemu-aarch64 -cpu cortex-a53 -L /usr/aarch64-linux-gnu \
    "$dir/kernel_check" "$base"
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
exit "$status"
