"""Which problems an RL step trains on, by difficulty: rloo.py's and grpo.py's --curriculum, and the
probe behind grpo.py's --adaptive_temperature and the temperatures it gives each rollout.
  tiers   paper 001 Algorithm 1: tiers T_0..T_{m-1} by (operand count, target bin), easiest first.
          A step draws uniformly from T_0 ∪ ... ∪ T_level; when the mean rollout accuracy of the
          last W steps reaches τ, the next tier unlocks and the window clears.
  filter  paper 002 §5.2: only problems the init solves sometimes. A group whose G rewards are
          equal has A = 0 for every rollout, no gradient; a problem the init always or never
          solves makes such groups. The probe measures it: k samples of the init on each of the
          first N train problems, before training.
The probe's per-problem accuracy is also 002's easy / hard split for per-example temperature.
Departures: 001 gives no W or τ (ours: 10 steps, 0.6); 002 filters by one SFT answer per problem
(ours: k samples, and "sometimes" rather than "right")."""
import json
import os

import torch

from common import CountdownError
from sampler import rollouts, score_rollouts


def probe(sampler, model, tok, tasks, k, template, max_prompt_len, temperature, max_new_tokens,
          seed, path):
    """The init's accuracy on each of `tasks` from k samples at `temperature`, kept on each task
    as task["solve_rate"] and written to `path` (JSONL; read back if there, so a resumed run does
    not probe again). Returns `tasks`."""
    if os.path.exists(path):
        rows = [json.loads(line) for line in open(path)]
        problems = [(list(t["nums"]), t["target"]) for t in tasks]
        if [(list(r["nums"]), r["target"]) for r in rows] != problems:
            raise CountdownError(f"{path} probed other problems than this run's: remove it")
        rates = [r["solve_rate"] for r in rows]
    else:
        ro = rollouts(sampler, model, tok, tasks, k, template, max_prompt_len, temperature,
                      max_new_tokens, seed)
        scores = score_rollouts(ro, tasks)[0].view(len(tasks), k)                      # (N, k)
        rates = (scores == 1).float().mean(1).tolist()
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps({**t, "solve_rate": r}) + "\n" for t, r in zip(tasks, rates))
        os.replace(path + ".tmp", path)
    for t, r in zip(tasks, rates):
        t["solve_rate"] = r
    never, always = sum(r == 0 for r in rates), sum(r == 1 for r in rates)
    print(f"probe: {len(tasks)} problems x {k} samples: the init never solves {never}, always "
          f"{always}, sometimes {len(tasks) - never - always}")
    return tasks


def tiers(tasks, bins):
    """001 Algorithm 1, line 1: task indices in tiers, by operand count, then `bins` equal-count
    bins of the target within each count; smaller counts and targets first."""
    out = []
    for count in sorted({len(t["nums"]) for t in tasks}):
        idx = sorted((i for i, t in enumerate(tasks) if len(t["nums"]) == count),
                     key=lambda i: tasks[i]["target"])
        out += [idx[len(idx) * b // bins: len(idx) * (b + 1) // bins] for b in range(bins)]
    return [tier for tier in out if tier]


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

    def state(self):
        return {"level": self.level, "recent": self.recent}


def setup_curriculum(tasks, sampler, model, tok, run_dir, state, seed, mode, probe_problems,
                     probe_samples, template, max_prompt_len, temperature, max_new_tokens, bins,
                     window, threshold, probe_always=False):
    """What rloo.py and grpo.py train on: the probed first `probe_problems` of `tasks` when `mode`
    is filter (or `probe_always`: grpo's --adaptive_temperature needs the solve rates), with the
    Curriculum over them; `state`: a resumed run's. The flags come from
    CurriculumArgs.curriculum_options(). Returns (tasks, curriculum)."""
    if mode == "filter" or probe_always:  # 002 §5.2: the init's solve rate per problem
        tasks = probe(sampler, model, tok, tasks[:probe_problems], probe_samples, template,
                      max_prompt_len, temperature, max_new_tokens, seed,
                      os.path.join(run_dir, "probe.jsonl"))
    return tasks, make_curriculum(mode, tasks, bins, window, threshold, state)


def make_curriculum(mode, tasks, bins, window, threshold, state=None):
    """The Curriculum of --curriculum `mode` (none | tiers | filter) over `tasks`; `filter` needs
    the probe's task["solve_rate"] first and keeps the probed problems with 0 < rate < 1. `state`:
    a resumed run's level and window."""
    if mode == "tiers":
        return Curriculum(tiers(tasks, bins), window, threshold, **(state or {}))
    if mode == "filter":
        keep = [i for i, t in enumerate(tasks) if 0 < t.get("solve_rate", 0) < 1]
        if not keep:
            raise CountdownError("--curriculum filter: the init solves every probed problem always "
                                 "or never; probe more (--probe_problems, --probe_samples)")
        return Curriculum([keep], window, threshold)
    return Curriculum([list(range(len(tasks)))], window, threshold)


def parse_temperatures(adaptive, backend, bottom_p):
    """--adaptive_temperature as (T_easy, T_hard), or () when off; one line for what cannot run."""
    if bottom_p < 1 and backend != "hf":
        raise CountdownError("--bottom_p needs --backend hf: vLLM has no bottom-p sampling")
    try:
        temps = tuple(float(x) for x in adaptive.split(",")) if adaptive else ()
    except ValueError:
        temps = None
    if temps is None or len(temps) not in (0, 2) or any(t <= 0 for t in temps or ()):
        raise CountdownError("--adaptive_temperature must be EASY,HARD (e.g. 0.6,1.5), not "
                             f"{adaptive!r}")
    return temps


def row_temperatures(batch, G, T, T_easy_hard):
    """002 §5.2's adaptive temperature: explore what the init fails, exploit what it solves. The
    sampler's T (one per prompt, or T) and the trainer's (one per rollout (B*G,), or T)."""
    if not T_easy_hard:
        return T, T
    per_prompt = [T_easy_hard[t["solve_rate"] < 0.5] for t in batch]
    return per_prompt, torch.tensor(per_prompt).repeat_interleave(G)
