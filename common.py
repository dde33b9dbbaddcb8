"""The helpers every algorithm's step calls, in the order a step uses them. Read top to bottom:
  1. Sampling, one interface (generate -> Rollouts, sync, sleep, wake), two backends: HFSampler
     (the training model samples; its plain loop over transformers' cache is here, its fast twin
     in plumbing/fast_decode.py) and VLLMSampler (an engine in this process, vllm 0.32.0).
  2. Which problems a step draws (paper 001's curriculum, paper 002's filter and its probe), then
     the batch: rollouts() samples it (take_groups: groups of several), score_rollouts() scores it.
  3. The training forward: micro-batches with masks, the precision (autocast), and chunked
     log-probs, entropy and KL, so no (B, T, V) logits tensor ever exists (token_stats,
     decoder_states; on a CPU each prompt runs once for its group: plumbing/shared_prompts.py).
  4. Three pieces the losses share (k3_kl, behavior_logp, mix_reference); the log (rollout_metrics).
Nothing here knows one algorithm; plumbing/ holds what a step never needs read."""
import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from plumbing import fast_decode
from plumbing.distributed import (Draws, fsdp_units, gather, gathered, keyed, prompt_keys, release,
                                  wrap, wrapper)
from plumbing.flags import CountdownError
from plumbing.harness import step_seed
from plumbing.models import cache_name, causal_only, cpu_attention_on, trains_in_bf16
from plumbing.models import decode_precision as _decode_precision
from plumbing.shared_prompts import group_chunks, group_prompts, shared_states, spans
from plumbing.tasks import load_tasks, solve_rates, tiers
from plumbing.traces import mistake_shares, strategy_metrics, strategy_stats
from plumbing.vllm_engine import Engine
from verifier import dense_score, make_prompt, score


# ---- sampling, the HF backend --------------------------------------------------------------------
@dataclass
class Rollouts:
    """n completions per prompt, flattened prompt-major: row i belongs to prompt i // n."""
    prompt_ids: list        # per prompt: token ids
    completion_ids: list    # per row: token ids, EOS included when the completion finished
    logprobs: list          # per row: each token's log-prob under softmax(logits / T), the
                            # distribution that sampled it (T = 0: raw), before top-k / top-p
    texts: list             # per row: decoded completion without EOS
    finished: list          # per row: stopped at EOS (False = truncated at max_new_tokens)
    versions: list = field(default_factory=list)  # per row: the weights' version that sampled it


def _filter_logits(logits, temperature, top_k, top_p, bottom_p=1.0, explore=None):
    """Temperature, then top-k, then top-p (nucleus), as vLLM applies them; then paper 002 §5.2's
    bottom-p on the rows `explore` (N,) marks (None: all): the mirror of top-p, it drops the most
    likely tokens that together hold at most 1 − bottom_p of what top-p kept. The token that
    crosses that mass always stays, so at least one does. (N, V) -> (N, V)."""
    logits = logits.float() / temperature
    V = logits.shape[-1]
    if 0 < top_k < V or top_p < 1.0:
        # the candidates in descending order: the top k, else all V (top-p within the k sorts k
        # values: 0.6 ms a step at 256 rows, 2.7 sorting the vocabulary; a tie at the k-th keeps k)
        vals, idx = logits.topk(top_k, -1) if 0 < top_k < V else logits.sort(-1, descending=True)
        if top_p < 1.0:  # keep the smallest prefix whose mass reaches top_p
            probs = vals.softmax(-1)  # (N, k or V)
            vals = vals.masked_fill(probs.cumsum(-1) - probs > top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, vals)
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
    u = Draws.of(gen).uniform(len(cdf), cdf.device)[:, None] * cdf[:, -1:]  # (N, 1)
    return torch.searchsorted(cdf, u)[:, 0].clamp(max=cdf.shape[-1] - 1)  # first cdf ≥ u


