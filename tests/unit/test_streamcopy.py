"""connector/_streamcopy.c: the page copies of a reload on CPU (streaming stores).

Each copy must land exactly its bytes, whatever the alignment of either end and whatever
the length (the line-aligned head, the 4 KiB-page blocks with their prefetch, the 64-byte
lines and the tail are separate loops), and touch nothing around them; the fallback without
the extension (one glibc memmove each) the same.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from connector import kv_pages

# lengths around each loop's bounds: a line (64), a block of four 4 KiB pages, two blocks
# (the prefetch of the next block), and a GLM-5.3-Flash latent page (1.18 MB)
LENGTHS = [0, 1, 15, 63, 64, 65, 4095, 16383, 16384, 16385, 32768 + 100, 1_179_648]


def _copies(rng: np.random.Generator, src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """Copies of LENGTHS bytes at odd offsets of both ends, disjoint in ``dst``."""
    table, at = [], 0
    for n in LENGTHS:
        s_off = int(rng.integers(0, len(src) - n))
        d_off = at + int(rng.integers(0, 64))
        table.append((dst.ctypes.data + d_off, src.ctypes.data + s_off, n))
        at = d_off + n + 64
    assert at <= len(dst)
    return table


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "memmove"])
def test_each_copy_lands_its_bytes_and_nothing_else(streaming, monkeypatch):
    if streaming and not kv_pages.STREAMING_COPY:
        pytest.skip("connector._streamcopy is not built here (no C compiler at install, or not x86-64)")
    monkeypatch.setattr(kv_pages, "STREAMING_COPY", streaming)
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 2 << 20, dtype=np.uint8)
    dst = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    table = _copies(rng, src, dst)
    expected = dst.copy()
    for d, s, n in table:
        expected[d - dst.ctypes.data: d - dst.ctypes.data + n] = src[s - src.ctypes.data: s - src.ctypes.data + n]
    kv_pages.copy_table(table)
    assert np.array_equal(dst, expected)


@pytest.mark.parametrize("built", [True, False], ids=["c", "memmove"])
def test_each_strided_row_lands_its_pieces_and_nothing_else(built, monkeypatch):
    """copy_rows: parts of rows (pieces of a page's rows, strides apart on either side), in C
    or, without the extension, as one memmove per piece."""
    if built and not kv_pages.TABLE_COPIES:
        pytest.skip("connector._streamcopy is not built here")
    monkeypatch.setattr(kv_pages, "TABLE_COPIES", built)
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    # (destination offset, source offset, bytes, pieces, destination stride, source stride):
    # pieces packed in the source and spread in the destination (a load), the other way, equal
    # strides, one piece, no piece, empty pieces; disjoint in the destination
    rows = [(3, 5, 96, 128, 288, 96), (40_001, 7, 17, 50, 17, 301), (70_000, 100_000, 64, 64, 64, 64),
            (90_000, 1, 1000, 1, 0, 0), (95_000, 0, 8, 0, 8, 8), (96_000, 0, 0, 9, 4, 4)]
    expected = dst.copy()
    for d, s, n, k, ds, ss in rows:
        for i in range(k):
            expected[d + i * ds: d + i * ds + n] = src[s + i * ss: s + i * ss + n]
    kv_pages.copy_rows(np.array([(dst.ctypes.data + d, src.ctypes.data + s, n, k, ds, ss)
                                 for d, s, n, k, ds, ss in rows], dtype=np.uint64))
    assert np.array_equal(dst, expected)
    if built:
        with pytest.raises(ValueError, match="sextuples"):
            kv_pages._streamcopy.copy_rows(np.zeros(9, dtype=np.uint64))


def test_a_table_that_is_not_whole_triples_is_refused():
    if kv_pages._streamcopy is None:
        pytest.skip("connector._streamcopy is not built here")
    with pytest.raises(ValueError, match="uint64 triples"):
        kv_pages._streamcopy.copy_pages(np.zeros(4, dtype=np.uint64))
    kv_pages._streamcopy.copy_pages(np.zeros((0, 3), dtype=np.uint64))  # nothing to copy


def test_buffer_spans_names_each_buffers_first_byte_and_length():
    """A load's payloads (bytes, read-only views of a segment, numpy slices, empty ones) by
    address and length in bytes; a buffer that is not contiguous is refused."""
    if kv_pages._streamcopy is None:
        pytest.skip("connector._streamcopy is not built here")
    arr = np.arange(4096, dtype=np.uint8)
    wide = np.arange(64, dtype=np.float32)
    data = b"abcdefgh"
    buffers = [memoryview(arr)[100:300], memoryview(arr[7:9]).toreadonly(), data, memoryview(wide), b"", arr[10:10]]
    spans = np.frombuffer(kv_pages._streamcopy.buffer_spans(buffers), dtype=np.uint64).reshape(-1, 2)
    assert spans.tolist() == [[arr.ctypes.data + 100, 200], [arr.ctypes.data + 7, 2],
                              [kv_pages._address(memoryview(data)), 8], [wide.ctypes.data, 256], [0, 0], [0, 0]]
    with pytest.raises(BufferError):
        kv_pages._streamcopy.buffer_spans([memoryview(arr)[::2]])
    with pytest.raises(TypeError):
        kv_pages._streamcopy.buffer_spans([arr[:4], 5])


@pytest.mark.skipif(not (shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC")
                                     else "cc") and Path(sysconfig.get_paths()["include"], "Python.h").exists()),
                    reason="no C compiler or no Python headers here: the extension is optional")
def test_the_install_built_the_streaming_copy_where_it_can():
    """Where a compiler and Python's headers are, `make setup` builds it (an optional
    extension: its build failing would otherwise go unnoticed, and reloads copy at torch's
    speed through the cache)."""
    import platform

    assert kv_pages._streamcopy is not None, "connector._streamcopy did not build: see `pip install -e .`'s output"
    assert kv_pages.STREAMING_COPY == (platform.machine() in ("x86_64", "AMD64"))
    assert kv_pages.NON_TEMPORAL_PAGES or not kv_pages.STREAMING_COPY
