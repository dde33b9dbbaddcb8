"""The sampler k steps ahead of the trainer (--async_steps k), as TRL's AsyncGRPOTrainer, verl's
one-step-off-policy recipe and tinker's `sampling_steps_ahead` run RL: the loop hands step t + k's
prompts to the sampler with the weights it has now (version t − 1, the weights after step t − 1),
then takes step t's rollouts, sampled k steps ago by version t − 1 − k (the init for the first
k + 1 steps): k versions behind the π it trains. k = 0: the loop that takes turns, in this process.

k ≥ 1: the HF sampler runs in a process of its own (spawned, `threads` threads, a core of two
taken from the trainer's) while the trainer updates. Weights travel through shared memory, not a
file: a ring of k + 1 copies, version v in slot v mod (k + 1), written when the trainer hands over
the request that needs it. The slot it overwrites held version v − k − 1, whose last request (step
v) the trainer has already taken, so the sampler never reads a slot being written. Each request is
seeded by its step (harness.step_seed), as the loop that takes turns seeds it, so a seed and k give
the same rollouts run to run, and --resume (the finished requests ride in the saved state) goes on
as the uninterrupted run. The process ends with the trainer however it ends: close() on success, a
daemon at an error's exit, Linux's parent-death signal at a kill; a sampler that dies or fails ends
the run with one line."""
import ctypes
import multiprocessing
import os
import queue
import signal
import time
import weakref

import torch

from plumbing import distributed as ranks
from plumbing.flags import CountdownError


