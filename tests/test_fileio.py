"""Atomic writes (fedistill/fileio.py): a reader finds the old content or the new, never a part; no temporary file
stays behind, except one of a killed process, which ``remove_temporaries`` (and a resume) removes; files get the
mode of a normally created file. Also the places that write through it: checkpoints, run directories."""

from __future__ import annotations

import csv
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from fedistill import fileio
from fedistill.engine.checkpoint import load_checkpoint, save_checkpoint
from fedistill.fileio import atomic_open, atomic_write, is_temporary, remove_temporaries
from fedistill.report.rundir import RunDirectory


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


class WriterFailed(Exception):
    pass


# -- a write completes whole, or not at all ------------------------------------------------------------
def test_bytes_and_text_replace_the_file_and_leave_nothing_else(tmp_path):
    target = tmp_path / "f.bin"
    atomic_write(target, b"\x00\x01first")
    atomic_write(target, b"second")
    assert target.read_bytes() == b"second"
    atomic_write(tmp_path / "t.txt", "a\nb\n")
    assert (tmp_path / "t.txt").read_text() == "a\nb\n"
    assert names(tmp_path) == ["f.bin", "t.txt"]


def test_csv_rows_keep_their_own_line_ends(tmp_path):
    with atomic_open(tmp_path / "m.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", "acc"])
        writer.writerow([1, 0.5])
    assert (tmp_path / "m.csv").read_bytes() == b"round,acc\r\n1,0.5\r\n"  # csv's own \r\n, not translated


@pytest.mark.parametrize("interruption", [WriterFailed, KeyboardInterrupt])
def test_a_writer_that_raises_midway_leaves_the_old_content_and_no_temporary(tmp_path, interruption):
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"old, complete")
    with pytest.raises(interruption):
        with atomic_open(target) as f:
            f.write(b"new, half")
            f.flush()  # the half-written bytes are on the disk, under the temporary name only
            assert target.read_bytes() == b"old, complete"
            raise interruption()
    assert target.read_bytes() == b"old, complete"
    assert names(tmp_path) == ["checkpoint.pt"]


