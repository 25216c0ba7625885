#!/usr/bin/env bash
# Packs third_party/deepgemm.tar.gz (tests/gpu/deepgemm_env.sh unpacks and builds it on the GPU
# machine, which cannot reach GitHub): DeepGEMM's tree at a commit, with the include/ trees of
# the cutlass and fmt commits it pins as submodules, under deepgemm/. Takes git directories
# (clones or mirrors) of the three repositories; nothing of them is committed here.
#   [DEEPGEMM_TARBALL=FILE] bash tests/gpu/pack_deepgemm.sh DG_GIT CUTLASS_GIT FMT_GIT [COMMIT]
# COMMIT defaults to HEAD, FILE to third_party/deepgemm.tar.gz.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 DG_GIT CUTLASS_GIT FMT_GIT [COMMIT]"; exit 2; }
dg=$1 cutlass=$2 fmt=$3 commit=${4:-HEAD}
root=$(cd "$(dirname "$0")/../.." && pwd)
tarball=$(realpath -m "${DEEPGEMM_TARBALL:-$root/third_party/deepgemm.tar.gz}")
stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/deepgemm"
git -C "$dg" archive "$commit" | tar -x -C "$stage/deepgemm"
# pinned: the gitlink of submodule $2 in DeepGEMM's tree; its include/ from repository $1
submodule_include() {
  local repo=$1 path=$2 pin
  pin=$(git -C "$dg" ls-tree "$commit" "$path" | awk '$2 == "commit" {print $3}')
  [ -n "$pin" ] || { echo "$path is no submodule of DeepGEMM at $commit"; exit 1; }
  git -C "$repo" cat-file -e "$pin^{commit}" 2>/dev/null ||
    { echo "$repo lacks $path's pinned commit $pin"; exit 1; }
  mkdir -p "$stage/deepgemm/$path"
  # a mirror may lack blobs outside include/, which git archive names but does not need
  git -C "$repo" archive "$pin" include 2> >(grep -v "^error: invalid object" >&2) |
    tar -x -C "$stage/deepgemm/$path"
  echo "$path: $pin"
}
submodule_include "$cutlass" third-party/cutlass
submodule_include "$fmt" third-party/fmt
mkdir -p "$(dirname "$tarball")"
tar -czf "$tarball" -C "$stage" deepgemm
echo "DeepGEMM $(git -C "$dg" rev-parse "$commit"): $tarball ($(du -h "$tarball" | cut -f1))"
