"""Which training path is fastest on this machine, measured, not guessed from its CPU flags:
run_cpu.sh runs this once before its first stage. It times the pipeline's two kinds of training
step on the base model itself, in bf16 autocast and in fp32, interleaved, in ~15 s:
  an SFT step   micro-batches shaped as the SFT stage's own steps (its flags after `--`: its
                traces, its micro-batches), forward and backward, on every core;
  an RL update  8 micro-batches of 32 rollouts x 126-166 tokens, forward and backward plus a
                frozen model's forward (GRPO's reference, OPD's teacher), on a core: RL stages
                run side by side, a core or so each,
and keeps, for each kind, the precision whose step is the shorter: the two can differ. On a
2-core Intel Xeon with AMX the SFT stage's step took 0.72-0.78 s in bf16 against 0.44-0.47 in
fp32, its RL updates 3.80 s in bf16 against 4.27; on a 2-core AMD EPYC with AVX512-BF16 bf16 was
the faster for both (docs/studies/performance.md). Each round takes new shapes, as a stage's
steps do: on that Xeon one SFT batch timed over and over ranked bf16 first (0.39 s against 0.42),
the stage's successive batches fp32 (0.60 against 0.45).
Not probed, with reasons:
  torch.compile  its first compile takes 1.5-2 min, more than the probe's budget, and it did not
                 pay back over 1,000 SFT steps on either CPU measured (COMPILE=1
                 ./run_cpu.sh compiles the SFT stage anyway);
  sampling       fp32 on every CPU (common.autocast); its CPU loop is fast_decode's `dynamic`,
                 the only one that drops finished rows (`static` exists for CUDA graphs).
COUNTDOWN_CPU_BF16=0 or 1 set by the user wins for both, and nothing is timed. It writes OUT, which
run_cpu.sh sources (`export COUNTDOWN_CPU_BF16=1`: the RL and IPO stages' precision;
`export SFT_CPU_BF16=0`: the sft.py stages'), and prints one line with the numbers:

  python -m plumbing.machine --init out/cpu/base --cores 2 --out out/cpu/path.env -- SFT_FLAGS
"""
import argparse
import os
import random
import sys
import time

import torch

from plumbing.tasks import LLM_MISTAKES, parse_mixes, sft_data

RL_ROWS, RL_MICRO = 32, 8  # rollouts a micro-batch, 8 of them a step: 32 prompts x 8
RL_LENGTHS = (150, 134, 166, 142, 158, 126)  # tokens a rollout, a round's (a stage's vary)

# sft.py's flags that shape its steps, with its defaults (tests/test_pipeline.py holds them equal)
SFT_FLAGS = (("data", str, None), ("template", str, "base"), ("seed", int, 0),
             ("batch_size", int, 512), ("micro_batch", int, 64), ("micro_batch_tokens", int, 16384),
             ("eval_problems", int, 200), ("dead_ends", float, 0.0), ("near_misses", float, 0.0),
             ("strategies", str, "random"), ("mistakes", str, LLM_MISTAKES))


def micro_step(model, frozen, ids, attn, bf16):
    """One training micro-batch as common.autocast runs it: in bf16 the trained model's attention
    is eager (the CPU's fused attention is slow in bf16 backward), a frozen one (GRPO's reference,
    OPD's teacher) keeps the fused one; in fp32 both fused. attn: (rows, T) right padding."""
    model.set_attn_implementation("eager" if bf16 else "sdpa")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=ids, attention_mask=attn).logits.float().logsumexp(-1).mean()
        if frozen is not None:
            with torch.no_grad():
                frozen(input_ids=ids, attention_mask=attn)
    loss.backward()
    model.zero_grad(set_to_none=True)


def sft_shapes(tok, flags, n):
    """The row lengths of the SFT stage's first n steps' micro-batches, from its flags (sft.py's
    that shape them; the defaults are sft.py's): its traces of its training problems, tokenized,
    sorted and cut at --micro_batch rows and --micro_batch_tokens padded tokens as sft.py cuts
    them (common.spans)."""
    p = argparse.ArgumentParser()
    for name, kind, default in SFT_FLAGS:
        p.add_argument(f"--{name}", type=kind, default=default)
    args = p.parse_known_args(flags)[0]
    mix, mistakes = parse_mixes(args.strategies, args.mistakes)
    prompts, write = sft_data(args.data, "train", n * args.batch_size, args.template,
                              args.eval_problems, args.dead_ends, args.near_misses, mix=mix,
                              mistakes=mistakes)
    texts = [q + r for q, r in zip(prompts, write(random.Random(args.seed)))]
    lengths = [len(x) + 1 for x in tok(texts, add_special_tokens=False)["input_ids"]]  # + EOS
    steps = []
    for i in range(0, n * args.batch_size, args.batch_size):
        micro = [[]]
        for k in sorted(lengths[i:i + args.batch_size]):
            if micro[-1] and (len(micro[-1]) == args.micro_batch
                              or (len(micro[-1]) + 1) * k > args.micro_batch_tokens):
                micro.append([])
            micro[-1].append(k)
        steps.append(micro)
    return steps


