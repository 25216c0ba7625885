#!/usr/bin/env bash
# Same-run A/B of top-K kernel sources on a CUDA machine:
#   bash benchmarks/device_topk_ab.sh NAME=FILE [NAME=FILE...] [-- bench_topk.py flags]
# Each FILE (another revision's topk.cu: `git show REV:cpp/src/topk.cu > .ab/REV.cu`, and carry
# .ab: the device gets the working tree, not git, and .ab is ignored; paths from the repository
# root) replaces cpp/src/topk.cu for one build, the tree's own is built as "tree", and each
# library is kept; the tree's source and library are put back however the script ends. The
# tree's GPU top-K and compact tests run first (TEST_LIMIT s, default 180); then bench_topk runs
# with each library in turn, ROUNDS rounds (default 1) interleaved, and the medians of one CTA
# a row (spin_us) and the filter (filter_us) are printed per case and build, beside
# TensorRT-LLM's kernel where third_party/trtllm_topk.tar.gz is there (its build.sh makes the
# trtllm_topk_peer module).
# Default cases: the 24 of RESULTS §4 (8/32/96 x 32K/128K, next_n 1/2, all and half).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/spin-topk-ab}; mkdir -p "$out"; rm -f "$out"/*_r[0-9]*.json
variants=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do variants+=("$1"); shift; done
[ $# -gt 0 ] && shift
seen=" tree "
for v in "${variants[@]}"; do
  [[ "$v" == *=* && -f "${v#*=}" ]] || { echo "not NAME=FILE of an existing file: $v"; exit 2; }
  name=${v%%=*}
  [[ "$name" =~ ^[A-Za-z0-9_.-]+$ && "$seen" != *" $name "* ]] ||
    { echo "NAME must be a new word, not tree: $v"; exit 2; }
  seen+="$name "
done
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--batch 8 32 96 --slots 32768 131072
  --next-n 1 2 --sparsity 0 0.5)
export SPIN_REQUIRE_NATIVE=1
source tests/gpu/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
if [ -f third_party/trtllm_topk.tar.gz ]; then
  peer=$(mktemp -d); tar xzf third_party/trtllm_topk.tar.gz -C "$peer"
  (cd "$peer/trtllm_topk" && PYTHON=python3 ./build.sh > "$out/trtllm_build.log" 2>&1) &
  peer_build=$!
fi
lib=spin_trtllm/libspin_native.so keep=$(mktemp -d)
# The variants' object is dropped too: a later build on this machine (its tree synced with the
# source's older time stamp) would otherwise link the last variant's and call it up to date.
restore() {
  if [ -f "$keep/tree.cu" ]; then cp "$keep/tree.cu" cpp/src/topk.cu; fi
  if [ -f "$keep/tree.so" ]; then cp "$keep/tree.so" "$lib"; fi
  rm -f build/native/topk.cuda.o
}
trap 'restore; rm -rf "$keep" "${peer:-}"' EXIT
trap 'exit 130' INT TERM
build() {   # NAME: build the tree as it is, keep the library as NAME
  python3 -m spin_trtllm._build > "$out/build_$1.log" 2>&1 ||
    { tail -20 "$out/build_$1.log"; return 1; }
  cp "$lib" "$keep/$1.so"
}
cp cpp/src/topk.cu "$keep/tree.cu"
build tree || exit 1
names=()
for v in "${variants[@]}"; do
  cp "${v#*=}" cpp/src/topk.cu   # ninja recompiles topk.cu alone
  build "${v%%=*}" || exit 1
  names+=("${v%%=*}")
done
names+=(tree)
restore
if [ -n "${peer_build:-}" ]; then
  wait "$peer_build" && export SPIN_TRTLLM_TOPK_PEER="$peer/trtllm_topk/build" ||
    echo "TensorRT-LLM peer build failed: $out/trtllm_build.log"
fi
echo "builds done at $SECONDS s"
timeout "${TEST_LIMIT:-180}" python3 -m pytest -q -p no:cacheprovider -m "gpu and not large" \
  tests/test_ops_topk.py tests/test_ops_compact.py > "$out/tests.log" 2>&1
echo "tests (tree) rc=$? $(tail -1 "$out/tests.log")"
grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -20
for i in $(seq "${ROUNDS:-1}"); do
  for b in "${names[@]}"; do
    cp "$keep/$b.so" "$lib"
    timeout 300 python3 benchmarks/bench_topk.py "${args[@]}" --json "$out/${b}_r$i.json" \
      > "$out/bench_${b}_r$i.log" 2>&1
    echo "round $i $b rc=$? at $SECONDS s"
  done
done
restore
python3 - "$out" "${names[@]}" <<'PY'
import glob, json, statistics, sys
out, names = sys.argv[1], sys.argv[2:]
runs = {k: [json.load(open(f))["rows"] for f in sorted(glob.glob(f"{out}/{k}_r[0-9]*.json"))]
        for k in names}
runs = {k: v for k, v in runs.items() if v}
if not runs:
    sys.exit("no benchmark finished")
names = list(runs)
def med(k, j, col):
    xs = [r[j].get(col) for r in runs[k] if r[j].get(col) is not None]
    return f"{statistics.median(xs):.1f}" if xs else "-"
print(f"medians (us) of {len(next(iter(runs.values())))} round(s); builds {'/'.join(names)}")
print("case: one CTA | filter | trtllm | copy bound")
for j, r in enumerate(next(iter(runs.values()))[0]):
    one = "/".join(med(k, j, "spin_us") for k in names)
    fil = "/".join(med(k, j, "filter_us") for k in names)
    print(f"{r['batch']:>3} x {r['slots']:>6} n{r['next_n']} rho {r['target_sparsity']}: "
          f"{one} | {fil} | {med(names[-1], j, 'trtllm_us')} | {r['bound_us']:.1f}")
PY
echo "total $SECONDS s"