class HFSampler:
    """Sampling with the training model itself (so sync() has nothing to copy), in batches of
    `batch_size` rows. `decode` picks the loop (DECODE; None: the faster on this device):
      plain    _batch below, the one to read: the transformers model's forward once per token over
               its own KV cache;
      dynamic  (a CPU's default) its fast twin in plumbing/fast_decode.py, the same tokens and
               log-probs (tests/test_sampler.py), 1.6-1.9x the plain loop's tokens/s;
      static, graph  (a GPU's default: graph) the fast twin at fixed shapes, a CUDA graph.
    1,024 rows a batch (the tiny model's evaluation: 22,200 tokens/s on 2 CPU cores, 17,000 in
    batches of 256). On a GPU: bf16 (_decode_precision), and a batch only the rows whose KV cache
    fits `kv_budget` bytes (default a quarter of the card; fast_decode.rows_per_batch)."""

    DECODE = ("plain", "dynamic", "static", "graph")

    def __init__(self, model, tokenizer, batch_size=1024, kv_budget=None, decode=None):
        if batch_size < 1:
            raise CountdownError(f"--batch_size (rows decoded together) must be at least 1, not "
                                 f"{batch_size}")
        if decode not in (None, *self.DECODE):
            raise CountdownError(
                f"--decode must be one of auto, {', '.join(self.DECODE)}; not {decode!r}")
        self.model, self.tok, self.batch_size, self.decode = model, tokenizer, batch_size, decode
        self.kv_budget = kv_budget  # None: a quarter of a GPU; batch_size alone on a CPU

    def decode_mode(self):  # `decode`, else the faster loop on the model's device
        return fast_decode.decode_mode(self.model.device, self.decode)

    def rows_per_batch(self, slots):  # batch_size, or fewer where their KV cache passes kv_budget
        return fast_decode.rows_per_batch(self.model, self.batch_size, self.kv_budget, slots)

    def sync(self, model):  # the training model itself samples: nothing to copy
        self.model = model

    def wake(self):  # under FSDP: the whole model on every rank until sleep() (distributed.gather)
        gather(self.model)

    def sleep(self):  # vLLM frees its GPU memory here; the HF sampler, FSDP's gathered weights
        release(self.model)

    @torch.no_grad()
    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024,
                 seed=0, bottom_p=1.0, bottom_p_freq=1.0, seed_requests=True, progress=None):
        """One generator seeded by `seed` serves the call (`seed_requests` is vLLM's); bottom_p < 1:
        002's bottom-p on a token with probability bottom_p_freq; progress(rows) after a batch."""
        prompt_ids = self.tok(prompts, add_special_tokens=False)["input_ids"]
        rows = [p for p in prompt_ids for _ in range(n)]
        # one generator for the call; under torchrun a key per prompt (distributed.Draws)
        draws = Draws.for_rows([p for p in prompts for _ in range(n)], seed, self.model.device)
        was_training = self.model.training
        self.model.eval()
        out_ids, out_lp, finished = [], [], []
        size = self.rows_per_batch(max(map(len, rows), default=0) + max_new_tokens)
        mode = self.decode_mode()
        # the plain loop, or the fast twin handed this file's token picker
        batch = self._batch if mode == "plain" else fast_decode.batch_loop(
            mode, self.model, self.tok.eos_token_id, _pick)
        # one autocast around every batch: a graph reads the bf16 copies of the weights that
        # autocast cached in it, freed when it ends
        with _decode_precision(self.model.device):
            for s in range(0, len(rows), size):
                for acc, new in zip((out_ids, out_lp, finished), batch(
                        rows[s:s + size], temperature, top_p, top_k, max_new_tokens,
                        draws.rows(s, s + size), bottom_p, bottom_p_freq)):
                    acc += new
                if progress:
                    progress(len(rows[s:s + size]))
        self.model.train(was_training)
        texts = self.tok.batch_decode([[t for t in ids if t != self.tok.eos_token_id]
                                       for ids in out_ids])
        return Rollouts(prompt_ids, out_ids, out_lp, texts, finished)

    def _batch(self, rows, temperature, top_p, top_k, max_new_tokens, gen, bottom_p,
               bottom_p_freq):
        """The plain loop: the transformers model's forward once per token over its own KV cache,
        rows (prompt token ids) left-padded. Whenever a quarter of the batch has sampled EOS, the
        finished rows leave it and its cache. Returns each row's (tokens, log-probs, finished)."""
        eos, dev, cache = self.tok.eos_token_id, self.model.device, cache_name(self.model)
        P, b, L = max(map(len, rows)), len(rows), max_new_tokens
        ids = torch.tensor([[eos] * (P - len(r)) + r for r in rows], device=dev)  # (b, P)
        attn = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], device=dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (b, P) a row's first real token is at 0
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1)
        if not torch.isfinite(out.logits).all():  # a blown-up model: say so, not a sampling error
            raise CountdownError("the model's logits are not finite: its weights have blown up")
        toks = torch.full((b, L), eos, device=dev)  # (b, L) by row; EOS after a row's end
        lps = torch.zeros(b, L, device=dev)
        n_new = torch.zeros(b, dtype=torch.long, device=dev)  # tokens each row has, EOS included
        live = torch.arange(b, device=dev)  # which of the b rows the batch (and cache) holds
        active = torch.ones(b, dtype=torch.bool, device=dev)  # live rows without an EOS yet
        for t in range(L):
            logits = out.logits[:, -1]                                                 # (live, V)
            tok = _pick(logits, temperature, top_p, top_k, gen, bottom_p, bottom_p_freq)  # (live,)
            # its log-prob under softmax(logits / T): the trainer's token_stats(temperature=T)
            lp = torch.log_softmax(logits.float() / (temperature or 1.0), -1)            # (live, V)
            rows_t = live[active]  # a finished row drew too (its draw is thrown away)
            toks[rows_t, t] = tok[active]
            lps[rows_t, t] = lp.gather(-1, tok[:, None])[active, 0]
            n_new[rows_t] += 1
            active &= tok != eos
            n_active = int(active.sum())  # the step's one host sync
            if n_active == 0 or t == L - 1:
                break
            if n_active <= 0.75 * len(live):  # drop finished rows from the batch and its cache
                keep = active.nonzero()[:, 0]
                out[cache].batch_select_indices(keep)
                live, tok, active, attn, pos = (x[keep] for x in (live, tok, active, attn, pos))
                gen.keep(keep)
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)  # (live, P + t + 1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                             use_cache=True, **{cache: out[cache]})
        finished = (toks.gather(1, (n_new - 1)[:, None])[:, 0] == eos).tolist()
        n_new = n_new.tolist()  # each row cut after its EOS
        return [x[:k] for x, k in zip(toks.tolist(), n_new)], [
            x[:k] for x, k in zip(lps.tolist(), n_new)], finished


