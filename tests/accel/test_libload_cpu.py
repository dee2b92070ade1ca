"""The CUDA library's loader (sparsekit/accel/libload.py) and build hook (build.py) on CPU, no
nvcc run: a planted, foreign, truncated, stale, symlinked, other-writable or foreign-owned
library is refused with a one-line reason before anything is loaded (the test libraries'
constructors write a marker file: it stays absent), and sk24_mma.load() falls back to the
Triton kernel with the reason (CUDA faked); a library that passes every check loads. The
libraries are tiny C files built with ``cc`` (skipped without one)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from sparsekit.accel import build, libload
from sparsekit.accel.kernels.mma_sp import launch as sk24_mma

SPEC = sk24_mma.SPEC
C_LIBRARY = r"""
#include <stdio.h>
__attribute__((constructor)) static void ran(void) {
  FILE *f = fopen(MARKER, "w"); if (f) { fputs("ran", f); fclose(f); }
}
"""
C_SK24 = C_LIBRARY + r"""
int sk24_mma_version(void) { return VERSION; }
int sk24_mma_launch(void) { return -1; }
int sk24_mma_e4m3_launch(void) { return -1; }
"""
C_FOREIGN = C_LIBRARY + "int some_other_library(void) { return 7; }\n"


def _cc(tmp: Path, name: str, source: str, marker: Path, version: int = sk24_mma.VERSION
        ) -> Path:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("needs a C compiler (cc) for the test libraries")
    src = tmp / f"{name}.c"
    src.write_text(source)
    out = tmp / f"{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', f"-DVERSION={version}",
                    "-o", str(out), str(src)], check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture
def lib_dir(tmp_path):
    """(lib_dir, marker): a built-and-recorded fake of the mma.sp library in its own 0755
    directory, as ``python -m sparsekit.accel.build`` leaves it."""
    marker = tmp_path / "constructor_ran"
    d = tmp_path / "_lib"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    so = _cc(tmp_path, "sk24", C_SK24, marker)
    shutil.copy(so, d / "sk24_mma.so")
    os.chmod(d / "sk24_mma.so", 0o755)
    build.record(d, build.SK24_MMA, d / "sk24_mma.so", build.SK24_MMA_SOURCES, SPEC.version)
    return d, marker


def refused(d: Path, match: str) -> str:
    with pytest.raises(libload.Refused, match=match) as e:
        libload.load(SPEC, d)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_library_that_passes_every_check_loads(lib_dir):
    d, marker = lib_dir
    lib = libload.load(SPEC, d)
    assert lib.sk24_mma_version() == sk24_mma.VERSION
    assert marker.read_text() == "ran"  # the marker works: a refusal leaves it absent


def test_planted_library_is_refused_before_it_loads(lib_dir, tmp_path):
    d, marker = lib_dir
    # another library with every symbol, put where the built one was (the manifest unchanged)
    planted = _cc(tmp_path, "planted", C_SK24 + "int extra(void) { return 1; }\n", marker)
    shutil.copy(planted, d / "sk24_mma.so")
    refused(d, "does not match the sha256")
    assert not marker.exists()


def test_foreign_library_is_refused_for_its_symbols_not_as_attribute_error(lib_dir, tmp_path):
    d, marker = lib_dir
    foreign = _cc(tmp_path, "foreign", C_FOREIGN, marker)
    shutil.copy(foreign, d / "sk24_mma.so")
    build.record(d, build.SK24_MMA, d / "sk24_mma.so", build.SK24_MMA_SOURCES, SPEC.version)
    msg = refused(d, "is not sparsekit's sk24_mma library")
    assert "sk24_mma_launch" in msg and not marker.exists()


def test_truncated_library_is_refused(lib_dir):
    d, marker = lib_dir
    data = (d / "sk24_mma.so").read_bytes()
    (d / "sk24_mma.so").write_bytes(data[:len(data) // 2])
    refused(d, "truncated")
    # recorded as it is (the manifest rewritten too): the ELF reader refuses the cut file
    build.record(d, build.SK24_MMA, d / "sk24_mma.so", build.SK24_MMA_SOURCES, SPEC.version)
    refused(d, "not a well-formed ELF file")
    assert not marker.exists()


@pytest.mark.parametrize("what", ["library", "directory", "manifest"])
def test_group_or_other_writable_files_are_refused(lib_dir, what, monkeypatch):
    import grp

    d, marker = lib_dir
    monkeypatch.setattr(grp, "getgrgid", lambda gid: grp.struct_group(("staff", "x", gid, [])))
    path = {"library": d / "sk24_mma.so", "directory": d, "manifest": d / build.MANIFEST}[what]
    for mode in (0o757, 0o775):
        os.chmod(path, mode)
        refused(d, "writable by group or others")
    assert not marker.exists()


def test_group_write_is_accepted_only_for_the_owners_private_group(lib_dir, monkeypatch):
    # umask 002 systems: a pip-installed library is group-writable, its group the owner's own
    import grp
    import pwd

    d, marker = lib_dir
    os.chmod(d / "sk24_mma.so", 0o775)
    owner = pwd.getpwuid(os.stat(d).st_uid).pw_name
    gid = os.stat(d).st_gid
    group = grp.struct_group((owner, "x", gid, []))
    monkeypatch.setattr(grp, "getgrgid", lambda gid: group)
    monkeypatch.setattr(pwd, "getpwall", lambda: [])  # no other user has it as primary group
    libload.load(SPEC, d)
    assert marker.exists()
    marker.unlink()
    for shared in (grp.struct_group(("staff", "x", gid, [])),
                   grp.struct_group((owner, "x", gid, [owner, "mallory"]))):
        monkeypatch.setattr(grp, "getgrgid", lambda gid, g=shared: g)
        refused(d, "writable by group or others")
    monkeypatch.setattr(grp, "getgrgid", lambda gid: group)
    mallory = pwd.struct_passwd(("mallory", "x", 4242, gid, "", "/home/mallory", "/bin/sh"))
    monkeypatch.setattr(pwd, "getpwall", lambda: [mallory])  # her primary group: shared
    refused(d, "writable by group or others")
    assert not marker.exists()


def test_a_file_owned_by_another_user_is_refused(lib_dir, monkeypatch):
    d, marker = lib_dir
    if os.getuid() == 0:  # give the library to someone else
        os.chown(d / "sk24_mma.so", 4242, -1)
        refused(d, "owned by uid 4242, not by you or root")
    else:  # be someone else
        me = os.getuid()
        monkeypatch.setattr(libload.os, "getuid", lambda: me + 4242)
        refused(d, f"owned by uid {os.stat(d).st_uid}, not by you or root")
    assert not marker.exists()


def test_symlink_stale_source_and_missing_manifest_are_refused(lib_dir, tmp_path):
    d, marker = lib_dir
    real = tmp_path / "elsewhere.so"
    shutil.move(d / "sk24_mma.so", real)
    (d / "sk24_mma.so").symlink_to(real)
    refused(d, "symbolic link")
    (d / "sk24_mma.so").unlink()
    shutil.move(real, d / "sk24_mma.so")
    libload.load(SPEC, d)  # as built again
    marker.unlink()
    other = ("kernels/cusparselt/csrc/cslt_epilogue.cpp",)
    stale = libload.Spec(SPEC.name, SPEC.version, other, SPEC.symbols)
    with pytest.raises(libload.Refused, match="built from other sources"):
        libload.load(stale, d)
    newer = libload.Spec(SPEC.name, SPEC.version + 1, SPEC.sources, SPEC.symbols)
    with pytest.raises(libload.Refused, match=f"calls version {SPEC.version + 1}"):
        libload.load(newer, d)
    (d / build.MANIFEST).unlink()
    refused(d, r"not built: .*python -m sparsekit.accel.build builds it")
    assert not marker.exists()


def test_checks_before_the_elf_need_no_compiler(tmp_path):
    # the checks on bytes alone: any file, recorded, then changed, cut or opened to others
    d = tmp_path / "_lib"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    (d / "sk24_mma.so").write_bytes(b"\x7fELF" + bytes(200))
    os.chmod(d / "sk24_mma.so", 0o644)
    build.record(d, build.SK24_MMA, d / "sk24_mma.so", build.SK24_MMA_SOURCES, SPEC.version)
    refused(d, "not an ELF shared library|not a 64-bit")
    (d / "sk24_mma.so").write_bytes(b"\x7fELF" + bytes(199) + b"x")
    refused(d, "sha256")
    (d / "sk24_mma.so").write_bytes(b"\x7fELF")
    refused(d, "truncated")
    os.chmod(d, 0o777)
    refused(d, "writable by group or others")
    os.chmod(d, 0o755)
    os.chmod(tmp_path, 0o777)  # others could rename _lib/ between the checks and the load
    refused(d, "above .* is writable by others")
    os.chmod(tmp_path, 0o1777)  # sticky (as /tmp): they cannot
    refused(d, "truncated")
    os.chmod(tmp_path, 0o755)


@pytest.fixture
def fake_cuda(monkeypatch):
    """sk24_mma.load() as on an sm_90 GPU, its self-check (GPU launches) skipped; the cache of
    load() cleared before and after."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(sk24_mma, "_self_check", lambda lib: None)
    sk24_mma.load.cache_clear()
    yield
    sk24_mma.load.cache_clear()


