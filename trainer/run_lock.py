"""One run per run directory: `run.lock` holds the running job's host and pid.

Two runs writing one directory interleave their metrics, race on checkpoint names and overwrite each other's
status (a second `python -m trainer hydra.run.dir=runs/a` while the first still trains). The CLI takes the
lock before Hydra writes anything into the directory and holds it until the job ends; a second run is
refused with one line naming the holder. A lock left by a process that is gone (killed, the machine
rebooted) is taken over, and the log says so; one held from another host cannot be checked from here, so
the message says how to remove it when that run is known to be over.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from trainer.config.errors import ConfigError

log = logging.getLogger("trainer")
LOCK_FILE = "run.lock"
# A lock file still being written (no complete JSON yet) counts as held for this long.
WRITE_GRACE_S = 10.0


def _holder(path: Path) -> Optional[dict[str, Any]]:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _refusal(run_dir: Path, holder: dict[str, Any], hint: str = "") -> ConfigError:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started", 0))))
    return ConfigError("hydra.run.dir", f"{run_dir} is in use by another run (pid {holder.get('pid')} on "
                                        f"{holder.get('host')}, since {since}): wait for it to end or pick another "
                                        f"hydra.run.dir{hint}")


def acquire(run_dir: Path) -> dict[str, Any]:
    """Take the lock of `run_dir` (created if missing); raise ConfigError when a live run holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if holder is None:
                try:
                    age = time.time() - path.stat().st_mtime
                except FileNotFoundError:
                    continue  # released meanwhile
                if age < WRITE_GRACE_S:
                    raise _refusal(run_dir, {"pid": "?", "host": "?", "started": path.stat().st_mtime}) from None
            elif holder.get("host") != me["host"]:
                raise _refusal(run_dir, holder, f" (a lock from another host: remove {path} if that run is over)")
            elif _alive(int(holder.get("pid", -1))):
                raise _refusal(run_dir, holder)
            log.warning(f"taking over {path}: its run (pid {(holder or {}).get('pid', '?')}) is gone")
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue  # another taker may win the O_EXCL race: then its lock is checked like any other
        with os.fdopen(fd, "w") as out:
            json.dump(me, out)
        return me


def release(run_dir: Path, me: dict[str, Any]) -> None:
    """Remove the lock if it is still this process's."""
    path = run_dir / LOCK_FILE
    if _holder(path) == me:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def run_directory_lock(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock for the block (ConfigError when another live run holds it)."""
    me = acquire(run_dir)
    try:
        yield
    finally:
        release(run_dir, me)
