"""Build a slim FlashInfer carry for the lent GPU machine: its wheel cut to what ``import flashinfer``
and the JIT builds of decode, prefill (decode on tensor cores), sampling and top-k need, plus the
dependencies the machine lacks.

    python scripts/bench/flashinfer_carry.py .whl-fi [--wheel flashinfer_python-0.7.4-py3-none-any.whl]

flashinfer-python's wheel is ~100 MB (mostly CUDA sources of other kernels and CuTe-DSL backends),
over what a device call carries (64 MiB with everything else). What is kept: every Python module of
a package that the imports above load (so that a lazy ``from .x import y`` inside such a package
still resolves; packages they never load are dropped), the headers (``data/include``, the vendored
CCCL that the JIT puts ahead of the toolkit's) and the top-level JIT sources (``data/csrc/*``, not
its subfolders: those are CUTLASS / TensorRT-LLM / CuTe kernels, like ``data/cutlass``). Which
packages load is found by importing the full wheel here (CPU torch is enough), so a newer release
is cut by the same rule. Nothing is stubbed: a lazily imported module outside the kept packages
raises ModuleNotFoundError where it is used.

The engine's one FlashInfer module, sampling, is also built here ahead of time for the GPU machine's
architecture (``--arch``, default 9.0a for Hopper), into ``OUT/aot/sampling/sampling.so``, so that
the device needs no JIT (124 s of nvcc on two cores). This host needs nvcc (``CUDA_HOME``, default
/usr/local/cuda) and cuRAND's headers (the ``nvidia`` CUDA wheels that torch installs have them).
``--no-aot`` skips it.

Install on the machine (``scripts/gpu_run.sh`` does it when ``.whl-fi`` is there):
``pip install --no-index --no-deps --target /tmp/site .whl-fi/*.whl``, then
``cp -r .whl-fi/aot /tmp/site/flashinfer/data/`` and ``FLASHINFER_DISABLE_JIT=1``. Without the
built module, FlashInfer's JIT needs nvcc and ninja on ``PATH`` there (``/tmp/site/bin``).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FLASHINFER = "flashinfer-python==0.7.4"
DEPENDENCIES = ("apache-tvm-ffi==0.1.15.post2", "nvidia-ml-py==13.615.71", "ninja==1.13.2")
"""What flashinfer imports or runs that the GPU machine's image may lack (tvm-ffi; pynvml and ninja
are there too, but small)."""
IMPORTS = ("flashinfer", "flashinfer.decode", "flashinfer.prefill", "flashinfer.sampling", "flashinfer.topk")
PIP_DOWNLOAD = (
    *("-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"),
    *("--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64"),
    *("--platform", "any"),
)


def download(specs: tuple[str, ...], into: Path) -> list[Path]:
    """Wheels of ``specs`` for the GPU machine (CPython 3.12, x86-64), downloaded into the empty folder ``into``."""
    into.mkdir(parents=True)
    subprocess.run([sys.executable, *PIP_DOWNLOAD, "-d", str(into), *specs], check=True)
    return sorted(into.glob("*.whl"))


def loaded_packages(wheels: list[Path], work: Path) -> set[str]:
    """Dotted names of the flashinfer packages that ``IMPORTS`` load, from a full install of ``wheels``."""
    site = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site)]
        + [str(wheel) for wheel in wheels],
        check=True,
    )
    probe = f"import sys, {', '.join(IMPORTS)}; print('\\n'.join(m for m in sys.modules if m.startswith('flashinfer')))"
    env = {**os.environ, "PYTHONPATH": str(site), "FLASHINFER_WORKSPACE_BASE": str(work)}
    modules = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, env=env
    ).stdout.split()
    packages = {module for module in modules if (site / module.replace(".", "/")).is_dir()}
    return packages | {module.rsplit(".", 1)[0] for module in modules}


def kept(name: str, packages: set[str]) -> bool:
    """Whether the slim wheel keeps the wheel entry ``name``."""
    if not name.startswith("flashinfer/"):
        return name.startswith("flashinfer_python-")  # the dist-info; not b12x/, build_backend.py
    if name.startswith("flashinfer/data/"):
        rest = name.removeprefix("flashinfer/data/")
        return rest.startswith(("include/", "cccl/")) or (rest.startswith("csrc/") and rest.count("/") == 1)
    return name.endswith(".py") and name.rsplit("/", 1)[0].replace("/", ".") in packages


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim_wheel(wheel: Path, packages: set[str], out: Path) -> Path:
    """``wheel`` with only the entries ``kept`` and a RECORD of them, written under ``out`` by the same name."""
    target = out / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as slim:
        record = next(name for name in source.namelist() if name.endswith(".dist-info/RECORD"))
        lines = []
        for info in source.infolist():
            if info.filename != record and kept(info.filename, packages):
                data = source.read(info)
                slim.writestr(info, data)
                lines.append(record_line(info.filename, data))
        slim.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
    return target


def curand_headers() -> Path:
    """The folder of ``curand.h`` among the ``nvidia`` CUDA wheels of this interpreter (the toolkit may lack it)."""
    import nvidia  # the namespace package of the CUDA wheels that torch depends on

    for root in nvidia.__path__:
        found = sorted(Path(root).glob("*/include/curand.h"))
        if found:
            return found[0].parent
    raise SystemExit("cuRAND's headers (curand.h) were not found: pip install nvidia-curand (the cu13 wheel)")


def build_sampling_module(site: Path, work: Path, arch: str) -> Path:
    """FlashInfer's sampling module built by its JIT for ``arch``, with ``site`` holding the slim install."""
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not (cuda_home / "bin" / "nvcc").exists():
        raise SystemExit(f"no nvcc under {cuda_home}/bin: set CUDA_HOME to a CUDA toolkit, or pass --no-aot")
    # FlashInfer links with -lcuda; a toolkit without lib64/stubs has no libcuda.so here. A stub with
    # the driver's soname stands in (the module calls no driver function, so --as-needed drops it).
    stubs = work / "stubs"
    stubs.mkdir()
    subprocess.run(
        ["cc", "-shared", "-x", "c", "/dev/null", "-Wl,-soname,libcuda.so.1", "-o", str(stubs / "libcuda.so")],
        check=True,
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "FLASHINFER_WORKSPACE_BASE": str(work),
        "FLASHINFER_CUDA_ARCH_LIST": arch,
        "CUDA_HOME": str(cuda_home),
        "PATH": f"{site / 'bin'}:{os.environ['PATH']}",
        "CPATH": ":".join(filter(None, [str(curand_headers()), os.environ.get("CPATH")])),
        "LIBRARY_PATH": ":".join(filter(None, [str(stubs), os.environ.get("LIBRARY_PATH")])),
    }
    build = (
        "from flashinfer.jit.sampling import gen_sampling_module as g; m = g(); m.build(); print(m.jit_library_path)"
    )
    return Path(
        subprocess.run(
            [sys.executable, "-c", build], check=True, capture_output=True, text=True, env=env
        ).stdout.split()[-1]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the carry folder (ignored by git: add it to .git/info/exclude)")
    parser.add_argument("--wheel", type=Path, default=None, help=f"a local {FLASHINFER} wheel (default: download it)")
    parser.add_argument("--arch", default="9.0a", help="the GPU's architecture for the sampling module (9.0a: Hopper)")
    parser.add_argument(
        "--no-aot", action="store_true", help="leave the sampling module to FlashInfer's JIT on the device"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        wheel = args.wheel or download((FLASHINFER,), work / "flashinfer")[0]
        dependencies = download(DEPENDENCIES, work / "dependencies")
        for dependency in dependencies:
            shutil.copy(dependency, args.out)
        slim = slim_wheel(wheel, loaded_packages([wheel, *dependencies], work), args.out)
        if not args.no_aot:
            module = build_sampling_module(work / "site", work, args.arch)
            (args.out / "aot" / "sampling").mkdir(parents=True, exist_ok=True)
            shutil.copy(module, args.out / "aot" / "sampling" / "sampling.so")
    total = sum(path.stat().st_size for path in args.out.rglob("*") if path.is_file())
    print(f"{slim} ({slim.stat().st_size / 1e6:.1f} MB); {args.out}: {total / 1e6:.1f} MB in all")


if __name__ == "__main__":
    main()
