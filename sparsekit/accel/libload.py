"""Open a CUDA library that :mod:`sparsekit.accel.build` built, after checking the file.

Every check that can be made on the file is made before ``dlopen`` (which runs a library's
constructors):

1. the directory (``sparsekit/accel/_lib/``), ``manifest.json`` and the library are owned by
   you or root and writable by no one else (the others' write bit clear, the group's too
   unless the group is the owner's private one, as ``umask 002`` gives), neither file is a
   symbolic link, and no directory above is writable by others without the sticky bit (so that
   no one else can replace the file between these checks and the load);
2. the manifest names the library and records the version this sparsekit calls and the sha256
   of the sources it ships (a library built from other sources is stale: rebuild);
3. the file's size and sha256 are those the manifest records (a planted, changed or truncated
   file fails here);
4. the file is an ELF shared library for this machine that exports every function sparsekit
   calls (a foreign library fails here, not as an AttributeError on first call).

Anything wrong raises :class:`Refused` with one line saying what and how to fix it; the
callers turn that into their fallback and a note in the accelerate report.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from sparsekit.accel import build

LIB_DIR = build.LIB_DIR
# e_machine of the ELF files this machine runs
_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21}


class Refused(RuntimeError):
    """A library file failed a check (one line: what, and the command that fixes it)."""


@dataclass(frozen=True)
class Spec:
    """What the caller expects of a library: its manifest ``name``, the ``version`` it calls,
    the ``sources`` (relative to ``sparsekit/accel``) it must have been built from, and the
    ``symbols`` it calls; ``require``: (manifest field, value) pairs it must match too (e.g.
    the torch a C++ extension was built against)."""

    name: str
    version: int
    sources: tuple[str, ...]
    symbols: tuple[str, ...]
    require: tuple[tuple[str, str], ...] = ()


def _private_group(st: os.stat_result) -> bool:
    """Whether ``st``'s group is its owner's own (a user private group, as ``umask 002``
    systems give every user: named as the owner, no other member, no other user's primary
    group), so that group write lets no one else write."""
    try:
        import grp
        import pwd

        owner = pwd.getpwuid(st.st_uid).pw_name
        group = grp.getgrgid(st.st_gid)
    except (ImportError, KeyError):
        return False
    return (group.gr_name == owner and set(group.gr_mem) <= {owner}
            and all(u.pw_gid != st.st_gid or u.pw_name == owner for u in pwd.getpwall()))


def _owner_mode(st: os.stat_result, what: str) -> None:
    """Refused unless ``st`` is owned by this user or root and writable by no one else: not by
    others, nor by its group unless that is the owner's private group."""
    if hasattr(os, "getuid") and st.st_uid not in (os.getuid(), 0):
        raise Refused(f"{what} is owned by uid {st.st_uid}, not by you or root")
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and not _private_group(st)):
        raise Refused(f"{what} is writable by group or others (mode "
                      f"{stat.S_IMODE(st.st_mode):o}): only the owner may write it")


def _check_ancestors(where: Path) -> None:
    """Refused where a directory above ``where`` (resolved) is owned by another user than you
    or root, or writable by others without the sticky bit (they could rename ``where``)."""
    for parent in where.parents:
        st = os.stat(parent)
        if hasattr(os, "getuid") and st.st_uid not in (os.getuid(), 0):
            raise Refused(f"{parent} (above {where}) is owned by uid {st.st_uid}, not by you "
                          f"or root")
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise Refused(f"{parent} (above {where}) is writable by others")


def _open_file(name: str, dir_fd: int, what: str) -> int:
    """An fd of the regular file ``name`` in ``dir_fd`` (not a symbolic link), checked by
    :func:`_owner_mode`."""
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dir_fd)
    except FileNotFoundError:
        raise Refused(f"{what} is missing") from None
    except OSError as e:
        raise Refused(f"{what} cannot be opened ({e.strerror or e}; a symbolic link is "
                      f"refused)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{what} is not a regular file")
        _owner_mode(st, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def exported_functions(data: bytes) -> set[str]:
    """The names of the functions an ELF64 little-endian shared library ``data`` defines and
    exports (its ``.dynsym``), read from the bytes without loading them; Refused for a file
    that is not such a library for this machine."""
    try:
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise Refused("is not a 64-bit little-endian ELF file")
        e_type, e_machine = struct.unpack_from("<HH", data, 16)
        want = _MACHINES.get(platform.machine().lower())
        if e_type != 3:  # ET_DYN
            raise Refused("is not an ELF shared library")
        if want is not None and e_machine != want:
            raise Refused(f"is built for ELF machine {e_machine}, not {platform.machine()}")
        shoff, = struct.unpack_from("<Q", data, 40)
        shentsize, shnum = struct.unpack_from("<HH", data, 58)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                    for i in range(shnum)]
        names: set[str] = set()
        for sec in sections:
            if sec[1] != 11:  # SHT_DYNSYM
                continue
            off, size, link, entsize = sec[4], sec[5], sec[6], sec[9] or 24
            strtab = sections[link][4]
            for i in range(size // entsize):
                st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", data,
                                                                   off + i * entsize)
                if st_shndx == 0 or (st_info & 0xF) != 2 or (st_info >> 4) not in (1, 2):
                    continue  # undefined, not a function, or local
                end = data.index(b"\0", strtab + st_name)
                names.add(data[strtab + st_name:end].decode("utf-8", "replace"))
        return names
    except (struct.error, IndexError, ValueError):
        raise Refused("is not a well-formed ELF file (truncated?)") from None


