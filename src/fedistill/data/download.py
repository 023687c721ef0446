"""Checked, atomic downloads of official dataset files, and safe extraction of official archives.

fedistill is offline first: :mod:`fedistill.data.sources` reads the official files from the data directory
and calls into this module only when the caller passed ``download=True`` (CLI: ``--download``), and only
for the files that are missing.

Guarantees of :func:`download_file`:

* the body is streamed into a temporary file *in the destination directory* (so the final rename never
  crosses a file system), its md5 is computed on the fly and compared with the expected value, and only
  then is it synced and renamed onto the destination with :func:`os.replace` (atomic on POSIX and Windows;
  :func:`fedistill.fileio.atomic_open`);
* on any failure (HTTP error, unreachable host, timeout, connection cut before ``Content-Length`` bytes
  arrived, checksum mismatch, interrupt) the temporary file is deleted and a :class:`DatasetError` names
  the URL and what went wrong. A half-written file therefore never appears under the final name, and no
  temporary file is left behind;
* the file gets the permissions of any file the process creates normally (``0o666`` minus the umask,
  typically ``0o644``, or what a default ACL of the directory says), so a shared data directory stays
  readable by the other users of the group. :func:`tempfile.mkstemp` would leave ``0o600``; see
  :mod:`fedistill.fileio` for how this is done without touching the process umask.

Fetching uses only :mod:`urllib`; progress is drawn with :mod:`rich` (already a dependency of fedistill).

Progress
--------
:class:`DownloadProgress` reports each download on stderr. On a terminal it is a single updating line
(name, bar, bytes done / total, percentage, MB/s, time left) that gives way to one summary line. When
stderr is not a terminal (``nohup``, SLURM, CI logs) it prints a handful of plain lines per file: the URL
and size when the transfer starts, one line at 25, 50 and 75 % (at 10 MB, 100 MB, 1 GB ... when the server
sends no ``Content-Length``, one line per factor of ten), and a final line with the size, the mean speed
and the md5 result (or the error). ``report=False`` silences it.

Where files come from
---------------------
Each dataset has a tuple of base URLs (module constants below). They are tried in order and every failure
is reported if all fail; a file is only accepted when its md5 equals the official one, so a mirror cannot
substitute different bytes.

``FEDISTILL_MIRROR`` replaces all of them: when set to a base URL ``M``, the file ``F`` of dataset ``D``
(registry name, e.g. ``mnist``, ``cifar10``) is fetched from ``M/D/F`` and nowhere else. Examples:
``http://127.0.0.1:8000`` (tests, a local cache server) or ``file:///srv/datasets`` (an offline copy laid
out as ``/srv/datasets/mnist/train-images-idx3-ubyte.gz``, ``/srv/datasets/cifar10/cifar-10-python.tar.gz``).
The md5 check still applies.

Length (over the ~500-line guide of ARCHITECTURE.md): the official URL and md5 table of every dataset next to
the one atomic, checked downloader that uses it.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from pathlib import Path
from typing import IO, Callable, Mapping

from ..errors import DatasetError
from ..fileio import atomic_open

log = logging.getLogger(__name__)

MIRROR_ENV = "FEDISTILL_MIRROR"
"""Environment variable: a base URL that replaces every official host (see the module docstring)."""

DEFAULT_TIMEOUT = 60.0
"""Seconds to wait for the connection and for each read; a stalled server fails instead of hanging."""

CHUNK_SIZE = 1 << 20
USER_AGENT = "fedistill-dataset-download/0.1 (python urllib)"

# --- official locations --------------------------------------------------------------------------------
# MNIST: the original host (yann.lecun.com) has refused or throttled downloads for years, so the
# byte-identical copy hosted by the PyTorch project is tried first; both serve the same md5s.
MNIST_URLS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
# Fashion-MNIST: the location given in zalandoresearch/fashion-mnist's README, then the repository itself.
FASHION_MNIST_URLS = (
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/",
)
# EMNIST: NIST's distribution of the "gzip.zip" archive (about 562 MB).
EMNIST_URLS = ("https://biometrics.nist.gov/cs_links/EMNIST/",)
# CIFAR-10 / CIFAR-100: Alex Krizhevsky's page (https://www.cs.toronto.edu/~kriz/cifar.html).
CIFAR_URLS = ("https://www.cs.toronto.edu/~kriz/",)
# SVHN cropped digits (format 2): http://ufldl.stanford.edu/housenumbers/
SVHN_URLS = ("http://ufldl.stanford.edu/housenumbers/",)

OFFICIAL_BASE_URLS: dict[str, tuple[str, ...]] = {
    "mnist": MNIST_URLS,
    "fashion_mnist": FASHION_MNIST_URLS,
    "emnist": EMNIST_URLS,
    "cifar10": CIFAR_URLS,
    "cifar100": CIFAR_URLS,
    "svhn": SVHN_URLS,
}

Progress = Callable[[int, "int | None"], None]
"""Called after each chunk with (bytes received so far, total from Content-Length or None)."""


# --- progress display ----------------------------------------------------------------------------------


def _format_bytes(count: float) -> str:
    """Decimal units, rich's own (its download columns use them): 950 bytes, 28.9 kB, 170.5 MB, 1.2 GB."""
    from rich.filesize import decimal

    return decimal(int(count))


