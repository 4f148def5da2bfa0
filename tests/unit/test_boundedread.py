"""read_at_most: a file's bytes up to a limit, one byte more when it is
longer, from regular files, /proc files (which report size 0) and pipes."""

from __future__ import annotations

import os
import threading

import pytest

from cgpud.boundedread import PIECE, read_at_most


@pytest.mark.parametrize("length", [0, 1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 17])
def test_a_file_within_the_limit_is_read_whole(tmp_path, length: int) -> None:
    data = os.urandom(length)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert read_at_most(fd, 3 * PIECE + 17) == data
    finally:
        os.close(fd)


@pytest.mark.parametrize("limit", [0, 5, PIECE, 2 * PIECE + 3])
def test_a_longer_file_gives_one_byte_more_than_the_limit_and_no_more(tmp_path, limit: int) -> None:
    data = os.urandom(limit + PIECE + 10)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert read_at_most(fd, limit) == data[: limit + 1]
        assert os.lseek(fd, 0, os.SEEK_CUR) == limit + 1  # the rest is not read
    finally:
        os.close(fd)


def test_a_proc_file_that_reports_no_size_is_read_whole() -> None:
    fd = os.open("/proc/self/mountinfo", os.O_RDONLY)
    try:
        got = read_at_most(fd, 16 << 20)
    finally:
        os.close(fd)
    with open("/proc/self/mountinfo", "rb") as f:
        assert got.count(b"\n") == f.read().count(b"\n") > 0


def test_a_pipe_written_in_small_pieces_is_read_to_its_end() -> None:
    r, w = os.pipe()
    chunks = [os.urandom(1000) for _ in range(100)]

    def write() -> None:
        for c in chunks:
            os.write(w, c)
        os.close(w)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert read_at_most(r, 1 << 20) == b"".join(chunks)
    finally:
        writer.join()
        os.close(r)
