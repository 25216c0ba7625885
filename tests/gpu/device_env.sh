# Sourced by the device scripts, from the repository root: the package on PYTHONPATH, wheels
# from .whl/ for packages the GPU machine lacks (pydantic), and the system libstdc++ (torch
# extensions crashed in std::regex with the image's own otherwise).
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
libstdcxx=$(ls /usr/lib/x86_64-linux-gnu/libstdc++.so.6 2>/dev/null) && export LD_PRELOAD="$libstdcxx"

# build_native LOG: build the native library, its output in LOG; on failure print the errors
# and stop the script.
build_native() {
  python3 -m spin_trtllm._build > "$1" 2>&1 || { grep -m20 -E "error|Error" "$1"; exit 1; }
}