def test_sk24_mma_falls_back_with_the_reason_and_loads_what_passes(lib_dir, tmp_path,
                                                                  monkeypatch, fake_cuda):
    d, marker = lib_dir
    monkeypatch.setattr(libload, "LIB_DIR", d)
    good = (d / "sk24_mma.so").read_bytes()
    planted = _cc(tmp_path, "planted", C_SK24 + "int extra(void) { return 1; }\n", marker)
    shutil.copy(planted, d / "sk24_mma.so")
    assert sk24_mma.load() is None  # planted: the Triton kernel runs
    assert "sha256" in sk24_mma.reason() and not marker.exists()
    shutil.copy(_cc(tmp_path, "foreign", C_FOREIGN, marker), d / "sk24_mma.so")
    build.record(d, build.SK24_MMA, d / "sk24_mma.so", build.SK24_MMA_SOURCES, SPEC.version)
    sk24_mma.load.cache_clear()
    assert sk24_mma.load() is None  # foreign, recorded: refused on its symbols, no exception
    assert "lacks sk24_mma_launch" in sk24_mma.reason() and not marker.exists()
    (d / "sk24_mma.so").write_bytes(good)
    build.record(d, build.SK24_MMA, d / "sk24_mma.so", build.SK24_MMA_SOURCES, SPEC.version)
    sk24_mma.load.cache_clear()
    assert sk24_mma.load() is not None and marker.exists()


