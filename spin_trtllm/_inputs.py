"""Checks shared by every user input: files read, files written, YAML, error text, devices.

The rule (docs/limits.md): a hostile or careless input gives a SpinError with a one-line
message, in bounded time and memory, never a traceback, a hang or a huge allocation.

- Input files must be regular files (no directories, device files, fifos or sockets) under
  a size limit that suits each input; text is strict UTF-8 (a UTF-8 byte-order mark is
  dropped, UTF-16/32 ones are refused by name).
- YAML is parsed by a SafeLoader that refuses anchors and aliases (so no alias expansion),
  nesting deeper than YAML_MAX_DEPTH, non-string mapping keys and numbers longer than
  YAML_MAX_NUMBER_CHARS characters.
- Output paths are checked before any long work starts (spin_trtllm/_outputs.py writes them).
- Error text is one line: control characters (newlines included) are escaped and the length
  is capped at MAX_MESSAGE_CHARS.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import yaml

from .errors import SpinError

PathLike = Union[str, "os.PathLike[str]"]

# ---- limits (docs/limits.md lists the same numbers) -------------------------------------------
MAX_MESSAGE_CHARS = 1000             # an error line is never longer than this (+ a short tail)
CONFIG_MAX_BYTES = 256 << 10         # SpinConfig / LLM-API options YAML (pure-Python parse: ~2 s)
PROMPT_MAX_BYTES = 16 << 20          # trace --prompt-file (at most 1 Mi prompt bytes are used)
CHECKPOINT_MAX_BYTES = 4 << 30       # dsa-lite checkpoints (the shipped one is 8.8 MB)
TRACE_MAX_BYTES = 32 << 30           # SPIN trace v1 files (loaded whole into memory)
TRACE_V2_MAX_BYTES = 64 << 30        # v2 (+ q, w, keys): q is 2*H*D bytes a row, as many as
                                     # 8,192 fp16 scores for V4's 64x128 indexer
YAML_MAX_DEPTH = 32                  # nested mappings/sequences (SpinConfig needs 3)
YAML_MAX_NUMBER_CHARS = 100          # characters of one YAML int/float scalar

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a fifo"),
               (stat.S_ISSOCK, "a socket"))
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32 LE"), (b"\x00\x00\xfe\xff", "UTF-32 BE"),
         (b"\xff\xfe", "UTF-16 LE"), (b"\xfe\xff", "UTF-16 BE"))
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# C0/C1 controls, DEL, the Unicode line/paragraph separators and lone surrogates
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def one_line(msg: object, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`msg` as one printable line: control characters escaped, at most `limit` characters
    plus a note of how long it was."""
    text = str(msg)
    total = len(text)
    text = _UNPRINTABLE.sub(_escape, text[:limit])
    if total > limit or len(text) > limit:
        return f"{text[:limit]}... ({total:,} characters in all)"
    return text


def printable(text: object) -> str:
    """`text` (a str, or a path whose bytes need not be UTF-8) with control characters and
    undecodable bytes escaped: safe to print, plot or encode as UTF-8."""
    return _UNPRINTABLE.sub(_escape, os.fsdecode(text) if isinstance(text, (bytes, os.PathLike))
                            else str(text))


def _escape(m: "re.Match[str]") -> str:
    c = m.group()
    return _ESCAPES.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def shown(value: Any, limit: int = 100) -> str:
    """repr(value) for an error message, one line and short."""
    return one_line(repr(value), limit)


def size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n:,} bytes"


def approx_size(n: float) -> str:
    """An estimate in binary units: '3.2 GiB', '870 MiB'."""
    return f"{n / (1 << 30):,.1f} GiB" if n >= 1 << 29 else f"{n / (1 << 20):,.0f} MiB"


def _kind(mode: int) -> Optional[str]:
    for test, name in _FILE_KINDS:
        if test(mode):
            return name
    return None


def check_input_file(path: Optional[PathLike], what: str, max_bytes: int,
                     error: type[SpinError] = SpinError, verb: str = "cannot read") -> Path:
    """`path` names a regular file of at most max_bytes; else `error`: "WHAT: VERB (why)".
    Uses os.stat only, so a fifo or device file is never opened."""
    if path is None or str(path) == "":
        raise error(f"{what}: empty path")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what}: {verb} (no such file)") from None
    except (OSError, ValueError) as err:         # ValueError: a NUL byte in the path
        raise error(f"{what}: {verb} ({getattr(err, 'strerror', None) or err})") from None
    kind = _kind(st.st_mode)
    if kind is not None or not stat.S_ISREG(st.st_mode):
        raise error(f"{what}: {verb} ({kind or 'not a regular file'}; need a regular file)")
    if st.st_size > max_bytes:
        raise error(f"{what}: {verb} ({st.st_size:,} bytes, over the limit of "
                    f"{size_text(max_bytes)})")
    return Path(path)


def read_regular_file(path: Optional[PathLike], what: str, max_bytes: int, *,
                      text: bool = True, error: type[SpinError] = SpinError) -> Any:
    """The contents of a regular file of at most max_bytes (str: strict UTF-8, see
    decode_text; or bytes with text=False). Anything else raises `error`."""
    check_input_file(path, what, max_bytes, error)
    try:
        # O_NONBLOCK: if a fifo replaced the file since the stat, open does not block
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise error(f"{what}: cannot read ({err.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{what}: cannot read (not a regular file)")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as err:
        raise error(f"{what}: cannot read ({err.strerror})") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise error(f"{what}: cannot read (over the limit of {size_text(max_bytes)})")
    data = b"".join(chunks)
    return decode_text(data, what, error) if text else data


