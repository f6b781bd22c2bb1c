"""Running model-generated Python (HumanEval's completions): only when asked, and then confined.

Off unless ``HF_ALLOW_CODE_EVAL=1``, the switch lm-eval's own code tasks use (``humaneval``,
``mbpp``, through Hugging Face ``evaluate``'s ``code_eval``). When on, each program runs in a child
process:

- ``python -I -S -B`` with an empty environment, no stdin and its output discarded, in an empty
  temporary folder that is removed after it;
- under the limits and the reliability guard of ``sweep/eval/guard.py`` (after OpenAI
  human-eval's): 1 GiB of address space, 1 MiB per file, CPU seconds = the timeout + 1, no
  process or thread started (the guard's: Linux exempts root from RLIMIT_NPROC), no file written
  outside its folder, no ``subprocess`` or ``socket``;
- on Linux, where util-linux ``unshare`` and the kernel allow it, in new user, mount, network and
  PID namespaces (and its own ``/proc``): no network at all, the host's loopback included; every
  process it might start dies with it; every mount but its folder read-only
  (``guard.read_only_except``), so writes outside fail in the kernel, past the guard;
- in its own session, killed as a process group at the timeout (wall seconds).

Where ``unshare`` is missing or refused (macOS, user namespaces disabled) the guard alone keeps
the network out and the process-group kill ends what it started; :func:`limits_line` says which
holds. Not a security sandbox (human-eval's own warning holds): run code from an untrusted model
in a container or a virtual machine.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

OPT_IN = "HF_ALLOW_CODE_EVAL"
ADDRESS_SPACE_BYTES = 2**30
FILE_SIZE_BYTES = 2**20
GUARD = Path(__file__).with_name("guard.py")
# Tried in order; the first that runs Python here is used. Without --user only root may unshare.
NAMESPACES = (
    ("--user", "--map-root-user", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"),
    ("--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"),
    ("--net", "--pid", "--fork", "--kill-child"),
)


class CodeEvalRefused(RuntimeError):
    """Model-generated code was about to run without ``HF_ALLOW_CODE_EVAL=1``; nothing ran."""


def code_eval_allowed() -> bool:
    """Whether the user opted in to running model-generated code (``HF_ALLOW_CODE_EVAL=1``)."""
    return os.environ.get(OPT_IN) == "1"


def require_opt_in(what: str) -> None:
    """Stop before ``what`` runs model-generated code unless the user opted in.

    Raises:
        CodeEvalRefused: ``HF_ALLOW_CODE_EVAL`` is not ``1``.
    """
    if not code_eval_allowed():
        raise CodeEvalRefused(f"{what} runs model-generated code; set {OPT_IN}=1 to allow it")


@functools.cache
def isolation() -> tuple[str, ...]:
    """The ``unshare`` command that puts a child in new namespaces here (the first of
    :data:`NAMESPACES` under which Python runs and, with ``--mount``, under which the file
    system really turns read-only but for the working folder), or ``()`` where none does.
    Probed once per process (about 30 ms a try)."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return ()
    for flags in NAMESPACES:
        with tempfile.TemporaryDirectory(prefix="humaneval-probe-") as work:
            probe = f"{_guard_source()}\n{_READ_ONLY_PROBE}" if "--mount" in flags else "pass"
            try:
                done = subprocess.run(
                    [unshare, *flags, sys.executable, "-I", "-S", "-c", probe],
                    cwd=work,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=30,
                )
            except (OSError, subprocess.TimeoutExpired):
                continue
        if done.returncode == 0:
            return (unshare, *flags)
    return ()


# Exits 0 only if, after read_only_except, the working folder takes a file and its parent not.
_READ_ONLY_PROBE = """
import errno, os
read_only_except(os.path.realpath(os.getcwd()))
open("inside", "w").close()
try:
    open(os.path.join("..", "outside-" + str(os.getpid())), "w").close()
except OSError as err:
    raise SystemExit(0 if err.errno == errno.EROFS else 1)
raise SystemExit(1)
"""


def private_mounts() -> bool:
    """Whether :func:`isolation` gives the child its own mount namespace, in which the guard makes
    the file system read-only but for the working folder (``guard.read_only_except``)."""
    return "--mount" in isolation()


def limits_line(timeout_s: float) -> str:
    """The confinement in one line, for the warning printed before any code runs."""
    if private_mounts():
        where = "new user, mount, network and PID namespaces (unshare): no network, a read-only file system"
    elif isolation():
        where = "new user, network and PID namespaces (unshare): no network; writes refused by the guard only"
    else:
        where = "no namespaces (unshare unavailable): socket import and writes refused by the guard only"
    return (
        f"each program in an empty temporary folder, {timeout_s:g} s, "
        f"{ADDRESS_SPACE_BYTES / 2**30:g} GiB of address space, {FILE_SIZE_BYTES / 2**20:g} MiB files, "
        f"process starts refused by the guard (and every process killed with it), {where}"
    )


@functools.cache
def _guard_source() -> str:
    return GUARD.read_text()


def run_confined(program: str, timeout_s: float) -> bool:
    """Whether ``program`` (Python source from a model) ran to its end within ``timeout_s`` wall
    seconds, confined as the module docstring says; its output is discarded.

    Raises:
        CodeEvalRefused: ``HF_ALLOW_CODE_EVAL`` is not ``1``: nothing runs.
    """
    require_opt_in("this evaluation")
    cpu_s = math.ceil(timeout_s) + 1
    limits = f"{ADDRESS_SPACE_BYTES}, {FILE_SIZE_BYTES}, {cpu_s}, {private_mounts()}"
    call = f"run_guarded({ascii(program)}, {limits})"
    command = [*isolation(), sys.executable, "-I", "-S", "-B", "-c", f"{_guard_source()}\n{call}\n"]
    with tempfile.TemporaryDirectory(prefix="humaneval-", ignore_cleanup_errors=True) as work:
        child = subprocess.Popen(
            command,
            cwd=work,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: killed as a whole
        )
        try:
            code = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _kill_group(child)
    return code == 0


def _kill_group(child: subprocess.Popen) -> None:
    """SIGKILL the child's process group (what is left of it), then reap the child."""
    if hasattr(os, "killpg"):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone already
            pass
    else:
        child.kill()
    child.wait()
