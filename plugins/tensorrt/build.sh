#!/usr/bin/env bash
# Build libspin_trtllm_plugins.so (the SPIN TensorRT plugins + the cpp/src kernels) and the
# test harness plugin_harness, when TensorRT headers and nvcc are found.
#   plugins/tensorrt/build.sh [--out DIR] [--no-harness]     (default DIR: build/tensorrt)
# Headers: $TENSORRT_ROOT/include when TENSORRT_ROOT is set (and only there), else
# third_party/TensorRT/include in the repository, else the compiler's include path.
# Without headers or nvcc it prints one line saying so and exits 0; a compile error exits 1.
# SPIN_CUDA_ARCHS="100 120" adds -gencode targets, as for the torch library.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out="$root/build/tensorrt"
harness=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --no-harness) harness=0; shift ;;
    *) echo "plugins/tensorrt/build.sh: unknown argument '$1' (use --out DIR, --no-harness)" >&2; exit 2 ;;
  esac
done

if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
  nvcc="$CUDA_HOME/bin/nvcc"
elif command -v nvcc >/dev/null 2>&1; then
  nvcc=$(command -v nvcc)
else
  echo "plugins/tensorrt: skipped: nvcc not found (set CUDA_HOME or put nvcc on PATH)"
  exit 0
fi

inc=""
if [ -n "${TENSORRT_ROOT:-}" ]; then
  if [ -f "$TENSORRT_ROOT/include/NvInferRuntime.h" ]; then
    inc="$TENSORRT_ROOT/include"
  else
    echo "plugins/tensorrt: skipped: no TensorRT headers in $TENSORRT_ROOT/include (set TENSORRT_ROOT)"
    exit 0
  fi
elif [ -f "$root/third_party/TensorRT/include/NvInferRuntime.h" ]; then
  inc="$root/third_party/TensorRT/include"
else
  probe=$(mktemp -d)
  trap 'rm -rf "$probe"' EXIT
  printf '#include <NvInferRuntime.h>\n' > "$probe/probe.cpp"
  if ! "$nvcc" -std=c++17 -E "$probe/probe.cpp" -o /dev/null >/dev/null 2>&1; then
    echo "plugins/tensorrt: skipped: no TensorRT headers (set TENSORRT_ROOT)"
    exit 0
  fi
fi

mkdir -p "$out/obj"
gencode=(-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=sm_90)
for a in ${SPIN_CUDA_ARCHS:-}; do gencode+=("-gencode=arch=compute_$a,code=sm_$a"); done
incflags=(-I"$root/cpp/include")
[ -n "$inc" ] && incflags+=(-isystem "$inc")
common=(-std=c++17 -O3 -Xcompiler -fPIC,-fvisibility=hidden,-Wall "${incflags[@]}")

# compile every source in parallel; a failure prints its log and stops the build
pids=() logs=() objs=()
for src in "$root"/cpp/src/*.cu "$here"/src/*.cpp; do
  # objects keep the source's extension: select.cu and a select.cpp would not collide
  name=$(basename "$src"); obj="$out/obj/$name.o"; log="$out/obj/$name.log"
  if [ "${src##*.}" = "cu" ]; then
    "$nvcc" "${common[@]}" "${gencode[@]}" -c "$src" -o "$obj" >"$log" 2>&1 &
  else
    "$nvcc" "${common[@]}" -c "$src" -o "$obj" >"$log" 2>&1 &
  fi
  pids+=($!); logs+=("$log"); objs+=("$obj")
done
failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "plugins/tensorrt: compile failed: ${logs[$i]%.log}" >&2
    cat "${logs[$i]}" >&2
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1

lib="$out/libspin_trtllm_plugins.so"
# static cudart (nvcc's default) keeps the library free of a libcudart version dependency
"$nvcc" -shared -o "$lib" "${objs[@]}" -Xlinker --version-script="$here/exports.map" \
  -Xlinker --no-undefined >"$out/link.log" 2>&1 || { cat "$out/link.log" >&2; exit 1; }

if [ "$harness" = 1 ]; then
  "$nvcc" -std=c++17 -O2 -Xcompiler -Wall "${incflags[@]}" "$here/tests/plugin_harness.cpp" \
    -o "$out/plugin_harness" -ldl >"$out/harness.log" 2>&1 || { cat "$out/harness.log" >&2; exit 1; }
fi
version=$(sed -n 's/^#define TRT_\(MAJOR\|MINOR\|PATCH\)_ENTERPRISE \([0-9]*\).*/\2/p' \
  "${inc:-/dev/null}/NvInferVersion.h" 2>/dev/null | paste -sd. -)
echo "plugins/tensorrt: built $lib${version:+ (TensorRT $version headers)}$([ "$harness" = 1 ] && echo " and $out/plugin_harness")"
