"""``make corpus-bench``: how fast a streaming corpus build encodes against a bare tokenizer loop on
the same file, its peak memory, and that it survives ``kill -9``.

Writes a JSON-lines file of ``--mb`` megabytes (documents of 0.5-8 kB of made-up words,
Zipf-distributed) and trains a byte-level BPE on its first 20 MB, then, each in a child process
(its seconds and peak resident memory, ``ru_maxrss``):
1. ``--rounds`` times, interleaved: the bare loop (read the lines, ``json.loads``, tiktoken's
   ``encode_ordinary_batch`` on every core, write the ids), then the build of the file with that
   BPE as its ``tokenizer.json``; prints each's MB/s and their ratio;
2. the same build encoding with HF ``tokenizers`` (the fallback), and whether its token files are
   byte-identical to tiktoken's;
3. the build that also trains its BPE (``data.tokenizer`` unset), end to end;
4. a build killed with SIGKILL after ``--kill-after`` seconds, run again: its token files against
   the first build's.
``--file`` benches a JSON-lines file of your own (``{"text": ...}`` lines) instead of the made-up
one; it is read through once first, and a file the bench cannot read (Parquet, gzip, empty, a
line that is not a JSON object with a ``text`` string) is one line, exit status 2, before any
child starts. A child that fails anyway (a full disk) is one line too, with its last, exit 1.
``--against CHECKOUT`` adds, in every round, the build of another checkout of this project (an
older commit) on the same file with the same BPE: its MB/s, this build's speed over it, and whether
their token files are identical.
Figures, not assertions: a slower or busier machine prints larger seconds. Run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import resource
import shutil
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
recipe = {"vocab_size": 4096, "max_chars_per_source": 10**12,
          "sources": [{"files": sys.argv[1], "domain": "web"}]}
if sys.argv[3] != "-":
    recipe["tokenizer"] = {"file": sys.argv[3], "eos": "<|endoftext|>"}
corpus = build_corpus(from_dict(DataConfig, recipe), sys.argv[2])
print("TOKENS", sum(sum(d.values()) for d in corpus.manifest["tokens"].values()), flush=True)
"""

# The bare loop: what the tokenizer alone does with the file, nothing else (about 20 lines).
_BARE = """
import json, os, sys
import numpy as np
from tokenizers import Tokenizer
from experiments.corpus.fast_bpe import tiktoken_encoding
encoding, ids = tiktoken_encoding(json.loads(Tokenizer.from_file(sys.argv[2]).to_str()))
threads = len(os.sched_getaffinity(0))
with open(sys.argv[1], encoding="utf-8") as src, open(sys.argv[3], "wb") as out:
    while True:
        lines = src.readlines(2_000_000)
        if not lines:
            break
        texts = [json.loads(line)["text"] for line in lines]
        for doc in encoding.encode_ordinary_batch(texts, num_threads=threads):
            out.write(ids[np.asarray(doc, dtype=np.int64)].astype(np.uint16).tobytes())
"""

_TRAIN = """
import sys
from pathlib import Path
from tools.corpus_bench import train_tokenizer
train_tokenizer(Path(sys.argv[1]), Path(sys.argv[2]))
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


ROOT = Path(__file__).resolve().parents[1]
_MAGIC = {b"PAR1": "a Parquet file", b"\x1f\x8b": "gzip-compressed", b"PK\x03\x04": "a zip archive"}


def jsonl_problem(path: Path) -> str | None:
    """Why ``path`` is not a JSON-lines file the bench can read, in a few words, or None: every
    line a JSON object with a ``text`` string (the bare loop reads each line with ``json.loads``),
    at least one. Reads the file through once, a line at a time."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            return f'is {what}; the bench reads JSON lines, {{"text": ...}} a line'
    documents = 0
    try:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    return f"line {number} is blank (the bench reads a JSON object a line)"
                try:
                    record = json.loads(line)
                except ValueError:
                    return f"line {number} is not JSON"
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    return f'line {number} is not a JSON object with a "text" string'
                documents += 1
    except UnicodeDecodeError as err:
        return f"is not UTF-8 text (a byte near offset {err.start:,} of a line)"
    return None if documents else "holds no line: nothing to bench"


