"""Files kvbench opens in a folder others may write (a shared results folder): never through a symbolic link
(``O_NOFOLLOW``), created only when new (``O_EXCL``), and refused in one line when the name is a link, not a
regular file, or another user's, so that a link planted under a lock's or a temporary file's name cannot make
kvbench overwrite the file it points at (stdlib only)."""
from __future__ import annotations

import errno
import os
import stat

SAFE = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO planted under the name does not block the open


class UnsafeFile(OSError):
    """A file kvbench would open is a link, not a regular file, or another user's: the message is the one line.
    An OSError, so that a command's own handler of file errors says it in one line (no strerror: str() is it)."""


def why_unsafe(path: str, st: os.stat_result) -> str | None:
    """Why the file ``st`` (lstat'ed or fstat'ed at ``path``) is not one kvbench may open, or None."""
    if stat.S_ISLNK(st.st_mode):
        return (f"{path} is a symbolic link: kvbench does not write through a link in a results folder (remove it, "
                "or use a folder only you can write)")
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file: kvbench does not open it (remove it)"
    if st.st_uid != os.geteuid():
        return (f"{path} belongs to user {st.st_uid}, not to this user ({os.geteuid()}): kvbench does not open "
                "another user's file in a results folder (use a folder of your own)")
    return None


def check(path: str) -> None:
    """UnsafeFile when ``path`` (not followed) is a link, not a regular file or another user's; a missing one is fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    why = why_unsafe(path, st)
    if why:
        raise UnsafeFile(why)


def open_own(path: str, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` without following a link, and only onto a regular file of this user's (else
    UnsafeFile; other errors as OSError).  The descriptor is blocking again once the file is known regular."""
    try:
        fd = os.open(path, flags | SAFE, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EEXIST):  # O_NOFOLLOW met a link, or O_EXCL any name (a link too)
            try:
                why = why_unsafe(path, os.lstat(path))
            except OSError:
                why = None
            if why or exc.errno == errno.ELOOP:
                raise UnsafeFile(why or f"{path}: a symbolic link") from None
        raise
    try:
        why = why_unsafe(path, os.fstat(fd))
        if why:
            raise UnsafeFile(why)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_new(path: str, mode: int = 0o644) -> int:
    """A new file at ``path`` for writing (``O_EXCL``: never an existing file, nor a link's target).  A stale
    file of this user's under the name (a killed write's) is removed first; another's, or a link, is UnsafeFile."""
    for _ in range(2):
        try:
            return open_own(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            check(path)  # a link, a FIFO or another user's file: refused, left as it is
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return open_own(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)


def remove(path: str) -> bool:
    """Remove ``path`` unless it is a link, not a regular file or another user's (UnsafeFile, left as it is: the
    user sees what was planted); False when it is gone already."""
    try:
        check(path)
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def write_whole(path: str, write, tmp: str | None = None, midway=None, over_link: bool = False) -> None:
    """Write ``path`` whole or not at all: ``write(fh)`` into ``tmp`` (``path.tmp``, a binary file created new:
    create_new), then renamed over ``path`` (a rename replaces a name, never follows it).  A link, FIFO or
    another user's file at ``path`` is refused (UnsafeFile) unless ``over_link`` (then a link is replaced, its
    target untouched); a failed write (a full disk) leaves no temporary file behind.  ``midway`` runs between
    the two (the fault matrix's point)."""
    if not over_link:
        check(path)
    tmp = tmp or path + ".tmp"
    fd = create_new(tmp)  # UnsafeFile for a link or another user's file under the name: left as it is
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        if midway is not None:
            midway()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_text(path: str) -> str:
    """The text of ``path``, a regular file of this user's (not through a link: UnsafeFile)."""
    fd = open_own(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as fh:
        return fh.read().decode()
