"""Build of cloudtrain's native ops (csrc/) as the extension module `cloudtrain._C`.

Everything else is declared in pyproject.toml. The extension is optional: the package imports and
works without it (the pure-PyTorch reference in compress/reference.py is the fallback), so a
machine without a compiler still installs cloudtrain. CPU sources always build; CUDA sources build
only when the installed torch has CUDA and nvcc is found (CLOUDTRAIN_NO_CUDA=1 skips them,
CLOUDTRAIN_NO_NATIVE=1 skips the extension altogether).
"""

import glob
import os
import shutil

from setuptools import setup


def native_extensions():
    if os.environ.get("CLOUDTRAIN_NO_NATIVE") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        return [], {}
    cpu = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    if not cpu:
        return [], {}
    cxx = ["-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17"]
    cuda = sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
    with_cuda = (
        bool(cuda)
        and torch.version.cuda is not None
        and shutil.which("nvcc") is not None
        and os.environ.get("CLOUDTRAIN_NO_CUDA") != "1"
    )
    if with_cuda:
        nvcc = [
            "-O3",
            "-fmad=false",  # bit-identical to the CPU reference's separate multiply and add
            "-gencode=arch=compute_80,code=sm_80",
            "-gencode=arch=compute_90,code=sm_90",
        ]
        ext = CUDAExtension(
            "cloudtrain._C",
            cpu + cuda,
            extra_compile_args={"cxx": [*cxx, "-DCLOUDTRAIN_WITH_CUDA"], "nvcc": nvcc},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension(
            "cloudtrain._C", cpu, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"]
        )
    return [ext], {
        "build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)
    }


ext_modules, cmdclass = native_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
