"""Build sparsekit's CUDA library ahead of time: ``python -m sparsekit.accel.build``.

The mma.sp 2:4 kernel (``kernels/mma_sp/csrc/sk24_mma.cu``,
:mod:`sparsekit.accel.kernels.mma_sp.launch`) is a plain shared library compiled by nvcc for
sm_90. It is built here, never by the library at run time:
by ``pip install`` on a machine with a GPU and the CUDA toolkit (``setup.py`` calls
:func:`install_hook`), or by this command after installing (or in a checkout). The binary goes
into the package itself (``sparsekit/accel/_lib/``), beside ``manifest.json``, which records per
library its file, sha256, size, the sha256 of the sources it was built from and its version;
:mod:`sparsekit.accel.libload` opens only a file that matches it.

Without the library the layers run the Triton 2:4 kernels: 1.4-3.2x slower per decode GEMM
shape (README, Quickstart). ``--check`` reports what is built without building.

This module uses the standard library only: ``setup.py`` loads it by path in pip's build
environment, where neither torch nor sparsekit is importable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIB_DIR = HERE / "_lib"
MANIFEST = "manifest.json"
COMMAND = "python -m sparsekit.accel.build"
SK24_MMA = "sk24_mma"
SK24_MMA_SOURCES = ("kernels/mma_sp/csrc/sk24_mma.cu",)
# the functions the loader requires in the file before it opens it (libload)
SK24_MMA_SYMBOLS = ("sk24_mma_launch", "sk24_mma_version", "sk24_mma_e4m3_launch")
ARCH = "sm_90"


def source_hash(sources: tuple[str, ...], root: Path = HERE) -> str:
    """sha256 over the sources (paths relative to ``root``), in order."""
    h = hashlib.sha256()
    for rel in sources:
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def source_version(root: Path = HERE) -> int:
    """The version ``sk24_mma_version()`` returns in the source."""
    text = (root / SK24_MMA_SOURCES[0]).read_text()
    found = re.search(r"int\s+sk24_mma_version\(\)\s*\{\s*return\s+(\d+)\s*;", text)
    if found is None:
        raise RuntimeError(f"{SK24_MMA_SOURCES[0]}: no sk24_mma_version() in the source")
    return int(found.group(1))


def find_nvcc() -> str | None:
    """nvcc on PATH, else in ``$CUDA_HOME/bin`` (default /usr/local/cuda), else None."""
    found = shutil.which("nvcc")
    if found:
        return found
    cand = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda") / "bin" / "nvcc"
    return str(cand) if cand.is_file() and os.access(cand, os.X_OK) else None


def gpu_capability() -> tuple[int, int] | None:
    """The first NVIDIA GPU's compute capability from ``nvidia-smi`` (no torch needed), or
    None where there is no driver or GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        res = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    first = res.stdout.strip().splitlines()[:1] if res.returncode == 0 else []
    found = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", first[0]) if first else None
    return (int(found.group(1)), int(found.group(2))) if found else None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(lib_dir: Path) -> dict:
    """The manifest's ``libraries`` (name -> entry), {} where there is none or it is unreadable
    (the loader checks it properly: :mod:`sparsekit.accel.libload`)."""
    try:
        return dict(json.loads((lib_dir / MANIFEST).read_text())["libraries"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _write_manifest(lib_dir: Path, libraries: dict) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=lib_dir)
    with os.fdopen(fd, "w") as f:
        json.dump({"format": 1, "libraries": libraries}, f, indent=1, sort_keys=True)
    os.chmod(tmp, 0o644)
    os.replace(tmp, lib_dir / MANIFEST)


def up_to_date(lib_dir: Path | None = None) -> bool:
    """Whether ``lib_dir`` (default the package's ``_lib/``) holds the mma.sp library built
    from the current sources, with the hash its manifest records."""
    lib_dir = lib_dir or LIB_DIR
    entry = read_manifest(lib_dir).get(SK24_MMA)
    if not isinstance(entry, dict) or entry.get("source_sha256") != source_hash(SK24_MMA_SOURCES):
        return False
    path = lib_dir / str(entry.get("file", ""))
    return path.is_file() and entry.get("sha256") == _sha256(path)


def build_sk24_mma(lib_dir: Path | None = None, nvcc: str | None = None) -> Path:
    """Compile ``kernels/mma_sp/csrc/sk24_mma.cu`` for sm_90 into ``lib_dir/sk24_mma.so`` (a
    temporary file renamed into place, mode 0755) and record it in the manifest; RuntimeError
    with nvcc's first error line on failure or without nvcc."""
    lib_dir, nvcc = lib_dir or LIB_DIR, nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("no nvcc on PATH or in $CUDA_HOME/bin (install the CUDA toolkit)")
    lib_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(lib_dir, 0o755)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_dir)
    os.close(fd)
    cmd = [nvcc, "-O3", f"-arch={ARCH}", "-DSK24_ORDERED", "-shared", "-Xcompiler", "-fPIC",
           "-o", tmp, str(HERE / SK24_MMA_SOURCES[0])]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        os.unlink(tmp)
        lines = [ln for ln in res.stderr.splitlines() if "error" in ln.lower()]
        raise RuntimeError(f"nvcc failed: {(lines or res.stderr.splitlines() or ['?'])[0][:300]}")
    os.chmod(tmp, 0o755)
    path = lib_dir / f"{SK24_MMA}.so"
    os.replace(tmp, path)
    record(lib_dir, SK24_MMA, path, SK24_MMA_SOURCES, source_version())
    return path


