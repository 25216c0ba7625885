# Sourced from the repository root on the GPU machine. Defines build_deepgemm LOG, which builds
# DeepGEMM (the kernels TensorRT-LLM runs for the DSA indexer logits) from
# third_party/deepgemm.tar.gz: DeepGEMM HEAD plus the cutlass and fmt headers it pins, packed
# off-line by tests/gpu/pack_deepgemm.sh because the GPU machine cannot reach GitHub. Nothing of
# DeepGEMM is committed here.
DG_SRC=/tmp/deepgemm
# Kernels are compiled by nvcc at first call; keep that cache off the copied working tree.
export DG_JIT_CACHE_DIR=/tmp/deepgemm_jit
# DeepGEMM (and torch's extension build) find nvcc, cuobjdump and the headers through CUDA_HOME;
# its own fallback, two levels above `which nvcc`, is wrong where nvcc is a wrapper script.
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda
  elif nvcc_bin=$(command -v nvcc); then export CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$nvcc_bin")")")
  fi
fi
# The image's own libstdc++ crashes in std::regex, which DeepGEMM uses to read nvcc's version.
libstdcxx=$(ls /usr/lib/x86_64-linux-gnu/libstdc++.so.6 2>/dev/null) && export LD_PRELOAD="$libstdcxx"

# build_deepgemm LOG: unpack and build in place (as DeepGEMM's develop.sh does), so that
# `import deep_gemm` works; the build output goes to LOG. On failure print the first errors.
build_deepgemm() {
  local log
  log=$(realpath -m "$1")
  rm -rf "$DG_SRC" && mkdir -p "$(dirname "$DG_SRC")" &&
    tar -xzf third_party/deepgemm.tar.gz -C "$(dirname "$DG_SRC")" || return 1
  (
    cd "$DG_SRC" || exit 1
    # The JIT compiles against deep_gemm/include, so cutlass and cute must be reachable there.
    ln -sf "$DG_SRC/third-party/cutlass/include/cutlass" deep_gemm/include
    ln -sf "$DG_SRC/third-party/cutlass/include/cute" deep_gemm/include
    python3 setup.py build > "$log" 2>&1 || exit 1
    so=$(find build -name "_C*.so" -type f | head -n 1)
    [ -n "$so" ] && ln -sf "$DG_SRC/$so" deep_gemm/
  ) || { grep -m20 -E "error|Error" "$log"; tail -n 5 "$log"; return 1; }
  export PYTHONPATH="$DG_SRC${PYTHONPATH:+:$PYTHONPATH}"
}
