"""Build of cloudtrain's native ops (csrc/) as the extension module `cloudtrain._C`.

Everything else is declared in pyproject.toml. The extension is optional: the package imports and
works without it (the pure-PyTorch reference in compress/reference.py is the fallback), so a
machine without a compiler still installs cloudtrain. CPU sources always build; CUDA sources build
only when the installed torch has CUDA and nvcc is found, on PATH or under CUDA_HOME
(CLOUDTRAIN_NO_CUDA=1 skips them, CLOUDTRAIN_NO_NATIVE=1 skips the extension altogether). CUDA code
is built for sm_80 and sm_90; CLOUDTRAIN_CUDA_ARCHS="90" (say) narrows that to save build time.
"""

import glob
import os
import shutil

from setuptools import setup


def set_cuda_home():
    """torch guesses CUDA_HOME as the folder above the `nvcc` on PATH; where that nvcc is a
    wrapper script outside the toolkit (/usr/local/bin/nvcc), point it at /usr/local/cuda."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    guess = os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None
    if guess and os.path.exists(os.path.join(guess, "include", "cuda_runtime.h")):
        return
    if os.path.exists("/usr/local/cuda/include/cuda_runtime.h"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"


def find_nvcc():
    """nvcc on PATH, else under CUDA_HOME (torch's guess: $CUDA_HOME, /usr/local/cuda)."""
    found = shutil.which("nvcc")
    if found:
        return found
    from torch.utils.cpp_extension import CUDA_HOME

    candidate = os.path.join(CUDA_HOME or "/usr/local/cuda", "bin", "nvcc")
    return candidate if os.path.exists(candidate) else None


def native_extensions():
    if os.environ.get("CLOUDTRAIN_NO_NATIVE") == "1":
        return [], {}
    set_cuda_home()
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        return [], {}
    cpu = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    if not cpu:
        return [], {}
    # -ffp-contract=off: no FMA, so a * b + c rounds twice as in the reference. -fno-trapping-math
    # only lets the compiler ignore floating-point exception flags (it then vectorises selects on
    # floats); every result is the same IEEE value.
    cxx = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-std=c++17"]
    cuda = sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
    with_cuda = (
        bool(cuda)
        and torch.version.cuda is not None
        and find_nvcc() is not None
        and os.environ.get("CLOUDTRAIN_NO_CUDA") != "1"
    )
    if with_cuda:
        archs = os.environ.get("CLOUDTRAIN_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
        nvcc = [
            "-O3",
            "-fmad=false",  # bit-identical to the CPU reference's separate multiply and add
            *(f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a.strip()),
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
