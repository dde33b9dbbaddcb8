"""Which training path is fastest on this machine, measured, not guessed from its CPU flags:
run_cpu.sh runs this once before its first stage. It times the pipeline's two kinds of training
step on the model itself, in bf16 autocast and in fp32, interleaved, in ~15 s:
  an SFT step   4 micro-batches of 16 rows x 128 tokens, forward and backward, on every core;
  an RL update  8 micro-batches of 32 rollouts x 150 tokens, forward and backward plus a frozen
                model's forward (GRPO's reference, OPD's teacher), on a core: RL stages run side
                by side, a core or so each,
and keeps the precision that makes the pipeline's steps (700 SFT, 300 RL by default) the
shortest. Why measure: on a 2-core Intel Xeon with AMX, bf16 made the SFT step slower (0.638 s
against fp32's 0.539) where the flags said bf16; on a 2-core AMD EPYC with AVX512-BF16 it made
it faster (0.59 against 0.72; docs/studies/performance.md). Not probed, with reasons:
  torch.compile  its first compile takes 1.5-2 min, more than the probe's budget, and it did not
                 pay back over 1,000 SFT steps on either CPU measured (COMPILE=1
                 ./run_cpu.sh compiles the SFT stage anyway);
  sampling       fp32 on every CPU (common.autocast); its CPU loop is fast_decode's `dynamic`,
                 the only one that drops finished rows (`static` exists for CUDA graphs).
COUNTDOWN_CPU_BF16=0 or 1 set by the user wins, and nothing is timed. It writes OUT (a line
run_cpu.sh sources: `export COUNTDOWN_CPU_BF16=1`) and prints one line with the numbers:

  python -m plumbing.machine --init out/cpu/base --cores 2 --out out/cpu/path.env
"""
import argparse
import os
import time

import torch

SHAPES = {"sft": (16, 128), "rl": (32, 150)}  # (rows, tokens) a micro-batch, as run_cpu.sh's
MICRO = {"sft": 4, "rl": 8}  # micro-batches a step: 64 SFT rows, 32 prompts x 8 rollouts


def micro_step(model, frozen, ids, bf16):
    """One training micro-batch as common.autocast runs it: in bf16 the trained model's attention
    is eager (the CPU's fused attention is slow in bf16 backward), a frozen one keeps the fused
    one; in fp32 both fused."""
    model.set_attn_implementation("eager" if bf16 else "sdpa")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        if frozen is not None:
            with torch.no_grad():
                frozen(input_ids=ids)
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure(model, frozen, cores, rl_threads, budget_s=20.0):
    """Seconds of an SFT step and an RL update {("sft"|"rl", bf16): s}: the median of rounds that
    alternate the candidates after a warm-up round (oneDNN builds its kernels on first use), as
    many as `budget_s` allows, at least one. A candidate 2x slower than the other in the warm-up
    (bf16 where the CPU emulates it: 10x) is timed no more: it cannot win."""
    vocab = model.config.vocab_size
    sft_ids, rl_ids = (torch.randint(vocab, SHAPES[kind]) for kind in ("sft", "rl"))
    times, start, rounds, left = {}, time.perf_counter(), 0, [True, False]
    while rounds < 2 or (rounds < 5 and time.perf_counter() - start < budget_s / 2):
        for bf16 in left:
            for kind, ids, other, threads in (("sft", sft_ids, None, cores),
                                              ("rl", rl_ids, frozen, rl_threads)):
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                micro_step(model, other, ids, bf16)
                seconds = MICRO[kind] * (time.perf_counter() - t0)
                times[kind, bf16] = [seconds] if rounds == 1 else times.get((kind, bf16), []) + [
                    seconds]  # the warm-up's time is kept only until round 1's
        if rounds == 0:
            warm = {b: times["sft", b][0] + times["rl", b][0] for b in left}
            left = [b for b in left if warm[b] < 2 * min(warm.values())]
        rounds += 1
    torch.set_num_threads(cores)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def choose(times, sft_steps, rl_steps):
    """bf16 or not, and each path's training seconds: sft_steps SFT steps + rl_steps RL updates."""
    total = {bf16: sft_steps * times["sft", bf16] + rl_steps * times["rl", bf16]
             for bf16 in (True, False)}
    return total[True] < total[False], total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--init", required=True, help="the pipeline's base model (its shapes are timed)")
    p.add_argument("--cores", type=int, default=torch.get_num_threads())
    p.add_argument("--out", required=True, help="the file run_cpu.sh sources")
    p.add_argument("--sft_steps", type=int, default=700)
    p.add_argument("--rl_steps", type=int, default=300, help="RL updates of all RL stages")
    args = p.parse_args(argv)
    set_by_user = os.environ.get("COUNTDOWN_CPU_BF16") in ("0", "1")
    if set_by_user:
        bf16 = os.environ["COUNTDOWN_CPU_BF16"] == "1"
        line = f"{'bf16' if bf16 else 'fp32'}, as COUNTDOWN_CPU_BF16 says (not measured)"
    else:
        from plumbing.harness import frozen_copy
        from plumbing.models import load_model
        t0 = time.perf_counter()
        model, _ = load_model(args.init)
        model.train()
        rl_threads = max(1, args.cores // 2)
        times = measure(model, frozen_copy(model), args.cores, rl_threads)
        bf16, total = choose(times, args.sft_steps, args.rl_steps)
        line = (f"{'bf16' if bf16 else 'fp32'}, the faster here (measured in "
                f"{time.perf_counter() - t0:.0f} s: an SFT step {times['sft', True]:.2f} s in bf16, "
                f"{times['sft', False]:.2f} s in fp32 on {args.cores} threads; an RL update "
                f"{times['rl', True]:.2f} / {times['rl', False]:.2f} s on {rl_threads}; "
                f"{args.sft_steps} + {args.rl_steps} of them: {total[True] / 60:.1f} / "
                f"{total[False] / 60:.1f} min)")
    print(f"== training forwards in {line}; sampling in fp32; SFT compiled only with COMPILE=1",
          flush=True)
    with open(args.out + ".tmp", "w") as f:
        f.write(f"# {line}\nexport COUNTDOWN_CPU_BF16={int(bf16)}\n")
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
