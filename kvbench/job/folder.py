"""The results folder itself (issue 45 item 3): kvbench writes its files only in a folder no other user can plant
a link in, so a folder another user owns, or one writable by others without the sticky bit, is refused in one
line saying why and how to fix it; a folder kvbench makes inside it (``<results>/<machine>/``) may not be a link
either.  Files in the folder are opened by job/safefile.py.  Standard library only."""
from __future__ import annotations

import os
import stat

from kvbench.job.safefile import UnsafeFile


class UnsafeFolder(UnsafeFile):
    """A results folder another user could write files into: the message is the one line."""


def why_unsafe(path: str, st: os.stat_result) -> str | None:
    """Why the folder ``st`` (stat'ed at ``path``) may not hold kvbench's files, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return (f"{path} belongs to user {st.st_uid}, not to this user ({os.geteuid()}): its owner could plant "
                "links there for kvbench to write through (choose a folder of your own with -o)")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return (f"{path} is writable by others without the sticky bit: anyone could replace kvbench's files there "
                f"with links (chmod o-w {path}, or chmod +t {path}, or choose another -o)")
    return None


def _nearest(path: str) -> str:
    """``path`` or its nearest ancestor that exists."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return probe


def check(path: str, inner: str | None = None) -> None:
    """UnsafeFolder when the results folder ``path`` (a link to it is followed: the user named it) is another
    user's or open to all, or when ``path/inner`` is there and is a link or unsafe the same way.  A folder not
    made yet is judged by the one it would be made in: never one writable by others without the sticky bit."""
    if not os.path.lexists(path):
        where = _nearest(path)
        st = os.stat(where)
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise UnsafeFolder(f"{path} would be made in {where}, which is writable by others without the sticky "
                               f"bit: anyone could put a folder of theirs there first (chmod o-w {where}, or "
                               f"chmod +t {where}, or choose another -o)")
        return
    why = why_unsafe(path, os.stat(path))
    if why:
        raise UnsafeFolder(why)
    if inner is None:
        return
    sub = os.path.join(path, inner)
    try:
        st = os.lstat(sub)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFolder(f"{sub} is a symbolic link: kvbench makes this folder itself and writes no result "
                           "through a link (remove it)")
    why = why_unsafe(sub, st)
    if why:
        raise UnsafeFolder(why)


def ensure(path: str, inner: str | None = None) -> str:
    """Make the results folder ``path`` (and ``path/inner``) where missing, each checked (UnsafeFolder) before
    and after; returns the innermost."""
    check(path)
    os.makedirs(path, exist_ok=True)
    check(path, inner)
    if inner is None:
        return path
    sub = os.path.join(path, inner)
    try:
        os.mkdir(sub)
    except FileExistsError:
        pass
    check(path, inner)
    return sub


def door(path: str, error: type[Exception], inner: str | None = None) -> None:
    """At a command's door: check(path, inner), its refusal raised as ``error`` (the command's one line)."""
    try:
        check(path, inner)
    except UnsafeFolder as exc:
        raise error(f"-o {path}: {exc}") from None
