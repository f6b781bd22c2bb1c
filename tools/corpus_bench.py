"""``make corpus-bench``: what a streaming corpus build costs, and that it survives ``kill -9``.

Writes a JSON-lines file of ``--mb`` megabytes (documents of 0.5-8 kB of made-up words,
Zipf-distributed), then
1. builds it in a child process, printing the build's own progress lines (MB/s, time left), its
   seconds and its peak resident memory (``ru_maxrss`` of the child);
2. builds it again in another cache, SIGKILLs that build after ``--kill-after`` seconds, runs the
   same build again and checks the token files are byte-identical to the first build's.
Figures, not assertions: a slower machine prints larger seconds. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_BUILD = """
import sys
from experiments.config import DataConfig, from_dict
from experiments.corpus import build_corpus
cfg = from_dict(DataConfig, {"vocab_size": 4096, "max_chars_per_source": 10**12,
                             "sources": [{"files": sys.argv[1], "domain": "web"}]})
corpus = build_corpus(cfg, sys.argv[2])
print("TOKENS", sum(sum(d.values()) for d in corpus.manifest["tokens"].values()), flush=True)
"""


def write_jsonl(path: Path, megabytes: int, seed: int = 0) -> int:
    """Write about ``megabytes`` MB of ``{"text": ...}`` lines; return the documents written."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(50000)]
    cum_weights = list(itertools.accumulate(1 / rank for rank in range(1, len(words) + 1)))  # Zipf's law
    target, written, docs = megabytes * 1_000_000, 0, 0
    with open(path, "w", encoding="utf-8") as fh:
        while written < target:
            text = " ".join(rng.choices(words, cum_weights=cum_weights, k=rng.randint(100, 1500)))
            line = json.dumps({"text": text}) + "\n"
            fh.write(line)
            written += len(line)
            docs += 1
    return docs


def build(data: Path, cache: Path, kill_after: float | None = None) -> tuple[float, int, bool]:
    """Run one build in a child; return (seconds, the child's peak RSS in MB, whether it was killed)."""
    cmd = [sys.executable, "-c", _BUILD, str(data), str(cache)]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd)
    killed = False
    while True:  # reaped by wait4 alone, which also gives the child's peak memory
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        if kill_after is not None and time.perf_counter() - t0 > kill_after and not killed:
            os.kill(child.pid, signal.SIGKILL)
            killed = True
        time.sleep(0.1)
    child.returncode = os.waitstatus_to_exitcode(status)
    if not killed and child.returncode != 0:
        raise SystemExit(f"error: the build failed with exit status {child.returncode}")
    return time.perf_counter() - t0, usage.ru_maxrss // 1024, killed


def token_files(cache: Path) -> dict[str, bytes]:
    (root,) = cache.glob("corpus-*")
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.bin"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=1024, help="size of the JSON-lines file, MB")
    p.add_argument("--kill-after", type=float, default=20.0, help="seconds before the SIGKILL")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        data = work / "web.jsonl"
        t0 = time.perf_counter()
        docs = write_jsonl(data, args.mb)
        size = data.stat().st_size / 1e6
        print(f"wrote {data.name}: {size:.0f} MB, {docs:,} documents in {time.perf_counter() - t0:.0f} s")
        secs, rss, _ = build(data, work / "a")
        print(f"build: {secs:.0f} s, {size / secs:.1f} MB/s end to end, peak RSS {rss} MB")
        _, _, killed = build(data, work / "b", kill_after=args.kill_after)
        print(
            f"second build {'killed (SIGKILL)' if killed else 'finished before'} at {args.kill_after:.0f} s"
        )
        secs2, rss2, _ = build(data, work / "b")
        same = token_files(work / "a") == token_files(work / "b")
        print(f"rerun after the kill: {secs2:.0f} s, peak RSS {rss2} MB; token files identical: {same}")
        self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(f"(this driver's own peak RSS: {self_rss} MB)")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
