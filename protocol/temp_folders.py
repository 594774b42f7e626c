"""Temporary folders and files named for the process that made them, and the sweep of those whose maker is
gone.

A launcher removes what it made (the engine's sockets, its refusal file, the API servers' metrics and
shared state) when it stops, and an engine its workers' sockets; one killed with SIGKILL removes nothing,
and its children, stopped by the kernel's parent-death signal, do not know its folders. So each name
carries its maker's pid (`engine-KIND-PID-XXXXXX`), and the next `engine serve` or offline LLM to start
on the machine removes those of makers no longer running (`sweep`). A pid this process may not signal
(another user's running process) counts as running.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

# engine-KIND-PID-: what `folder` and `file` name (KIND: letters)
OWNED = re.compile(r"^engine-[a-z]+-(\d+)-")


def prefix(kind: str, pid: int | None = None) -> str:
    """The prefix of the temporary names of this kind that process pid (default this one) makes."""
    return f"engine-{kind}-{os.getpid() if pid is None else pid}-"


def folder(kind: str, parent: str | None = None) -> str:
    """A new temporary folder of this process (tempfile.mkdtemp)."""
    return tempfile.mkdtemp(prefix=prefix(kind), dir=parent)


def file(kind: str) -> str:
    """A new, empty temporary file of this process (tempfile.mkstemp), closed."""
    handle, path = tempfile.mkstemp(prefix=prefix(kind))
    os.close(handle)
    return path


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def sweep(parent: str | None = None) -> list[str]:
    """Remove the temporary folders and files (in parent, default the temporary folder) whose maker is no
    longer running; returns their paths."""
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = OWNED.match(name)
        if match is None or int(match.group(1)) == os.getpid() or running(int(match.group(1))):
            continue
        path = os.path.join(parent, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
        removed.append(path)
    return removed