def _folder(text: str) -> str:
    """An argparse ``type``: a folder that exists and this user can write into."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such folder")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: the folder is not writable")
    return text


def _jsonl(text: str) -> str:
    """An argparse ``type``: a readable JSON-lines file the bench can read (:func:`jsonl_problem`)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file" + (" (a folder)" if path.is_dir() else ""))
    try:
        problem = jsonl_problem(path)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"{text}: cannot read: {err.strerror}") from None
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return text


def _seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text!r}")
    return value


def child(script: str, args: list[str], kill_after: float | None = None, env: dict | None = None,
          root: Path = ROOT) -> tuple[float, int, bool]:  # fmt: skip
    """Run ``script`` in a child that imports this project from ``root`` (its working folder, which
    ``python -c`` puts first on ``sys.path``); return (seconds, its peak RSS in MB, whether it was
    killed)."""
    cmd = [sys.executable, "-c", script, *args]
    env = {**(os.environ if env is None else env), "PYTHONPATH": str(root)}
    os.sync()  # the last child's written files go to disk now, not during this one's time
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as stderr:
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, env=env, cwd=root, stderr=stderr)
        killed = False
        while True:  # reaped by wait4 alone, which also gives the child's peak memory
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if kill_after is not None and time.perf_counter() - t0 > kill_after and not killed:
                os.kill(child.pid, signal.SIGKILL)
                killed = True
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
        child.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        said = stderr.read()
    if not killed and child.returncode != 0:  # its traceback's last line: what failed
        last = next((line for line in reversed(said.splitlines()) if line.strip()), "no message")
        # SystemExit with a text: Python prints it, one line, and exits 1 (the input was checked before)
        raise SystemExit(f"error: a child failed with exit status {child.returncode}: {last.strip()}")
    sys.stderr.write(said)  # its warnings, after it
    return seconds, usage.ru_maxrss // 1024, killed


def build(data: Path, cache: Path, tokenizer: Path | None, kill_after: float | None = None,
          encoder: str | None = None, root: Path = ROOT) -> tuple[float, int, bool]:  # fmt: skip
    """One build in a child (``encoder="tokenizers"`` forces the fallback; ``root`` is the checkout
    whose code builds): (seconds, peak RSS MB, killed)."""
    env = {**os.environ, **({"GATED_ATTN_ENCODER": encoder} if encoder else {})}
    return child(_BUILD, [str(data), str(cache), str(tokenizer or "-")], kill_after, env, root=root)


def token_files(cache: Path) -> dict[str, str]:
    """Each token file of the build in ``cache`` by its sha256 (streamed: the driver stays small, as
    its size would show in the peak RSS of the children it starts)."""
    from experiments.checksums import file_sha256

    (root,) = cache.glob("corpus-*")
    return {str(p.relative_to(root)): file_sha256(p) for p in sorted(root.rglob("*.bin"))}


