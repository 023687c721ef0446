"""Checked, atomic downloads of official dataset files, and safe extraction of official archives.

fedistill is offline first: :mod:`fedistill.data.sources` reads the official files from the data directory
and calls into this module only when the caller passed ``download=True`` (CLI: ``--download``), and only
for the files that are missing.

Guarantees of :func:`download_file`:

* the body is streamed into a temporary file *in the destination directory* (so the final rename never
  crosses a file system), its md5 is computed on the fly and compared with the expected value, and only
  then is it renamed onto the destination with :func:`os.replace` (atomic on POSIX and Windows);
* on any failure (HTTP error, unreachable host, timeout, connection cut before ``Content-Length`` bytes
  arrived, checksum mismatch, interrupt) the temporary file is deleted and a :class:`DatasetError` names
  the URL and what went wrong. A half-written file therefore never appears under the final name, and no
  temporary file is left behind.

Only :mod:`urllib` is used, so downloading adds no dependency.

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
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from pathlib import Path
from typing import IO, Callable, Mapping

from ..errors import DatasetError

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
) -> Path:
    """Download ``url`` to ``dest`` atomically, checking its md5 (when given) before it gets its name.

    Returns ``dest``. Raises :class:`DatasetError` (naming the URL) on an HTTP error, an unreachable host,
    a timeout, a body shorter than its ``Content-Length``, or an md5 mismatch; in every failure case
    nothing is written at ``dest`` and the temporary file is removed. ``md5=None`` skips the checksum
    (only for files without a published one); truncation is still detected through ``Content-Length``.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    finished = False
    try:
        with os.fdopen(fd, "wb") as out:
            actual_md5 = _stream(url, out, timeout, progress)
            out.flush()
            os.fsync(out.fileno())
        if md5 is not None and actual_md5 != md5.lower():
            raise DatasetError(
                f"checksum mismatch for {url}: expected md5 {md5.lower()}, got {actual_md5}; the server "
                f"sent different bytes than the official file, so it was discarded (nothing written to {dest})"
            )
        os.replace(tmp, dest)
        finished = True
    finally:
        if not finished:
            _remove_quietly(tmp)
    return dest


def _stream(url: str, out: IO[bytes], timeout: float, progress: Progress | None) -> str:
    """Copy the body of ``url`` into ``out``; return its md5. Every failure becomes a DatasetError."""
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    digest = hashlib.md5()
    received = 0
    expected: int | None = None
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            expected = int(length) if length is not None and length.strip().isdigit() else None
            while True:
                chunk = response.read(CHUNK_SIZE)
                if not chunk:
                    break
                out.write(chunk)
                digest.update(chunk)
                received += len(chunk)
                if progress is not None:
                    progress(received, expected)
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
) -> Path:
    """Fetch one official file of ``dataset`` into ``dest``, trying each candidate URL in order.

    See :func:`candidate_urls` for where the file comes from and :func:`download_file` for the guarantees.
    If every URL fails, the :class:`DatasetError` lists each URL with its failure.
    """
    failures: list[str] = []
    for url in candidate_urls(dataset, filename):
        log.info("downloading %s -> %s", url, dest)
        try:
            return download_file(url, dest, md5, timeout=timeout, progress=progress)
        except DatasetError as exc:
            log.warning("%s", exc)
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
    """Copy ``source`` into ``dest`` through a temporary file in the same directory."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    finished = False
    try:
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(source, out, CHUNK_SIZE)
        os.replace(tmp, dest)
        finished = True
        log.info("extracted %s from %s -> %s", member, archive, dest)
    except OSError as exc:
        # Decompression/CRC failures are OSErrors without errno and mean a corrupt archive (handled by
        # the caller); an errno means the local file system refused the write (full disk, permissions).
        if exc.errno is None:
            raise
        raise DatasetError(f"cannot write {dest} (extracting {member} from {archive}): {exc}") from None
    finally:
        if not finished:
            _remove_quietly(tmp)


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:  # pragma: no cover - e.g. permissions changed under us
        log.warning("could not remove temporary file %s: %s", path, exc)
