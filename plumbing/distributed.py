"""Data parallelism under `torchrun --nproc_per_node N <script>.py ...`, with PyTorch's own engines:
DDP, or FSDP2's fully_shard with --fsdp. A plain `python <script>.py` never joins a process group,
and everything here is then a no-op: the run is the single process it always was.
  - `distributed()` (prepare_run and load_policy call it): joins the group (NCCL on GPUs, gloo on
    CPUs) and gives the rank its own card.
  - `wrap`, through common.data_parallel, the one visible call after load_policy in each main():
    DDP or fully_shard around common.decoder_states, the forward every loss runs, so each
    backward() averages its gradient over the ranks. Each rank divides its loss by its own share of
    the batch (B/N prompts; SFT: the step's tokens / N), so the average is the whole batch's loss,
    the gradient of one process (tests/test_distributed.py, docs/distributed.md).
  - Each rank takes its contiguous share of a step's prompts (harness.Run.next_indices): whole
    groups for RL, so a group's advantage is computed where its rollouts are. A frozen reference
    or teacher is never wrapped: each rank holds its own copy.
  - The HF sampler draws per prompt (`Draws`): the same global batch and seed sample the same
    rollouts whatever N is.
  - Rank 0 alone prints, logs, evaluates and writes; metrics are reduced over the ranks first."""
import builtins
import contextlib
import dataclasses
import functools
import inspect
import os
import weakref
import zlib

import torch
import torch.distributed as dist

from plumbing.flags import CountdownError

_WRAPPED = weakref.WeakKeyDictionary()  # policy -> its DDP/FSDP wrapper (common.decoder_states)


def distributed():
    """Join torchrun's process group, once; the number of ranks (1 for a plain `python` run). A
    rank but 0 prints nothing from here on."""
    if "RANK" not in os.environ:  # not launched by torchrun
        return 1
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # "cuda" is this rank's card
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if dist.get_rank():
            builtins.print = lambda *args, **kwargs: None
    return dist.get_world_size()


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world():
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier():
    if dist.is_initialized():
        dist.barrier()


class _Forward(torch.nn.Module):
    """What DDP or FSDP wraps: the policy run as common.decoder_states runs it (the decoder, then
    the caller's chunked LM head, which reads the wrapped weights)."""

    def __init__(self, model, forward):
        super().__init__()
        self.model, self.run = model, forward

    def forward(self, *args):
        return self.run(self.model, *args)


def wrap(model, forward, fsdp=False, batch_size=None):
    """Under torchrun, DDP (or FSDP2: each decoder layer, then the rest, sharded over the ranks)
    around `forward(model, ...)`; wrapper(model) finds it, and the model's attributes and
    checkpoints are unchanged. DDP starts every rank from rank 0's weights. `batch_size`: the
    step's, which must split over the ranks. Returns N."""
    if batch_size is not None and batch_size % world():
        raise CountdownError(f"--batch_size {batch_size} does not split over {world()} ranks")
    if not dist.is_initialized():
        return 1
    inner = _Forward(model, forward)
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in model.get_decoder().layers:
            fully_shard(layer)
        fully_shard(inner)
    else:
        # no buffer sync in forward (RoPE's are computed): rank 0's evaluation runs alone
        ddp = torch.nn.parallel.DistributedDataParallel
        quiet = ("forward_sync_buffers" if "forward_sync_buffers" in
                 inspect.signature(ddp).parameters else "broadcast_buffers")  # its 2.13 name
        inner = ddp(inner, device_ids=[torch.cuda.current_device()] if torch.cuda.is_available()
                    else None, **{quiet: False})
    _WRAPPED[model] = inner
    return world()


def wrapper(model):
    return _WRAPPED.get(model)


def fsdp_units(model):
    """The FSDP modules of a policy wrapped with --fsdp (none otherwise)."""
    from torch.distributed.fsdp import FSDPModule
    inner = _WRAPPED.get(model)
    return [] if inner is None else [m for m in inner.modules() if isinstance(m, FSDPModule)]


_GATHERED = weakref.WeakKeyDictionary()  # FSDP wrapper -> how many full_weights blocks are open


def gather(model):
    """Under FSDP, every rank gathers the whole model (all ranks call it together), and no forward
    communicates until release(): a rank decodes as many tokens as its own rows need. Nested calls
    count; nothing to do without FSDP."""
    units = fsdp_units(model)
    if units and _GATHERED.setdefault(units[-1], 0) == 0:
        for m in units:
            m.unshard()
            if m is not units[0]:  # the root (units[0]) keeps its own: whole after a forward
                m.set_reshard_after_forward(False)
    if units:
        _GATHERED[units[-1]] += 1


def release(model):
    units = fsdp_units(model)
    if units and _GATHERED.get(units[-1], 0) > 0:  # (a release with no gather: nothing)
        _GATHERED[units[-1]] -= 1
        if _GATHERED[units[-1]] == 0:
            for m in units:
                m.reshard()
                if m is not units[0]:
                    m.set_reshard_after_forward(True)


@contextlib.contextmanager
def full_weights(model):
    """gather() for the block (sampling, a checkpoint, rank 0's evaluation), then release()."""
    gather(model)
    try:
        yield
    finally:
        release(model)