@contextlib.contextmanager
def library_path(path: PathLike) -> Iterator[str]:
    """`path` as a name that libraries needing UTF-8 names (safetensors) can open: itself when
    it is valid UTF-8, else /proc/self/fd/N of the file opened here (Linux)."""
    name = os.fsdecode(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        if not os.path.isdir("/proc/self/fd"):
            raise SpinError(f"{one_line(name, 300)}: a file name that is not UTF-8 cannot be "
                            f"read on this system (rename it)") from None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    yield name


def decode_text(data: bytes, what: str, error: type[SpinError] = SpinError) -> str:
    """Strict UTF-8 (a UTF-8 byte-order mark is dropped); a UTF-16/32 mark is named."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise error(f"{what}: the file is {name} (byte-order mark); save it as UTF-8")
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{what}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                    f"{err.start})") from None


def check_output_dir(path: Optional[PathLike], what: str,
                     error: type[SpinError] = SpinError) -> Path:
    """`path` is a directory or can be made one: not '', not an existing non-directory, and
    its nearest existing ancestor is a writable directory."""
    if path is None or str(path) == "":
        raise error(f"{what}: empty path")
    p = Path(path)
    probe = p
    try:
        while not probe.exists():
            if probe.parent == probe:
                break
            probe = probe.parent
    except (OSError, ValueError) as err:
        raise error(f"{what} {p}: cannot write ({getattr(err, 'strerror', None) or err})") from None
    if not probe.is_dir():
        raise error(f"{what} {p}: cannot write ({probe} is not a directory)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise error(f"{what} {p}: cannot write (directory {probe} is not writable)")
    return p


# ---- YAML --------------------------------------------------------------------------------------
class _Refused(yaml.MarkedYAMLError):
    pass


class _SafeLoader(yaml.SafeLoader):
    """SafeLoader without anchors/aliases, with a nesting limit, string keys only and
    bounded number scalars."""

    _depth = 0

    def compose_node(self, parent, index):  # type: ignore[override]
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise _Refused(problem="anchors and aliases (&name, *name) are not allowed",
                           problem_mark=event.start_mark)
        self._depth += 1
        try:
            if self._depth > YAML_MAX_DEPTH:
                raise _Refused(problem=f"nested deeper than {YAML_MAX_DEPTH} levels",
                               problem_mark=event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
        for key_node, _ in node.value:
            if key_node.tag != "tag:yaml.org,2002:str":
                key = shown(key_node.value, 40) if isinstance(key_node, yaml.ScalarNode) \
                    else f"a {type(key_node).__name__[:-4].lower()}"
                raise _Refused(problem=f"mapping keys must be strings, found {key}",
                               problem_mark=key_node.start_mark)
        return yaml.constructor.BaseConstructor.construct_mapping(self, node, deep)

    def _bounded_number(self, node, construct):
        if len(node.value) > YAML_MAX_NUMBER_CHARS:
            raise _Refused(problem=f"a number of {len(node.value):,} characters (the limit is "
                                   f"{YAML_MAX_NUMBER_CHARS})", problem_mark=node.start_mark)
        return construct(self, node)

    def construct_bounded_int(self, node):
        return self._bounded_number(node, yaml.SafeLoader.construct_yaml_int)

    def construct_bounded_float(self, node):
        return self._bounded_number(node, yaml.SafeLoader.construct_yaml_float)


_SafeLoader.add_constructor("tag:yaml.org,2002:int", _SafeLoader.construct_bounded_int)
_SafeLoader.add_constructor("tag:yaml.org,2002:float", _SafeLoader.construct_bounded_float)


def yaml_error_text(err: yaml.YAMLError) -> str:
    """One line: the problem and where (YAML's own text spans several lines)."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = ": ".join(x for x in (err.context, err.problem) if x)
        return one_line(f"{what}{where}", 300)
    return one_line(" ".join(str(err).split()), 300)


def safe_yaml(text: str, what: str, error: type[SpinError] = SpinError) -> Any:
    """One YAML document parsed by the restricted SafeLoader; `error` naming `what` else."""
    try:
        return yaml.load(text, Loader=_SafeLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as err:
        raise error(f"{what}: not valid YAML ({yaml_error_text(err)})") from None
    except (ValueError, OverflowError) as err:  # e.g. a timestamp out of range
        raise error(f"{what}: not valid YAML ({one_line(err, 300)})") from None


def load_yaml_file(path: Optional[PathLike], what: str,
                   error: type[SpinError] = SpinError) -> Any:
    """read_regular_file (CONFIG_MAX_BYTES) + safe_yaml."""
    return safe_yaml(read_regular_file(path, what, CONFIG_MAX_BYTES, error=error), what, error)


# ---- devices -----------------------------------------------------------------------------------
_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d{1,4}))?")


def check_device(name: Optional[str], flag: str = "--device") -> str:
    """auto, cpu, cuda or cuda:N (N < the number of CUDA devices); else SpinError."""
    m = _DEVICE.fullmatch(name or "")
    if m is None:
        raise SpinError(f"{flag} {shown(name, 60)}: use auto, cpu, cuda or cuda:N")
    if name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SpinError(f"{flag} {name}: this torch has no CUDA device")
        if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
            raise SpinError(f"{flag} {name}: there are {torch.cuda.device_count()} CUDA "
                            f"devices (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return name


def exit_code_of(main: Callable[[], int], prog: str) -> int:
    """A script's main() with bad input (SpinError: files, values) as one line and exit 2, the
    CLI's contract (benchmarks that read user files use it)."""
    try:
        return main()
    except SpinError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
