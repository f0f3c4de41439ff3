#!/usr/bin/env bash
# One device session on an H200: build, check the binary, run every test (CUDA ones included),
# compute-sanitizer over the op workload, then the benchmarks. Logs and results go to $OUT.
#   STAGES="build tests sanitizer bench engine demo" COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_h200.sh
# (COMMIT: the tree's commit for the results; a device copy's .git names an older one)
# STAGES may also name "cudatests" (only the CUDA tests, the oracle property tests and the
# save_rows tests, FlashMLA and DeepGEMM importable: the quick gate after a kernel change),
# "bench2" (a second bench_ops run, for the spread between runs), "core" (the DSA core vLLM
# runs: its CUDA tests, then bench_decode_tpot at 32k, 64k and 128k with capacity),
# "fusedattn" (the fused sparse-MLA kernel alone, then the step with it), "flashmla"
# (FlashMLA's sparse FP8 decode built, its CUDA tests, then the core's step with it),
# "kernels" (FlashMLA and DeepGEMM built where not yet importable, the captured step's kernels
# by category at 32k, then each kernel beside its baseline: kernels_vs_baselines_<gpu>.{json,md})
# and "external" (both built where not yet importable, their adapters' CUDA tests, then the
# step as a CUDA vLLM user gets it: attention and indexer each chosen by measurement, split by
# category and at capacity), and "external_contexts" (the same choice at 32k, 64k and 128k: batch 1
# and each mode's limit, then the capacity table over the three), and "split_contexts" (the
# same choice's kernels by category at batch 1 and HiSparse's limit, at 32k, 64k and 128k: the
# per-request cost split by context); each fits one 10-minute device call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hisparse-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
STAGES=${STAGES:-"build tests sanitizer bench"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
# Result files are named by the GPU that made them (h200, h100, ...), whatever this script's name.
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h[0-9]{3}' | tr 'A-Z' 'a-z')}
GPU=${GPU:-gpu}
status=0
# FlashMLA and DeepGEMM importable: built from benchmarks/baselines/src where not yet. The
# builds start before the project's own (they take minutes; 16 cores run all three at once) and
# a stage that needs them waits for them.
base=$PWD/benchmarks/baselines
baseline_builds=()
if has kernels || has external || has external_contexts || has split_contexts || has cudatests; then
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/deepgemm-jit}
  PYTHONPATH="$base/src/flashmla:$PYTHONPATH" python3 -c "import flash_mla.cuda" 2>/dev/null \
    || { bash "$base/build_flashmla.sh" > "$OUT/flashmla_build.txt" 2>&1 & baseline_builds+=($!); }
  PYTHONPATH="$base/src/deepgemm:$PYTHONPATH" python3 -c "import deep_gemm" 2>/dev/null \
    || { bash "$base/build_deepgemm.sh" > "$OUT/deepgemm_build.txt" 2>&1 & baseline_builds+=($!); }
fi
baselines() {
  for pid in "${baseline_builds[@]}"; do wait "$pid" || echo "a baseline build failed: $OUT/*_build.txt"; done
  baseline_builds=()
  export PYTHONPATH="$base/src/flashmla:$base/src/deepgemm:$PYTHONPATH"
}

if has build; then
  # Build with the compiler whose libstdc++ the process loads at run time. The H200 image sets
  # CXX to a newer GCC in /opt/gcc: its header-instantiated stream code inside _C.so crashed
  # against the system libstdc++ whenever an error message formatted a number.
  export CC=${HISPARSE_CC:-/usr/bin/gcc} CXX=${HISPARSE_CXX:-/usr/bin/g++}
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
  so=$(ls hisparse/_C*.so)
  # A private copy of libstdc++'s stream code inside _C.so crashed error formatting once.
  echo "private libstdc++ stream symbols in $so: $(nm -C --defined-only "$so" | grep -c '_M_insert')" | tee -a "$OUT/build.txt"
  python3 -m hisparse info | tee -a "$OUT/build.txt"
fi
if has tests; then
  timeout 400 python3 -m pytest -q -rs -p no:cacheprovider tests/ > "$OUT/pytest.txt" 2>&1 || status=1
  tail -15 "$OUT/pytest.txt"
