"""Handing freed heap memory back to the operating system after large JSON requests (glibc only).

A JSON group of 16 x 2048 tokens is a 1 MB body that passes through several transient buffers (the body, numeric
arrays before narrowing, parser output). glibc keeps such freed memory in the heap for reuse, and with requests of
that size the kept memory settles near 13 MB: resident memory that holds no data. :class:`HeapTrimmer` asks glibc
for the free total (``mallinfo2``, about half a microsecond) and returns it (``malloc_trim``) only when it passes
a limit, which bounds the idle heap without paying for a trim on every request. Elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class HeapTrimmer:
    """Calling it trims the heap when glibc holds more than ``limit_bytes`` of free memory.

    Args:
        limit_bytes: free heap memory tolerated between trims.
    """

    def __init__(self, limit_bytes: int = 4 * 2**20) -> None:
        self.limit_bytes = limit_bytes
        self.trims = 0
        self._libc = None
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
                libc.mallinfo2.restype = _MallInfo2
                libc.malloc_trim.argtypes = [ctypes.c_size_t]
                self._libc = libc
            except (OSError, AttributeError):  # not glibc (or older than 2.33): nothing to do
                self._libc = None

    @property
    def active(self) -> bool:
        """Whether this platform supports trimming."""
        return self._libc is not None

    def free_bytes(self) -> int:
        """Free memory glibc holds in its heaps (0 where unsupported)."""
        return int(self._libc.mallinfo2().fordblks) if self._libc is not None else 0

    def __call__(self) -> bool:
        """Trim if the free heap is over the limit; return whether a trim ran."""
        if self._libc is None or self._libc.mallinfo2().fordblks <= self.limit_bytes:
            return False
        self._libc.malloc_trim(0)
        self.trims += 1
        return True