def _format_rate(count: int, seconds: float) -> str:
    return f"{count / 1_000_000 / max(seconds, 1e-6):.1f} MB/s"


class DownloadProgress:
    """Shows the progress of one download at a time on ``stream`` (default: ``sys.stderr`` at call time).

    :func:`download_file` calls :meth:`start` once the response headers arrived, :meth:`update` after every
    chunk, then either :meth:`finish` (file in place) or :meth:`fail` (any error, also before
    :meth:`start`). One instance can serve several downloads in turn (each :meth:`start` resets it).

    ``tty`` chooses the display; ``None`` asks ``stream.isatty()``:

    * terminal: a :mod:`rich` progress line (transient) replaced by the summary line at the end;
    * otherwise, plain lines for log files: start (URL, size, destination), 25 %, 50 %, 75 % (or 10 MB,
      100 MB, 1 GB, ... when the size is unknown) and the final line; a chunk crossing several marks
      prints one line, so a file of known size never takes more than five.

    Writing progress never fails a download: errors of the stream (closed pipe, ...) are ignored.
    """

    QUARTERS = 4
    UNKNOWN_SIZE_FIRST_MARK = 10_000_000

    def __init__(self, stream: IO[str] | None = None, tty: bool | None = None) -> None:
        self._stream = stream
        self._tty = tty
        self._bar = None  # rich.progress.Progress while a terminal line is shown
        self._task = None
        self._started = False
        self._name = ""
        self._total: int | None = None
        self._received = 0
        self._t0 = 0.0
        self._next_mark = 0

    @property
    def stream(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stderr

    def is_tty(self) -> bool:
        if self._tty is not None:
            return self._tty
        try:
            return bool(self.stream.isatty())
        except (AttributeError, OSError, ValueError):
            return False

    # -- events --

    def start(self, url: str, dest: Path, total: int | None) -> None:
        self._close_bar()
        self._started = True
        self._name = Path(dest).name
        self._total = total
        self._received = 0
        self._t0 = time.monotonic()
        self._next_mark = 1 if total else self.UNKNOWN_SIZE_FIRST_MARK
        if self.is_tty() and self._open_bar(total):
            return
        size = _format_bytes(total) if total is not None else "size unknown"
        self._emit(f"downloading {url} ({size}) -> {dest}")

    def update(self, received: int) -> None:
        if not self._started:
            return
        self._received = received
        if self._bar is not None:
            try:
                self._bar.update(self._task, completed=received)
            except Exception:  # pragma: no cover - a display problem must not fail the download
                self._bar = None
            return
        line = self._milestone(received)
        if line is not None:
            self._emit(f"  {self._name}: {line}")

    def finish(self, note: str) -> None:
        """The file is in place; ``note`` says what the md5 check found."""
        self._close_bar()
        elapsed = time.monotonic() - self._t0
        self._emit(
            f"  {self._name}: done, {_format_bytes(self._received)} in {elapsed:.1f} s "
            f"({_format_rate(self._received, elapsed)}), {note}"
        )
        self._started = False

    def fail(self, message: str) -> None:
        """The download failed; ``message`` is the error (already naming the URL)."""
        self._close_bar()
        self._emit(f"  {self._name}: {message}" if self._started else message)
        self._started = False

    # -- plain lines --

    def _milestone(self, received: int) -> str | None:
        """The line due at ``received`` bytes, if a milestone was crossed (several at once give one line)."""
        elapsed = time.monotonic() - self._t0
        rate = _format_rate(received, elapsed)
        total = self._total
        if total:
            quarter = min(received * self.QUARTERS // total, self.QUARTERS)
            if quarter < self._next_mark or quarter >= self.QUARTERS:  # 100 % is the final line's job
                return None
            self._next_mark = quarter + 1
            return f"{100 * quarter // self.QUARTERS}% ({_format_bytes(received)} of {_format_bytes(total)}, {rate})"
        if received < self._next_mark:
            return None
        while self._next_mark <= received:
            self._next_mark *= 10
        return f"{_format_bytes(received)} so far (size unknown, {rate})"

    def _emit(self, line: str) -> None:
        try:
            print(line, file=self.stream, flush=True)
        except (OSError, ValueError):  # closed or broken stream: progress is optional
            pass

    # -- terminal line --

    def _open_bar(self, total: int | None) -> bool:
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress as RichProgress,
                TaskProgressColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TaskProgressColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self.stream, force_terminal=True),
                transient=True,
            )
            self._task = bar.add_task(self._name, total=total)
            bar.start()
        except Exception:  # e.g. another live display is active: fall back to plain lines
            return False
        self._bar = bar
        return True

    def _close_bar(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            try:
                bar.stop()
            except Exception:  # pragma: no cover
                pass


def _reporter(report: "bool | DownloadProgress") -> DownloadProgress | None:
    if isinstance(report, DownloadProgress):
        return report
    return DownloadProgress() if report else None


# --- files ---------------------------------------------------------------------------------------------

def md5_file(path: Path, chunk_size: int = CHUNK_SIZE) -> str:
    """Hex md5 of a file, read in chunks so that archives of several hundred MB need little memory."""
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk_size), b""):
            digest.update(block)
    return digest.hexdigest()