def train_tokenizer(data: Path, target: Path, chars: int = 20_000_000) -> float:
    """Train the bench's BPE (4,096 ids, as the build would) on the file's first ``chars``; seconds."""
    from experiments.corpus.bpe import train_bpe

    t0 = time.perf_counter()
    texts, total = [], 0
    with open(data, encoding="utf-8") as fh:
        for line in fh:
            texts.append(json.loads(line)["text"])
            total += len(texts[-1])
            if total >= chars:
                break
    train_bpe(texts, 4096).save(str(target))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0, every comparison identical; 1, one was not or a child failed (one line);
    2, a bad option (one line, before anything is written)."""
    from sweep.cli_parser import OneLineParser, whole  # one line, exit 2, for any bad option

    p = OneLineParser(prog="python -m tools.corpus_bench", description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=whole(1), default=200, help="size of the JSON-lines file, MB")
    p.add_argument("--rounds", type=whole(1), default=2, help="interleaved rounds of bare loop and build")
    p.add_argument(
        "--kill-after", type=_seconds, default=None, help="seconds before the SIGKILL (default: half a build)"
    )
    p.add_argument(
        "--dir", type=_folder, default=None, help="work folder (default: a temporary one, removed)"
    )
    p.add_argument(
        "--file", type=_jsonl, default=None, help='bench this JSON-lines file ({"text": ...} lines)'
    )
    p.add_argument("--against", default=None, help="another checkout of this project whose build to time too")
    args = p.parse_args(argv)
    against = Path(args.against).resolve() if args.against else None
    if against is not None and not (against / "experiments" / "corpus").is_dir():
        p.error(f"--against {args.against}: not a checkout of this project (no experiments/corpus)")
    free = shutil.disk_usage(args.dir or tempfile.gettempdir()).free
    if args.file is None and args.mb * 1_000_000 > free:
        p.error(f"--mb {args.mb}: the work folder has {free // 1_000_000:,} MB free (--dir names another)")
    try:
        return _bench(args, against)
    except OSError as err:  # the machine: a full disk, a folder gone
        print(f"error: {err.filename + ': ' if err.filename else ''}{err.strerror or err}", file=sys.stderr)
        return 1


def _bench(args: argparse.Namespace, against: Path | None) -> int:
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        data, tok = work / "web.jsonl", work / "tokenizer.json"
        if args.file is None:
            t0 = time.perf_counter()
            docs, secs = write_jsonl(data, args.mb), time.perf_counter() - t0
            print(
                f"wrote {data.name}: {data.stat().st_size / 1e6:.0f} MB, {docs:,} documents in {secs:.0f} s"
            )
        else:
            data = Path(args.file).resolve()
            print(f"benching {data}: {data.stat().st_size / 1e6:.0f} MB")
        mb = data.stat().st_size / 1e6
        # In a child: the trainer's memory would stay in this driver, and a child started by a large
        # process reports that process's size as its own peak RSS.
        trained, _, _ = child(_TRAIN, [str(data), str(tok)])
        print(f"trained the bench's BPE (4,096 ids) on its first 20 MB in {trained:.1f} s")
        ratios, speedups, agree, fastest = [], [], True, float("inf")
        for r in range(1, args.rounds + 1):
            bare, bare_rss, _ = child(_BARE, [str(data), str(tok), str(work / "bare.bin")])
            secs, rss, _ = build(data, work / f"round{r}", tok)
            ratios.append(bare / secs)
            fastest = min(fastest, secs)
            print(
                f"round {r}: bare tiktoken loop {mb / bare:.1f} MB/s (peak RSS {bare_rss} MB); "
                f"build {mb / secs:.1f} MB/s (peak RSS {rss} MB); build / bare {bare / secs:.2f}"
            )
            if against is not None:
                old, old_rss, _ = build(data, work / f"against{r}", tok, root=against)
                speedups.append(old / secs)
                agree = agree and token_files(work / f"against{r}") == token_files(work / f"round{r}")
                print(
                    f"round {r}: {against.name}'s build {mb / old:.1f} MB/s (peak RSS {old_rss} MB); "
                    f"this build is {old / secs:.2f}x faster; token files identical: {agree}"
                )
        print(f"build / bare tiktoken loop, the rounds' mean: {sum(ratios) / len(ratios):.2f}")
        if speedups:
            print(f"build / {against.name}'s build, the rounds' mean: {sum(speedups) / len(speedups):.2f}x")
        hf, hf_rss, _ = build(data, work / "hf", tok, encoder="tokenizers")
        same = token_files(work / "round1") == token_files(work / "hf")
        print(
            f"the build encoding with HF tokenizers: {mb / hf:.1f} MB/s (peak RSS {hf_rss} MB); "
            f"tiktoken's build is {hf / fastest:.1f}x faster; token files identical: {same}"
        )
        full, full_rss, _ = build(data, work / "trained", None)
        print(f"the build training its BPE: {full:.0f} s, {mb / full:.1f} MB/s, peak RSS {full_rss} MB")
        kill_after = args.kill_after if args.kill_after is not None else fastest / 2
        _, _, killed = build(data, work / "b", tok, kill_after=kill_after)
        print(f"a build {'killed (SIGKILL)' if killed else 'finished before'} at {kill_after:.1f} s")
        again, again_rss, _ = build(data, work / "b", tok)
        kept = token_files(work / "round1") == token_files(work / "b")
        print(f"rerun after the kill: {again:.0f} s, peak RSS {again_rss} MB; token files identical: {kept}")
        self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(f"(this driver's own peak RSS: {self_rss} MB)")
        return 0 if same and kept and agree else 1


if __name__ == "__main__":
    sys.exit(main())
