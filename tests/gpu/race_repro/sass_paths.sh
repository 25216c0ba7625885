#!/usr/bin/env bash
# The logits kernel's per-page paths in SASS, for indexer_logits.cu sources side by side (no GPU:
# nvcc and cuobjdump, e.g. from `pip download nvidia-cuda-cuobjdump`): for logits_kernel<G>, the
# instructions from the main loop's full-barrier wait to the first QGMMA (what every warp runs
# before the warpgroup's MMA can start) and from the last QGMMA to WARPGROUP.DEPBAR (what runs
# under the MMA: at G 2 a page's four 64x128x32 QGMMAs take about 256 cycles).
#   [G=2] bash tests/gpu/race_repro/sass_paths.sh A.cu [B.cu ...]
# A source is a file or REV:cpp/src/indexer_logits.cu (git show).
set -euo pipefail
cd "$(dirname "$0")/../../.."
command -v cuobjdump > /dev/null || { echo "needs cuobjdump on PATH"; exit 2; }
torch_inc=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")/include
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
for src in "$@"; do
  name=$(basename "${src//:/_}" .cu)
  if [ -f "$src" ]; then cp "$src" "cpp/src/.sass_$name.cu"; else git show "$src" > "cpp/src/.sass_$name.cu"; fi
  nvcc -std=c++17 -O3 -cubin -gencode=arch=compute_90a,code=sm_90a -Icpp/include -Icpp/src \
    -I"$torch_inc" "cpp/src/.sass_$name.cu" -o "$work/$name.cubin"
  rm -f "cpp/src/.sass_$name.cu"
  cuobjdump -sass "$work/$name.cubin" | awk -v g="logits_kernelILi${G:-2}E" '
    /Function :/ { on = index($0, g) > 0 } on' |
    grep -E '^\s+/\*[0-9a-f]{4}\*/' | sed -E 's/ +\/\* 0x[0-9a-f]+ \*\/ *$//; s/^\s+//' \
    > "$work/$name.txt"
  # the main loop: the first full-barrier try-wait after the prologue's BAR.SYNC
  python3 - "$work/$name.txt" "$src" <<'PY'
import re, sys
lines = open(sys.argv[1]).read().splitlines()
ops = [re.sub(r"^/\*[0-9a-f]+\*/\s+", "", l) for l in lines]
mma = [i for i, o in enumerate(ops) if "GMMA." in o]
if not mma:
    sys.exit(f"{sys.argv[2]}: no GMMA in this kernel")
first = mma[0]
last = next(i for i in mma if "gsb0" in ops[i])   # the group's commit
wait = max(i for i in range(first) if "TRYWAIT" in ops[i])
depbar = next(i for i in range(last, len(ops)) if "WARPGROUP.DEPBAR" in ops[i])
print(f"== {sys.argv[2]}: {len(ops)} instructions; before the MMA {first - wait - 1}, "
      f"under it {depbar - last - 1}")
for title, a, b in (("wait -> first GMMA", wait, first + 1), ("last GMMA -> DEPBAR", last, depbar + 1)):
    print(f"-- {title}")
    for o in ops[a:b]:
        if re.search(r"LDS|LDG|STS|BAR|SYNCS|UBLKCP|UTMALDG|GMMA|WARPSYNC|R2UR|ELECT|BRA", o):
            print("   ", o)
PY
done