def test_a_library_of_another_version_falls_back(tmp_path, monkeypatch, fake_cuda):
    # recorded as the expected version but returning another one when called
    marker = tmp_path / "ran"
    d = tmp_path / "_lib"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    so = _cc(tmp_path, "old", C_SK24, marker, version=sk24_mma.VERSION - 1)
    shutil.copy(so, d / "sk24_mma.so")
    build.record(d, build.SK24_MMA, d / "sk24_mma.so", build.SK24_MMA_SOURCES, SPEC.version)
    monkeypatch.setattr(libload, "LIB_DIR", d)
    assert sk24_mma.load() is None
    assert f"not {sk24_mma.VERSION}: rebuild it" in sk24_mma.reason()


def _fake_nvcc(tmp_path: Path) -> Path:
    """A script standing in for nvcc: writes ``-o``'s file (and a log of its calls)."""
    script = tmp_path / "bin" / "nvcc"
    script.parent.mkdir()
    script.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\n'
                      'while [ "$1" != "-o" ]; do shift; done\nprintf "built" > "$2"\n')
    script.chmod(0o755)
    return script


def test_install_hook_compiles_nothing_without_a_gpu_and_says_so_in_one_line(tmp_path,
                                                                          monkeypatch):
    nvcc = _fake_nvcc(tmp_path)
    monkeypatch.setattr(build, "find_nvcc", lambda: str(nvcc))
    monkeypatch.setattr(build, "gpu_capability", lambda: None)
    line = build.install_hook(tmp_path / "_lib")
    assert "no NVIDIA GPU" in line and "\n" not in line
    assert not (nvcc.parent / "calls").exists() and not (tmp_path / "_lib").exists()
    monkeypatch.setattr(build, "gpu_capability", lambda: (9, 0))
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    line = build.install_hook(tmp_path / "_lib")
    assert "no CUDA toolkit" in line and "python -m sparsekit.accel.build" in line
    assert "1.4-3.2x slower" in line and "\n" not in line
    monkeypatch.setattr(build, "gpu_capability", lambda: (8, 0))
    assert "needs sm_90, not built" in build.install_hook(tmp_path / "_lib")
    assert not (tmp_path / "_lib").exists()


