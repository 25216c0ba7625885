# Sourced from the repository root on the GPU machine. Defines setup_flashinfer LOG, which makes
# flashinfer's ragged-row top-K importable off-line from third_party/flashinfer_topk.tar.gz, for
# benchmarks/bench_topk.py. Nothing of flashinfer is committed here (third_party/ is ignored).
#
# What was found (flashinfer-python 0.7.4, the py3-none-any wheel):
# - API: flashinfer.top_k_varlen(logits, seq_lens, top_k, *, row_starts=None,
#   max_window_len=None, absolute_indices=False, page_table=None, page_size=None,
#   compress_ratio=None, next_n=None, pre_idx=None, return_values=False, out_indices=None,
#   out_values=None, backend="auto", load_balance=True, workspace=None) -> (indices, values|None).
#   logits fp32/bf16/fp16 [rows, num_cols]; seq_lens int32 [rows // next_n] in tokens (row t of
#   request i ranks its first seq_lens[i] - next_n + t + 1 columns; next_n=None means 1, so one
#   entry per row gives exact per-row lengths); indices int32 [rows, top_k] = logits columns
#   (positions within the row, unordered), -1 padded; values only with return_values.
#   Backends: "radix", "gvr", "gvr_2", "radix_filter" are CuTe-DSL kernels for SM100+ only; on
#   SM90 the one backend (and what "auto" picks) is "radix_cutlass": a CUDA C++ radix top-K,
#   get_topk_module().radix_topk_ragged_transform with offsets 0 and lengths = per-row counts
#   (it builds those two int32 tensors on every call). The same kernels' direct entry point is
#   flashinfer.top_k_ragged_transform(input, offsets, lengths, k, deterministic=False,
#   tie_break=0, dsa_graph_safe=False, row_starts=None) -> int32 [rows, k] (index + offset),
#   which picks CUB DeviceBatchedTopK or the radix kernel by shape and graph capture.
# - Kernel build: JIT (nvcc + ninja via tvm-ffi), module "topk" = data/csrc/{topk.cu,
#   cub_topk.cu, flashinfer_topk_binding.cu, flashinfer_fast_topk_clusters_binding.cu}, headers
#   from data/include/flashinfer, the vendored CCCL (data/cccl, put first with -I: cub_topk.cu
#   needs DeviceBatchedTopK) and tvm-ffi's; no cutlass, spdlog or cubin downloads. sampling.cuh
#   includes <curand.h>, which a pip-style CUDA toolkit lacks, so the bundle brings the curand
#   headers (used after the toolkit's own). No prebuilt cubin/jit-cache package covers it.
#   Compiling it is slow (cub_topk.cu alone: ~25 min of one core, 6 GB cicc, 14 GB ptxas;
#   more than one 10-minute device call) and links -lcudart from $CUDA_HOME/lib64 and -lcuda
#   from lib64/stubs, which a pip-style toolkit lacks. So the bundle holds the module prebuilt
#   for sm_90a (nvcc 13.0, gcc 12: needs glibc >= 2.34, libcudart.so.13; it uses no driver API,
#   so it was linked without -lcuda) as data/aot/topk/topk.so, which flashinfer loads before
#   trying JIT, and falls back to JIT if loading fails (FLASHINFER_TOPK_FORCE_JIT=1 removes it).
# - Python: `import flashinfer` imports ~all of its 3300 modules (23 MB compressed), so the
#   bundle keeps only the 74 modules the top-K import path loads, plus topk_varlen/kernels and
#   the two jit modules it imports lazily, with a 4-line flashinfer/__init__.py exporting
#   top_k_varlen, top_k_ragged_transform, top_k and __version__. Runtime deps of that path:
#   torch, apache-tvm-ffi (compiled, cp312 wheel), nvidia-ml-py (pynvml), packaging, filelock,
#   requests, jinja2 (+markupsafe) and ninja (the binary); the wheel's other requirements
#   (cuda-python, nvidia-cutlass-dsl, cudnn-frontend, nccl, einops, numpy, ...) are not imported
#   on it. Wheels in the bundle are installed only where the import is missing (tvm-ffi always).
#
# Rebuild the bundle (a machine with network, python3 + torch, and nvcc 13.0 with the full
# toolkit's libs for the prebuilt module, ~30 min on 2 cores): from the repository root,
#   source tests/gpu/flashinfer_env.sh; build_flashinfer_bundle
# (FI_PREBUILT_SO=path/to/topk.so reuses a module built before, FI_PREBUILT_SO=none skips it).
# On the development machine (2026-12-02: ~17 min, MAX_JOBS=2) its toolkit lacked
# lib64/stubs/libcuda.so, which flashinfer's link names although the module calls no driver
# API: CUDA_HOME pointed at a symlinked copy of the toolkit with an empty stub there, and
# python3 came from a venv with the CPU torch wheel.
FI_ENV=/tmp/flashinfer_env
FI_BUNDLE=third_party/flashinfer_topk.tar.gz
# JIT cache/workspace (FLASHINFER_WORKSPACE_BASE/.cache/flashinfer) off the copied working tree.
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_ws
# Build only for the H200; "9.0a" because the radix kernels are compiled per exact arch.
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
# Never FLASHINFER_JIT_VERBOSE/DEBUG=1: it also compiles with -G -O0 (slow kernels).

