"""What a training step keeps in memory, measured with torch's own trackers on the CPU: a
checkpointed MoE block keeps nothing past its backward pass, and the chunked loss equals the
whole one (issue 55)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from experiments.config import DataConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig
from experiments.loss import chunked_cross_entropy, next_token_loss
from experiments.memory import GIB, _measure, measured_memory
from experiments.model import GatedLM
from experiments.moe import MoEFFN, auxiliary_loss, choose_experts_path, router_stats
from experiments.sharding import checkpoint_blocks, shard_numel
from tests.support import KINDS

#: ``tiny``'s shape: 4 blocks of d 128, 128 experts of 48, top-8; the dense twin's FFN is the
#: width a token uses (8 x 48).
DENSE = ModelConfig(
    vocab_size=2048,
    d_model=128,
    n_layers=4,
    n_heads=16,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=384,
    max_seq_len=128,
)
MOE = dataclasses.replace(DENSE, moe=MoEConfig(n_experts=128, top_k=8, expert_dim=48))


def activations_after_backward(cfg: ModelConfig) -> tuple[int, int]:
    """Bytes of activations (torch's MemTracker: tensors the forward or a recomputation made) still
    alive after the backward pass of a per-block checkpointed model, its loss with the router
    losses; and the bytes of the routing statistics the MoE layers keep (the expert loads, the
    token count, the two losses: a few numbers a layer, rounded as MemTracker rounds)."""
    torch.manual_seed(0)
    model = GatedLM(cfg)
    for m in model.modules():
        if isinstance(m, MoEFFN):  # before the checkpointed forward, as a fit's start does
            choose_experts_path(m, torch.device("cpu"), torch.float32)
    checkpoint_blocks(model)
    tokens = torch.randint(0, cfg.vocab_size, (8, 129))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = next_token_loss(model, tokens)
        if stats := router_stats(model):
            loss = loss + auxiliary_loss(stats, cfg.moe)[0]
        loss.backward()
        del loss
        gc.collect()
        snapshot = tracker.get_tracker_snapshot("current")
    (device,) = snapshot
    kept = sum(
        -(-t.untyped_storage().nbytes() // 512) * 512
        for s in stats
        for t in {id(t): t for t in (s.load, s.tokens, s.lb_loss, s.z_loss)}.values()
    )
    return next(v for k, v in snapshot[device].items() if str(k).endswith("ACT")), kept


def test_a_checkpointed_moe_block_keeps_no_more_after_backward_than_its_dense_twin() -> None:
    """Before the fix the recomputed routing statistics stayed on the module with the recomputed
    block's graph: 34.6 MiB of activations alive after the backward, against the dense twin's
    8 KiB (its RoPE tables' views). Now only the statistics themselves (2 KiB over 4 layers)."""
    (dense, _), (moe, statistics) = activations_after_backward(DENSE), activations_after_backward(MOE)
    assert dense < 2**14 and statistics <= 4 * 4 * 512
    assert moe <= dense + statistics


@pytest.mark.parametrize("chunk", [7, 32, 1000])
def test_the_chunked_loss_equals_the_whole_loss_and_its_gradients(chunk: int) -> None:
    """Chunks of 7 (uneven), 32 and more than the 4 x 32 tokens: the mean and the sum and every
    gradient equal the whole loss's to 1e-6 (relative), untied and tied."""
    for tied in (False, True):
        cfg = dataclasses.replace(DENSE, d_model=32, n_layers=2, n_heads=4, head_dim=8, ffn_dim=64,
                                  tie_embeddings=tied, vocab_size=512)  # fmt: skip
        torch.manual_seed(0)
        model = GatedLM(cfg)
        batch = torch.randint(0, 512, (4, 33))
        got = []
        for size in (0, chunk):
            model.zero_grad()
            mean = next_token_loss(model, batch, "mean", size)
            mean.backward()
            total = next_token_loss(model, batch, "sum", size).detach()
            got.append((mean.detach(), total, [p.grad.clone() for p in model.parameters()]))
        (whole_mean, whole_sum, whole_grads), (mean, total, grads) = got
        assert mean == pytest.approx(float(whole_mean), rel=1e-6)
        assert total == pytest.approx(float(whole_sum), rel=1e-6)
        for g, w in zip(grads, whole_grads):
            assert float((g - w).abs().max()) <= 1e-6 * float(w.abs().max())


def test_a_chunk_keeps_its_logits_for_the_backward_pass_only_as_its_inputs() -> None:
    """The chunked loss saves nothing of size tokens x vocabulary for the backward pass (each
    chunk's logits are recomputed there): the whole loss saves the fp32 logits, the chunked one
    only the hidden states and the weight it had anyway."""
    hidden = torch.randn(64, 16, requires_grad=True)
    weight = torch.randn(1000, 16, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    for chunked in (False, True):
        sizes: list[int] = []

        def pack(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if chunked:
                chunked_cross_entropy(hidden, weight, targets, 16)
            else:
                F.cross_entropy(F.linear(hidden, weight).float(), targets)
        assert (max(sizes) >= 64 * 1000) is not chunked, sizes


def sharded_micro(world: int, vocab: int = 512, seq_len: int = 32, **train: object) -> RunConfig:
    """A micro MoE (4 experts, top-2) sharded over ``world`` ranks, 2 micro-batches of 2 x ``seq_len``."""
    t = TrainConfig(
        max_steps=4, batch_size=4 * world, seq_len=seq_len, warmup_steps=1, val_tokens=512, devices=world,
        strategy="fsdp", grad_accum=2, precision="bf16-mixed", **train,
    )  # fmt: skip
    model = dataclasses.replace(KINDS["moe"], vocab_size=vocab)
    return RunConfig(model=model, train=t, data=DataConfig(vocab_size=vocab))


def test_the_measured_peak_under_fake_tensors_is_the_peak_of_real_tensors() -> None:
    """One rank, a whole step: FakeTensorMode's figures equal the tracker's on real CPU tensors,
    part by part, byte for byte."""
    cfg = sharded_micro(1, activation_checkpointing=True)
    fake, real = measured_memory(cfg), _measure(cfg, fake=False)
    assert fake.peak == real.peak > 0 and fake.parts == real.parts


def test_the_measured_shards_are_the_ranks_share_and_adamw_keeps_two_moments() -> None:
    """Over 4 fake ranks each holds a quarter of every parameter in fp32, and AdamW two such
    moments: the tracker's sharded parameters and optimizer state, to the byte."""
    cfg = sharded_micro(4)
    measured = measured_memory(cfg)
    model = GatedLM(cfg.model)
    shard = sum(shard_numel(tuple(p.shape), 4) for p in model.parameters()) * 4 / GIB
    assert measured.parts["sharded_param"] == pytest.approx(shard, rel=1e-12)
    steps = sum(1 for _ in model.parameters()) * 4 / GIB  # AdamW's step counter, one fp32 a tensor
    assert measured.parts["opt"] == pytest.approx(2 * shard + steps, rel=1e-6)


def test_dtensors_global_shape_propagation_is_not_counted_as_memory() -> None:
    """DTensor runs each op on fake tensors of the global shape to find its output's shape; counted,
    the norm of 4 gradients sharded over 64 ranks would hold the 4 whole gradients (64 MiB each)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import Shard, distribute_tensor

    from experiments.memory import _fake_ranks, _untracked_sharding_propagation

    peaks = []
    with _fake_ranks(64) as mesh, FakeTensorMode():
        grads = [distribute_tensor(torch.empty(4096, 4096), mesh, [Shard(0)]) for _ in range(4)]
        for untracked in (contextlib.nullcontext, _untracked_sharding_propagation):
            tracker = MemTracker()
            with untracked(), tracker:
                torch.nn.utils.get_total_norm(grads)
            (snapshot,) = tracker.get_tracker_snapshot("peak").values()
            peaks.append(snapshot["Total"])
    assert peaks[0] >= 64 * 2**20 and peaks[1] < 2**20


def test_a_row_over_its_gpu_budget_by_the_measured_peak_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``make params`` measures the sharded rows with a budget; the row over it ends the command
    with one line naming the grid file, the row and ``train.gpu_memory_gib``, exit status 2."""
    from sweep.cli import main
    from tests.support import MICRO, write_grid

    moe = "model: {moe: {n_experts: 4, top_k: 2, expert_dim: 16}}"
    text = MICRO.replace("max_lr: 2e-3}", "max_lr: 2e-3, devices: 4, strategy: fsdp, gpu_memory_gib: 2.3}")
    text = text.replace("batch_size: 4,", "batch_size: 8,")
    text = text.replace(f"{moe}}}", f"{moe}, train: {{gpu_memory_gib: 0.01}}}}")
    grid = write_grid(tmp_path, text)
    assert main(["params", "--grid", str(grid)]) == 2
    out, err = capsys.readouterr()
    assert "Measured" in out and "| NO " in out
    lines = [line for line in err.splitlines() if not line.startswith("measuring ")]
    assert len(lines) == 1
    assert lines[0].startswith(f"error: {grid}: row 'moe': train.gpu_memory_gib: measured ")
    assert "over 90% of 0.01 GiB" in lines[0]
    assert [line for line in err.splitlines() if line.startswith("measuring ")] == [
        "measuring baseline (1 of 3)", "measuring sdpa_elementwise (2 of 3)", "measuring moe (3 of 3)"
    ]  # fmt: skip


def test_the_plan_counts_fsdp2s_padding_where_no_dim_splits_evenly() -> None:
    """Over 3 ranks no dim of the micro model's matrices splits evenly: each rank holds a padded
    third; over 2 ranks every parameter splits evenly (3 experts on their model dim)."""
    from experiments.memory import memory_plan

    cfg = sharded_micro(2)
    three = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, devices=3, batch_size=12))
    shapes = [tuple(p.shape) for p in GatedLM(cfg.model).parameters()]
    padded = sum(shard_numel(s, 3) for s in shapes)
    assert padded > sum(math.prod(s) for s in shapes) / 3
    assert memory_plan(three).weights == pytest.approx(4 * padded / GIB)
    assert shard_numel((132, 2048, 1536), 128) * 128 == 132 * 2048 * 1536  # Table 1's 4 added experts


def test_a_model_vocabulary_past_its_tokenizers_rounded_up_to_128_is_refused() -> None:
    """At ``paper`` the model had 151,936 rows for a 32,768-id tokenizer: 119k rows no token
    trains, logits 4.6x what the data needs. A grid asking for it is refused (its BPE's size);
    so is a built tokenizer (a pretrained one, or a BPE that came out smaller) that leaves more
    rows than its ids rounded up to 128; the shipped ``paper`` rows train a BPE of the model's size."""
    from types import SimpleNamespace

    from experiments.strict import ConfigError
    from sweep.grid import load_grid
    from sweep.gridfile import GridError
    from sweep.run.corpora import check_fits
    from tests.support import ROOT

    model, train = dataclasses.replace(KINDS["moe"], vocab_size=640), TrainConfig(seq_len=32)
    with pytest.raises(ConfigError, match=r"model.vocab_size.*512 token ids rounded up .* \(512\), got 640"):
        RunConfig(model=model, train=train, data=DataConfig(vocab_size=512))
    RunConfig(model=model, train=train, data=DataConfig(vocab_size=513))  # 513 ids: up to 640 rows
    cfg = RunConfig(model=model, train=train, data=DataConfig(vocab_size=640))
    cell = SimpleNamespace(config=cfg, row=SimpleNamespace(id="small_bpe"))
    built = SimpleNamespace(vocab_size=500, domains=[], manifest={"tokenizer": {}}, root=Path("corpus"))
    with pytest.raises(GridError, match="row 'small_bpe': model.vocab_size: 640 rows for the 500 token ids"):
        check_fits(SimpleNamespace(file="g.yaml"), [cell], built)
    for name in ("table1", "table2", "table5"):
        for c in load_grid(ROOT / f"grids/{name}.yaml").cells("paper", seeds=[0]):
            assert c.config.model.vocab_size == c.config.data.vocab_size, (name, c.row.id)