def _no_cslt_build(lib_dir=None):
    raise RuntimeError("the cuSPARSELt binding builds against torch: faked")


def test_install_hook_and_command_build_and_record_the_library(tmp_path, monkeypatch, capsys):
    nvcc = _fake_nvcc(tmp_path)
    monkeypatch.setattr(build, "find_nvcc", lambda: str(nvcc))
    monkeypatch.setattr(build, "gpu_capability", lambda: (9, 0))
    monkeypatch.setattr(build, "build_cslt", _no_cslt_build)
    d = tmp_path / "_lib"
    line = build.install_hook(d)
    assert "built the mma.sp CUDA kernel" in line and "\n" not in line
    assert "not the cuSPARSELt binding (" in line and "python -m sparsekit.accel.build" in line
    assert "-arch=sm_90" in (nvcc.parent / "calls").read_text()
    entry = build.read_manifest(d)[build.SK24_MMA]
    assert entry["version"] == sk24_mma.VERSION == build.source_version()
    assert entry["size"] == len(b"built")
    assert entry["source_sha256"] == build.source_hash(build.SK24_MMA_SOURCES)
    with pytest.raises(libload.Refused, match="not a 64-bit little-endian ELF"):
        libload.load(SPEC, d)  # hash and permissions pass; "built" is no ELF file
    monkeypatch.setattr(build, "LIB_DIR", d)
    assert build.main(["--check", "--only", "mma"]) == 0
    assert "up to date" in capsys.readouterr().out
    calls = (nvcc.parent / "calls").read_text().count("\n")
    assert build.main(["--only", "mma"]) == 0
    assert (nvcc.parent / "calls").read_text().count("\n") == calls
    assert build.main(["--force", "--only", "mma"]) == 0
    assert (nvcc.parent / "calls").read_text().count("\n") == calls + 1
    (d / "sk24_mma.so").write_bytes(b"changed")
    assert build.main(["--check", "--only", "mma"]) == 1
    assert "not built or stale" in capsys.readouterr().out
    # the binding is not built here (the hook's cslt build faked to fail): --check says so
    assert build.main(["--check"]) == 1
    assert "the cuSPARSELt binding in" in capsys.readouterr().out