def _manifest_entry(spec: Spec, dir_fd: int, where: Path) -> dict:
    fd = _open_file(build.MANIFEST, dir_fd, f"{where / build.MANIFEST}")
    try:
        data = _read_all(fd)
    finally:
        os.close(fd)
    try:
        entry = json.loads(data)["libraries"][spec.name]
        if not isinstance(entry, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise Refused(f"{where / build.MANIFEST} has no valid entry for {spec.name} (rebuild: "
                      f"{build.COMMAND})") from None
    if entry.get("version") != spec.version:
        raise Refused(f"{spec.name} in {where} is version {entry.get('version')!r}, this "
                      f"sparsekit calls version {spec.version} (rebuild: {build.COMMAND})")
    for key, value in spec.require:
        if entry.get(key) != value:
            raise Refused(f"{spec.name} in {where} was built for {key} {entry.get(key)!r}, this "
                          f"is {value!r} (rebuild: {build.COMMAND})")
    if entry.get("source_sha256") != build.source_hash(spec.sources):
        raise Refused(f"{spec.name} in {where} was built from other sources than this "
                      f"sparsekit's (rebuild: {build.COMMAND})")
    name = entry.get("file")
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise Refused(f"{where / build.MANIFEST} names no valid file for {spec.name}")
    return entry


def open_checked(spec: Spec, lib_dir: Path | None = None) -> tuple[int, Path]:
    """(an open fd, the path) of ``spec``'s library in ``lib_dir`` (default the package's
    ``_lib/``) after every check of the module docstring but the load; the caller closes the
    fd. Refused on anything wrong."""
    where = Path(os.path.realpath(lib_dir or LIB_DIR))
    if not (where / build.MANIFEST).exists():
        raise Refused(f"not built: no {where / build.MANIFEST}, {build.COMMAND} builds it "
                      f"with the CUDA toolkit")
    _check_ancestors(where)
    try:
        dir_fd = os.open(where, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        raise Refused(f"{where} cannot be opened ({e.strerror or e})") from None
    try:
        _owner_mode(os.fstat(dir_fd), f"the directory {where}")
        entry = _manifest_entry(spec, dir_fd, where)
        path = where / entry["file"]
        fd = _open_file(entry["file"], dir_fd, str(path))
    finally:
        os.close(dir_fd)
    try:
        data = _read_all(fd)
        size = entry.get("size")
        if isinstance(size, int) and len(data) < size:
            raise Refused(f"{path} has {len(data)} bytes, the manifest records {size} "
                          f"(truncated; rebuild: {build.COMMAND})")
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise Refused(f"{path} does not match the sha256 its manifest records (changed or "
                          f"planted; rebuild: {build.COMMAND})")
        try:
            exported = exported_functions(data)
        except Refused as e:
            raise Refused(f"{path} {e}") from None
        missing = [s for s in spec.symbols if s not in exported]
        if missing:
            raise Refused(f"{path} is not sparsekit's {spec.name} library: it lacks "
                          f"{', '.join(missing)}")
    except BaseException:
        os.close(fd)
        raise
    return fd, path


def load(spec: Spec, lib_dir: Path | None = None) -> ctypes.CDLL:
    """``spec``'s library, opened with ctypes after :func:`open_checked` (by its resolved path:
    the checks leave only you and root able to change it); Refused on anything wrong, the
    load's own error included."""
    fd, path = open_checked(spec, lib_dir)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise Refused(f"{path} does not load ({str(e)[:200]})") from None
    finally:
        os.close(fd)


def load_module(spec: Spec, module: str, lib_dir: Path | None = None) -> ModuleType:
    """``spec``'s library as the Python extension module ``module`` (a torch C++ extension),
    imported after :func:`open_checked`; Refused on anything wrong, the import's own error
    included."""
    fd, path = open_checked(spec, lib_dir)
    try:
        loader = importlib.machinery.ExtensionFileLoader(module, str(path))
        found = importlib.util.spec_from_file_location(module, str(path), loader=loader)
        mod = importlib.util.module_from_spec(found)
        loader.exec_module(mod)
        return mod
    except Exception as e:  # noqa: BLE001  (an extension's init may raise anything)
        raise Refused(f"{path} does not import ({type(e).__name__}: {str(e)[:200]})") from None
    finally:
        os.close(fd)


__all__ = ["LIB_DIR", "Refused", "Spec", "exported_functions", "load", "load_module",
           "open_checked"]
