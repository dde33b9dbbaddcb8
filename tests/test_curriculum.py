"""Paper 001's curriculum, paper 002's filter and exploration knobs: tiers, promotion, the probe,
the data order over a pool, bottom-p, per-problem temperature; and 2-step runs with each on."""
import json
import os
import random
import sys

import pytest
import torch

import common as C
import grpo
from plumbing import models as M
import rloo
import common as S
from plumbing.flags import CountdownError
from conftest import GEN, ROOT, gap_bound, run_cli
from common import pack, token_stats
from plumbing.harness import Run

FAST = ["--data", GEN, "--eval_data", GEN, "--batch_size", "2", "--group_size", "2", "--micro_batch", "2",
        "--max_steps", "2", "--max_response_len", "8", "--eval_problems", "2", "--eval_samples", "2",
        "--eval_max_new_tokens", "8", "--eval_every", "0", "--save_every", "1", "--template", "compact"]


def test_tiers_by_operand_count_then_target_bins():
    tasks = [{"nums": [1] * n, "target": t} for n, t in [(4, 5), (3, 90), (3, 10), (4, 50), (3, 40), (3, 70)]]
    assert C.tiers(tasks, 2) == [[2, 4], [5, 1], [0], [3]]
    assert C.tiers(tasks, 4) == [[2], [4], [5], [1], [0], [3]]  # no empty tier


def test_tiers_on_a_generated_three_and_four_number_pool_unlock_in_order():
    """The 3/4 lane's curriculum (--curriculum tiers on its balanced mix): the pool opens 3-number
    problems first, by target, then 4-number ones, by target, and every tier adds its own problems
    and keeps the ones before. Broken on purpose (tiers by target alone), it failed."""
    import verifier as V
    tasks = V.generate_splits({"train": 400}, 5, (3, 4), (1, 20), (10, 100))["train"]
    cur = C.make_curriculum("tiers", tasks, 2, window=1, threshold=0.5)
    pools = [cur.pool()]
    while cur.update(1.0)["train/curriculum_level"] < len(cur.tiers) - 1:
        pools.append(cur.pool())
    pools.append(cur.pool())
    assert len(pools) == 4 and sorted(pools[-1]) == list(range(400))
    counts = [{len(tasks[i]["nums"]) for i in p} for p in pools]
    assert counts == [{3}, {3}, {3, 4}, {3, 4}]
    added = [sorted(set(b) - set(a)) for a, b in zip([[]] + pools, pools)]
    assert all(set(a) < set(b) for a, b in zip(pools, pools[1:]))
    assert max(tasks[i]["target"] for i in added[0]) <= min(tasks[i]["target"] for i in added[1])
    assert {len(tasks[i]["nums"]) for i in added[2] + added[3]} == {4}
    assert max(tasks[i]["target"] for i in added[2]) <= min(tasks[i]["target"] for i in added[3])


def test_the_four_numbers_study_changes_one_thing_per_variant(tmp_path, capsys):
    """benchmarks/four_numbers.py (paper 001's questions on the 3to4 lane): each variant's rloo.py
    command parses back to the lane's own flags with only its change (and its folder, init, seed),
    its evaluations take all of the val and test split, and `three`'s file holds the training split's
    3-number problems only. Broken on purpose (the override dropped), it failed."""
    import dataclasses
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import four_numbers as F
    from plumbing.flags import parse_args
    mix = "gen:nums=3-4,range=1-9,test=8,val=4"
    lane = dataclasses.asdict(parse_args(rloo.Args, ["--data", mix, "--eval_data", mix, "--max_steps", "50",
                                                     "--template", "compact", "--lr", "6.7e-5", "--seed", "0"]))
    for name, change in F.VARIANTS.items():
        for seed in F.SEEDS:
            out, train, evals = F.commands("LANE", str(tmp_path), lane, f"{name}_s{seed}", name, seed)
            got = dataclasses.asdict(parse_args(rloo.Args, train[2:]))
            moved = {k for k in got if got[k] != lane[k]}
            want = {k: os.path.join(str(tmp_path), v) if k == "data" else v for k, v in change.items()}
            assert moved == {"output_dir", "init", "overwrite"} | ({"seed"} if seed else set()) | {
                k for k, v in want.items() if v != lane[k]} and all(got[k] == v for k, v in want.items()), name
            assert got["init"] == "LANE/sft" and got["output_dir"] == out and got["seed"] == seed
            assert [(e[e.index("--split") + 1], e[e.index("--num_problems") + 1]) for e in evals] == [("val", "4"),
                                                                                                   ("test", "8")]
    F.write_jsonl(str(tmp_path / "train_3.jsonl"), [t for t in F.load_tasks(mix, "train") if len(t["nums"]) == 3])
    three = F.load_tasks(str(tmp_path / "train_3.jsonl"), "train")
    assert three and {len(t["nums"]) for t in three} == {3}
    # the decision: tiers against none, paired by problem over both seeds, by hand
    right = {"none": [[1, 0, 0, 0], [0, 0, 0, 0]], "tiers": [[1, 1, 0, 0], [1, 1, 1, 1]]}  # problem 0, problem 1
    for name, rates in right.items():
        for seed in F.SEEDS:
            d = tmp_path / "eval" / "test" / f"{name}_s{seed}"
            d.mkdir(parents=True)
            F.write_jsonl(str(d / "samples.jsonl"), [{"nums": [p, 2, 3], "target": 9, "scores": [float(x) for x in r]}
                                                     for p, r in enumerate(rates)])
    F.decision(str(tmp_path))
    # per problem, seeds pooled: 0.25 -> 0.5 and 0 -> 1, a mean of +0.625 and its spread over the 2 problems
    assert capsys.readouterr().out.splitlines() == ["test: tiers - none, pass@1 over 2 problems and 2 seeds: "
                                                    "+0.625 ± 0.735 (95 %)"]


