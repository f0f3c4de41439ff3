"""Builds hisparse._C: the C++ CPU kernels always, the CUDA kernels when nvcc and a CUDA build
of torch are both present (HISPARSE_NO_CUDA=1 forces a CPU-only build)."""

import glob
import os
import shutil

from setuptools import setup
from torch.utils import cpp_extension


def _want_cuda() -> bool:
    if os.environ.get("HISPARSE_NO_CUDA", "") not in ("", "0"):
        return False
    import torch

    has_nvcc = cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None
    return torch.version.cuda is not None and has_nvcc


def _extension():
    root = os.path.dirname(os.path.abspath(__file__))
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cxx_flags = ["-O3", "-std=c++17"]
    if _want_cuda():
        cu = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")) +
                    glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if not arch:
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        return cpp_extension.CUDAExtension(
            "hisparse._C",
            cpp + cu,
            include_dirs=[os.path.join(root, "csrc")],
            define_macros=[("HISPARSE_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"],
            },
        )
    return cpp_extension.CppExtension(
        "hisparse._C",
        cpp,
        include_dirs=[os.path.join(root, "csrc")],
        extra_compile_args={"cxx": cxx_flags},
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