def candidate_urls(dataset: str, filename: str) -> list[str]:
    """URLs to try, in order, for one official file of ``dataset``.

    With ``FEDISTILL_MIRROR`` set, this is the single URL ``<mirror>/<dataset>/<filename>``; otherwise one
    URL per official base in :data:`OFFICIAL_BASE_URLS`.
    """
    mirror = os.environ.get(MIRROR_ENV, "").strip()
    if mirror:
        return [f"{mirror.rstrip('/')}/{dataset}/{filename}"]
    try:
        bases = OFFICIAL_BASE_URLS[dataset]
    except KeyError:
        raise DatasetError(f"dataset {dataset!r} has no official download location") from None
    return [base + filename for base in bases]


def download_file(
    url: str,
    dest: Path,
    md5: str | None,
    timeout: float = DEFAULT_TIMEOUT,
    progress: Progress | None = None,
    report: bool | DownloadProgress = True,
) -> Path:
    """Download ``url`` to ``dest`` atomically, checking its md5 (when given) before it gets its name.

    Returns ``dest``. Raises :class:`DatasetError` (naming the URL) on an HTTP error, an unreachable host,
    a timeout, a body shorter than its ``Content-Length``, or an md5 mismatch; in every failure case
    nothing is written at ``dest`` and the temporary file is removed. ``md5=None`` skips the checksum
    (only for files without a published one); truncation is still detected through ``Content-Length``.

    ``progress`` is called after every chunk (see :data:`Progress`). ``report`` shows the download on
    stderr (``True``, see :class:`DownloadProgress`), on a given :class:`DownloadProgress`, or not at all
    (``False``). The file gets the permissions of a normally created file (see :mod:`fedistill.fileio`);
    missing parent folders are created with :meth:`Path.mkdir`'s default mode (``0o777`` minus the umask).
    """
    dest = Path(dest)
    reporter = _reporter(report)

    def on_chunk(received: int, expected: int | None) -> None:
        if reporter is not None:
            reporter.update(received)
        if progress is not None:
            progress(received, expected)

    def on_headers(expected: int | None) -> None:
        if reporter is not None:
            reporter.start(url, dest, expected)

    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_open(dest) as out:  # renamed onto dest only if the block ends without an exception
            actual_md5 = _stream(url, out, timeout, on_chunk, on_headers)
            if md5 is not None and actual_md5 != md5.lower():
                raise DatasetError(
                    f"checksum mismatch for {url}: expected md5 {md5.lower()}, got {actual_md5}; the server "
                    f"sent different bytes than the official file, so it was discarded (nothing written to {dest})"
                )
    except BaseException as exc:
        if reporter is not None:
            reporter.fail(_describe_failure(exc))
        raise
    if reporter is not None:
        reporter.finish(f"md5 ok ({actual_md5})" if md5 is not None else "md5 not checked (none published)")
    return dest