def test_a_failed_first_write_leaves_no_file_at_all(tmp_path):
    with pytest.raises(WriterFailed):
        with atomic_open(tmp_path / "summary.json", "w") as f:
            f.write('{"rounds": ')
            raise WriterFailed()
    assert names(tmp_path) == []


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_sync_or_rename_leaves_the_old_content_and_no_temporary(tmp_path, monkeypatch, failing):
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def refuse(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fileio.os, failing, refuse)
    with pytest.raises(OSError, match="Input/output error"):
        atomic_write(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and names(tmp_path) == ["f"]


def test_closing_the_file_inside_the_block_is_an_error_not_an_unsynced_file(tmp_path):
    target = tmp_path / "f"
    target.write_bytes(b"old")
    with pytest.raises(ValueError):
        with atomic_open(target) as f:
            f.write(b"new")
            f.close()
    assert target.read_bytes() == b"old" and names(tmp_path) == ["f"]


def test_torch_save_writes_through_the_open_file(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "round": 4}
    with atomic_open(tmp_path / "s.pt") as f:
        torch.save(state, f)
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["round"] == 4
    assert names(tmp_path) == ["s.pt"]


def test_only_wb_and_w_are_accepted(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        with atomic_open(tmp_path / "f", "a"):
            pass
    assert names(tmp_path) == []


# -- two writers of one file ---------------------------------------------------------------------------
def test_two_threads_writing_one_file_at_once_leave_one_complete_version(tmp_path):
    """Both threads are in the middle of their write at the same moment (the barrier): with a shared temporary
    name they would write into one file, or rename it from under each other."""
    target = tmp_path / "metrics.csv"
    versions = {name: (name * 1000).encode() for name in ("A", "B")}
    both_halfway = threading.Barrier(2, timeout=10)
    errors: list[BaseException] = []

    def write(name: str) -> None:
        try:
            data = versions[name]
            with atomic_open(target) as f:
                f.write(data[: len(data) // 2])
                f.flush()
                both_halfway.wait()
                f.write(data[len(data) // 2 :])
        except BaseException as exc:  # surfaced below: an exception in a thread would go unseen
            errors.append(exc)

    for _ in range(20):
        threads = [threading.Thread(target=write, args=(name,)) for name in versions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert target.read_bytes() in versions.values()
        assert names(tmp_path) == ["metrics.csv"]


# -- what a killed writer leaves, and cleaning it up ---------------------------------------------------
KILLED_WRITER = """
import os, sys
from fedistill.fileio import atomic_open
with atomic_open(sys.argv[1]) as f:
    f.write(b"new, half")
    f.flush()
    os._exit(9)  # like SIGKILL: no exception, no cleanup
"""


def test_a_killed_writer_leaves_the_old_file_and_a_temporary_that_cleanup_removes(tmp_path):
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"old, complete")
    (tmp_path / "notes.tmp").write_text("a user's file")  # ends in .tmp, but not a temporary of fileio
    (tmp_path / ".hidden.tmp").write_text("neither")
    (tmp_path / "1234.json").write_text("{}")
    result = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(target)], capture_output=True)
    assert result.returncode == 9, result.stderr
    assert target.read_bytes() == b"old, complete"
    leftovers = [name for name in names(tmp_path) if is_temporary(name)]
    assert len(leftovers) == 1 and is_temporary(leftovers[0], "checkpoint.pt")
    assert (tmp_path / leftovers[0]).read_bytes() == b"new, half"
    assert remove_temporaries(tmp_path, "metrics.csv") == []  # another file's temporaries only: none
    assert remove_temporaries(tmp_path) == [tmp_path / leftovers[0]]
    assert names(tmp_path) == [".hidden.tmp", "1234.json", "checkpoint.pt", "notes.tmp"]
    assert remove_temporaries(tmp_path / "missing") == []


def test_temporary_names():
    assert is_temporary(".checkpoint.pt.0123456789ab.tmp")
    assert is_temporary(".checkpoint.pt.0123456789ab.tmp", "checkpoint.pt")
    assert not is_temporary(".checkpoint.pt.0123456789ab.tmp", "metrics.csv")
    for name in ("checkpoint.pt.tmp", "client-000001.r000002.pt", ".x.0123456789AB.tmp", ".x.0123.tmp", ".0123456789ab.tmp"):
        assert not is_temporary(name), name


# -- syncing -------------------------------------------------------------------------------------------
def fsync_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = os.fsync

    def counting(fd):
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(fileio.os, "fsync", counting)
    return calls


@pytest.mark.skipif(os.name != "posix", reason="directories are synced on POSIX only")
def test_the_file_and_its_directory_are_synced_unless_not_durable(tmp_path, monkeypatch):
    calls = fsync_calls(monkeypatch)
    atomic_write(tmp_path / "f", b"x")
    assert len(calls) == 2  # the file, then the directory holding the new name
    calls.clear()
    atomic_write(tmp_path / "g", b"x", durable=False)
    assert calls == [] and (tmp_path / "g").read_bytes() == b"x"


def test_a_directory_that_cannot_be_opened_is_not_synced_and_not_an_error(tmp_path, monkeypatch):
    """As on Windows, where a directory cannot be opened with os.open."""
    calls = fsync_calls(monkeypatch)
    real_open = os.open

    def no_directories(path, flags, *args):
        if Path(path) == tmp_path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(fileio.os, "open", no_directories)
    atomic_write(tmp_path / "f", b"x")
    assert (tmp_path / "f").read_bytes() == b"x" and len(calls) == 1  # the file only


# -- permissions ---------------------------------------------------------------------------------------
@pytest.fixture
def umask():
    previous = os.umask(0o022)
    os.umask(previous)
    yield os.umask
    os.umask(previous)


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_the_file_gets_the_mode_of_a_normally_created_file(tmp_path, umask, mask, mode):
    umask(mask)
    atomic_write(tmp_path / "f", b"x")  # not mkstemp's 0o600 whatever the umask
    with open(tmp_path / "plain", "wb"):
        pass
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == mode == stat.S_IMODE((tmp_path / "plain").stat().st_mode)


# -- the places that write through it ------------------------------------------------------------------
def test_a_checkpoint_save_that_fails_midway_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"round": 1})
    real_save = torch.save

    def dies_midway(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 a few bytes of a zip")
        raise WriterFailed()

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(WriterFailed):
        save_checkpoint(path, {"round": 2})
    monkeypatch.setattr(torch, "save", real_save)
    assert load_checkpoint(path)["round"] == 1
    assert names(tmp_path) == ["checkpoint.pt"]


def test_resuming_a_run_directory_removes_the_killed_attempt_s_temporaries(tmp_path):
    run = RunDirectory(tmp_path)
    run.write_config({"seed": 1})
    history = [{"round": 1, "test_accuracy": 50.0}]
    run.write_csv(history)
    for target in ("checkpoint.pt", "metrics.csv"):
        (tmp_path / f".{target}.0123456789ab.tmp").write_bytes(b"half")
    (tmp_path / "notes.tmp").write_text("kept")
    run.begin_resume(history, restored=True, rounds=3, changes=[])
    assert names(tmp_path) == ["config.yaml", "metrics.csv", "metrics.jsonl", "notes.tmp"]
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0].startswith("round,lr,clients")
