"""HumanEval's executor runs model-generated code only with HF_ALLOW_CODE_EVAL=1, and then confined:
each harmful completion below fails its problem and harms nothing, while the same completion
without the harmful line passes. Every harmful act is bounded (200 forks that exit within 3 s, an
allocation that touches no page, a short timeout), so a broken sandbox fails a test, not the
machine."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sweep.eval import sandbox
from sweep.eval.humaneval_exec import passes, process_results
from sweep.eval.sandbox import CodeEvalRefused, isolation, run_confined
from sweep.eval.suite import humaneval_problems


@pytest.fixture(scope="module")
def problem() -> dict:
    return humaneval_problems()[0]  # has_close_elements


@pytest.fixture(autouse=True)
def opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")


def completion(problem: dict, *lines: str) -> str:
    """``lines`` at the top of the function's body, then the correct solution."""
    return "".join(f"    {line}\n" for line in lines) + problem["canonical_solution"]


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker`` (the child's program is its argument)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return found


def test_a_correct_completion_passes_and_a_wrong_one_fails(problem: dict) -> None:
    assert passes(problem, problem["canonical_solution"])
    assert passes(problem, completion(problem, "x = [i * i for i in range(1000)]"))
    assert not passes(problem, "    return None\n")
    assert not passes(problem, "    return (\n")  # a syntax error


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_a_fork_bomb_fails_its_problem_and_leaves_no_process(problem: dict) -> None:
    marker = f"fork-bomb-{uuid.uuid4().hex}"
    bomb = completion(
        problem,
        f"import os, time  # {marker}",
        "for _ in range(200):",
        "    if os.fork() == 0:",
        "        time.sleep(3)",
        "        os._exit(0)",
    )
    assert not passes(problem, bomb, timeout_s=5.0)
    assert processes_with(marker) == []


def test_allocating_8_gib_fails_its_problem(problem: dict) -> None:
    # bytes(n) is calloc: were the limit broken, no page would be touched (bytearray(n) writes n
    # zero bytes, 8 GiB resident).
    assert not passes(problem, completion(problem, "_ = bytes(8 * 2**30)"))
    assert passes(problem, completion(problem, "_ = bytes(2**20)"))


def test_writing_or_deleting_outside_its_folder_fails_and_touches_nothing(
    problem: dict, tmp_path: Path
) -> None:
    escaped, kept = tmp_path / "escaped.txt", tmp_path / "kept.txt"
    kept.write_text("mine")
    for harm in (
        f"open({str(escaped)!r}, 'w').write('x')",
        f"__import__('pathlib').Path({str(escaped)!r}).write_text('x')",
        f"__import__('os').open({str(escaped)!r}, 0o101)",  # O_WRONLY | O_CREAT
        f"__import__('os').remove({str(kept)!r})",
        f"__import__('shutil').rmtree({str(tmp_path)!r})",
    ):
        assert not passes(problem, completion(problem, harm)), harm
    assert not escaped.exists()
    assert kept.read_text() == "mine"
    assert passes(problem, completion(problem, "open('inside.txt', 'w').write('x')"))  # its own folder


def test_a_file_over_1_mib_fails_its_problem(problem: dict) -> None:
    assert not passes(problem, completion(problem, "open('big.bin', 'wb').write(bytes(2 * 2**20))"))
    assert passes(problem, completion(problem, "open('small.bin', 'wb').write(bytes(2**19))"))


def listening() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    return server


def test_connecting_to_a_listening_port_fails_its_problem_and_never_connects(problem: dict) -> None:
    with listening() as server:
        port = server.getsockname()[1]
        harm = f"__import__('socket').create_connection(('127.0.0.1', {port}), timeout=2).close()"
        assert not passes(problem, completion(problem, harm))
        with pytest.raises(TimeoutError):
            server.accept()


@pytest.mark.skipif(not isolation(), reason="unshare cannot make namespaces here")
def test_the_network_namespace_reaches_not_even_the_hosts_loopback() -> None:
    """The kernel layer alone, without the guard: a connection from the namespace fails."""
    with listening() as server:
        port = server.getsockname()[1]
        program = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
        done = subprocess.run([*isolation(), sys.executable, "-I", "-S", "-c", program], capture_output=True)
        assert done.returncode != 0
        assert b"unreachable" in done.stderr or b"refused" in done.stderr
        with pytest.raises(TimeoutError):
            server.accept()


@pytest.mark.skipif(not sandbox.private_mounts(), reason="unshare cannot make a mount namespace here")
@pytest.mark.parametrize(
    "undo",
    [
        "import _io; _io.FileIO({target!r}, 'w').write(b'x')",  # the C open, past the guard's
        "import sys; [sys.modules.pop(m, None) for m in ('subprocess', '_posixsubprocess', 'signal', "
        "'_signal')]; import subprocess; subprocess.run(['/bin/sh', '-c', 'echo x > {target}'], check=True)",
    ],
)
def test_code_that_undoes_the_guard_still_writes_nothing_outside_its_folder(
    undo: str, problem: dict, tmp_path: Path
) -> None:
    """The kernel layer: in its own mount namespace every mount but the working folder is
    read-only, so a write outside fails even where the Python guard was got round."""
    target = tmp_path / "written.txt"
    assert not passes(problem, completion(problem, undo.format(target=str(target))))
    assert not target.exists()
    inside = "open('mine.txt', 'w').write('x'); assert open('mine.txt').read() == 'x'"
    assert passes(problem, completion(problem, inside))  # its own folder stays writable


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_a_completion_that_sleeps_forever_is_killed_at_the_timeout(problem: dict) -> None:
    marker = f"sleeper-{uuid.uuid4().hex}"
    started = time.monotonic()
    assert not passes(problem, completion(problem, f"import time  # {marker}", "time.sleep(10**6)"), 2.0)
    assert time.monotonic() - started < 5.0
    assert processes_with(marker) == []


@pytest.mark.parametrize(
    "leave", ["import sys; sys.exit(0)", "raise SystemExit(0)", "import os; os._exit(0)"]
)
def test_leaving_early_with_status_0_is_not_a_pass(problem: dict, leave: str) -> None:
    assert not passes(problem, completion(problem, leave))


@pytest.mark.parametrize("value", [None, "0", "true", ""])
def test_without_hf_allow_code_eval_1_nothing_runs(
    problem: dict, value: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if value is None:
        monkeypatch.delenv("HF_ALLOW_CODE_EVAL")
    else:
        monkeypatch.setenv("HF_ALLOW_CODE_EVAL", value)
    started = []
    monkeypatch.setattr(sandbox.subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(CodeEvalRefused, match=r"HumanEval \(HumanEval/0\) runs model-generated code; set"):
        passes(problem, problem["canonical_solution"])
    with pytest.raises(CodeEvalRefused, match=r"HF_ALLOW_CODE_EVAL=1"):
        process_results(problem, [problem["canonical_solution"]])  # no score, not a 0
    with pytest.raises(CodeEvalRefused):
        run_confined("print(1)", 1.0)
    assert started == []
