"""One run per run folder: ``run.lock``, held for the run's life.

:func:`lock_run_dir` creates ``OUT/run.lock`` with ``O_CREAT | O_EXCL`` (atomic, on local file
systems and NFS alike: of two runs starting together, exactly one creates it) and writes the
holder into it: pid, host and pid namespace, the process's start time as the kernel counts it
(to tell a live process from a later one that reuses its pid), when the run started and its
command line.
:meth:`RunLock.release` removes it (the trainer releases it at the end of the run, after an
error too). Where the file exists:

- its holder runs on this host and is alive: refused (:class:`RunLockError`, naming the
  holder);
- its holder ran on this host and is gone (killed, ``kill -9``, a crash, a reboot): the lock is
  stale; it is moved aside (a rename: of two runs taking it over together, one moves it), and
  the run takes it over, saying so;
- its holder runs on another host (folders on a shared file system) or in another pid
  namespace (a container sharing the folder): it cannot be checked from here, so the run is
  refused, naming the holder and the file to remove if that run is gone.

In a job (torchrun) the global rank 0 takes the lock for the whole job, on one host or several:
the job is one run, its other ranks write only into checkpoints, and the trainer makes every
rank raise rank 0's refusal (see ``Trainer.run``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moec.errors import MoecError

LOCK_FILE = "run.lock"
_TRIES = 10
_WAIT_S = 0.1
"""How long to wait for a lock being written (its writer writes it as soon as it exists)."""


class RunLockError(MoecError):
    """The run folder is held by another run, or its lock cannot be created or read."""


@dataclasses.dataclass
class RunLock:
    path: Path
    holder: dict[str, Any]
    """What was written into the lock (``token`` tells this lock from a later one)."""

    def release(self) -> None:
        """Remove the lock if it is still this run's (never another run's that replaced it)."""
        if (_read(self.path) or {}).get("token") == self.holder["token"]:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def lock_run_dir(out: Path, say: Callable[[str], None]) -> RunLock:
    """Lock ``out`` for this process's run (see module); ``say`` reports a stale lock taken
    over."""
    path = out / LOCK_FILE
    holder = _this_holder()
    found: dict[str, Any] | None = None
    stale: dict[str, Any] | None = None
    for _ in range(_TRIES):
        if _create(path, holder):
            if stale is not None:
                say(
                    f"note: {path} was left by {_describe(stale)}, which is no longer running "
                    "(killed or crashed): this run takes the folder over"
                )
            return RunLock(path, holder)
        found = _read(path)
        if found is None:  # removed meanwhile (its run ended): try again
            continue
        if not found:  # being written, or not a lock: look again shortly
            time.sleep(_WAIT_S)
            continue
        _refuse_if_held(out, found)
        if _move_aside(path, found):
            stale = found
    if found == {}:
        raise RunLockError(
            f"{path} exists but names no run (empty, damaged, or not written by moec): if no "
            f"run uses {out}, remove it"
        )
    raise RunLockError(
        f"{path}: other runs keep creating or replacing it while this one starts; start one "
        "run per --out"
    )


def check_free(out: Path) -> None:
    """Raise :class:`RunLockError` where a run holds ``out`` (alive here, or on another host);
    a stale lock passes (:func:`lock_run_dir` takes it over). A look before a run is built, so
    that a busy folder is refused before the compile: only :func:`lock_run_dir` decides."""
    found = _read(out / LOCK_FILE)
    if found:
        _refuse_if_held(out, found)


def _refuse_if_held(out: Path, holder: dict[str, Any]) -> None:
    """Raise :class:`RunLockError` unless ``holder`` ran where its pid can be checked from
    here (this host, this pid namespace) and is gone."""
    here = holder.get("host") == socket.gethostname() and holder.get("pid_ns") == _pid_ns()
    if here and not _alive(holder):
        return
    where = (
        "it is still running"
        if here
        else "on another host or in another container, which this one cannot check"
    )
    path = out / LOCK_FILE
    raise RunLockError(
        f"{out} is in use by another run: {path} is held by {_describe(holder)}, and {where}. "
        "Wait for that run to end, or write to another --out; if it is no longer running, "
        f"remove {path}"
    )


def _this_holder() -> dict[str, Any]:
    pid = os.getpid()
    argv = getattr(sys, "orig_argv", sys.argv)  # ``python3 -m moec train ...`` as typed
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "pid_ns": _pid_ns(),
        "process_start": _process_start(pid),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(argv[0]), *argv[1:]])[:300],
        "token": uuid.uuid4().hex,
    }


def _create(path: Path, holder: dict[str, Any]) -> bool:
    """Create the lock holding ``holder``; False where it exists."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        return False
    except OSError as exc:
        reason = "read-only file system" if exc.errno == errno.EROFS else exc.strerror
        raise RunLockError(
            f"cannot create {path} ({reason}): --out must be a folder this run can write"
        ) from exc
    try:
        os.write(fd, json.dumps(holder).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _read(path: Path) -> dict[str, Any] | None:
    """The lock's holder; None where there is no lock, {} where it is being written or is not
    a lock moec wrote (a symlink among them)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    with os.fdopen(fd) as file:
        try:
            found = json.loads(file.read())
        except (OSError, ValueError):
            return {}
    return found if isinstance(found, dict) and "pid" in found else {}


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the holder's process (on this host) still runs: its pid exists, is not a zombie
    and, where the kernel tells, started when the holder's did (not a reused pid)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    recorded, now = holder.get("process_start"), _process_start(pid)
    if now == "zombie":
        return False
    return recorded is None or now is None or recorded == now


def _pid_ns() -> str | None:
    """This process's pid namespace (Linux: ``pid:[inode]``); None where unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (Linux's ``/proc/PID/stat``);
    ``"zombie"`` for a process that ended and was not reaped; None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "pid (command)": state is field 3
    if fields and fields[0] == "Z":
        return "zombie"
    return fields[19] if len(fields) > 19 else None  # field 22, starttime


def _move_aside(path: Path, stale: dict[str, Any]) -> bool:
    """Remove the stale lock ``path``; False where another run took it over first. The lock is
    renamed away before it is judged again, so of two runs taking it over at once only one
    removes it (the other finds it gone, or moved the new holder's lock and puts it back)."""
    aside = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.stale")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if (_read(aside) or {}).get("token") == stale.get("token"):
        aside.unlink()
        return True
    with contextlib.suppress(OSError):  # exists: a third run's; no hard links: lost
        os.link(aside, path)  # the live lock of the run that took over first
    aside.unlink()
    return False


def _describe(holder: dict[str, Any]) -> str:
    return (
        f"pid {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')}: "
        f"{holder.get('command')})"
    )
