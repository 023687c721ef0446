"""Downloads against a local HTTP server on 127.0.0.1: success is atomic and md5-checked; every failure
(wrong checksum, connection cut short, 404, unreachable host, stall) raises DatasetError and leaves neither
a file at the destination nor a temporary file. Files (downloaded or extracted) get the mode the umask
gives a normally created file, and progress is shown as a terminal line or a few log lines. End to end,
``load_dataset(..., download=True)`` fetches only the missing official files through ``FEDISTILL_MIRROR``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import re
import socket
import stat
import tarfile
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from fedistill.data import download as dl
from fedistill.data import sources
from fedistill.data.sources import load_dataset
from fedistill.errors import DatasetError

MNIST_NAMES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


# --- local server -------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    """Serves ``server.routes``: path -> (mode, body); mode "ok", "cut" (announces 4x the length, sends
    the body, closes) or "stall" (sends headers, then waits until the test ends)."""

    timeout = 5  # a stuck client cannot hold a handler thread for long

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.server.requests.append(self.path)
        route = self.server.routes.get(self.path)
        if route is None:
            self.send_error(404, "Not Found")
            return
        mode, body = route
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body) * (4 if mode == "cut" else 1)))
        self.end_headers()
        if mode == "stall":
            self.wfile.flush()
            self.server.release.wait(5)
            return
        self.wfile.write(body)
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, format, *args) -> None:  # keep pytest output clean
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.routes = {}
    httpd.requests = []
    httpd.release = threading.Event()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def assert_empty(directory: Path) -> None:
    assert sorted(p.name for p in directory.iterdir()) == []


# --- download_file ------------------------------------------------------------------------------------


def test_good_file(server, tmp_path):
    body = bytes(range(256)) * 4000  # ~1 MB: several chunks
    server.routes["/good.bin"] = ("ok", body)
    dest = tmp_path / "sub" / "good.bin"
    seen = []
    result = dl.download_file(f"{server.url}/good.bin", dest, md5(body), timeout=5,
                              progress=lambda got, total: seen.append((got, total)))
    assert result == dest
    assert dest.read_bytes() == body
    assert sorted(p.name for p in dest.parent.iterdir()) == ["good.bin"]  # no temp file left
    assert seen[-1] == (len(body), len(body))


def test_md5_none_skips_checksum(server, tmp_path):
    server.routes["/a"] = ("ok", b"hello")
    dl.download_file(f"{server.url}/a", tmp_path / "a", None, timeout=5)
    assert (tmp_path / "a").read_bytes() == b"hello"


def test_wrong_checksum(server, tmp_path):
    server.routes["/bad.bin"] = ("ok", b"tampered content")
    dest = tmp_path / "dl" / "bad.bin"
    with pytest.raises(DatasetError) as info:
        dl.download_file(f"{server.url}/bad.bin", dest, "0" * 32, timeout=5)
    message = str(info.value)
    assert f"{server.url}/bad.bin" in message
    assert "0" * 32 in message and md5(b"tampered content") in message
    assert_empty(dest.parent)


def test_connection_cut_midway(server, tmp_path):
    body = b"x" * 100_000
    server.routes["/cut.bin"] = ("cut", body)
    dest = tmp_path / "dl" / "cut.bin"
    with pytest.raises(DatasetError, match=r"cut.bin ended after 100000 of 400000 bytes"):
        dl.download_file(f"{server.url}/cut.bin", dest, None, timeout=5)
    assert_empty(dest.parent)


def test_404(server, tmp_path):
    dest = tmp_path / "dl" / "missing.bin"
    with pytest.raises(DatasetError, match=r"/missing.bin answered HTTP 404"):
        dl.download_file(f"{server.url}/missing.bin", dest, None, timeout=5)
    assert_empty(dest.parent)


def test_failure_keeps_existing_destination(server, tmp_path):
    dest = tmp_path / "file.bin"
    dest.write_bytes(b"previous")
    server.routes["/file.bin"] = ("ok", b"new but wrong")
    with pytest.raises(DatasetError):
        dl.download_file(f"{server.url}/file.bin", dest, md5(b"something else"), timeout=5)
    assert dest.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.bin"]


def test_unreachable_host(tmp_path):
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dest = tmp_path / "dl" / "x.bin"
    with pytest.raises(DatasetError, match=rf"could not reach http://127.0.0.1:{port}/x.bin"):
        dl.download_file(f"http://127.0.0.1:{port}/x.bin", dest, None, timeout=5)
    assert_empty(dest.parent)


def test_stalled_server_times_out(server, tmp_path):
    server.routes["/slow"] = ("stall", b"z" * 10)
    dest = tmp_path / "dl" / "slow"
    with pytest.raises(DatasetError, match="/slow"):
        dl.download_file(f"{server.url}/slow", dest, None, timeout=0.3)
    assert_empty(dest.parent)


# --- file modes ---------------------------------------------------------------------------------------


@pytest.fixture
def umask():
    """Set the process umask for one test (``umask(0o022)``), restoring the previous one afterwards."""
    previous = os.umask(0o022)
    os.umask(previous)

    def set_umask(mask: int) -> None:
        os.umask(mask)

    try:
        yield set_umask
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize(("mask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                            (0o002, 0o664, 0o775)])
def test_downloaded_file_mode_follows_umask(server, tmp_path, umask, mask, file_mode, dir_mode):
    server.routes["/m.bin"] = ("ok", b"data" * 1000)
    umask(mask)
    dest = tmp_path / "shared" / "mnist" / "m.bin"
    dl.download_file(f"{server.url}/m.bin", dest, md5(b"data" * 1000), timeout=5, report=False)
    assert mode(dest) == file_mode  # not mkstemp's 0o600, and not forced world-readable either
    assert mode(dest.parent) == dir_mode and mode(dest.parent.parent) == dir_mode


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_replaced_file_gets_new_mode(server, tmp_path, umask):
    dest = tmp_path / "f.bin"
    dest.write_bytes(b"old")
    dest.chmod(0o600)
    server.routes["/f.bin"] = ("ok", b"new")
    umask(0o022)
    dl.download_file(f"{server.url}/f.bin", dest, md5(b"new"), timeout=5, report=False)
    assert dest.read_bytes() == b"new" and mode(dest) == 0o644


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize(("mask", "file_mode"), [(0o022, 0o644), (0o077, 0o600)])
@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_extracted_file_mode_follows_umask(tmp_path, umask, mask, file_mode, kind):
    archive = tmp_path / f"a.{kind}"
    if kind == "zip":
        with zipfile.ZipFile(archive, "w") as zf:
            zf.writestr("top/x.bin", b"member")
    else:
        with tarfile.open(archive, "w:gz") as tar:
            info = tarfile.TarInfo("top/x.bin")
            info.size = 6
            info.mode = 0o600  # the archive's own mode is not what decides
            tar.addfile(info, io.BytesIO(b"member"))
    umask(mask)
    dest = tmp_path / "out" / "x.bin"
    dl.extract_members(archive, {"top/x.bin": dest})
    assert dest.read_bytes() == b"member" and mode(dest) == file_mode
    assert sorted(p.name for p in dest.parent.iterdir()) == ["x.bin"]


# --- progress -----------------------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def plain_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_log_progress_known_size():
    out = io.StringIO()
    report = dl.DownloadProgress(out, tty=False)
    report.start("http://host/f.bin", Path("/data/f.bin"), 10_000_000)
    for received in range(100_000, 10_000_001, 100_000):  # 100 chunks
        report.update(received)
    report.finish("md5 ok (abc)")
    lines = plain_lines(out.getvalue())
    assert lines[0] == "downloading http://host/f.bin (10.0 MB) -> /data/f.bin"
    assert [line.split(":")[1].split("%")[0].strip() for line in lines[1:-1]] == ["25", "50", "75"]
    assert "2.5 MB of 10.0 MB" in lines[1] and "MB/s" in lines[1]
    assert lines[-1].startswith("  f.bin: done, 10.0 MB in ") and lines[-1].endswith("md5 ok (abc)")
    assert len(lines) == 5


def test_log_progress_big_jumps_and_unknown_size():
    out = io.StringIO()
    report = dl.DownloadProgress(out, tty=False)
    report.start("http://host/a", Path("a"), 1000)
    report.update(900)  # crosses 25, 50 and 75 % at once: one line
    report.update(1000)
    report.finish("md5 ok (x)")
    report.start("http://host/b", Path("b"), None)  # the same instance serves the next download
    for received in range(1_000_000, 2_000_000_001, 1_000_000):
        report.update(received)
    report.fail("download failed: http://host/b broke off")
    lines = plain_lines(out.getvalue())
    assert lines[0] == "downloading http://host/a (1.0 kB) -> a"
    assert lines[1].startswith("  a: 75% (900 bytes of 1.0 kB, ") and lines[2].startswith("  a: done, 1.0 kB in ")
    assert lines[3] == "downloading http://host/b (size unknown) -> b"
    assert [line.split(" so far")[0] for line in lines[4:7]] == ["  b: 10.0 MB", "  b: 100.0 MB", "  b: 1.0 GB"]  # rich.filesize.decimal
    assert len(lines) == 8  # 2000 chunks of an unsized body: start, 10 MB, 100 MB, 1 GB, final
    assert lines[-1] == "  b: download failed: http://host/b broke off"


def test_download_logs_few_lines(server, tmp_path, monkeypatch, capsys):
    body = bytes(range(256)) * 4000
    server.routes["/big.bin"] = ("ok", body)
    monkeypatch.setattr(dl, "CHUNK_SIZE", 4096)  # 250 chunks
    seen = []
    dest = tmp_path / "big.bin"
    dl.download_file(f"{server.url}/big.bin", dest, md5(body), timeout=5, progress=lambda *a: seen.append(a))
    lines = plain_lines(capsys.readouterr().err)  # captured stderr is not a terminal: log lines
    assert lines[0] == f"downloading {server.url}/big.bin (1.0 MB) -> {dest}"
    assert lines[-1].startswith("  big.bin: done, 1.0 MB in ") and lines[-1].endswith(f"md5 ok ({md5(body)})")
    assert len(lines) <= 6
    assert len(seen) >= 250 and seen[-1] == (len(body), len(body))  # the callback still sees every chunk
    assert dest.read_bytes() == body


def test_download_logs_failures(server, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(dl.MIRROR_ENV, raising=False)
    monkeypatch.setitem(dl.OFFICIAL_BASE_URLS, "mnist", (f"{server.url}/first/", f"{server.url}/second/"))
    server.routes["/second/f.bin"] = ("ok", b"tampered")
    with pytest.raises(DatasetError):
        dl.download_official("mnist", "f.bin", tmp_path / "f.bin", md5(b"payload"), timeout=5)
    lines = plain_lines(capsys.readouterr().err)
    assert lines[0] == f"download failed: {server.url}/first/f.bin answered HTTP 404 Not Found"
    assert lines[1].startswith(f"downloading {server.url}/second/f.bin (8 bytes)")
    expected = f"  f.bin: checksum mismatch for {server.url}/second/f.bin: expected md5 {md5(b'payload')}"
    assert lines[2].startswith(expected)  # the final line carries the md5 result
    assert len(lines) == 3
    assert_empty(tmp_path)


def test_md5_none_reported(server, tmp_path, capsys):
    server.routes["/n"] = ("ok", b"abc")
    dl.download_file(f"{server.url}/n", tmp_path / "n", None, timeout=5)
    assert plain_lines(capsys.readouterr().err)[-1].endswith("md5 not checked (none published)")


def test_terminal_progress_is_one_updating_line(server, tmp_path, monkeypatch):
    body = b"t" * 300_000
    server.routes["/t.bin"] = ("ok", body)
    monkeypatch.setattr(dl, "CHUNK_SIZE", 1024)
    out = io.StringIO()
    dl.download_file(f"{server.url}/t.bin", tmp_path / "t.bin", md5(body), timeout=5,
                     report=dl.DownloadProgress(out, tty=True))
    raw = out.getvalue()
    assert "\r" in raw and "\x1b[" in raw  # redrawn in place by rich
    assert "downloading" not in raw  # no separate start line on a terminal
    text = ANSI.sub("", raw)
    assert "t.bin" in text and "300.0/300.0 kB" in text and "100%" in text
    final = text.split("\r")[-1].strip()
    assert final.startswith("t.bin: done, 300.0 kB in ") and final.endswith(f"md5 ok ({md5(body)})")
    assert (tmp_path / "t.bin").read_bytes() == body


def test_terminal_progress_stops_on_failure(server, tmp_path):
    server.routes["/cut.bin"] = ("cut", b"c" * 5000)
    out = io.StringIO()
    with pytest.raises(DatasetError, match="ended after 5000 of 20000 bytes"):
        dl.download_file(f"{server.url}/cut.bin", tmp_path / "cut.bin", None, timeout=5,
                         report=dl.DownloadProgress(out, tty=True))
    final = ANSI.sub("", out.getvalue()).split("\r")[-1].strip()
    assert final.startswith("cut.bin: download failed:") and "ended after 5000 of 20000 bytes" in final
    assert_empty(tmp_path)


def test_report_false_is_silent_and_broken_stream_is_harmless(server, tmp_path, capsys):
    server.routes["/q"] = ("ok", b"quiet")
    dl.download_file(f"{server.url}/q", tmp_path / "q", md5(b"quiet"), timeout=5, report=False)
    assert capsys.readouterr().err == ""
    closed = io.StringIO()
    closed.close()
    dl.download_file(f"{server.url}/q", tmp_path / "r", md5(b"quiet"), timeout=5,
                     report=dl.DownloadProgress(closed))
    assert (tmp_path / "r").read_bytes() == b"quiet"


# --- URL resolution -----------------------------------------------------------------------------------


def test_candidate_urls(monkeypatch):
    monkeypatch.delenv(dl.MIRROR_ENV, raising=False)
    urls = dl.candidate_urls("cifar10", "cifar-10-python.tar.gz")
    assert urls == ["https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"]
    assert len(dl.candidate_urls("mnist", MNIST_NAMES[0])) == len(dl.MNIST_URLS)
    monkeypatch.setenv(dl.MIRROR_ENV, "http://127.0.0.1:8000/cache/")
    assert dl.candidate_urls("svhn", "test_32x32.mat") == ["http://127.0.0.1:8000/cache/svhn/test_32x32.mat"]


def test_official_urls_tried_in_order(server, tmp_path, monkeypatch):
    monkeypatch.delenv(dl.MIRROR_ENV, raising=False)
    server.routes["/second/f.bin"] = ("ok", b"payload")
    monkeypatch.setitem(dl.OFFICIAL_BASE_URLS, "mnist", (f"{server.url}/first/", f"{server.url}/second/"))
    dl.download_official("mnist", "f.bin", tmp_path / "f.bin", md5(b"payload"), timeout=5)
    assert (tmp_path / "f.bin").read_bytes() == b"payload"
    assert server.requests == ["/first/f.bin", "/second/f.bin"]
    with pytest.raises(DatasetError) as info:
        dl.download_official("mnist", "g.bin", tmp_path / "g.bin", None, timeout=5)
    assert f"{server.url}/first/g.bin" in str(info.value) and f"{server.url}/second/g.bin" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


# --- end to end through load_dataset ------------------------------------------------------------------


def idx_gz(array: np.ndarray) -> bytes:
    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    return gzip.compress(header + array.tobytes())


def tiny_mnist_files(prefix: str = "") -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    arrays = (
        rng.integers(0, 256, (4, 28, 28)), rng.integers(0, 10, 4),
        rng.integers(0, 256, (2, 28, 28)), rng.integers(0, 10, 2),
    )
    names = [prefix + n.replace("t10k", "test") if prefix else n for n in MNIST_NAMES]
    return {name: idx_gz(a) for name, a in zip(names, arrays)}


@pytest.fixture
def mnist_mirror(server, monkeypatch):
    files = tiny_mnist_files()
    for name, data in files.items():
        server.routes[f"/mnist/{name}"] = ("ok", data)
        monkeypatch.setitem(sources.MD5["mnist"], name, md5(data))
    monkeypatch.setenv(dl.MIRROR_ENV, server.url)
    return files


def test_load_mnist_downloads_from_mirror(server, mnist_mirror, tmp_path):
    root = tmp_path / "data"
    ds = load_dataset("mnist", root, download=True)
    assert tuple(ds.train_x.shape) == (4, 1, 28, 28) and tuple(ds.test_x.shape) == (2, 1, 28, 28)
    assert sorted(server.requests) == sorted(f"/mnist/{n}" for n in MNIST_NAMES)
    assert sorted(p.name for p in (root / "mnist").iterdir()) == sorted(MNIST_NAMES)
    for name, data in mnist_mirror.items():
        assert (root / "mnist" / name).read_bytes() == data
    # present now: no further request, with or without download=True
    load_dataset("mnist", root, download=True)
    load_dataset("mnist", root)
    assert len(server.requests) == 4


def test_download_fetches_only_missing_files(server, mnist_mirror, tmp_path):
    directory = tmp_path / "mnist"
    directory.mkdir()
    for name in MNIST_NAMES[:2]:
        (directory / name).write_bytes(mnist_mirror[name])
    load_dataset("mnist", tmp_path, download=True)
    assert sorted(server.requests) == sorted(f"/mnist/{n}" for n in MNIST_NAMES[2:])


def test_no_download_without_flag(server, mnist_mirror, tmp_path):
    with pytest.raises(DatasetError, match="--download"):
        load_dataset("mnist", tmp_path)
    assert server.requests == []


def test_download_with_bad_checksum_leaves_nothing(server, mnist_mirror, tmp_path, monkeypatch):
    monkeypatch.setitem(sources.MD5["mnist"], "t10k-images-idx3-ubyte.gz", "f" * 32)
    with pytest.raises(DatasetError, match="t10k-images-idx3-ubyte.gz"):
        load_dataset("mnist", tmp_path, download=True)
    present = sorted(p.name for p in (tmp_path / "mnist").iterdir())
    assert "t10k-images-idx3-ubyte.gz" not in present
    assert all(not name.startswith(".") for name in present)  # no temporary files


def test_load_cifar10_downloads_and_extracts(server, tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in (*sources.CIFAR10_FILES, "batches.meta", "readme.html"):
            batch = {b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), b"labels": [3, 7]}
            data = pickle.dumps(batch, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive = buffer.getvalue()
    server.routes["/cifar10/cifar-10-python.tar.gz"] = ("ok", archive)
    monkeypatch.setitem(sources.MD5["cifar10"], "cifar-10-python.tar.gz", md5(archive))
    monkeypatch.setenv(dl.MIRROR_ENV, server.url)
    ds = load_dataset("cifar10", tmp_path, download=True, verify=False)  # tiny batches: no official md5
    assert tuple(ds.train_x.shape) == (10, 3, 32, 32) and ds.test_y.tolist() == [3, 7]
    assert (tmp_path / "cifar-10-python.tar.gz").read_bytes() == archive  # kept for re-extraction
    assert sorted(p.name for p in (tmp_path / "cifar-10-batches-py").iterdir()) == sorted(sources.CIFAR10_FILES)


def test_load_emnist_downloads_zip(server, tmp_path, monkeypatch):
    files = tiny_mnist_files(prefix="emnist-letters-")
    files = {n: idx_gz(np.full(4 if "train" in n else 2, 5)) if "labels" in n else d for n, d in files.items()}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in files.items():
            zf.writestr(f"gzip/{name}", data)
    archive = buffer.getvalue()
    server.routes["/emnist/gzip.zip"] = ("ok", archive)
    monkeypatch.setitem(sources.MD5["emnist"], "gzip.zip", md5(archive))
    monkeypatch.setenv(dl.MIRROR_ENV, server.url + "/")
    ds = load_dataset("emnist", tmp_path, download=True, split="letters")
    assert ds.train_y.tolist() == [4, 4, 4, 4]
    assert server.requests == ["/emnist/gzip.zip"]


def test_load_svhn_downloads(server, tmp_path, monkeypatch):
    from scipy.io import savemat

    for name, n in (("train_32x32.mat", 3), ("test_32x32.mat", 2)):
        buffer = io.BytesIO()
        savemat(buffer, {"X": np.zeros((32, 32, 3, n), np.uint8), "y": np.full((n, 1), 10, np.uint8)})
        data = buffer.getvalue()
        server.routes[f"/svhn/{name}"] = ("ok", data)
        monkeypatch.setitem(sources.MD5["svhn"], name, md5(data))
    monkeypatch.setenv(dl.MIRROR_ENV, server.url)
    ds = load_dataset("svhn", tmp_path, download=True)
    assert ds.train_y.tolist() == [0, 0, 0] and tuple(ds.test_x.shape) == (2, 3, 32, 32)
