"""Builds hisparse._C: the C++ CPU kernels always, the CUDA kernels when nvcc and a CUDA build
of torch are both present (HISPARSE_NO_CUDA=1 forces a CPU-only build)."""

import glob
import os
import re
import shutil
import sys

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def cxx_standard(torch_version: str) -> str:
    """The C++ standard torch's headers need: ATen requires C++20 from torch 2.14 on and
    refuses to compile otherwise (`#error C++20 or later compatible compiler is required`)."""
    m = re.match(r"(\d+)\.(\d+)", torch_version)
    if m is None:
        raise ValueError(f"cannot read a torch version from {torch_version!r}")
    return "c++20" if (int(m.group(1)), int(m.group(2))) >= (2, 14) else "c++17"


# torch's names for architectures before 9.0 (TORCH_CUDA_ARCH_LIST also takes names)
_OLDER_ARCH_NAMES = {"kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada"}


def cuda_arch_list(value):
    """TORCH_CUDA_ARCH_LIST for the build: 9.0 when unset. The top-k kernel runs a cluster of CTAs
    per token (distributed shared memory), which needs compute capability 9.0 or newer, so an
    older architecture in the list is refused here, in one line, before nvcc starts."""
    if not value or not value.strip():
        return "9.0"
    for arch in re.split(r"[;\s]+", value.strip()):
        m = re.match(r"(\d+)\.(\d+)", arch)
        old = int(m.group(1)) < 9 if m else arch.split("+")[0].lower() in _OLDER_ARCH_NAMES
        if old:
            raise ValueError(
                f"TORCH_CUDA_ARCH_LIST: {arch} is older than 9.0, which hisparse's CUDA kernels "
                "need; list 9.0 or newer, or set HISPARSE_NO_CUDA=1 for the CPU build"
            )
    return value


def _want_cuda() -> bool:
    if os.environ.get("HISPARSE_NO_CUDA", "") not in ("", "0"):
        return False
    import torch

    has_nvcc = cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None
    return torch.version.cuda is not None and has_nvcc


def build_temp_dir(torch_version: str, with_cuda: bool) -> str:
    """A build folder that outlives the build: setuptools' editable builds compile in a fresh
    temporary folder each time, so ninja found no objects and recompiled everything (~60 s)
    even with csrc/ untouched. One folder per python/torch/backend keeps builds apart."""
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch_version}" + (
        "-cuda" if with_cuda else ""
    )
    return os.path.join(ROOT, "build", "temp-" + re.sub(r"[^A-Za-z0-9.+_-]", "_", tag))


def _extension(with_cuda: bool, std: str):
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cxx_flags = ["-O3", f"-std={std}"]
    if with_cuda:
        cu = sorted(
            glob.glob(os.path.join("csrc", "cuda", "*.cpp"))
            + glob.glob(os.path.join("csrc", "cuda", "*.cu"))
        )
        os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        return cpp_extension.CUDAExtension(
            "hisparse._C",
            cpp + cu,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("HISPARSE_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", f"-std={std}", "--use_fast_math", "-lineinfo"],
            },
        )
    return cpp_extension.CppExtension(
        "hisparse._C",
        cpp,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": cxx_flags},
    )


def _build_ext_class(temp_dir: str, with_cuda: bool):
    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class BuildExt(base):
        def finalize_options(self):
            super().finalize_options()
            self.build_temp = temp_dir

        def build_extensions(self):
            print(
                f"hisparse: compiling the C++{'/CUDA' if with_cuda else ''} "
                f"kernels in {temp_dir} (first build 40-130 s; later builds reuse the objects)",
                flush=True,
            )
            super().build_extensions()

    return BuildExt


if __name__ == "__main__":
    import torch

    _cuda = _want_cuda()
    setup(
        ext_modules=[_extension(_cuda, cxx_standard(torch.__version__))],
        cmdclass={"build_ext": _build_ext_class(build_temp_dir(torch.__version__, _cuda), _cuda)},
    )
