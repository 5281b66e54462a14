"""A file replaced whole (`atomicfile.replace`), as the journal, the record of shared stores
and the G3 and `file://` chunk files are: the old file or the new one, never a torn one, and
no temporary file left behind by a failure the process lives through."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.agent import atomicfile


def test_the_file_gets_the_new_bytes_and_the_mode_asked_for(tmp_path: Path) -> None:
    path, tmp = tmp_path / "record", tmp_path / "record.tmp"
    path.write_bytes(b"old")
    atomicfile.replace(path, [b"new ", memoryview(b"bytes")], tmp=tmp, mode=0o600)
    assert path.read_bytes() == b"new bytes"
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record"]


def test_a_failed_write_leaves_the_old_file_and_removes_the_temporary_one(
        tmp_path: Path) -> None:
    path, tmp = tmp_path / "record", tmp_path / "record.tmp"
    path.write_bytes(b"old")

    def data() -> Iterator[bytes]:
        yield b"half of the new"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomicfile.replace(path, data(), tmp=tmp)
    assert path.read_bytes() == b"old"
    assert not tmp.exists()


def test_a_failed_rename_leaves_the_old_file_and_removes_the_temporary_one(
        tmp_path: Path) -> None:
    target = tmp_path / "taken"
    (target / "inside").mkdir(parents=True)  # a non-empty directory cannot be replaced
    tmp = tmp_path / "taken.tmp"
    with pytest.raises(OSError):
        atomicfile.replace(target, [b"new"], tmp=tmp)
    assert (target / "inside").is_dir()
    assert not tmp.exists()


def test_a_crash_before_the_rename_leaves_the_old_file_and_the_next_write_reuses_the_name(
        tmp_path: Path) -> None:
    """A process killed in the middle of its write: the file keeps its old bytes; the
    temporary file it leaves (a fixed name, as the journal's) is truncated by the next write."""
    path, tmp = tmp_path / "record", tmp_path / "record.tmp"
    path.write_bytes(b"old")
    writer = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from kvpool.agent import atomicfile

        def data():
            yield b"x" * 100_000  # more than the write buffer: on the disk before the crash
            print("written", flush=True)
            sys.stdin.read()  # blocks until killed
            yield b"never"

        atomicfile.replace(Path({str(path)!r}), data(), tmp=Path({str(tmp)!r}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "written\n"
        assert tmp.stat().st_size >= 100_000  # the crash comes in the middle of the write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert path.read_bytes() == b"old"

    atomicfile.replace(path, [b"new"], tmp=tmp)
    assert path.read_bytes() == b"new"
    assert not tmp.exists()

