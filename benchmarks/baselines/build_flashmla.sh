#!/usr/bin/env bash
# Builds FlashMLA's SM90 kernels in place from sources already on this machine (no network):
# benchmarks/baselines/src/flashmla, laid out as README.md in this folder says. ~2 min on 16 cores.
set -euo pipefail
cd "$(dirname "$0")"
src=src/flashmla
if [ ! -f "$src/setup.py" ] || [ ! -d "$src/csrc/cutlass/include/cute" ]; then
  echo "FlashMLA sources missing under benchmarks/baselines/$src: see benchmarks/baselines/README.md" >&2
  exit 2
fi
cuda=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
# CUDA 13 moved libcu++ (cuda/std/...) under include/cccl, where CUTLASS does not look.
for d in "$cuda/include/cccl" "$cuda/targets/x86_64-linux/include/cccl"; do
  [ -d "$d" ] && export CPLUS_INCLUDE_PATH="$d${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
done
export FLASH_MLA_DISABLE_SM100=1 NVCC_THREADS=${NVCC_THREADS:-2} MAX_JOBS=${MAX_JOBS:-$(nproc)}
cd "$src"
python3 setup.py build_ext --inplace > build.log 2>&1 || { tail -40 build.log >&2; exit 1; }
python3 -c "import flash_mla, flash_mla.cuda; print('flash_mla built:', flash_mla.cuda.__file__)"