fi
if has cudatests; then
  baselines  # the FlashMLA and DeepGEMM adapters' tests run too, where their sources are here
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider -m cuda tests/ > "$OUT/pytest_cuda.txt" 2>&1 || status=1
  tail -5 "$OUT/pytest_cuda.txt"
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/ops/test_property.py tests/ops/test_save_rows.py > "$OUT/pytest_ops.txt" 2>&1 || status=1
  tail -3 "$OUT/pytest_ops.txt"
fi
if has sanitizer; then
  for tool in memcheck racecheck; do
    extra=""; [ $tool = memcheck ] && extra="--fallback"  # the global-workspace path too
    timeout 150 compute-sanitizer --tool $tool python3 tests/cuda_sanitizer_workload.py $extra > "$OUT/$tool.txt" 2>&1 || status=1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|workload" "$OUT/$tool.txt" | tail -3
  done
fi
if has bench; then
  timeout 300 python3 benchmarks/bench_ops.py --device cuda --json "$OUT/bench_ops_${GPU}.json" > "$OUT/bench.txt" 2>&1 || status=1
  sed -n '/## Issue table/,/^$/p' "$OUT/bench.txt"
fi
if has bench2; then
  timeout 300 python3 benchmarks/bench_ops.py --device cuda --json "$OUT/bench_ops_${GPU}_run2.json" > "$OUT/bench2.txt" 2>&1 || status=1
  sed -n '/## Issue table/,/^$/p' "$OUT/bench2.txt"
fi
if has engine; then
  # The DSA engine's three modes under one KV budget, about 4 minutes: the capacities run first
  # and no level starts past 180 s. Results: $OUT/engine_concurrency.{json,md,png}.
  timeout 330 python3 benchmarks/bench_engine.py --device cuda --max-seconds 180 --commit "${COMMIT:-?}" --out-dir "$OUT" > "$OUT/engine.txt" 2>&1 || status=1
  sed -n '/^# DSA engine/,$p' "$OUT/engine.txt"
fi
if has core; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/models/dsa tests/engine/dsa/test_cuda.py tests/engine/graph > "$OUT/pytest_core.txt" 2>&1 || status=1
  tail -2 "$OUT/pytest_core.txt"
  timeout 300 python3 benchmarks/bench_decode_tpot.py --commit "${COMMIT:-?}" --capacity --json "$OUT/engine_tpot_${GPU}.json" || status=1
  # batch 1 and HiSparse's limit at each context: the two points of the planner's step cost
  for run in 65536:1,69 131072:1,39; do
    ctx=${run%%:*}
    timeout 150 python3 benchmarks/bench_decode_tpot.py --commit "${COMMIT:-?}" --batches "${run#*:}" --capacity --context $ctx --json "$OUT/engine_tpot_${GPU}_ctx$ctx.json" || status=1
  done
  python3 benchmarks/tpot_report.py "$OUT/engine_tpot_${GPU}.json" > "$OUT/engine_tpot_${GPU}.md" || status=1
  python3 benchmarks/capacity_report.py "$OUT"/engine_tpot_${GPU}*.json --out "$OUT/capacity_by_context_${GPU}.md" --ceilings || status=1
fi
if has fusedattn; then
  timeout 120 python3 benchmarks/bench_mla.py --json "$OUT/mla_${GPU}.json" 2>&1 | tail -3 || status=1
  timeout 300 python3 benchmarks/bench_decode_tpot.py --commit "${COMMIT:-?}" --batches 1,16,30,64 --attention fused --json "$OUT/engine_tpot_fused_attention_${GPU}.json" || status=1
fi
if has flashmla; then  # needs the sources under benchmarks/baselines/src (its README.md)
  bash benchmarks/baselines/build_flashmla.sh > "$OUT/flashmla_build.txt" 2>&1 || { tail -20 "$OUT/flashmla_build.txt"; status=1; }
  export PYTHONPATH="$PWD/benchmarks/baselines/src/flashmla:$PYTHONPATH"
  # the core with FlashMLA importable: its tests, then the step (auto measures and takes it)
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m cuda tests/models/dsa/test_flashmla_cuda.py 2>&1 | tail -2 || status=1
  timeout 150 python3 benchmarks/bench_decode_tpot.py --commit "${COMMIT:-?}" --capacity --json "$OUT/engine_tpot_flashmla_${GPU}.json" || status=1