def _describe_failure(exc: BaseException) -> str:
    if isinstance(exc, DatasetError):
        return str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return "download interrupted; nothing written"
    return f"download failed: {type(exc).__name__}: {exc}"


def _stream(
    url: str,
    out: IO[bytes],
    timeout: float,
    on_chunk: Progress,
    on_headers: Callable[["int | None"], None],
) -> str:
    """Copy the body of ``url`` into ``out``; return its md5. Every failure becomes a DatasetError.

    ``on_headers(total)`` is called once the response headers arrived, ``on_chunk(received, total)``
    after each chunk (``total`` from ``Content-Length``, or None).
    """
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    digest = hashlib.md5()
    received = 0
    expected: int | None = None
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            expected = int(length) if length is not None and length.strip().isdigit() else None
            on_headers(expected)
            while True:
                chunk = response.read(CHUNK_SIZE)
                if not chunk:
                    break
                out.write(chunk)
                digest.update(chunk)
                received += len(chunk)
                on_chunk(received, expected)
    except urllib.error.HTTPError as exc:
        raise DatasetError(f"download failed: {url} answered HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise DatasetError(f"download failed: could not reach {url} ({exc.reason})") from None
    except (http.client.HTTPException, OSError, ValueError) as exc:
        # IncompleteRead, connection reset, socket timeout, disk full, malformed URL ...
        raise DatasetError(
            f"download failed: {url} broke off after {received} bytes ({type(exc).__name__}: {exc})"
        ) from None
    # http.client returns b"" (not an error) when the peer closes early, so check the length ourselves.
    if expected is not None and received != expected:
        raise DatasetError(
            f"download failed: {url} ended after {received} of {expected} bytes announced by "
            f"Content-Length (connection closed early); try again"
        )
    return digest.hexdigest()


def download_official(
    dataset: str,
    filename: str,
    dest: Path,
    md5: str | None,
    timeout: float = DEFAULT_TIMEOUT,
    progress: Progress | None = None,
    report: bool | DownloadProgress = True,
) -> Path:
    """Fetch one official file of ``dataset`` into ``dest``, trying each candidate URL in order.

    See :func:`candidate_urls` for where the file comes from and :func:`download_file` for the guarantees
    and for ``progress`` / ``report``. If every URL fails, the :class:`DatasetError` lists each URL with
    its failure.
    """
    reporter = _reporter(report) or False
    failures: list[str] = []
    for url in candidate_urls(dataset, filename):
        log.debug("downloading %s -> %s", url, dest)  # the progress reporter prints the start line
        try:
            return download_file(url, dest, md5, timeout=timeout, progress=progress, report=reporter)
        except DatasetError as exc:
            # Shown by the progress reporter (and in the final error); the log keeps it at debug level.
            log.debug("%s", exc)
            failures.append(str(exc))
    raise DatasetError(
        f"could not download {filename} for {dataset}: " + " | ".join(failures)
        + f". Place the file at {dest} by hand, or set {MIRROR_ENV} to a base URL serving <base>/{dataset}/{filename}"
    )


# --- archives ------------------------------------------------------------------------------------------


def extract_members(archive: Path, members: Mapping[str, Path]) -> None:
    """Extract exactly the listed archive members, each to the destination path given for it.

    ``members`` maps a member name inside the archive to the file to create. Member names are matched
    exactly against this fixed list and written to paths chosen by the caller, so a crafted member name
    (absolute, containing ``..``, a link or a device) can never write outside the dataset folder; a
    wanted member that is not a regular file is rejected. Each file is written atomically (temporary file
    then :func:`os.replace`). Supports ``.tar``, ``.tar.gz``/``.tgz`` and ``.zip``.

    Raises :class:`DatasetError` when the archive is unreadable/truncated or lacks a wanted member.
    """
    archive = Path(archive)
    name = archive.name.lower()
    if name.endswith(".zip"):
        _extract_zip(archive, dict(members))
    elif name.endswith((".tar", ".tar.gz", ".tgz")):
        _extract_tar(archive, dict(members))
    else:
        raise DatasetError(f"{archive}: unsupported archive type (expected .tar.gz or .zip)")


def _corrupt_archive(archive: Path, exc: BaseException) -> DatasetError:
    return DatasetError(
        f"cannot read archive {archive}: {type(exc).__name__}: {exc}; it is truncated or corrupt, "
        f"delete it and download it again (--download)"
    )


def _missing_members(archive: Path, wanted: Mapping[str, Path]) -> DatasetError:
    return DatasetError(
        f"archive {archive} lacks the expected member(s) {', '.join(sorted(wanted))}; "
        f"it is not the official release"
    )


def _extract_tar(archive: Path, wanted: dict[str, Path]) -> None:
    try:
        # One sequential pass: a .tar.gz cannot seek cheaply, and the wanted members are few.
        with tarfile.open(archive, "r:*") as tar:
            for info in tar:
                member = info.name[2:] if info.name.startswith("./") else info.name
                dest = wanted.get(member)
                if dest is None:
                    continue
                if not info.isfile():
                    raise DatasetError(f"archive {archive}: member {member} is not a regular file; refusing it")
                source = tar.extractfile(info)
                if source is None:  # pragma: no cover - isfile() members always have a body
                    raise DatasetError(f"archive {archive}: member {member} has no data")
                with source:
                    _write_atomic(source, dest, archive, member)
                del wanted[member]
                if not wanted:
                    break
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise _corrupt_archive(archive, exc) from None
    if wanted:
        raise _missing_members(archive, wanted)


def _extract_zip(archive: Path, wanted: dict[str, Path]) -> None:
    try:
        with zipfile.ZipFile(archive) as zf:
            infos = {info.filename: info for info in zf.infolist()}
            absent = {m: d for m, d in wanted.items() if m not in infos}
            if absent:
                raise _missing_members(archive, absent)
            for member, dest in wanted.items():
                info = infos[member]
                if info.is_dir():
                    raise DatasetError(f"archive {archive}: member {member} is a directory; refusing it")
                with zf.open(info) as source:  # the CRC is checked while reading
                    _write_atomic(source, dest, archive, member)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, OSError) as exc:
        raise _corrupt_archive(archive, exc) from None


def _write_atomic(source: IO[bytes], dest: Path, archive: Path, member: str) -> None:
    """Copy ``source`` into ``dest`` through a temporary file in the same directory (mode as for
    :func:`download_file`: that of a normally created file)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_open(dest) as out:
            shutil.copyfileobj(source, out, CHUNK_SIZE)
    except OSError as exc:
        # Decompression/CRC failures are OSErrors without errno and mean a corrupt archive (handled by
        # the caller); an errno means the local file system refused the write (full disk, permissions).
        if exc.errno is None:
            raise
        raise DatasetError(f"cannot write {dest} (extracting {member} from {archive}): {exc}") from None
    log.info("extracted %s from %s -> %s", member, archive, dest)
