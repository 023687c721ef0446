"""Atomic file writes: the one way fedistill replaces a file (DESIGN "Use the library that exists": one helper
for each repeated job).

:func:`atomic_open` (and :func:`atomic_write` for bytes or text already in memory) writes into a new temporary
file in the target's directory, flushes it to the disk (``fsync``), renames it onto the target with
:func:`os.replace` (atomic on POSIX and Windows) and, on POSIX, flushes the directory too so that the rename
itself survives a power cut. Whatever goes wrong before the rename (an exception in the caller's writer, a
full disk, ``KeyboardInterrupt``), the temporary file is removed and the target keeps its previous content: a
reader sees the old file or the new one, never a part of either.

Each write has its own temporary name, ``.<target name>.<12 hex digits>.tmp``, so that two writers of the same
target (two threads, two processes) never write into each other's file; the last rename wins, whole. A
process killed with ``SIGKILL`` mid-write leaves its temporary behind: :func:`remove_temporaries` removes such
leftovers (only names of this exact form) where a caller knows that nobody else is writing, e.g. when a run is
resumed.

The file gets the permissions of any normally created file (``0o666`` less the umask, or what a default ACL of
the directory says), as ``open(path, "w")`` would give it: it is created with mode ``0o666`` and the kernel
applies the umask. :func:`tempfile.mkstemp` would leave ``0o600``, which :func:`os.replace` keeps, and reading
the umask to correct that afterwards means setting it (process-wide, racing with other threads).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import re
import secrets
from pathlib import Path
from typing import IO, Any, Iterator

log = logging.getLogger(__name__)

TEMPORARY_SUFFIX = ".tmp"
_TOKEN_HEX_DIGITS = 12
_TEMPORARY = re.compile(rf"^\.(?P<target>.+)\.[0-9a-f]{{{_TOKEN_HEX_DIGITS}}}{re.escape(TEMPORARY_SUFFIX)}$")
# mkstemp's flags (exclusive creation, never through a planted link), without its fixed mode 0o600.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


def is_temporary(name: str, target: str | None = None) -> bool:
    """Whether ``name`` is a temporary file name of :func:`atomic_open` (of the file ``target``, when given)."""
    match = _TEMPORARY.match(name)
    return match is not None and (target is None or match["target"] == target)


def remove_temporaries(directory: str | Path, target: str | None = None) -> list[Path]:
    """Remove the temporary files :func:`atomic_open` left in ``directory`` (those of the file ``target`` only,
    when given) and return them; every other file stays. Only call it where no other writer can be at work in
    that directory (a writer's temporary would disappear under it, and its rename fail). A missing directory, or
    a file that cannot be removed (another user's, in a shared directory), is skipped."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not is_temporary(entry.name, target):
            continue
        path = Path(entry.path)
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.debug("could not remove leftover temporary file %s: %s", path, exc)
            continue
        removed.append(path)
    return removed


def _create_temporary(target: Path) -> tuple[int, Path]:
    """A new, empty file next to ``target`` under a fresh temporary name: its descriptor and path."""
    for _ in range(100):
        path = target.with_name(f".{target.name}.{secrets.token_hex(_TOKEN_HEX_DIGITS // 2)}{TEMPORARY_SUFFIX}")
        try:
            return os.open(path, _CREATE_FLAGS, 0o666), path
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(target.parent))  # pragma: no cover


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:  # pragma: no cover - e.g. the directory's permissions changed under us
        log.warning("could not remove temporary file %s: %s", path, exc)


def _sync_directory(directory: Path) -> None:
    """Flush ``directory``'s entries (the rename) to the disk; skipped where a directory cannot be opened or
    synced (Windows, some network file systems)."""
    if os.name != "posix":
        return
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(
    path: str | Path,
    mode: str = "wb",
    *,
    encoding: str | None = "utf-8",
    newline: str | None = None,
    durable: bool = True,
) -> Iterator[IO[Any]]:
    """Open a new temporary file beside ``path`` for writing; when the ``with`` block ends without an exception,
    the file is synced and renamed onto ``path``. On an exception (in the block, or while syncing or renaming)
    the temporary file is removed, ``path`` is left as it was, and the exception propagates.

    ``mode`` is ``"wb"`` (the default: ``torch.save(obj, f)``, a copy loop) or ``"w"`` (text, in ``encoding``,
    with ``newline`` as for :func:`open`: ``newline=""`` for :mod:`csv`). The block must not close the file.
    ``path``'s directory must exist. ``durable=False`` skips both syncs (the rename stays atomic, so readers
    still see a whole file; after a power cut it may hold the old content): for files that no longer mean
    anything once the machine restarts.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open: mode must be 'wb' or 'w', not {mode!r}")
    target = Path(path)
    fd, temporary = _create_temporary(target)
    try:
        binary = os.fdopen(fd, "wb")  # owns fd from here: closing it closes fd
    except BaseException:
        os.close(fd)
        _remove_quietly(temporary)
        raise
    try:
        file: IO[Any] = binary
        if mode == "w":
            try:
                file = io.TextIOWrapper(binary, encoding=encoding, newline=newline)
            except BaseException:
                binary.close()
                raise
        with file:
            yield file
            file.flush()
            if durable:
                os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        _remove_quietly(temporary)
        raise
    if durable:
        _sync_directory(target.parent)


def atomic_write(
    path: str | Path,
    data: bytes | str,
    *,
    encoding: str | None = "utf-8",
    newline: str | None = None,
    durable: bool = True,
) -> None:
    """Replace ``path``'s content by ``data`` (bytes, or text in ``encoding`` with ``newline`` as for
    :func:`open`) atomically: see :func:`atomic_open`."""
    mode = "wb" if isinstance(data, bytes) else "w"
    with atomic_open(path, mode, encoding=encoding, newline=newline, durable=durable) as file:
        file.write(data)