# setup_flashinfer LOG: unpack, install the missing wheels, check the import (output in LOG).
setup_flashinfer() {
  local log py
  log=$(realpath -m "${1:-/tmp/flashinfer_setup.log}")
  : > "$log"
  [ -f "$FI_BUNDLE" ] || { echo "setup_flashinfer: $FI_BUNDLE missing (see build_flashinfer_bundle)"; return 1; }
  rm -rf "$FI_ENV" && mkdir -p "$FI_ENV" && tar -xzf "$FI_BUNDLE" -C "$FI_ENV" ||
    { echo "setup_flashinfer: cannot unpack $FI_BUNDLE"; return 1; }
  [ "${FLASHINFER_TOPK_FORCE_JIT:-0}" = 1 ] && rm -rf "$FI_ENV/site/flashinfer/data/aot"
  # flashinfer and the wheels go first on PYTHONPATH; a wheel the machine already has (jinja2,
  # requests, ... that torch or pip brought) is left out so its own copy is not shadowed.
  local w name mod
  for w in "$FI_ENV"/wheels/*.whl; do
    name=$(basename "$w"); name=${name%%-*}
    case $name in
      apache_tvm_ffi) mod= ;;                      # always ours: the prebuilt module needs it
      ninja) command -v ninja >/dev/null && continue; mod= ;;
      nvidia_ml_py) mod=pynvml ;; *) mod=$(echo "$name" | tr A-Z a-z) ;;
    esac
    [ -n "$mod" ] && python3 -c "import $mod" 2>/dev/null && continue
    echo "installing $name" >> "$log"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$FI_ENV/site" "$w" \
      >> "$log" 2>&1 || { echo "setup_flashinfer: pip failed on $name"; tail -n 5 "$log"; return 1; }
  done
  export PYTHONPATH="$FI_ENV/site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$PATH:$FI_ENV/site/bin"             # ninja, for a JIT build
  # curand headers only where the toolkit has none (flags go after the toolkit's -isystem).
  export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $FI_ENV/curand/include"
  if [ -z "${CUDA_HOME:-}" ]; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda
    elif py=$(command -v nvcc); then export CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$py")")")
    fi
  fi
  # The module links libcudart.so.13; torch (cu13) has usually loaded it, else the toolkit's.
  [ -n "${CUDA_HOME:-}" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$CUDA_HOME/lib64"
  python3 - >> "$log" 2>&1 <<'EOF' || { echo "setup_flashinfer: import failed:"; tail -n 15 "$log"; return 1; }
import flashinfer, tvm_ffi
from flashinfer import top_k_varlen, top_k_ragged_transform  # noqa: F401
from flashinfer.jit.topk import gen_topk_module
spec = gen_topk_module()
print(f"flashinfer {flashinfer.__version__} ({flashinfer.__file__}), tvm_ffi {tvm_ffi.__version__}, "
      f"top-K module: {'prebuilt ' + str(spec.aot_path) if spec.is_aot else 'JIT into ' + str(spec.build_dir)}")
EOF
  tail -n 1 "$log"
}

# build_flashinfer_bundle: write $FI_BUNDLE from the flashinfer-python 0.7.4 wheel (network).
build_flashinfer_bundle() (
  set -euo pipefail
  local out=$PWD/$FI_BUNDLE tmp=/tmp/fi_bundle_build pre=${FI_PREBUILT_SO:-}
  [ -n "$pre" ] && [ "$pre" != none ] && pre=$(realpath "$pre")
  rm -rf "$tmp" && mkdir -p "$tmp"/{whl,site,wheels,curand,deps} && cd "$tmp"
  python3 -m pip download -q --no-deps -d whl flashinfer-python==0.7.4
  unzip -q whl/flashinfer_python-0.7.4-py3-none-any.whl 'flashinfer/*' -d whl
  local dl="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64"
  $dl -d wheels "apache-tvm-ffi>=0.1.11,<0.2" ninja nvidia-ml-py packaging filelock requests \
    urllib3 idna charset-normalizer certifi jinja2 markupsafe
  $dl -d curand nvidia-curand==10.4.0.35      # CUDA 13.0's curand; only its headers are kept
  unzip -q -j curand/*.whl 'nvidia/cu13/include/*' -d curand/include && rm curand/*.whl
  python3 -m pip install -q --target deps "apache-tvm-ffi>=0.1.11,<0.2" ninja nvidia-ml-py \
    packaging filelock requests jinja2
  # the modules the top-K import path loads, found by importing it with the slim __init__
  local fi=whl/flashinfer s=site/flashinfer
  printf '%s\n' 'from .version import __version__ as __version__' 'from . import jit as jit' \
    'from .topk import top_k as top_k, top_k_ragged_transform as top_k_ragged_transform' \
    'from .topk_varlen.topk_varlen import top_k_varlen as top_k_varlen' > $fi/__init__.py
  PYTHONPATH=$tmp/whl:$tmp/deps FLASHINFER_WORKSPACE_BASE=$tmp python3 -c '
import sys, flashinfer.topk_varlen.topk_varlen
for n, m in sys.modules.items():
    if n.startswith("flashinfer") and getattr(m, "__file__", None): print(m.__file__)' |
    sed "s|^$tmp/whl/||" > keep.txt
  (cd whl && ls flashinfer/topk_varlen/kernels/*.py flashinfer/jit/cute_dsl_core.py \
    flashinfer/jit/api_log_stats.py flashinfer/py.typed) >> keep.txt
  (cd whl && ls flashinfer/data/csrc/{topk.cu,cub_topk.cu,flashinfer_topk_binding.cu} \
    flashinfer/data/csrc/{flashinfer_fast_topk_clusters_binding.cu,topk_transform_checks.h,tvm_ffi_utils.h}
    find flashinfer/data/include flashinfer/data/cccl -type f) >> keep.txt
  (cd whl && tar -cf - -T ../keep.txt) | tar -xf - -C site
  mkdir -p $s/data/cutlass/include $s/data/cutlass/tools/util/include $s/data/spdlog/include
  # prebuilt module (FI_PREBUILT_SO: a topk.so built before, or "none"), else flashinfer's JIT
  if [ -n "$pre" ]; then
    [ "$pre" = none ] || install -D "$pre" $s/data/aot/topk/topk.so
  elif command -v nvcc >/dev/null; then
    PATH=$PATH:$tmp/deps/bin PYTHONPATH=$tmp/site:$tmp/deps FLASHINFER_WORKSPACE_BASE=$tmp/ws \
      FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_EXTRA_CUDAFLAGS="-isystem $tmp/curand/include" \
      python3 -c 'from flashinfer.topk import get_topk_module as g; g()'
    mkdir -p $s/data/aot/topk && cp ws/.cache/flashinfer/0.7.4/90a/cached_ops/topk/topk.so $s/data/aot/topk/
  fi
  find site -name __pycache__ -prune -exec rm -rf {} +
  mkdir -p "$(dirname "$out")" && tar -czf "$out" site wheels curand && ls -la "$out"
)