def test_curriculum_unlocks_on_the_full_window_mean_and_clears_it():
    cur = C.Curriculum([[0], [1, 2], [3]], window=2, threshold=0.5)
    assert cur.pool() == [0]
    assert cur.update(0.9)["train/curriculum_level"] == 0  # window not full yet
    assert cur.update(0.0) == {"train/curriculum_level": 0, "train/pool": 1}  # mean 0.45 < τ
    cur = C.Curriculum([[0], [1, 2], [3]], window=2, threshold=0.5)
    cur.update(0.4), cur.update(0.6)  # mean 0.5 reaches τ
    assert cur.level == 1 and cur.recent == [] and cur.pool() == [0, 1, 2]
    cur.update(0.6)
    assert cur.level == 1  # the window was cleared: one value is not a full window
    cur.update(0.6)
    assert cur.level == 2 and cur.update(1.0)["train/pool"] == 4
    cur.update(1.0)
    assert cur.level == 2  # the last tier stays
    again = C.Curriculum(cur.tiers, 2, 0.5, **cur.state())  # --resume
    assert again.level == 2 and again.recent == cur.recent


def test_curriculum_window_mean_below_threshold_does_not_unlock():
    cur = C.Curriculum([[0], [1]], window=3, threshold=0.7)
    for acc in (0.9, 0.9, 0.2, 0.9):  # windows 0.67, 0.67
        cur.update(acc)
    assert cur.level == 0
    cur.update(0.9)  # last three 0.2 0.9 0.9 -> 0.67; then 0.9 0.9 0.9
    cur.update(0.9)
    assert cur.level == 1


def test_filter_keeps_problems_solved_sometimes_and_none_logs_nothing():
    tasks = [{"nums": [1], "target": 1, "solve_rate": r} for r in (0.0, 0.25, 1.0, 0.5)]
    cur = C.make_curriculum("filter", tasks, 3, 10, 0.6)
    assert cur.pool() == [1, 3] and cur.update(1.0) == {}
    assert C.make_curriculum("none", tasks, 3, 10, 0.6).pool() == [0, 1, 2, 3]
    with pytest.raises(CountdownError, match="always or never"):
        C.make_curriculum("filter", tasks[::2], 3, 10, 0.6)