def full_state(model, opt=None):
    """Under FSDP, the whole model's (and the optimizer's) state on rank 0's CPU, under the plain
    model's names; every rank calls it together. None without FSDP (the model's own is whole)."""
    if not fsdp_units(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, optim = get_state_dict(_WRAPPED[model], [opt] if opt else [], options=options)
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    tied = {}  # tied weights (the embedding and the LM head) one tensor again, as save_pretrained
    for name, p in model.named_parameters(remove_duplicate=False):  # expects them
        if name in weights:
            weights[name] = tied.setdefault(id(p), weights[name])
    return weights, optim


def load_full_state(model, opt, weights, optim):
    """full_state's dicts back into an FSDP model and its optimizer, sharded over the ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    set_state_dict(_WRAPPED[model], [opt], model_state_dict={
        f"model.{k}": v for k, v in weights.items()}, optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True, strict=False))


def on_rank0(fn, model):
    """fn() on rank 0 alone (its evaluation), every rank waiting for it; the others get {}."""
    if not dist.is_initialized():
        return fn()
    with full_weights(model):
        out = fn() if rank() == 0 else {}
        dist.barrier()
    return out


def by_rank0(fn):
    """A decorator: fn(model, ...) as on_rank0 runs it (an evaluation)."""
    @functools.wraps(fn)
    def wrapped(model, *args, **kwargs):
        return on_rank0(lambda: fn(model, *args, **kwargs), model)
    return wrapped


def total(x):
    """x (a number) summed over the ranks."""
    if not dist.is_initialized():
        return x
    t = torch.tensor(float(x), dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def reduce(values, op="mean"):
    """A dict of numbers, each the mean (or max) of its value on every rank."""
    if not dist.is_initialized() or not values:
        return values
    t = torch.tensor([float(v) for v in values.values()], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return dict(zip(values, (t if op == "max" else t / world()).tolist()))


def mean_tensor(t):
    """A tensor's mean over the ranks (a copy)."""
    if not dist.is_initialized():
        return t
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / world()


def gathered(samples, scores, reward, adv, tasks):
    """A step's rollouts, scores (B*G,), rewards (B, G), advantages (B*G,) and tasks over every
    rank, in rank order: the whole batch, for its log (common.rollout_metrics)."""
    if not dist.is_initialized():
        return samples, scores, reward, adv, tasks
    every = [None] * world()
    dist.all_gather_object(every, (samples, scores.cpu(), reward.cpu(), adv.cpu(), tasks))
    fields = [f.name for f in dataclasses.fields(samples)]
    merged = type(samples)(*([x for e in every for x in getattr(e[0], f)] for f in fields))
    return (merged, *(torch.cat([e[i] for e in every]) for i in (1, 2, 3)),
            [t for e in every for t in e[4]])


def prompt_keys(prompts, seed):
    """A 32-bit key per prompt from the seed and its text (a repeated prompt: its k-th copy, k)."""
    seen, keys = {}, []
    for p in prompts:
        seen[p] = seen.get(p, -1) + 1
        keys.append(zlib.crc32(f"{seed}|{seen[p]}|{p}".encode()))
    return keys


def keyed():
    """Whether the HF sampler draws per prompt: under torchrun."""
    return dist.is_initialized()


class Draws:
    """The random numbers of one decode batch: one torch generator (a plain run's), or under
    torchrun a key per row (the seed, the prompt's text and its sample number), hashed with the
    draw's count, so that a row's draws depend on nothing else: any batching and any number of
    ranks sample the same rollouts. keep(rows) follows the rows the batch still holds."""

    def __init__(self, gen=None, keys=None):
        self.gen, self.keys = gen, keys
        self.count = None if keys is None else torch.zeros((), dtype=torch.long,
                                                           device=keys.device)

    @classmethod
    def for_rows(cls, rows, seed, device):
        """Draws for rows (each its prompt's text): keyed under torchrun, else one generator."""
        if not keyed():
            return cls(gen=torch.Generator(device=device).manual_seed(seed))
        return cls(keys=_mix(torch.tensor(prompt_keys(rows, seed), dtype=torch.long)).to(device))

    @staticmethod
    def of(gen):
        """gen itself, or a plain torch generator as Draws."""
        return gen if isinstance(gen, Draws) else Draws(gen=gen)

    def rows(self, s, e):
        return self if self.keys is None else Draws(keys=self.keys[s:e])

    def keep(self, rows):
        if self.keys is not None:
            self.keys = self.keys[rows]

    def uniform(self, n, device):
        """(n,) uniforms in [0, 1), one per row the batch holds."""
        if self.keys is None:
            return torch.rand(n, generator=self.gen, device=device)
        self.count += 1  # in place: a CUDA graph's replay advances it too
        return (_mix(self.keys ^ _mix(self.count)) >> 8).float() * 2.0**-24


def _mix(x):
    """A 32-bit integer hash (xorshift-multiply rounds), in int64 with no overflow: every product
    is of a 32-bit value and a 31-bit constant."""
    x = x & 0xFFFFFFFF
    for c in (0x2C1B3C6D, 0x297A2D39):
        x = ((x ^ (x >> 16)) * c) & 0xFFFFFFFF
    return x ^ (x >> 16)