def sft_step(model, micro, bf16):
    """One SFT step of micro-batches of these row lengths, random tokens (their values do not
    move the time), every core."""
    for rows in micro:
        T = max(rows)
        attn = (torch.arange(T)[None] < torch.tensor(rows)[:, None]).long()  # (rows, T)
        micro_step(model, None, torch.randint(model.config.vocab_size, attn.shape), attn, bf16)


def rl_step(model, frozen, T, bf16):
    """One RL micro-batch of RL_ROWS rollouts of T tokens with a frozen model's forward."""
    ids = torch.randint(model.config.vocab_size, (RL_ROWS, T))
    micro_step(model, frozen, ids, torch.ones_like(ids), bf16)


def measure(model, frozen, sft_steps, cores, rl_threads, budget_s=20.0):
    """Seconds of an SFT step and an RL update {("sft"|"rl", bf16): s}: the median of rounds that
    alternate the candidates after a warm-up round, as many as `budget_s` allows (at most
    len(sft_steps) - 1), at least one. Each round brings new shapes, as a stage's steps do: round r
    runs `sft_steps[r]` (sft_shapes) and RL rows of RL_LENGTHS[r] tokens (one shape
    repeated ranked bf16 first for SFT on a Xeon with AMX, the stage's steps fp32). The warm-up
    round is not counted (oneDNN builds kernels on first use). A candidate 2x slower than the
    other in the warm-up (bf16 where the CPU emulates it: 10x) is timed no more: it cannot win."""
    steps = {"sft": (lambda r, bf16: sft_step(model, sft_steps[r], bf16), cores, 1),
             "rl": (lambda r, bf16: rl_step(model, frozen, RL_LENGTHS[r], bf16), rl_threads,
                    RL_MICRO)}
    times, start, rounds = {}, time.perf_counter(), 0
    left = {kind: [True, False] for kind in steps}
    last = min(len(sft_steps), len(RL_LENGTHS))
    while rounds < 2 or (rounds < last and time.perf_counter() - start < budget_s / 2):
        for kind, (step, threads, repeat) in steps.items():
            torch.set_num_threads(threads)
            for bf16 in left[kind]:
                t0 = time.perf_counter()
                step(rounds, bf16)
                seconds = repeat * (time.perf_counter() - t0)
                # the warm-up's time is kept only until round 1's
                times[kind, bf16] = [seconds] if rounds == 1 else times.get((kind, bf16), []) + [
                    seconds]
            if rounds == 0:
                fastest = min(times[kind, b][0] for b in left[kind])
                left[kind] = [b for b in left[kind] if times[kind, b][0] < 2 * fastest]
        rounds += 1
    torch.set_num_threads(cores)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def choose(times):
    """{"sft"|"rl": bf16 or not}: each kind's faster precision."""
    return {kind: times[kind, True] < times[kind, False] for kind in ("sft", "rl")}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--init", required=True, help="the pipeline's base model (its shapes are timed)")
    p.add_argument("--cores", type=int, default=torch.get_num_threads())
    p.add_argument("--out", required=True, help="the file run_cpu.sh sources")
    args, sft_flags = p.parse_args(argv[:cut]), argv[cut + 1:]
    user = os.environ.get("COUNTDOWN_CPU_BF16")
    if user in ("0", "1"):
        bf16 = {"sft": user == "1", "rl": user == "1"}
        line = f"{'bf16' if user == '1' else 'fp32'}, as COUNTDOWN_CPU_BF16 says (not measured)"
    else:
        from plumbing.harness import frozen_copy
        from plumbing.models import load_model
        t0 = time.perf_counter()
        model, tok = load_model(args.init)
        model.train()
        rl_threads = max(1, args.cores // 2)
        times = measure(model, frozen_copy(model), sft_shapes(tok, sft_flags, len(RL_LENGTHS)),
                        args.cores, rl_threads)
        bf16 = choose(times)

        def said(kind, what, threads):
            b = bf16[kind]
            return (f"{kind.upper()} in {'bf16' if b else 'fp32'} ({what} {times[kind, b]:.2f} s, "
                    f"{times[kind, not b]:.2f} in {'fp32' if b else 'bf16'}, {threads} thread"
                    f"{'s' * (threads > 1)})")
        line = (f"{said('sft', 'a step', args.cores)}, {said('rl', 'an update', rl_threads)}: "
                f"the faster here, measured in {time.perf_counter() - t0:.0f} s")
    print(f"== training forwards: {line}; sampling in fp32; SFT compiled only with COMPILE=1",
          flush=True)
    with open(args.out + ".tmp", "w") as f:
        f.write(f"# {line}\nexport COUNTDOWN_CPU_BF16={int(bf16['rl'])}\n"
                f"export SFT_CPU_BF16={int(bf16['sft'])}\n")
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
