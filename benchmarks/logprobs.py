"""Peak memory and time of per-token log-probs at Qwen2.5-0.5B's head size (H 896, V 151,936):
the naive `log_softmax(logits.float()).gather(...)` vs logprobs.token_stats' chunked path.

Each variant runs in a fresh process and reports its peak RSS above what the inputs already took, so
the numbers are the extra memory the log-prob computation itself needs. CPU, fp32.

  python benchmarks/logprobs.py                     # B=8, T=1024 (the numbers in the README)
  python benchmarks/logprobs.py --B 2 --T 256        # a quick look
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from logprobs import token_stats  # noqa: E402


class HeadOnly(torch.nn.Module):
    """Stands in for a causal LM whose last hidden states are already computed: the benchmark
    isolates the lm_head + log-softmax part, which is where the B x T x V tensor appears."""

    def __init__(self, hidden, vocab):
        super().__init__()
        self.hidden = hidden
        self.lm_head = torch.nn.Linear(hidden.shape[-1], vocab, bias=False)

    def get_decoder(self):
        return lambda input_ids, attention_mask: SimpleNamespace(last_hidden_state=self.hidden)

    def get_output_embeddings(self):
        return self.lm_head


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_one(variant, B, T, H, V, chunk, backward):
    torch.manual_seed(0)
    hidden = torch.randn(B, T, H, requires_grad=backward)
    model = HeadOnly(hidden, V)
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    base = peak_mb()
    t = time.perf_counter()
    with torch.set_grad_enabled(backward):
        if variant == "naive":
            logits = model.lm_head(hidden)[:, :-1]                                    # (B, T-1, V)
            logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        else:
            logp = token_stats(model, ids, mask, mask, chunk_size=chunk)["logp"]
        if backward:
            logp.sum().backward()
    return {"variant": variant, "seconds": round(time.perf_counter() - t, 2), "peak_extra_mb": round(peak_mb() - base)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--H", type=int, default=896)
    p.add_argument("--V", type=int, default=151_936)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--backward", action="store_true", help="also time the backward pass")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant:  # child process
        print(json.dumps(run_one(a.variant, a.B, a.T, a.H, a.V, a.chunk, a.backward)))
        return
    results = {}
    for variant in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--variant", variant] + sys.argv[1:]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
        print(results[variant], flush=True)
    n, c = results["naive"], results["chunked"]
    print(f"B={a.B} T={a.T} V={a.V} chunk={a.chunk} backward={a.backward}: peak memory {n['peak_extra_mb']} MB -> "
          f"{c['peak_extra_mb']} MB ({n['peak_extra_mb'] / max(c['peak_extra_mb'], 1):.1f}x less), time "
          f"{n['seconds']} s -> {c['seconds']} s ({c['seconds'] / n['seconds']:.2f}x)")


if __name__ == "__main__":
    main()