fi
if has kernels; then  # needs the sources under benchmarks/baselines/src (its README.md)
  baselines
  timeout 200 python3 benchmarks/bench_decode_tpot.py --commit "${COMMIT:-?}" --kernel-split --batches 1,64 --layers 4 \
    --attention bmm --json "$OUT/kernel_split_${GPU}.json" > "$OUT/kernel_split.txt" 2>&1 || status=1
  timeout 300 python3 benchmarks/baselines/bench_kernels.py --commit "${COMMIT:-?}" \
    --split "$OUT/kernel_split_${GPU}.json" --json "$OUT/kernels_vs_baselines_${GPU}.json" \
    --md "$OUT/kernels_vs_baselines_${GPU}.md" > "$OUT/kernels.txt" 2>&1 || status=1
  tail -3 "$OUT/kernels.txt"
fi
if has external; then  # needs the sources under benchmarks/baselines/src (its README.md)
  baselines
  timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -m cuda tests/models/dsa/test_deepgemm_cuda.py \
    tests/models/dsa/test_flashmla_cuda.py > "$OUT/pytest_external.txt" 2>&1 || status=1
  tail -3 "$OUT/pytest_external.txt"
  timeout 200 python3 benchmarks/bench_decode_tpot.py --commit "${COMMIT:-?}" --kernel-split --batches 1,64 --layers 4 \
    --json "$OUT/kernel_split_external_${GPU}.json" > "$OUT/kernel_split_external.txt" 2>&1 || status=1
  timeout 200 python3 benchmarks/bench_decode_tpot.py --commit "${COMMIT:-?}" --capacity \
    --json "$OUT/engine_tpot_external_${GPU}.json" > "$OUT/engine_tpot_external.txt" 2>&1 || status=1
  tail -12 "$OUT/engine_tpot_external.txt"
fi
if has external_contexts; then  # needs the sources under benchmarks/baselines/src (its README.md)
  baselines
  # batch 1 and each mode's limit at each context (about 2 minutes for the three on an H100)
  for run in 32768:1,30,112 65536:1,15,69 131072:1,7,39; do
    ctx=${run%%:*}
    timeout 200 python3 benchmarks/bench_decode_tpot.py --commit "${COMMIT:-?}" --batches "${run#*:}" --capacity \
      --context $ctx --json "$OUT/engine_tpot_external_${GPU}_ctx$ctx.json" > "$OUT/engine_tpot_external_ctx$ctx.txt" 2>&1 || status=1
    tail -1 "$OUT/engine_tpot_external_ctx$ctx.txt"
  done
  python3 benchmarks/capacity_report.py "$OUT"/engine_tpot_external_${GPU}_ctx*.json \
    --out "$OUT/capacity_by_context_external_${GPU}.md" --ceilings || status=1
  cat "$OUT/capacity_by_context_external_${GPU}.md"
fi
if has split_contexts; then  # needs the sources under benchmarks/baselines/src (its README.md)
  baselines
  for run in 32768:1,112 65536:1,69 131072:1,39; do
    ctx=${run%%:*}
    timeout 180 python3 benchmarks/bench_decode_tpot.py --commit "${COMMIT:-?}" --kernel-split --layers 4 \
      --batches "${run#*:}" --context $ctx --json "$OUT/kernel_split_external_${GPU}_ctx$ctx.json" \
      > "$OUT/kernel_split_external_ctx$ctx.txt" 2>&1 || status=1
    tail -1 "$OUT/kernel_split_external_ctx$ctx.txt"
  done
  python3 - "$OUT"/kernel_split_external_${GPU}_ctx{32768,65536,131072}.json > "$OUT/kernel_split_contexts_${GPU}.md" <<'PY' || status=1
import json, sys
sys.path.insert(0, "benchmarks/baselines")
from bench_kernels import split_markdown
for path in sys.argv[1:]:
    print("\n".join(split_markdown(json.load(open(path)))))
PY
fi
if has demo; then
  python3 -m hisparse demo --device cuda --no-progress --json "$OUT/demo_cuda.json" > "$OUT/demo.txt" 2>&1 || status=1
  tail -20 "$OUT/demo.txt"
fi
exit $status
