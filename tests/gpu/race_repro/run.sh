cd "$(dirname "$0")"
for v in 1 2 3 4; do
  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DVARIANT=$v mbar_war.cu -o /tmp/mbar$v || continue
  compute-sanitizer --tool racecheck --racecheck-report all /tmp/mbar$v 2>&1 | grep -E "variant|SUMMARY|hazard detected" | sort | uniq -c | head -5
done