def test_cslt_binding_is_never_compiled_at_run_time_and_checked_when_loaded(
        tmp_path, monkeypatch):
    # CUDA faked: not built -> None with the build command, the C++ builder never called; a
    # library recorded for another torch, or planted, refused before it is imported
    import torch.utils.cpp_extension as cpp

    from sparsekit.accel.kernels.cusparselt import ext

    def no_compile(*a, **k):
        raise AssertionError("compiled at run time")
    monkeypatch.setattr(cpp, "load", no_compile)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    d = tmp_path / "_lib"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    monkeypatch.setattr(libload, "LIB_DIR", d)
    ext.load.cache_clear()
    try:
        assert ext.load() is None and "not built" in ext.reason()
        assert "python -m sparsekit.accel.build" in ext.reason()
        marker = tmp_path / "ran"
        init = f"void *PyInit_{build.CSLT_MODULE}(void) {{ return 0; }}\n"
        so = _cc(tmp_path, "cslt", C_LIBRARY + init, marker)
        shutil.copy(so, d / f"{build.CSLT_MODULE}.so")
        build.record(d, build.CSLT, d / f"{build.CSLT_MODULE}.so", build.CSLT_SOURCES,
                     build.CSLT_VERSION, torch="1.0", torch_cuda=str(torch.version.cuda))
        ext.load.cache_clear()
        assert ext.load() is None and "was built for torch '1.0'" in ext.reason()
        build.record(d, build.CSLT, d / f"{build.CSLT_MODULE}.so", build.CSLT_SOURCES,
                     build.CSLT_VERSION, torch=str(torch.__version__),
                     torch_cuda=str(torch.version.cuda))
        (d / f"{build.CSLT_MODULE}.so").write_bytes(so.read_bytes() + b"planted")
        ext.load.cache_clear()
        assert ext.load() is None and "sha256" in ext.reason()
        assert not marker.exists()
        # recorded as it is: it passes the file's checks, its (fake) PyInit fails the import,
        # a one-line refusal, not an exception
        (d / f"{build.CSLT_MODULE}.so").write_bytes(so.read_bytes())
        build.record(d, build.CSLT, d / f"{build.CSLT_MODULE}.so", build.CSLT_SOURCES,
                     build.CSLT_VERSION, torch=str(torch.__version__),
                     torch_cuda=str(torch.version.cuda))
        ext.load.cache_clear()
        assert ext.load() is None and "does not import" in ext.reason()
        assert marker.exists()  # the checks passed: only now did its constructor run
    finally:
        ext.load.cache_clear()


def test_the_fallback_is_one_line_in_the_accelerate_report(tmp_path, monkeypatch, fake_cuda):
    # a GPU machine without the built library: the decode plan's note names the shapes, the
    # kernel that runs instead, and how to build the library
    from types import SimpleNamespace

    from sparsekit.accel import kernels
    from sparsekit.accel.options import CompileOptions, PlanOptions
    from sparsekit.accel.planner import Planner
    from sparsekit.accel.report import AccelReport

    monkeypatch.setattr(libload, "LIB_DIR", tmp_path / "_lib")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    assert sk24_mma.load() is None
    small = [k for k in kernels.kernels() if k.small_m]
    mma = next(k.name for k in small if k.name.startswith("mma_sp"))
    triton = "sk24"  # the 2:4 Triton kernel, after the mma.sp ones in the registry's order
    assert kernels.get(mma).order < kernels.get(triton).order
    layer = SimpleNamespace(refused={mma: sk24_mma.reason()}, shape_text=lambda: "64x128",
                            plan=SimpleNamespace(routes=(SimpleNamespace(kernel=triton),)))
    report = AccelReport("bf16", "2:4", 1.0, "")
    planner = Planner(torch.device("cuda"), "bf16", "2:4", PlanOptions(cache=False),
                      CompileOptions(), False, report)
    planner._refused_notes([layer, layer])
    notes = [n for n in report.notes if mma in n]
    assert len(notes) == 1 and "\n" not in notes[0]
    assert f"run the {triton} kernel" in notes[0] and "64x128" in notes[0]
    assert "python -m sparsekit.accel.build" in notes[0]
