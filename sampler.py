"""Sampling: n completions per prompt with their log-probs, from one of two backends behind one
interface (generate -> Rollouts, sync(model), sleep(), wake()):
  HFSampler    plain PyTorch with a KV cache, using the training model itself; CPU friendly, tested.
  VLLMSampler  a vLLM engine colocated on the GPU, pinned to vllm==0.10.2 (`pip install -e ".[vllm]"`).
vLLM ships CUDA wheels only, so VLLMSampler has never run on the CPU machines this repo is developed
and tested on; vllm is imported inside it, so nothing on the CPU path touches it. Its weight sync uses
the in-process engine path TRL's colocate mode used with 0.10: a newer vLLM may move it, which the
sampler/trainer log-prob canary every RL script logs (train/sampler_gap) would show at once.
The RL scripts' rollout plumbing is here too: rollouts() samples, score_rollouts() runs the verifier,
rollout_batch() turns rows into trainer tensors.
"""
import os
from dataclasses import dataclass

import torch

from common import CountdownError, make_prompt, pack
from verifier import dense_score, score


# ---- the HF backend ------------------------------------------------------------------------------
@dataclass
class Rollouts:
    """n completions per prompt, flattened prompt-major: row i belongs to prompt i // n."""
    prompt_ids: list        # per prompt: token ids
    completion_ids: list    # per row: token ids, EOS included when the completion finished
    logprobs: list          # per row: log-prob of each token under softmax(logits / T), the distribution
                            # that sampled it (T = 0: raw); top-k / top-p not applied (RL uses neither)
    texts: list             # per row: decoded completion without EOS
    finished: list          # per row: stopped at EOS (False = truncated at max_new_tokens)