class ScriptedSampler:
    """Answers each prompt's k samples from a script; counts its calls."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def wake(self): pass
    sleep = wake

    def sync(self, model): pass

    def generate(self, prompts, n, temperature, top_p, top_k, max_new_tokens, seed, **kw):
        self.calls.append((len(prompts), temperature, seed, kw))
        texts = [a for p in prompts for a in self.answers[p.split("equals ")[1].split(".")[0]][:n]]
        return S.Rollouts([[0]] * len(prompts), [[1]] * len(texts), [[0.0]] * len(texts), texts, [True] * len(texts))


def test_probe_measures_solve_rates_writes_them_and_reads_them_back(tmp_path):
    tok = M.build_tiny_tokenizer()
    tasks = [{"nums": [2, 3], "target": 5}, {"nums": [2, 3], "target": 6}]
    right, wrong = "</think>\n<answer>2 + 3</answer>", "</think>\n<answer>2 * 3</answer>"
    sampler = ScriptedSampler({"5": [right, wrong, right, right], "6": [right] * 4})
    path = str(tmp_path / "probe.jsonl")
    S.probe(sampler, None, tok, tasks, 4, "compact", 512, 1.0, 8, 0, path)
    assert [t["solve_rate"] for t in tasks] == [0.75, 0.0] and len(sampler.calls) == 1
    again = [{"nums": [2, 3], "target": 5}, {"nums": [2, 3], "target": 6}]
    S.probe(sampler, None, tok, again, 4, "compact", 512, 1.0, 8, 0, path)  # a resumed run
    assert [t["solve_rate"] for t in again] == [0.75, 0.0] and len(sampler.calls) == 1
    with pytest.raises(CountdownError, match="probed other problems"):
        S.probe(sampler, None, tok, again[:1], 4, "compact", 512, 1.0, 8, 0, path)


def test_per_task_temperatures_one_call_each_merged_in_task_order():
    tok = M.build_tiny_tokenizer()
    tasks = [{"nums": [1, 2], "target": t} for t in (10, 11, 12)]
    sampler = ScriptedSampler({"10": ["a", "b"], "11": ["c", "d"], "12": ["e", "f"]})
    ro = S.rollouts(sampler, None, tok, tasks, 2, "compact", 512, [1.5, 0.6, 1.5], 8, 7)
    assert ro.texts == ["a", "b", "c", "d", "e", "f"] and len(ro.prompt_ids) == 3
    assert [(n, T, seed) for n, T, seed, _ in sampler.calls] == [(1, 0.6, 7), (2, 1.5, 9)]  # 7 + 1·2
    sampler.calls = []
    S.rollouts(sampler, None, tok, tasks, 2, "compact", 512, 1.0, 8, 7, bottom_p=0.9, bottom_p_freq=0.5)
    # RL rollouts ask vLLM for no per-request seeds (its engine is seeded once)
    assert sampler.calls == [(3, 1.0, 7, {"bottom_p": 0.9, "bottom_p_freq": 0.5, "seed_requests": False})]


def test_bottom_p_cuts_the_head_keeps_one_token_and_composes_with_top_p():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.99, 0.01, 0.0, 0.0]]).log()         # (2, 4)
    kept = lambda out: torch.isfinite(out).tolist()  # noqa: E731
    # bottom 0.5: cut the head holding at most 0.5 -> 0.4 goes; the 0.99 token crosses 0.5, so it stays
    assert kept(S._filter_logits(logits, 1.0, 0, 1.0, 0.5)) == [[False, True, True, True], [True, True, False, False]]
    # top 0.8 first keeps 0.4 0.3 0.2 (0.44 0.33 0.22 renormalized); bottom 0.5 then cuts 0.44: the middle
    assert kept(S._filter_logits(logits, 1.0, 0, 0.8, 0.5))[0] == [False, True, True, False]
    # only the rows `explore` marks; bottom_p 1 cuts nothing
    assert kept(S._filter_logits(logits, 1.0, 0, 1.0, 0.5, torch.tensor([False, True])))[0] == [True] * 4
    assert kept(S._filter_logits(logits, 1.0, 0, 1.0, 1.0))[0] == [True] * 4
    # after temperature: a flatter distribution has a longer head to cut
    # (T 5: 0.28 0.26 0.24 0.21): bottom 0.45 cuts one token at T 1, two at T 5
    assert [sum(kept(S._filter_logits(logits, T, 0, 1.0, 0.45))[0]) for T in (1.0, 5.0)] == [3, 2]


def test_bottom_p_samples_off_the_mode_and_reports_untruncated_logprobs(tiny_ckpt):
    model, tok = M.load_model(tiny_ckpt)
    hf = S.HFSampler(model, tok)
    prompts = ["User: Using the numbers [1, 2, 3], create an equation that equals 6.\nAssistant: <think>"]
    plain = hf.generate(prompts, 4, 1.0, max_new_tokens=6, seed=0)
    cut = hf.generate(prompts, 4, 1.0, max_new_tokens=6, seed=0, bottom_p=0.5)
    assert plain.completion_ids != cut.completion_ids
    ids, attn, mask = pack([cut.prompt_ids[0]] * 4, cut.completion_ids, tok.pad_token_id)
    logp = token_stats(model, ids, attn, mask, 1.0)["logp"]  # the policy's, not the truncated sampler's
    sampled = torch.zeros_like(logp).masked_scatter(mask[:, 1:].bool(), torch.tensor(sum(cut.logprobs, [])))
    assert torch.allclose(logp, sampled, atol=1e-4)


def test_token_stats_per_row_temperature_equals_one_call_per_row(tiny_ckpt):
    model, tok = M.load_model(tiny_ckpt)
    ids, attn, mask = pack([[5, 6, 7], [5, 8]], [[9, 10, 11], [12, 13]], tok.pad_token_id)
    both = token_stats(model, ids, attn, mask, torch.tensor([0.6, 1.5]), entropy=True, chunk_size=3)
    for row, T in enumerate((0.6, 1.5)):
        one = token_stats(model, ids, attn, mask, T, entropy=True)
        for k in ("logp", "entropy"):
            assert torch.allclose(both[k][row], one[k][row], atol=1e-6)


def test_run_draws_only_from_the_pool_and_reshuffles_when_it_grows(tmp_path):
    model = torch.nn.Linear(1, 1)
    run = Run(str(tmp_path), 1, model, None, torch.optim.SGD(model.parameters(), 0.1))
    tasks = list(range(10))
    assert sorted(run.next_tasks(tasks, 3, [1, 4, 7])) == [1, 4, 7]
    assert set(run.next_tasks(tasks, 2, [1, 4, 7])) <= {1, 4, 7}  # none left: a new shuffle
    grown = [1, 4, 7, 8, 9]
    assert set(run.next_tasks(tasks, 5, grown)) == set(grown)  # a new tier: a shuffle of the whole pool
    # no pool: the same order as a shuffle of range(n) (the data order before pools existed)
    fresh = Run(str(tmp_path / "b"), 1, model, None, torch.optim.SGD(model.parameters(), 0.1), seed=3)
    assert fresh.next_tasks(tasks, 4) == random.Random(3).sample(range(10), 10)[:4]


def test_grpo_two_steps_with_every_exploration_knob_and_filter(tiny_ckpt, tmp_path, monkeypatch):
    def fake_probe(sampler, model, tok, tasks, *args):  # an untrained model solves nothing
        for i, t in enumerate(tasks):
            t["solve_rate"] = [0.0, 0.5, 1.0, 0.25][i % 4]
        return tasks
    monkeypatch.setattr(C, "probe", fake_probe)  # common.curriculum_tasks calls it
    grpo.main(["--init", tiny_ckpt, *FAST, "--curriculum", "filter", "--probe_problems", "8",
               "--adaptive_temperature", "0.6,1.5", "--bottom_p", "0.9", "--bottom_p_freq", "0.5",
               "--output_dir", str(tmp_path)])
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    bf16 = json.load(open(tmp_path / "args.json"))["train_compute"] == "bf16"
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["train/sampler_gap"] < gap_bound(bf16)
    assert "train/curriculum_level" not in rows[-1]  # one fixed tier: nothing to log


def test_rloo_two_steps_with_tiers_then_resume_keeps_the_level(tiny_ckpt, tmp_path):
    tiers = ["--curriculum", "tiers", "--curriculum_window", "1", "--curriculum_threshold", "0"]
    rloo.main(["--init", tiny_ckpt, *FAST, *tiers, "--output_dir", str(tmp_path)])
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["train/curriculum_level"] for r in rows[1:]] == [1, 2]  # τ 0: every full window unlocks
    rloo.main(["--init", tiny_ckpt, *FAST, *tiers, "--max_steps", "3", "--resume", str(tmp_path)])
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert rows[-1]["step"] == 3 and rows[-1]["train/curriculum_level"] == 2  # the last of 3 tiers


@pytest.mark.parametrize("flags,message", [
    (["--curriculum", "easy"], "--curriculum must be none, tiers or filter"),
    (["--curriculum", "filter"], "--curriculum filter: the init solves every probed problem always or never"),
    (["--adaptive_temperature", "0.6"], "--adaptive_temperature must be EASY,HARD"),
    (["--bottom_p", "0.9", "--backend", "vllm"], "--bottom_p needs --backend hf"),
])
def test_bad_curriculum_and_exploration_flags_are_one_line_errors(flags, message, tiny_ckpt, tmp_path):
    r = run_cli("grpo.py", "--init", tiny_ckpt, *FAST, "--probe_problems", "4", *flags, "--output_dir",
                str(tmp_path))  # in this process
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_row_temperatures_explore_the_hard_problems_and_exploit_the_easy_ones():
    # 002 §5.2: T_hard where the init solves under half its samples, T_easy elsewhere; the trainer
    # gets one per rollout, each prompt's repeated G times in the rollouts' order
    batch = [{"solve_rate": r} for r in (0.0, 0.5, 1.0, 0.25)]
    sampler_T, trainer_T = grpo.row_temperatures(batch, 2, 0.7, (0.6, 1.5))
    assert sampler_T == [1.5, 0.6, 0.6, 1.5]
    assert torch.allclose(trainer_T, torch.tensor([1.5, 1.5, 0.6, 0.6, 0.6, 0.6, 1.5, 1.5]))
    assert grpo.row_temperatures(batch, 2, 0.7, ()) == (0.7, 0.7)  # off: --temperature for all
