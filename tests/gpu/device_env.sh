# Sourced by the device scripts, from the repository root: the package on PYTHONPATH, wheels
# from .whl/ for packages the GPU machine lacks (pydantic), and the system libstdc++ (torch
# extensions crashed in std::regex with the image's own otherwise). .whl/ is made off the GPU
# machine (which has no network), for its Python 3.12:
#   pip download -d .whl --python-version 3.12 --only-binary=:all: \
#     --platform manylinux2014_x86_64 pydantic pyyaml hypothesis safetensors tqdm
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
libstdcxx=$(ls /usr/lib/x86_64-linux-gnu/libstdc++.so.6 2>/dev/null) && export LD_PRELOAD="$libstdcxx"

# native_sources: a digest of the sources the native library is built from (run in the tree).
native_sources() {
  find cpp spin_trtllm/csrc -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o \
    -name '*.cpp' \) | sort | xargs cat | sha256sum | cut -c1-16
}

# build_native LOG: build the native library, its output in LOG; on failure print the errors
# and stop the script. SPIN_NATIVE_PREBUILT=FILE.so.gz (from an earlier call's $OUT, with
# FILE.sources beside it) is unpacked instead, to spend the call's time on the tests; refused
# when it was built from other sources.
build_native() {
  if [ -n "${SPIN_NATIVE_PREBUILT:-}" ]; then
    if [ "$(cat "${SPIN_NATIVE_PREBUILT%.gz}.sources" 2>/dev/null)" != "$(native_sources)" ]; then
      echo "SPIN_NATIVE_PREBUILT=$SPIN_NATIVE_PREBUILT was built from other sources (or has no"\
        "${SPIN_NATIVE_PREBUILT%.gz}.sources): build it again"; exit 1
    fi
    # a new file renamed into place: a process that has the old one loaded keeps it intact
    gzip -dc "$SPIN_NATIVE_PREBUILT" > spin_trtllm/.libspin_native.so.$$ && \
      mv spin_trtllm/.libspin_native.so.$$ spin_trtllm/libspin_native.so && echo "native library: prebuilt $SPIN_NATIVE_PREBUILT" | tee "$1" && return 0
    echo "cannot unpack SPIN_NATIVE_PREBUILT=$SPIN_NATIVE_PREBUILT"; exit 1
  fi
  python3 -m spin_trtllm._build > "$1" 2>&1 || { grep -m20 -E "error|Error" "$1"; exit 1; }
}
