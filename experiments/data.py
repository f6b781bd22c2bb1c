"""Token windows over the corpus memmaps, and the LightningDataModule that serves them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from experiments.config import DataConfig, TrainConfig
from experiments.corpus import Corpus, build_corpus


class RandomWindows(Dataset):
    """``n_samples`` training windows of ``seq_len + 1`` tokens at seeded random offsets (drawn with
    replacement), or, with ``disjoint``, the disjoint windows in a seeded order (no token read
    twice; :class:`ValueError` when there are fewer than ``n_samples``), or, with
    ``sequence_tokens`` (a synthetic task), at the start of seeded random sequences.

    Item ``i`` is fixed by (seed, i), so the data order is reproducible and a run that resumes at
    batch ``k`` sees the same batches as one that never stopped.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        n_samples: int,
        seed: int,
        sequence_tokens: int | None = None,
        disjoint: bool = False,
    ) -> None:
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"{len(tokens)} training tokens cannot fill one window of {seq_len + 1}")
        if sequence_tokens is not None and sequence_tokens < seq_len + 1:
            raise ValueError(f"a window of {seq_len + 1} tokens does not fit a sequence of {sequence_tokens}")
        self.tokens, self.seq_len = tokens, seq_len
        rng = np.random.default_rng(seed)
        if disjoint:  # a seeded order of the disjoint windows: no token is read twice
            available = disjoint_windows(len(tokens), seq_len)
            if n_samples > available:
                raise ValueError(
                    f"{n_samples} windows asked, {available} disjoint ones in {len(tokens)} tokens"
                )
            self.starts = rng.permutation(available)[:n_samples] * (seq_len + 1)
        elif sequence_tokens:
            self.starts = rng.integers(0, len(tokens) // sequence_tokens, size=n_samples) * sequence_tokens
        else:
            self.starts = rng.integers(0, len(tokens) - seq_len - 1, size=n_samples)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        s = int(self.starts[i])
        return torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64))  # (seq_len + 1,)


def disjoint_windows(n_tokens: int, seq_len: int) -> int:
    """How many disjoint windows of ``seq_len + 1`` tokens ``n_tokens`` training tokens hold."""
    return n_tokens // (seq_len + 1)


class ResumingSampler(Sampler[int]):
    """This process's indices of an epoch of ``n`` items, from item ``start`` on.

    A run resumed after ``k`` optimiser steps starts at item ``k * batch_size``: the data
    position is the trainer's step, so it needs no state of its own. The length stays the whole
    epoch's share so Lightning's epoch (and its validation interval) is the one the run started
    with. With ``world`` processes, each global batch of ``batch_size`` consecutive items is split
    into ``world`` contiguous slices and rank ``r`` takes slice ``r``: together the ranks see
    exactly the batches one process would.

    Raises:
        ValueError: ``start`` outside the epoch, or ``batch_size`` not divisible by ``world``.
    """

    def __init__(self, n: int, start: int = 0, rank: int = 0, world: int = 1, batch_size: int = 1) -> None:
        if not 0 <= start <= n:
            raise ValueError(f"start {start} outside an epoch of {n} items")
        if batch_size % world or not 0 <= rank < world:
            raise ValueError(f"a batch of {batch_size} does not split over {world} ranks (rank {rank})")
        self.n, self.start, self.rank, self.world, self.batch_size = n, start, rank, world, batch_size

    def __len__(self) -> int:
        return self.n // self.world

    def __iter__(self) -> Iterator[int]:
        if self.world == 1:
            return iter(range(self.start, self.n))
        share = self.batch_size // self.world
        return (i for i in range(self.start, self.n) if (i % self.batch_size) // share == self.rank)


class HeldOutWindows(Dataset):
    """Contiguous, non-overlapping windows over the first ``max_tokens`` held-out tokens.

    Consecutive windows overlap by one token so every held-out token after the first is predicted
    exactly once; the same tokens for every run of a corpus. With ``sequence_tokens`` (a synthetic
    task), one window at the start of each sequence instead.
    """

    def __init__(
        self, tokens: np.ndarray, seq_len: int, max_tokens: int, sequence_tokens: int | None = None
    ) -> None:
        n = min(len(tokens), max_tokens)
        if n < seq_len + 1:
            raise ValueError(f"held-out split has {n} tokens, fewer than one window of {seq_len + 1}")
        self.tokens, self.seq_len = tokens, seq_len
        self.starts = list(range(0, n - seq_len, sequence_tokens or seq_len))  # [s, s + seq_len] fits in n

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        s = self.starts[i]
        return torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64))


class CorpusDataModule(pl.LightningDataModule):
    """Training windows from the train split; one validation loader per domain (sorted names).

    Args:
        data: the corpus recipe; built (or found in the cache) in ``prepare_data``.
        train: the global batch size, sequence length, steps and held-out token budget; each of
            the trainer's processes loads its share of every global batch.
        seed: seeds the training window offsets.
        cache_root: where corpora are cached (``experiments.corpus.default_cache_root()`` if None).
    """

    def __init__(
        self, data: DataConfig, train: TrainConfig, seed: int, cache_root: Path | None = None
    ) -> None:
        super().__init__()
        self.data_cfg, self.train_cfg, self.seed, self.cache_root = data, train, seed, cache_root
        self.corpus: Corpus | None = None

    def prepare_data(self) -> None:
        build_corpus(self.data_cfg, self.cache_root)

    def setup(self, stage: str | None = None) -> None:
        if self.corpus is None:
            self.corpus = build_corpus(self.data_cfg, self.cache_root, log=lambda _msg: None)

    @property
    def domains(self) -> list[str]:
        self.setup()
        return self.corpus.domains

    def train_dataloader(self) -> DataLoader:
        t = self.train_cfg
        ds = RandomWindows(
            self.corpus.tokens("train"), t.seq_len, t.max_steps * t.batch_size, self.seed,
            self.corpus.sequence_tokens, disjoint=self.data_cfg.train_windows == "disjoint",
        )  # fmt: skip
        # A resumed fit has restored the trainer's step before it asks for this loader.
        steps_done = self.trainer.global_step if self.trainer is not None else 0
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        sampler = ResumingSampler(len(ds), steps_done * t.batch_size, rank, world, t.batch_size)
        # Rank r's slice of each global batch, in t.grad_accum consecutive micro-batches.
        pinned = torch.cuda.is_available()  # the host-to-device copy then runs beside the step, no wait
        return DataLoader(
            ds, batch_size=t.device_batch, sampler=sampler, num_workers=0, drop_last=True, pin_memory=pinned
        )

    def val_dataloader(self) -> list[DataLoader]:
        t = self.train_cfg
        return [
            DataLoader(
                HeldOutWindows(
                    self.corpus.tokens("val", d), t.seq_len, t.val_tokens, self.corpus.sequence_tokens
                ),
                batch_size=t.device_batch,  # what a device holds in training (one process: the batch)
            )
            for d in self.corpus.domains
        ]