def record(lib_dir: Path, name: str, path: Path, sources: tuple[str, ...], version: int,
           **extra: str) -> None:
    """Write ``path``'s (a file in ``lib_dir``) sha256, size, the sources' hash and ``version``
    into ``lib_dir``'s manifest under ``name`` (the other entries kept)."""
    libraries = read_manifest(lib_dir)
    libraries[name] = {"file": path.name, "sha256": _sha256(path), "size": path.stat().st_size,
                       "source_sha256": source_hash(sources), "version": version,
                       "arch": ARCH, **extra}
    _write_manifest(lib_dir, libraries)


def install_hook(lib_dir: Path) -> str:
    """What ``pip install`` does (``setup.py``): build the library into ``lib_dir`` where there
    is an sm_90 GPU and nvcc, else build nothing; returns the one line it prints."""
    cap = gpu_capability()
    if cap is None:
        return ("sparsekit: no NVIDIA GPU found, the mma.sp CUDA kernel is not built "
                f"(on a GPU machine: {COMMAND})")
    if cap[0] < 9:
        return (f"sparsekit: GPU compute capability {cap[0]}.{cap[1]}: the mma.sp kernel needs "
                "sm_90, not built")
    nvcc = find_nvcc()
    if nvcc is None:
        return ("sparsekit: GPU found but no CUDA toolkit (nvcc): the mma.sp 2:4 decode kernel "
                f"is not built, the Triton kernels run instead (1.4-3.2x slower); install the "
                f"toolkit and run {COMMAND}")
    try:
        path = build_sk24_mma(lib_dir, nvcc)
    except (OSError, RuntimeError) as e:
        return f"sparsekit: the mma.sp kernel did not build ({str(e)[:200]}); retry: {COMMAND}"
    return f"sparsekit: built the mma.sp CUDA kernel into {path}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description="Build sparsekit's CUDA library "
                                 "(the mma.sp 2:4 kernel, sm_90) into the installed package.")
    ap.add_argument("--check", action="store_true",
                    help="say whether the built library is up to date; build nothing")
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = ap.parse_args(argv)
    if args.check or (up_to_date() and not args.force):
        ok = up_to_date()
        print(f"sparsekit: the mma.sp library in {LIB_DIR} is "
              f"{'up to date' if ok else f'not built or stale (run {COMMAND})'}")
        return 0 if ok else 1
    try:
        path = build_sk24_mma()
    except (OSError, RuntimeError) as e:
        print(f"{COMMAND}: error: {e}", file=sys.stderr)
        return 1
    print(f"sparsekit: built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
