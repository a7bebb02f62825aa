"""Errors the store raises. Each names the path, and where it applies the region and offset, so a
user can act on it instead of reading a stack trace from a background thread."""

from __future__ import annotations


class StoreError(RuntimeError):
    """Base class for every error raised by the flat store."""


class StoreIOError(StoreError):
    """A read or write failed (EIO, ENOSPC, removed file) or moved fewer bytes than asked."""

    def __init__(self, message: str, *, path: str, region: str | None = None, offset: int | None = None,
                 errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.region = region
        self.offset = offset
        self.errno = errno


class StoreLockedError(StoreError):
    """Another live process holds the store file."""


class StoreFormatError(StoreError):
    """The store file or its manifest is truncated, tampered with, or from another format version."""


class StoreSpaceError(StoreError):
    """The store directory cannot hold the planned store."""


class StoreTimeoutError(StoreError):
    """An I/O wait exceeded its limit; the message lists what was still pending."""
