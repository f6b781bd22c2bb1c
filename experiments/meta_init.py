"""A model built on the meta device, then initialised on each rank's shards exactly as a CPU build.

Under FSDP no rank may hold the whole model (the paper's 15.6B parameters are 58 GiB in fp32), so
the model is built on the meta device and sharded before any weight exists. Its weights must still
be the ones a one-process run draws from the same seed, or a sharded run would train another
model. :func:`record_build` builds the model on the meta device under a recorder that notes,
in order, every call that draws from the CPU generator or fills a tensor (``torch.nn.init``'s
functions, ``Tensor.normal_`` and kin, ``torch.randn``, ``torch.zeros``, ``fill_``...), and which
parameter each call's result ends in. :meth:`InitPlan.replay` runs those calls again, one at a
time, on a full CPU tensor of the recorded shape from the recorded generator state: every draw
advances the generator as the CPU build did, and the last draw of each parameter is copied, as
each rank's shard, into the sharded parameter. Peak host memory is one tensor (the largest is
1.6 GB at the paper's MoE scale); the time is that of drawing every number twice.

A draw the recorder does not know (``torch.randint``, ``bernoulli_``, an explicit generator) or a
parameter whose value no recorded call set (one computed by arithmetic) raises ``ValueError``
naming it, rather than leave a rank with other weights than one process would have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: Calls that write a whole tensor in place, drawing from the global CPU generator.
RANDOM_IN_PLACE = (
    torch.nn.init.normal_,
    torch.nn.init.uniform_,
    torch.nn.init.trunc_normal_,
    torch.nn.init.kaiming_uniform_,
    torch.nn.init.kaiming_normal_,
    torch.nn.init.xavier_uniform_,
    torch.nn.init.xavier_normal_,
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
)
#: Calls that make a new tensor from the global CPU generator.
RANDOM_FACTORIES = (torch.randn, torch.rand)
#: Calls that set a tensor's values without the generator.
FILLS = (torch.Tensor.fill_, torch.Tensor.zero_)
FILL_FACTORIES = (torch.zeros, torch.ones, torch.full)
#: Draws the replay cannot reproduce: building a model with one of them is refused.
UNSUPPORTED = (
    torch.Tensor.random_,
    torch.Tensor.bernoulli_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
    torch.randint,
    torch.randperm,
    torch.normal,
    torch.bernoulli,
    torch.multinomial,
    torch.randn_like,
    torch.rand_like,
    torch.randint_like,
    torch.nn.init.orthogonal_,
    torch.nn.init.sparse_,
)


@dataclass
class _Call:
    """One recorded call: ``func(target, *args, **kwargs)`` in place, or ``func(*args, **kwargs)``
    that makes a tensor; ``tensor`` is the (meta) tensor it wrote, kept so its storage stays alive."""

    func: Callable
    args: tuple
    kwargs: dict
    tensor: torch.Tensor
    in_place: bool
    random: bool

    def run(self, generator: torch.Generator) -> torch.Tensor:
        """The call on the CPU, drawing from ``generator``: the full tensor it makes."""
        kwargs = dict(self.kwargs)
        kwargs.pop("device", None)
        if self.random:
            kwargs["generator"] = generator
        if not self.in_place:
            return self.func(*self.args, **kwargs)
        target = torch.empty(self.tensor.shape, dtype=self.tensor.dtype)
        with torch.no_grad():
            self.func(target, *self.args, **kwargs)
        return target


@dataclass
class InitPlan:
    """What :func:`record_build` saw: the calls in order and, for each parameter name, the call
    whose result is its value."""

    calls: list[_Call]
    final: dict[str, int] = field(default_factory=dict)

    def replay(self, model: nn.Module, rng_state: torch.Tensor) -> None:
        """Set every parameter of ``model`` (built by the recorded build, then sharded and
        materialised, e.g. ``to_empty``) to the value a CPU build from the global generator state
        ``rng_state`` gives it: each rank writes its own shard of a DTensor parameter.

        Raises:
            KeyError: ``model`` has a parameter the recorded build did not.
        """
        generator = torch.Generator().manual_seed(0)
        generator.set_state(rng_state)
        params = dict(model.named_parameters(remove_duplicate=False))
        writes: dict[int, list[str]] = {}
        for name, index in self.final.items():
            writes.setdefault(index, []).append(name)
        for index, call in enumerate(self.calls):
            if not call.random and index not in writes:
                continue  # a fill another call overwrote: nothing drawn, nothing to write
            value = call.run(generator)
            for name in writes.get(index, []):
                write_shard(params[name], value)


def write_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``param``'s part of the full tensor ``full`` into it: its local shard when it is a
    DTensor (no communication: every rank holds ``full``), else the whole."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in UNSUPPORTED:
            raise ValueError(f"{_name(func)} draws numbers a meta-device build cannot replay")
        out = func(*args, **kwargs)
        random = func in RANDOM_IN_PLACE or func in RANDOM_FACTORIES
        if not random and func not in FILLS and func not in FILL_FACTORIES:
            return out
        if kwargs.get("generator") is not None:
            raise ValueError(f"{_name(func)} with its own generator: a meta-device build cannot replay it")
        if func in RANDOM_IN_PLACE or func in FILLS:
            target = kwargs.pop("tensor", None)
            if target is None:
                target, args = args[0], args[1:]
            self.calls.append(_Call(func, tuple(args), kwargs, target, True, random))
        else:
            self.calls.append(_Call(func, tuple(args), kwargs, out, False, random))
        return out


def _name(func: Callable) -> str:
    return f"{getattr(func, '__module__', None) or 'torch.Tensor'}.{getattr(func, '__name__', func)}"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def record_build(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitPlan]:
    """``build()`` on the meta device (no memory, no draw from the generator), and the
    :class:`InitPlan` that initialises it as ``build()`` on the CPU would.

    Raises:
        ValueError: ``build`` draws in a way the plan cannot replay, initialises part of a tensor,
            or leaves a parameter whose value no recorded call set (both named).
    """
    recorder = _Recorder()
    with torch.device("meta"), recorder:
        model = build()
    last: dict[int, int] = {}
    for index, call in enumerate(recorder.calls):
        if call.tensor.numel() * call.tensor.element_size() != call.tensor.untyped_storage().nbytes():
            raise ValueError(f"{_name(call.func)} set part of a tensor: a meta-device build cannot replay it")
        last[_storage(call.tensor)] = index
    plan = InitPlan(recorder.calls)
    for name, param in model.named_parameters(remove_duplicate=False):
        if _storage(param) not in last:
            raise ValueError(f"parameter {name}: no recorded call set its value (computed by arithmetic?)")
        plan.final[name] = last[_storage(param)]
    return model, plan
