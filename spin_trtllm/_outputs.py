"""Every file spin-trtllm writes goes through here, so nothing the user had is lost.

The rule (docs/limits.md, "Outputs"):
- A regular file (new or replaced) is written to a temporary file in the same folder, fsynced
  and renamed over the path: an interrupted or failed write leaves the old file as it was.
  A replaced file keeps its mode (and owner, where allowed); a new one gets 0666 less the umask. A symlink stays a link:
  its target is replaced.
- A character device (/dev/null) is written through, and its errors (/dev/full: no space
  left) are reported. Anything else (a directory, fifo, socket or block device) is refused.
- Before any work: an output may not be an input of the same run (same file after symlinks,
  hard links included), a file inside the installed package, or another output of the run.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

from ._inputs import PathLike, _kind, one_line
from .errors import SpinError

PACKAGE_DIR = Path(__file__).resolve().parent
# safetensors/matplotlib write to a path: the temporary file they fill
Writer = Callable[[str], None]


def _stat(path: PathLike) -> Optional[os.stat_result]:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def is_device(st: Optional[os.stat_result]) -> bool:
    """A character device (written through, never replaced)."""
    return st is not None and stat.S_ISCHR(st.st_mode)


def _name(what: str, path: PathLike) -> str:
    return one_line(f"{what} {os.fsdecode(path)}".strip(), 300)


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output(path: Optional[PathLike], what: str, error: type[SpinError] = SpinError,
                 parents: bool = False) -> Path:
    """`path` can be written by write_output: not '', a regular file (new or replaced) in a
    writable folder (with `parents`: a folder the caller makes under a writable one), or a
    writable character device; not inside the installed package."""
    if path is None or os.fsdecode(path) == "":
        raise error(f"{what}: empty path")
    p = Path(path)
    where = _name(what, path)
    if os.fsdecode(path).endswith(os.sep):        # Path() would drop the slash
        raise error(f"{where}: cannot write (ends with {os.sep!r}: a folder, need a file)")
    try:
        st = _stat(p)
        real = Path(os.path.realpath(p))
    except (OSError, ValueError) as err:          # ValueError: a NUL byte in the path
        raise error(f"{where}: cannot write ({getattr(err, 'strerror', None) or err})") from None
    if is_device(st):
        if not os.access(p, os.W_OK):
            raise error(f"{where}: cannot write (permission denied)")
        return p
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise error(f"{where}: cannot write (it is {_kind(st.st_mode) or 'not a file'}; need a "
                    f"regular file or a character device)")
    if _within(real, PACKAGE_DIR):
        raise error(f"{where}: cannot write inside the installed spin_trtllm package "
                    f"({PACKAGE_DIR}); write elsewhere")
    if st is not None and not os.access(p, os.W_OK):
        raise error(f"{where}: cannot write (permission denied)")
    parent = real.parent
    while parents and not parent.exists() and parent.parent != parent:
        parent = parent.parent
    if not parent.is_dir():
        raise error(f"{where}: cannot write (no directory {one_line(parent, 200)})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"{where}: cannot write (directory {one_line(parent, 200)} is not writable)")
    return p


def _identity(path: PathLike) -> tuple:
    """What names one file: (device, inode) when it exists, else its resolved path."""
    try:
        st = os.stat(path)
        return ("inode", st.st_dev, st.st_ino)
    except (OSError, ValueError):
        return ("path", os.path.realpath(path))


def check_plan(outputs: Sequence[tuple[str, PathLike]],
               inputs: Iterable[tuple[str, PathLike]] = (),
               error: type[SpinError] = SpinError, parents: bool = False) -> None:
    """Before any work: every output writable (check_output), none of them an input of the run
    and no two the same file (character devices such as /dev/null may be shared)."""
    inputs = [(what, p) for what, p in inputs if p is not None and os.fsdecode(p) != ""]
    seen: dict[tuple, str] = {}
    for what, path in outputs:
        p = check_output(path, what, error, parents)
        st = _stat(p)
        if is_device(st):
            continue
        ident = _identity(p)
        for in_what, in_path in inputs:
            if _identity(in_path) == ident:
                raise error(f"{_name(what, p)}: is the input {_name(in_what, in_path)}; "
                            f"write the output elsewhere")
        if ident in seen:
            raise error(f"{_name(what, p)}: is also {seen[ident]}; give each output its own "
                        f"file")
        seen[ident] = _name(what, p)


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_output(path: PathLike, what: str, data: Union[bytes, str, None] = None,
                 writer: Optional[Writer] = None, error: type[SpinError] = SpinError) -> Path:
    """Write `data`, or what `writer(temporary_path)` writes, to `path` by the rule above;
    OSError and interrupts leave what stood at `path` as it was. Returns `path`."""
    if (data is None) == (writer is None):
        raise TypeError("write_output: give data or writer")
    if isinstance(data, str):
        data = data.encode("utf-8")
    p = check_output(path, what, error)
    where = _name(what, p)
    st = _stat(p)
    try:
        if is_device(st):
            _write_device(p, data, writer)
        else:
            _replace_file(Path(os.path.realpath(p)), st, data, writer)
    except OSError as err:
        raise error(f"{where}: cannot write ({err.strerror or one_line(err, 200)})") from None
    return p


def _replace_file(target: Path, st: Optional[os.stat_result], data: Optional[bytes],
                  writer: Optional[Writer]) -> None:
    # The temporary's name is known before the file exists, so an interrupt at any point after
    # its creation still removes it (one inside tempfile.mkstemp, after its open, left it).
    fd, tmp = -1, None
    try:
        while True:
            tmp = os.path.join(target.parent,
                               f".{target.name[:100]}.{os.urandom(6).hex()}.partial")
            try:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL |
                             getattr(os, "O_CLOEXEC", 0), 0o600)
                break
            except FileExistsError:
                continue
        if writer is None:
            _write_all(fd, data)
        else:
            os.close(fd)
            fd = -1
            writer(tmp)
            fd = os.open(tmp, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.chmod(tmp, stat.S_IMODE(st.st_mode) if st is not None else _new_file_mode())
        if st is not None and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
            try:                         # root replacing another user's file: keep the owner
                os.chown(tmp, st.st_uid, st.st_gid)
            except OSError:
                pass
        os.replace(tmp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise
    try:                                            # the rename itself survives a crash
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def _write_device(path: Path, data: Optional[bytes], writer: Optional[Writer]) -> None:
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if writer is None:
            _write_all(fd, data)
            return
        with tempfile.TemporaryDirectory(prefix="spin-trtllm-") as tmp:
            staged = os.path.join(tmp, "output")
            writer(staged)
            with open(staged, "rb") as src, os.fdopen(os.dup(fd), "wb", buffering=0) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[:1 << 24]):]