class AheadSampler:
    """put(step, tasks, model, version, temperature, seed) hands a step's prompts over; take(step)
    -> (Rollouts, tasks), each row's `versions` the weights that sampled it. `rollouts`:
    common.rollouts; `options`: its arguments after the temperature (group size, template, prompt
    and token budgets, bottom-p) and the decode loop."""

    def __init__(self, k, sampler, rollouts, model, tok, options, threads=1, pending=None):
        self.k, self.sampler, self.rollouts, self.tok, self.options = (k, sampler, rollouts, tok,
                                                                       options)
        self.asked, self.done = {}, {}  # step -> (tasks, version); step -> (Rollouts, times)
        for step, tasks, version, samples, times in pending or ():  # --resume: finished requests
            self.asked[step], self.done[step] = (tasks, version), (samples, times)
        self.proc = None
        if k == 0:
            return
        where = next(model.parameters()).device.type
        if where != "cpu" or ranks.world() > 1:
            on = "under torchrun" if where == "cpu" else f"on {where}"
            raise CountdownError(f"--async_steps {k} {on}: the sampler runs ahead with --backend "
                                 f"hf on a CPU, in one process; use --async_steps 0")
        names = [n for n, _ in model.named_parameters()]
        self.slots = [{n: p.detach().float().clone().share_memory_() for n, p in
                       model.named_parameters()} for _ in range(k + 1)]  # the ring of weights
        self.written = {}  # slot -> the version it holds
        ctx = multiprocessing.get_context("spawn")  # a forked OpenMP runtime can hang
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=serve, daemon=True, args=(  # the sampler's class and
            os.getpid(), type(sampler), rollouts, model.config, names, self.slots, tok, options,
            threads, self.inbox, self.outbox))  # common.rollouts travel by name, not copied
        self.proc.start()
        # an error or a NaN stop: ended when this object goes (or the interpreter exits)
        self.stop = weakref.finalize(self, stop, self.proc, self.inbox)
        self.threads = torch.get_num_threads()  # the trainer's, back at close()
        torch.set_num_threads(max(1, self.threads - threads))  # the trainer's share

    def due(self, step, last, draw=0):
        """The steps whose prompts the loop hands over at `step`: itself at k = 0 (again for
        grpo.py's refill `draw`s); at a run's first step every one of step .. step + k not yet
        asked, then step + k; none past `last`."""
        if draw:
            return [step]
        return [s for s in range(step, min(step + self.k, last) + 1) if s not in self.asked]

    def put(self, step, tasks, model, version, temperature, seed):
        """Hand step's prompts to the sampler with `model`'s weights, version `version`, and the
        step's seed (harness.step_seed: the loop that takes turns seeds it so)."""
        self.asked[step] = (tasks, version)
        if self.k == 0:  # sampled in take(), in this process, with the weights then (the same)
            self.model, self.temperature, self.seed = model, temperature, seed
            return
        slot = version % (self.k + 1)
        if self.written.get(slot) != version:  # the slot's last reader (step version) is done
            for n, p in model.named_parameters():
                self.slots[slot][n].copy_(p.detach())
            self.written[slot] = version
        self.inbox.put((step, tasks, temperature, slot, seed))

    def take(self, step):
        """Step's rollouts and tasks: sampled now (k = 0) or waited for (the sampler's order is the
        steps' order)."""
        tasks, version = self.asked[step]
        if self.k == 0:
            o = self.options
            samples = self.rollouts(self.sampler, self.model, self.tok, tasks, o["n"],
                                    o["template"], o["max_prompt_len"], self.temperature,
                                    o["max_new_tokens"], self.seed, o["bottom_p"],
                                    o["bottom_p_freq"])
            self.done[step] = (samples, {})
        while step not in self.done:
            self.receive()
        samples, times = self.done[step]
        samples.versions = [version] * len(samples.completion_ids)
        return samples, tasks

    def receive(self):
        """The sampler's next finished request; one line if it failed or died."""
        try:
            msg = self.outbox.get(timeout=1.0)
        except queue.Empty:
            if not self.proc.is_alive():
                raise CountdownError(f"the sampler process died (exit code {self.proc.exitcode}); "
                                     f"--resume goes on from the last saved state") from None
            return
        if msg[0] == "error":
            raise CountdownError(f"the sampler process failed: {msg[1]}")
        step, samples, times = msg
        self.done[step] = (samples, times)

    def metrics(self, step):
        """train/staleness: versions between the weights that sampled step's rollouts and the ones
        it trains (step − 1); time/sampler_wait: how long the sampler idled before the request (for
        the trainer's next weights), time/sampler_busy: how long it sampled (k ≥ 1)."""
        tasks, version = self.asked.pop(step)
        samples, times = self.done.pop(step)
        return {"train/staleness": step - 1 - version, **times}

    def state(self):
        """The finished and in-flight requests (waited for), for a saved state: --resume takes them
        as the uninterrupted run would have."""
        for step in self.asked:
            while step not in self.done:
                self.receive()
        return [(s, *self.asked[s], self.done[s][0], self.done[s][1]) for s in sorted(self.asked)]

    def close(self):
        if self.proc is not None:
            self.stop()
            torch.set_num_threads(self.threads)
        self.proc = None


def stop(proc, inbox):
    """Ask the sampler process to end, then make sure it has."""
    if proc.is_alive():
        inbox.put(None)
        proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()


def die_with_parent(parent):
    """End this process when its parent ends, even by SIGKILL (Linux's parent-death signal; then a
    check that the parent had not gone before it was set)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def serve(parent, sampler_class, rollouts, config, names, slots, tok, options, threads, inbox,
          outbox):
    """The sampler process: for each request, the model's weights pointed at the request's slot,
    then `rollouts` (common.rollouts) as the loop that takes turns calls it."""
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_config(config).eval()
        params = dict(model.named_parameters())
        sampler = sampler_class(model, tok, decode=options["decode"])
        while True:
            t0 = time.time()
            request = inbox.get()
            if request is None:
                return
            step, tasks, temperature, slot, seed = request
            t1 = time.time()
            for n in names:  # no copy: the slot's shared tensors are the model's weights
                params[n].data = slots[slot][n]
            samples = rollouts(sampler, model, tok, tasks, options["n"], options["template"],
                               options["max_prompt_len"], temperature, options["max_new_tokens"],
                               seed, options["bottom_p"], options["bottom_p_freq"])
            outbox.put((step, samples, {"time/sampler_wait": t1 - t0,
                                        "time/sampler_busy": time.time() - t1}))
    except Exception as e:  # noqa: BLE001 one line for the trainer to print
        outbox.put(("error", f"{type(e).__name__}: {e}"))
