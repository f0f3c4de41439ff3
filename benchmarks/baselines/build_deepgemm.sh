#!/usr/bin/env bash
# Builds DeepGEMM's Python extension in place from sources already on this machine (no network),
# then compiles (its JIT, nvcc) the indexer kernels bench_kernels.py times, at its batch sizes, so
# no compile lands inside a timing. Sources: benchmarks/baselines/src/deepgemm, or the archive
# src/deepgemm.tar.xz unpacked there (README.md in this folder says how both are made).
set -euo pipefail
cd "$(dirname "$0")/src"
if [ ! -d deepgemm ] && [ -f deepgemm.tar.xz ]; then tar -xJf deepgemm.tar.xz; fi
if [ ! -f deepgemm/csrc/python_api.cpp ] || [ ! -d deepgemm/third-party/cutlass/include/cute ] \
  || [ ! -d deepgemm/third-party/fmt/include/fmt ]; then
  echo "DeepGEMM sources missing under benchmarks/baselines/src/deepgemm: see benchmarks/baselines/README.md" >&2
  exit 2
fi
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/deepgemm-jit}
# the system compiler, whose libstdc++ the process loads (run_h200.sh's build says why)
export CC=${HISPARSE_CC:-/usr/bin/gcc} CXX=${HISPARSE_CXX:-/usr/bin/g++} MAX_JOBS=${MAX_JOBS:-4}
cd deepgemm
# the JIT compiles against deep_gemm/include, where CUTLASS's cute/ and cutlass/ must appear
ln -sfn ../../third-party/cutlass/include/cute deep_gemm/include/cute
ln -sfn ../../third-party/cutlass/include/cutlass deep_gemm/include/cutlass
t0=$(date +%s)
python3 - > build.log 2>&1 <<'PY' || { grep -m 20 -B2 -A6 "error" build.log >&2; exit 1; }
import os
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension
import torch

cuda, here = os.environ["CUDA_HOME"], os.getcwd()
abi = int(torch.compiled_with_cxx11_abi())
flags = ["-std=c++17", "-O3", "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations",
         f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
ext = CUDAExtension(
    "deep_gemm._C", [os.path.join(here, "csrc/python_api.cpp")],
    # absolute: ninja compiles from the build folder
    include_dirs=[f"{cuda}/include", f"{cuda}/include/cccl"] + [
        os.path.join(here, d)
        for d in ("deep_gemm/include", "third-party/cutlass/include", "third-party/fmt/include")
    ],
    libraries=["cudart", "nvrtc"], library_dirs=[f"{cuda}/lib64"],
    extra_compile_args={"cxx": flags},
)
setup(name="deep_gemm", ext_modules=[ext], cmdclass={"build_ext": BuildExtension},
      script_args=["build_ext", "--inplace"])
PY
echo "deep_gemm._C built in $(( $(date +%s) - t0 )) s"
cd ..
# JIT: each kernel once per batch size bench_kernels.py uses (the schedule's template has it)
warm() {
  PYTHONPATH="$PWD/deepgemm${PYTHONPATH:+:$PYTHONPATH}" python3 - "$@" <<'PY'
import sys, time
import torch
import deep_gemm as dg

kind, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
L, H, D = 4096, 64, 128
t0 = time.time()
for B in batches:
    q = torch.randn(B, H, D, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(B, H, device="cuda")
    if kind == "paged":
        kv = torch.zeros(B * L // 64, 64, 1, D + 4, dtype=torch.uint8, device="cuda")
        lens = torch.full((B, 1), L, dtype=torch.int32, device="cuda")
        bt = torch.arange(B * L // 64, dtype=torch.int32, device="cuda").view(B, -1)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        meta = dg.get_paged_mqa_logits_metadata(lens, 64, sms)
        dg.fp8_paged_mqa_logits(q.view(B, 1, H, D), kv, w, lens, bt, meta, L, False)
    else:
        k = torch.randn(B * L, D, device="cuda").to(torch.float8_e4m3fn)
        s = torch.ones(B * L, device="cuda")
        ks = torch.arange(B, dtype=torch.int32, device="cuda") * L
        dg.fp8_mqa_logits(q, (k, s), w, ks, ks + L, False, L)
torch.cuda.synchronize()
print(f"deep_gemm {kind} kernels compiled for batches {batches} in {time.time() - t0:.0f} s")
PY
}
batches=${DG_BATCHES:-1,64}
warm paged "$batches" & p=$!
warm flat "$batches" || status=1
wait $p || status=1
exit ${status:-0}
