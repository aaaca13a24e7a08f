"""One run per directory: an exclusive lock on the run directory, held for the run's whole life.

`mxflux train` (a new run, `--resume` or `--overwrite`) takes the lock before it looks at or
writes anything in the directory, so that two commands started at the same moment cannot both
decide the directory is theirs (a check-then-act race): the kernel's `flock` gives the lock to
exactly one of them; the other is refused at once, naming the process that holds it. The kernel
releases the lock whenever its process ends, however it ends (a crash, SIGKILL), so a lock can
never be held by a dead process; the lock file a killed process leaves behind still names it,
and the next run says that it took over that stale lock.

The lock file is `.mxflux.lock` in the run directory; it holds the holder's pid and command line
and is removed when the run ends normally. It is not one of the run's files (`rundir.RUN_FILES`).
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

from .rundir import RunDirError

__all__ = ["LOCK_FILE", "RunLock", "RunLockedError"]

LOCK_FILE = ".mxflux.lock"


class RunLockedError(RunDirError):
    """Another live process holds the run directory's lock."""


def _holder(fd: int) -> tuple[int | None, str]:
    """(pid, command line) written into the lock file by its last holder; (None, "") if none."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace")
    pid, _, command = text.partition("\n")
    command = command.strip()
    command = command if len(command) <= 100 else command[:97] + "..."
    return (int(pid), command) if pid.strip().isdigit() else (None, "")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class RunLock:
    """`with RunLock(out_dir) as lock:` holds `out_dir`'s lock (creating the directory) or raises
    RunLockedError; `lock.stale_note` is a line about a stale lock taken over, else None."""

    def __init__(self, out_dir: str | Path):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_FILE
        self.fd: int | None = None
        self.stale_note: str | None = None
        self.created = False

    def acquire(self) -> "RunLock":
        self.created = not self.out_dir.exists()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        while True:
            # never through a symbolic link: opening one would truncate (or lock) the file it points to
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except OSError:
                if self.path.is_symlink():
                    raise RunDirError(f"{self.path}: a symbolic link where the run's lock file belongs; remove it "
                                      f"(mxflux never writes through it)") from None
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid, command = _holder(fd)
                for _ in range(20):  # the holder writes its pid just after it locks: give it a moment
                    if pid is not None:
                        break
                    time.sleep(0.05)
                    pid, command = _holder(fd)
                os.close(fd)
                who = f"process {pid} ({command})" if pid is not None else "another process"
                raise RunLockedError(f"run directory {self.out_dir} is in use by {who}: one run per directory; "
                                     f"wait for it to end, or choose another --out") from None
            # The previous holder removes the file when it ends: if it did so between our open and
            # our flock, we hold a lock on a file nobody else will open. Lock the new file instead.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        pid, command = _holder(fd)
        if pid is not None and pid != os.getpid():
            state = "no longer running" if not _alive(pid) else "no longer holding it"
            self.stale_note = (f"note: run directory {self.out_dir}: took over the stale lock of process {pid} "
                               f"({command}), {state}")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n{' '.join(sys.argv)}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: nobody else can be holding it
        except OSError:
            pass
        os.close(self.fd)  # releases the flock
        self.fd = None
        if self.created:  # a command refused before it wrote anything leaves no empty directory behind
            try:
                self.out_dir.rmdir()
            except OSError:  # not empty: the run's files are there
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