def _pick(logits, temperature, top_p, top_k, gen, bottom_p, bottom_p_freq):
    """The next token of each row of logits (N, V): argmax at T = 0, else a draw from the filtered
    distribution; bottom-p's coin flips come from `gen` first, then the draw. (N,)"""
    if temperature == 0:
        return logits.argmax(-1)
    explore = None  # which rows cut their head this token (drawn only if bottom-p is on)
    if bottom_p < 1.0:
        explore = Draws.of(gen).uniform(len(logits), logits.device) < bottom_p_freq
    return _sample(_filter_logits(logits, temperature, top_k, top_p, bottom_p, explore), gen)


# ---- sampling, the vLLM backend ------------------------------------------------------------------
class VLLMSampler(Engine):
    """A vLLM engine in the trainer's process (its management: plumbing/vllm_engine.py), whose
    samples are the trainer's (tests/test_vllm.py): prompts go in as the trainer's token ids, or as
    text (`text_prompts`: vLLM's own tokenizer, the same ids); evaluation seeds prompt i with
    seed + i·n (one shared seed sampled a repeated prompt's same completion), RL rollouts
    (seed_requests=False) the engine's generator, seeded once; log-probs of softmax(logits / T)."""
    text_prompts = False  # True: vLLM tokenizes the prompts itself, as a vLLM user's call does

    def sync(self, model):  # the trainer's weights into the engine, then its KV cache
        self.load_weights(model)

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024,
                 seed=0, bottom_p=1.0, bottom_p_freq=1.0, seed_requests=True, progress=None):
        """As HFSampler's; with `progress`, vLLM's own progress bar instead."""
        from vllm import SamplingParams
        if bottom_p < 1.0:
            raise CountdownError("--bottom_p needs --backend hf: vLLM has no bottom-p sampling")
        if self.asleep:
            raise CountdownError("generate() on a sleeping vLLM engine: wake() and sync() it first")
        prompt_ids = self.tok(prompts, add_special_tokens=False)["input_ids"]
        seeds = prompt_keys(prompts, seed) if keyed() else [  # torchrun: per prompt, any N alike
            seed + i * n if seed_requests else None for i in range(len(prompts))]
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p,
                                 top_k=top_k if top_k > 0 else -1, max_tokens=max_new_tokens,
                                 seed=s, logprobs=0) for s in seeds]
        inputs = [{"prompt": p} if self.text_prompts else {"prompt_token_ids": i}
                  for p, i in zip(prompts, prompt_ids)]
        outs = self.llm.generate(inputs, params, use_tqdm=progress is not None)
        comps = [c for o in outs for c in o.outputs]
        ids = [list(c.token_ids) for c in comps]  # EOS included where it stopped, as HFSampler's
        texts = self.tok.batch_decode([[t for t in x if t != self.tok.eos_token_id] for x in ids])
        return Rollouts([list(o.prompt_token_ids) for o in outs], ids,
                        [[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for c in comps],
                        texts, [c.finish_reason == "stop" for c in comps])


def make_sampler(backend, model, tokenizer, model_dir, seed=0, max_model_len=2048, decode="auto",
                 batch_size=1024):
    """`hf`: the training model itself samples, with the `decode` loop (auto: the faster here).
    `vllm`: an engine from `model_dir`, synced before each rollout, its context the model's."""
    if backend == "vllm" and fsdp_units(model):
        raise CountdownError("--backend vllm with --fsdp: the engine syncs from whole weights; "
                             "run vLLM under DDP (no --fsdp), or --fsdp with --backend hf")
    if backend == "vllm":
        return VLLMSampler(model_dir, tokenizer, seed,
                           min(max_model_len, model.config.max_position_embeddings))
    if backend != "hf":
        raise CountdownError(f"--backend must be hf or vllm, not {backend!r}")
    return HFSampler(model, tokenizer, batch_size, decode=None if decode == "auto" else decode)


# ---- which problems a step draws: the curriculum (rloo.py's and grpo.py's) -----------------------
#   tiers   paper 001 Algorithm 1: tiers T_0..T_{m-1} by (operand count, target bin), easiest
#           first; a step draws from T_0 ∪ ... ∪ T_level; when the mean rollout accuracy of the
#           last W steps reaches τ, the next tier unlocks. 001 gives no W or τ (ours: 10, 0.6).
#   filter  paper 002 §5.2: only problems the init solves sometimes (probe() measures each from k
#           samples; 002 from one SFT answer): always or never, its groups' A = 0.
class Curriculum:
    """The tiers unlocked so far (001 Algorithm 1, lines 2-8). One tier of every problem (`none`)
    or of the probed ones the init solves sometimes (`filter`) never moves."""

    def __init__(self, tiers, window, threshold, level=0, recent=()):
        self.tiers, self.window, self.threshold = tiers, window, threshold
        self.level, self.recent = level, list(recent)  # `recent`: the window's accuracies

    def pool(self):
        """Indices of the problems a step may draw: T_0 ∪ ... ∪ T_level."""
        return [i for tier in self.tiers[:self.level + 1] for i in tier]

    def update(self, accuracy):
        """Push a step's rollout accuracy; unlock the next tier when the full window's mean
        reaches τ (lines 5-7). Returns the train/ metrics of a curriculum that can move."""
        if len(self.tiers) == 1:
            return {}
        self.recent = (self.recent + [accuracy])[-self.window:]
        if (len(self.tiers) > self.level + 1 and len(self.recent) == self.window
                and sum(self.recent) / self.window >= self.threshold):
            self.level, self.recent = self.level + 1, []
        return {"train/curriculum_level": self.level, "train/pool": len(self.pool())}

    def state(self):  # what a resumed run restores
        return {"level": self.level, "recent": self.recent}


def make_curriculum(mode, tasks, bins, window, threshold, state=None):
    """The Curriculum of --curriculum `mode` (none | tiers | filter) over `tasks`, from a resumed
    run's `state`; `filter` keeps the probed problems (task["solve_rate"]) with 0 < rate < 1."""
    if mode == "tiers":
        return Curriculum(tiers(tasks, bins), window, threshold, **(state or {}))
    if mode == "filter":
        keep = [i for i, t in enumerate(tasks) if 0 < t.get("solve_rate", 0) < 1]
        if not keep:
            raise CountdownError("--curriculum filter: the init solves every probed problem always "
                                 "or never; probe more (--probe_problems, --probe_samples)")
        return Curriculum([keep], window, threshold)
    return Curriculum([list(range(len(tasks)))], window, threshold)


def probe(sampler, model, tok, tasks, k, template, max_prompt_len, temperature, max_new_tokens,
          seed, path):
    """The init's accuracy on each of `tasks` from k samples at `temperature`, as task["solve_rate"]
    (002 §5.2's filter and easy/hard split), kept in `path` for a resumed run. Returns `tasks`."""
    def measure():
        samples = rollouts(sampler, model, tok, tasks, k, template, max_prompt_len, temperature,
                           max_new_tokens, seed)
        return (score_rollouts(samples, tasks)[0].view(len(tasks), k) == 1).float().mean(1).tolist()
    return solve_rates(path, tasks, k, measure)


def curriculum_tasks(args, sampler, model, tok, output_dir, state, probe_all=False):
    """The train split and the Curriculum that draws from it (rloo.py's and grpo.py's flags), the
    init probed first with --curriculum filter or `probe_all` (grpo.py's adaptive temperature)."""
    tasks = load_tasks(args.data, "train")
    if args.curriculum == "filter" or probe_all:
        tasks = probe(sampler, model, tok, tasks[:args.probe_problems], args.probe_samples,
                      args.template, args.max_prompt_len, args.temperature, args.max_response_len,
                      step_seed(args.seed, 0), f"{output_dir}/probe.jsonl")
    return tasks, make_curriculum(args.curriculum, tasks, args.curriculum_bins,
                                  args.curriculum_window, args.curriculum_threshold,
                                  state.get("curriculum"))


# ---- the batch: rollouts and the verifier's scores -----------------------------------------------
def rollouts(sampler, model, tokenizer, tasks, n, template, max_prompt_len, temperature,
             max_new_tokens, seed, bottom_p=1.0, bottom_p_freq=1.0):
    """n completions for each task's prompt from `sampler` synced to `model`, top_p 1 and no top_k,
    at `temperature` (or a list: one per task, paper 002's per-example temperature)."""
    prompts = [make_prompt(t["nums"], t["target"], template) for t in tasks]
    prompt_lens = [len(p) for p in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    if max(prompt_lens) > max_prompt_len:
        raise CountdownError(f"a prompt is longer than --max_prompt_len {max_prompt_len}")
    temps = temperature if isinstance(temperature, list) else [temperature] * len(tasks)
    explore = dict(bottom_p=bottom_p, bottom_p_freq=bottom_p_freq) if bottom_p < 1 else {}
    sampler.wake()
    sampler.sync(model)
    groups, rows = [], 0  # (task indices, their Rollouts): one generate call per temperature
    for T in sorted(set(temps)):
        idx = [i for i, t in enumerate(temps) if t == T]
        # a seed past the earlier calls' rows (the HF sampler's); vLLM's engine seeds itself
        groups.append((idx, sampler.generate([prompts[i] for i in idx], n, T, 1.0, 0,
                                             max_new_tokens, seed + rows, **explore,
                                             seed_requests=False)))
        rows += len(idx) * n
    sampler.sleep()  # vLLM hands its GPU memory back for the update
    order = sorted((i, s, k) for idx, s in groups for k, i in enumerate(idx))  # back in task order
    return groups[0][1] if len(groups) == 1 else take_groups([(s, k) for _, s, k in order], n)


def take_groups(picks, n):
    """One Rollouts of the groups `picks`, [(Rollouts, prompt index k)], in that order (n rows a
    group): rollouts' groups in task order, grpo.py's kept groups of several draws."""
    out = Rollouts([], [], [], [], [])
    for samples, k in picks:
        out.prompt_ids.append(samples.prompt_ids[k])
        for f in ("completion_ids", "logprobs", "texts", "finished", "versions"):
            getattr(out, f).extend(getattr(samples, f)[k * n:(k + 1) * n])
    return out


def score_rollouts(samples, tasks, reward="sparse", wrong_reward=0.1, no_answer_reward=0.0):
    """The verifier on every rollout: scores (n·len(tasks),) in {0, 0.1, 1}, and the training
    reward (len(tasks), n): the scores with `wrong_reward` for the 0.1 of a wrong answer and
    `no_answer_reward` for the 0 of none (sparse; 000: 0.1 and 0), or 001's dense credit."""
    n = len(samples.texts) // len(tasks)
    row_tasks = [t for t in tasks for _ in range(n)]
    scores = torch.tensor([score(x, t["nums"], t["target"])
                           for x, t in zip(samples.texts, row_tasks)])
    if reward == "dense":
        dense = [dense_score(x, t["nums"], t["target"]) for x, t in zip(samples.texts, row_tasks)]
        return scores, torch.tensor(dense).view(-1, n)
    wrong = (scores > 0) & (scores < 1)  # an answer, not the target
    reward = torch.where(wrong, torch.tensor(wrong_reward), scores)
    return scores, torch.where(scores == 0, torch.tensor(no_answer_reward), reward).view(-1, n)


# ---- rollouts as trainer tensors, with masks -----------------------------------------------------
def rollout_batch(samples, rows, pad_id, shared=False, forward_rows=16):
    """Rows of a Rollouts as trainer tensors: input_ids, attention_mask, completion mask (b, T), cut
    to these rows' longest, the sampler's log-probs (b, T-1) aligned with token_stats' outputs,
    and the rows' GroupPrompts. Per row (not `shared`): prompt then completion, and None. Shared:
    the prompt's last token then the completion, and the prompts before it (decoder_states)."""
    n = len(samples.completion_ids) // len(samples.prompt_ids)
    prompts = [samples.prompt_ids[r // n] for r in rows]
    ids, attn, mask = pack([p[-1:] for p in prompts] if shared else prompts,
                           [samples.completion_ids[r] for r in rows], pad_id)
    sel = mask[:, 1:].bool()
    lp = torch.tensor([x for r in rows for x in samples.logprobs[r]], dtype=torch.float32)
    head = group_prompts(samples.prompt_ids, rows, n, pad_id, attn.sum(1), forward_rows
                         ) if shared else None
    return ids, attn, mask, torch.zeros(sel.shape).masked_scatter(sel, lp), head


def micro_batches(samples, size, pad_id, device, shared=False, forward_rows=16):
    """(rows, input_ids, attention_mask, completion mask, sampler log-probs, GroupPrompts or None)
    per micro-batch of `size` rollouts, on `device` (the step's loss is a sum over rollouts: their
    order is free). Rows sorted by length, so a micro-batch holds like lengths and little padding.
    Shared (decoder_states), micro-batches of whole groups (shared_prompts.group_chunks), their rows
    run in forwards of `forward_rows`."""
    lengths = [len(c) for c in samples.completion_ids]
    if shared:
        chunks = group_chunks(lengths, len(samples.prompt_ids), size)
    else:
        by_len = sorted(range(len(lengths)), key=lengths.__getitem__)
        chunks = [by_len[s:s + size] for s in range(0, len(by_len), size)]
    for rows in chunks:
        *tensors, head = rollout_batch(samples, rows, pad_id, shared, forward_rows)
        yield (rows, *(x.to(device) for x in tensors), head and head.to(device))


def pack(prompt_ids, response_ids, pad_id):
    """Right-padded (B, T) input_ids, attention_mask, response_mask from token-id lists. The
    response mask covers the response tokens, EOS included if the response has one; prompt and
    padding are 0. Masks come from lengths, never from `ids != pad_id`: for Qwen pad == eos."""
    seqs = [torch.tensor(p + r, dtype=torch.long) for p, r in zip(prompt_ids, response_ids)]
    # (B, T)
    input_ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    pos = torch.arange(input_ids.shape[1])
    ends = torch.tensor([len(s) for s in seqs])[:, None]
    starts = torch.tensor([len(p) for p in prompt_ids])[:, None]
    return input_ids, (pos < ends).long(), ((pos >= starts) & (pos < ends)).long()


def tokenize_pairs(tokenizer, prompts, responses, max_prompt_len=512, max_response_len=1024):
    """Tokenize prompt and response separately (so the boundary is exact), append EOS to each
    response (kept in the mask: the model must learn to stop), truncate the response to
    max_response_len."""
    P = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    R = tokenizer(responses, add_special_tokens=False)["input_ids"]
    too_long = [len(p) for p in P if len(p) > max_prompt_len]
    if too_long:
        raise CountdownError(
            f"a prompt has {max(too_long)} tokens but --max_prompt_len is {max_prompt_len}")
    R = [(r + [tokenizer.eos_token_id])[:max_response_len] for r in R]
    return pack(P, R, tokenizer.pad_token_id)


# ---- the training forward: the precision it computes in ------------------------------------------
@contextlib.contextmanager
def autocast(device, *models):
    """Training forwards keep fp32 master weights and optimizer state and compute in bf16: a bf16
    AdamW update of lr 1e-6 would round away. On a GPU, always. On a CPU with native bf16
    (cpu_bf16(), measured by run_cpu.sh); else plain fp32. On a CPU the `models` (None: no
    reference) run plumbing/models.py's cpu_attention, a faster kernel of the same attention."""
    bf16 = device == "cuda" or (device == "cpu" and trains_in_bf16(device))
    with cpu_attention_on(device, models), torch.autocast(device, dtype=torch.bfloat16,
                                                          enabled=bf16):
        yield


# ---- log-probs, entropy and KL without the B x T x V wall ----------------------------------------
def token_stats(model, input_ids, attention_mask, mask, temperature=1.0, entropy=False,
                teacher=None, kd_temperature=1.0, chunk_size=None, teacher_inputs=None,
                kd_reverse=False, prompts=None):
    """Where `mask` (B, T) is 1: logp (B, T-1) of input_ids[:, 1:] and entropy (B, T-1) at
    `temperature` (a float, or a (B,) tensor: one per row); with a `teacher`, forward KL (B, T-1)
    (reverse with kd_reverse) at `kd_temperature` over the shared vocab (Qwen pads 151,936 vs
    152,064), the teacher reading `teacher_inputs` (same (B, T), left-padded so that the scored
    tokens line up; RoPE sees only relative positions) or the same tokens. entropy="logged": a
    metric built without a graph (a branch the loss never reaches would hold two (N, V) tensors a
    chunk until the next forward). `correct` (B, T-1): target == argmax. Zeros elsewhere. The
    lm_head runs on `chunk_size` positions at a time (default: 2^26 logits, 441 positions at Qwen's
    vocab), so memory scales with the chunk, not B x T x V, in forward and (checkpointed) backward.
    `prompts`: the rows continue these prompts, run once per group (decoder_states)."""
    sel = mask[:, 1:].bool()                                                             # (B, T-1)
    h = decoder_states(model, input_ids, attention_mask, prompts)[:, :-1][sel]          # (N, H)
    targets = input_ids[:, 1:][sel]                                                      # (N,)
    if torch.is_tensor(temperature):  # one per row (grpo's --adaptive_temperature)
        temperature = temperature.to(h.device)[:, None].expand(sel.shape)[sel][:, None]  # (N, 1)
    weight = model.get_output_embeddings().weight                                        # (V, H)
    t_h = t_weight = None
    if teacher is not None:
        with torch.no_grad():
            t_ids, t_attn = teacher_inputs or (input_ids, attention_mask)
            t_h = decoder_states(teacher, t_ids, t_attn, None if teacher_inputs else prompts
                                 )[:, :-1][sel]
            t_weight = teacher.get_output_embeddings().weight[: weight.shape[0]]
    chunk_size = chunk_size or max(1, 2**26 // weight.shape[0])
    # one chunk: nothing to save by recomputing
    recompute = torch.is_grad_enabled() and h.shape[0] > chunk_size
    outs = []
    for s in range(0, h.shape[0], chunk_size):
        c = slice(s, s + chunk_size)
        T = temperature[c] if torch.is_tensor(temperature) else temperature
        args = (h[c], weight, targets[c], T, entropy, None if t_h is None else t_h[c],
                t_weight, kd_temperature, kd_reverse)
        outs.append(checkpoint(_chunk_stats, *args, use_reentrant=False) if recompute
                    else _chunk_stats(*args))
    def cat(k):
        return torch.cat([o[k] for o in outs]) if outs else h.new_zeros(0, dtype=torch.float32)
    return {name: torch.zeros(sel.shape, device=h.device).masked_scatter(sel, cat(k))
            for k, name in enumerate(("logp", "entropy", "kl", "correct"))}


def data_parallel(model, fsdp=False, batch_size=None):
    """N ranks under torchrun: DDP (FSDP2 with `fsdp`) around decoder_states, so backward()
    averages the gradient over them (plumbing/distributed.py); 1 and the model untouched, else."""
    return wrap(model, decoder_states, fsdp, batch_size)


def decoder_states(model, input_ids, attention_mask, prompts=None, wrapped=True):
    """The decoder's last hidden states (B, T, D) of input_ids (B, T): each row, prompt then
    rollout, through the model's own forward. With `prompts` (micro_batches' shared layout), each
    row holds a prompt's last token then its rollout, and the decoder runs each prompt once, its
    keys and values expanded over its rows, inside autograd (plumbing/shared_prompts.py: the same
    values, fewer tokens). Under torchrun: inside DDP or FSDP (data_parallel)."""
    if wrapped and wrapper(model) is not None:
        return wrapper(model)(input_ids, attention_mask, prompts, False)
    decoder = model.get_decoder()
    if prompts is None:
        return decoder(input_ids=input_ids, attention_mask=causal_only(attention_mask)
                       ).last_hidden_state
    return shared_states(decoder, cache_name(model), input_ids, attention_mask, prompts)


def _chunk_stats(h, weight, targets, temperature, want_entropy, t_h, t_weight, kd_temperature,
                 kd_reverse=False):
    """Log-prob of `targets`, entropy, KL to the teacher (forward KL(teacher || model), or with
    kd_reverse KL(model || teacher)) and whether the target is the argmax, for one chunk of N
    positions. Only this chunk's (N, V) logits ever exist; checkpoint() recomputes them in
    backward."""
    logits = F.linear(h, weight).float()                                                 # (N, V)
    logp_all = torch.log_softmax(logits / temperature, -1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)                             # (N,)
    correct = (logp >= logp_all.amax(-1)).float()  # target == argmax (ties count), 8x faster
    with torch.set_grad_enabled(torch.is_grad_enabled() and want_entropy != "logged"):
        entropy = -(logp_all.exp() * logp_all).sum(-1) if want_entropy else torch.zeros_like(logp)
    kl = torch.zeros_like(logp)
    # paper 000 Eq. 4: KL(softmax(z_T / T) || softmax(z_S / T)) over the shared vocab; reversed,
    # GKD's KL(softmax(z_S / T) || softmax(z_T / T)), exact over the vocab at each position
    if t_h is not None:
        with torch.no_grad():  # (N, V')
            t_logp = torch.log_softmax(F.linear(t_h, t_weight).float() / kd_temperature, -1)
        s_logp = torch.log_softmax(logits[:, : t_logp.shape[-1]] / kd_temperature, -1)
        p, q = (s_logp, t_logp) if kd_reverse else (t_logp, s_logp)
        kl = (p.exp() * (p - q)).sum(-1)                                                  # (N,)
    return logp, entropy, kl, correct


# ---- three pieces the losses share ---------------------------------------------------------------
def k3_kl(logp, other_logp, sample_logp=None):
    """Schulman's k3 = r − 1 − log r, r = other/π_θ, per token (b, T-1) -> (b, T-1); never negative
    (paper 001 §3.1.4's KL estimator). On tokens from π_θ its value estimates KL(π_θ ‖ other), but
    as a loss its gradient is KL(other ‖ π_θ)'s. With `sample_logp`, the log-probs of the policy μ
    that drew the tokens (RLOO's sampler, GRPO's π_old), k3 is multiplied by the differentiable
    ratio π_θ/μ (TRL's use_bias_correction_kl): over μ's tokens its expectation is then
    KL(π_θ ‖ other) and its gradient that KL's (tests/test_rl.py checks both). RLOO's KL to μ,
    GRPO's and RLT's to π_ref: one copy, so that a course's handout blanks it once."""
    log_r = other_logp - logp
    k3 = log_r.exp() - 1 - log_r
    return k3 if sample_logp is None else (logp - sample_logp).exp() * k3


def behavior_logp(mu, logp, sampler_logp):
    """μ's log-probs of the sampled tokens (b, T-1), for RLOO's and OPD's weight w = π_θ/μ and their
    KL (000 Eq. 3): `sampler`, the sampler's own (the paper's μ, the policy that sampled; a bf16
    engine's rounding moves w too), or `trainer`, this forward's, detached (w = 1 before the
    update: the engine's mismatch left out, as TRL and verl take π_old)."""
    return logp.detach() if mu == "trainer" else sampler_logp


@torch.no_grad()
def mix_reference(ref, model, mix, step=0, every=1):
    """π_ref ← mix · π_θ + (1 − mix) · π_ref every `every` steps (paper 004 Table 3: a slowly
    moving reference); nothing for no reference or every=0 (a frozen one)."""
    if ref is None or not every or step % every:
        return
    for p_ref, p in zip(ref.parameters(), model.parameters()):  # (FSDP: each weight gathered)
        p_ref.mul_(1 - mix).add_(p.full_tensor() if hasattr(p, "full_tensor") else p, alpha=mix)


# ---- the step's log ------------------------------------------------------------------------------
def rollout_metrics(samples, scores, reward, adv, tasks):
    """Paper 001's flatline diagnostics of an RL batch, its strategies and its mistakes. scores
    (B*G,): verifier scores 0/0.1/1; reward (B, G): what the advantage saw; adv (B*G,); tasks:
    the B prompts' problems. A group whose rewards are all equal has A = 0. Every rank's
    rollouts."""
    samples, scores, reward, adv, tasks = gathered(samples, scores, reward, adv, tasks)
    n, group_std = len(samples.completion_ids), reward.std(1)  # (B,) within-group spread
    return {"train/reward": reward.mean(), "train/accuracy": (scores == 1).float().mean(),
            "train/format": (scores > 0).float().mean(), "train/reward_std": group_std.mean(),
            "train/adv_std": adv.std(), "train/zero_adv_groups": (group_std == 0).float().mean(),
            "train/resp_len": sum(map(len, samples.completion_ids)) / n,
            # what the reward sees (no complete answer block) and what the budget did (no EOS)
            "train/no_answer": (scores == 0).float().mean(),
            "train/cut": 1 - sum(samples.finished) / n,
            **strategy_metrics("train", strategy_stats(samples.texts, scores.tolist())),
            **{f"train/mistake/{k}": v for k, v in mistake_shares(
                samples.texts, [t for t in tasks for _ in range(n // len(tasks))]).items()}}