def _filter_logits(logits, temperature, top_k, top_p):
    """Temperature, then top-k, then top-p (nucleus), as vLLM applies them. (N, V) -> (N, V)."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def _sample(logits, gen):
    """One token per row from softmax(logits) by inverse CDF: one uniform per row, where torch.multinomial
    draws one exponential per vocabulary entry (measured: 8% of all sampling time). (N, V) -> (N,)"""
    cdf = logits.softmax(-1).cumsum(-1)                                                       # (N, V)
    u = torch.rand(len(cdf), 1, generator=gen, device=cdf.device) * cdf[:, -1:]
    return (cdf < u).sum(-1).clamp(max=cdf.shape[-1] - 1)  # the first index whose cdf reaches u


class HFSampler:
    """Plain-PyTorch KV-cache sampling with the training model itself (so sync() has nothing to copy).
    Rows are left-padded and decoded in batches of `batch_size`. Rows that hit EOS leave the batch and its
    KV cache whenever a quarter of it has finished (RL rollouts vary 2-3x in length); the batch stops
    when every row has."""

    def __init__(self, model, tokenizer, batch_size=256):
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size

    def sync(self, model):
        self.model = model

    def sleep(self):  # vLLM frees its GPU memory here; the HF sampler holds none of its own
        pass

    wake = sleep

    @torch.no_grad()
    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024, seed=0):
        prompt_ids = self.tok(prompts, add_special_tokens=False)["input_ids"]
        rows = [p for p in prompt_ids for _ in range(n)]
        gen = torch.Generator(device=self.model.device).manual_seed(seed)
        was_training = self.model.training
        self.model.eval()
        out_ids, out_lp, finished = [], [], []
        for s in range(0, len(rows), self.batch_size):
            for acc, new in zip((out_ids, out_lp, finished), self._batch(rows[s:s + self.batch_size], temperature, top_p,
                                                                        top_k, max_new_tokens, gen)):
                acc += new
        self.model.train(was_training)
        texts = self.tok.batch_decode([[t for t in ids if t != self.tok.eos_token_id] for ids in out_ids])
        return Rollouts(prompt_ids, out_ids, out_lp, texts, finished)

    def _batch(self, rows, temperature, top_p, top_k, max_new_tokens, gen):
        eos, dev = self.tok.eos_token_id, self.model.device
        P = max(map(len, rows))
        ids = torch.tensor([[eos] * (P - len(r)) + r for r in rows], device=dev)                # (b, P)
        attn = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], device=dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
        b = len(rows)
        toks = torch.full((b, max_new_tokens), eos, device=dev)                                 # (b, L)
        lps = torch.zeros(b, max_new_tokens, device=dev)
        lengths = torch.zeros(b, dtype=torch.long, device=dev)
        live = torch.arange(b, device=dev)  # which of the b rows the running batch (and its cache) holds
        active = torch.ones(b, dtype=torch.bool, device=dev)  # live rows that have not produced EOS yet
        for t in range(max_new_tokens):
            logits = out.logits[:, -1]                                                          # (live, V)
            if t == 0 and not torch.isfinite(logits).all():  # a blown-up model: say so, not a sampling error
                raise CountdownError("the model's logits are not finite: its weights have blown up (too large an --lr?)")
            if temperature == 0:
                tok = logits.argmax(-1)
            else:
                tok = _sample(_filter_logits(logits, temperature, top_k, top_p), gen)
            rows_t = live[active]
            toks[rows_t, t] = tok[active]
            tempered = logits[active].float() / (temperature or 1.0)  # the trainer's token_stats(temperature=T)
            lps[rows_t, t] = torch.log_softmax(tempered, -1).gather(-1, tok[active, None])[:, 0]
            lengths[rows_t] += 1
            active = active & (tok != eos)
            if not active.any():
                break
            if active.sum() <= 0.75 * len(live):  # drop finished rows from the batch and its KV cache
                keep = active.nonzero()[:, 0]
                out.past_key_values.batch_select_indices(keep)
                live, tok, attn, pos, active = live[keep], tok[keep], attn[keep], pos[keep], active[keep]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos, past_key_values=out.past_key_values,
                             use_cache=True)
        finished = (toks.gather(1, (lengths - 1)[:, None])[:, 0] == eos).tolist()
        lengths = lengths.tolist()
        return [x[:k] for x, k in zip(toks.tolist(), lengths)], [x[:k] for x, k in zip(lps.tolist(), lengths)], finished


# ---- the vLLM backend (GPU only) -----------------------------------------------------------------
class VLLMSampler:
    """A vLLM engine colocated with the trainer on one GPU, using a share of its memory."""

    def __init__(self, model_dir, tokenizer, gpu_memory_utilization=0.3, max_model_len=2048, seed=0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: weights reachable
        from vllm import LLM
        self.tok = tokenizer
        # processed_logprobs: log-probs after the temperature (before top-k/top-p), like HFSampler's; the
        # default raw mode ignores the temperature, so ρ ≠ 1 at T ≠ 1 (TRL issue 4159; vLLM >= 0.10.2).
        self.llm = LLM(model=model_dir, gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True,
                       dtype="bfloat16", max_model_len=max_model_len, seed=seed, logprobs_mode="processed_logprobs")

    def sync(self, model):
        """Copy the trainer's current weights into the engine (the vLLM 0.10 in-process path TRL uses)."""
        engine_model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        engine_model.load_weights(model.state_dict().items())
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def sleep(self):
        self.llm.sleep(level=1)  # weights to CPU, KV cache freed: the optimizer step gets the memory

    def wake(self):
        self.llm.wake_up()

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024, seed=0):
        from vllm import SamplingParams
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                                max_tokens=max_new_tokens, seed=seed, logprobs=0)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        comps = [c for o in outs for c in o.outputs]
        return Rollouts([list(o.prompt_token_ids) for o in outs], [list(c.token_ids) for c in comps],
                        [[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for c in comps],
                        [c.text for c in comps], [c.finish_reason == "stop" for c in comps])


def make_sampler(backend, model, tokenizer, model_dir, seed=0, max_model_len=2048):
    """`hf`: the training model itself samples. `vllm`: an engine loaded from `model_dir`, synced from the
    trainer before each rollout (GPU only)."""
    if backend == "vllm":
        return VLLMSampler(model_dir, tokenizer, max_model_len=max_model_len, seed=seed)
    if backend != "hf":
        raise CountdownError(f"--backend must be hf or vllm, not {backend!r}")
    return HFSampler(model, tokenizer)


def rollout_batch(ro, rows, pad_id):
    """Rows of a Rollouts as trainer tensors: input_ids, attention_mask, completion mask (b, T), cut to
    these rows' longest, and the sampler's log-probs (b, T-1) aligned with token_stats' outputs."""
    n = len(ro.completion_ids) // len(ro.prompt_ids)
    ids, attn, mask = pack([ro.prompt_ids[r // n] for r in rows], [ro.completion_ids[r] for r in rows], pad_id)
    sel = mask[:, 1:].bool()
    lp = torch.tensor([x for r in rows for x in ro.logprobs[r]], dtype=torch.float32)
    return ids, attn, mask, torch.zeros(sel.shape).masked_scatter(sel, lp)


def rollouts(sampler, model, tokenizer, tasks, n, args, seed):
    """n completions for each task's prompt from `sampler` after syncing it to `model`, with the RL
    scripts' flags (template, max_prompt_len, temperature, max_response_len); top_p 1 and no top_k."""
    prompts = [make_prompt(t["nums"], t["target"], args.template) for t in tasks]
    if max(len(p) for p in tokenizer(prompts, add_special_tokens=False)["input_ids"]) > args.max_prompt_len:
        raise CountdownError(f"a prompt is longer than --max_prompt_len {args.max_prompt_len}")
    sampler.wake()
    sampler.sync(model)
    ro = sampler.generate(prompts, n, args.temperature, 1.0, 0, args.max_response_len, seed)
    sampler.sleep()  # vLLM hands its GPU memory back for the update
    return ro


def score_rollouts(ro, tasks, reward="sparse", wrong_reward=0.1):
    """The verifier on every rollout: exact scores (n·len(tasks),) in {0, 0.1, 1}, for accuracy and format,
    and the training reward (len(tasks), n): the same scores with `wrong_reward` in place of the 0.1 of a
    wrong answer (sparse; paper 000: 0.1), or paper 001's dense partial credit."""
    n = len(ro.texts) // len(tasks)
    row_tasks = [t for t in tasks for _ in range(n)]
    exact = torch.tensor([score(x, t["nums"], t["target"]) for x, t in zip(ro.texts, row_tasks)])
    if reward == "dense":
        return exact, torch.tensor([dense_score(x, t["nums"], t["target"]) for x, t in zip(ro.texts, row_tasks)]).view(-1, n)
    wrong = (exact > 0) & (exact < 1)                                                   # an answer, not the target
    return exact, torch.where(wrong, torch.tensor(wrong_reward), exact).view(-1, n)
