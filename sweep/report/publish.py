"""All-or-nothing report files: every table and figure of one report is written into a private
staging folder inside the results folder, then moved into place in one go with Ctrl-C and SIGTERM
held back, so an interrupt leaves either the old report or the new one, never a mix.

A staging folder left by a process that died (``kill -9``) is removed by the next report.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from matplotlib.figure import Figure

from sweep.signals import held

_PREFIX = ".staging-"  # .staging-<pid>@<host>-<random>/
_HOST = socket.gethostname()


class Staging:
    """The files of one report, staged under ``results_dir/.staging-<pid>-*/``.

    Use as a context manager: leaving it normally publishes the files (:meth:`publish`), leaving
    it by an exception (a Ctrl-C included) removes them and changes nothing.

    Args:
        results_dir: the results folder; every final path is inside it.
    """

    def __init__(self, results_dir: Path) -> None:
        self.results_dir = results_dir.resolve()
        remove_stale(results_dir)
        self.folder = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}@{_HOST}-", dir=self.results_dir))
        self._files: dict[Path, Path] = {}  # final path -> staged path
        self._removed: set[Path] = set()  # final paths this report no longer has

    def _staged(self, final: Path) -> Path:
        relative = final.resolve().relative_to(self.results_dir)
        staged = self.folder / relative
        staged.parent.mkdir(parents=True, exist_ok=True)
        self._files[final] = staged
        return staged

    def text(self, final: Path, text: str) -> Path:
        """Stage ``text`` for ``final``; return ``final``."""
        self._staged(final).write_text(text)
        return final

    def figure(self, final: Path, fig: Figure, dpi: int = 120) -> Path:
        """Stage ``fig`` as a PNG for ``final``; return ``final``."""
        fig.savefig(self._staged(final), dpi=dpi)
        return final

    def remove(self, final: Path) -> None:
        """Have :meth:`publish` remove ``final``: a file an earlier report wrote that this one has
        nothing for (curves of runs since gone), which would otherwise sit beside the new table."""
        self._removed.add(final)

    def publish(self) -> list[Path]:
        """Move every staged file to its final path, and remove those :meth:`remove` named, with
        SIGINT and SIGTERM blocked (delivered once all are in place); return the final paths. The
        staging folder is removed whatever happens."""
        try:
            with held():
                for final, staged in self._files.items():
                    final.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staged, final)
                for final in self._removed - set(self._files):
                    final.unlink(missing_ok=True)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        return list(self._files)

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self._files.clear()
        self._removed.clear()

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.publish()
        else:
            self.discard()


def remove_stale(results_dir: Path) -> None:
    """Remove this machine's staging folders whose process is gone (killed while writing a
    report); another machine's are its own to clean."""
    for folder in results_dir.glob(f"{_PREFIX}*"):
        pid, _, rest = folder.name.removeprefix(_PREFIX).partition("@")
        if rest.rpartition("-")[0] == _HOST and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
