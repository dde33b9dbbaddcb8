import itertools
import json
import os
import random
import subprocess
import sys

import pytest
from conftest import ROOT

import evaluate as E


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_brute_force_over_subsets(n):
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
            assert E.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_exact_at_extremes():
    assert E.pass_at_k(16, 0, 16) == 0.0 and E.pass_at_k(16, 16, 1) == 1.0 and E.pass_at_k(16, 1, 16) == 1.0
    assert E.pass_at_k(16, 1, 1) == 1 / 16
    assert E.pass_at_k(1000, 1, 500) == 0.5  # big integers stay exact
    with pytest.raises(ValueError):
        E.pass_at_k(4, 5, 1)


@pytest.mark.parametrize("n, c, k", [(16, 0, 16), (16, 1, 16), (16, 5, 8), (8, 8, 4), (10, 3, 10)])
def test_expected_samples_matches_simulation(n, c, k):
    rng = random.Random(0)
    draws = []
    for _ in range(40_000):
        order = rng.sample([1] * c + [0] * (n - c), n)
        first = next((i + 1 for i, x in enumerate(order) if x), None)
        draws.append(min(first or k, k))
    assert E.expected_samples(n, c, k) == pytest.approx(sum(draws) / len(draws), abs=0.05)
    assert E.expected_samples(n, 0, k) == k and E.expected_samples(n, n, k) == 1


def test_summarize_splits_and_best_of_n():
    records = [{"nums": [1, 2, 3], "target": 6, "completions": ["Need 3: x", "1 + 2 = 3.", "", ""],
                "scores": [1.0, 0.1, 0.0, 0.1]},
               {"nums": [1, 2, 3, 4], "target": 24, "completions": [""] * 4, "scores": [0.1, 0.1, 0.1, 0.1]}]
    s = E.summarize(records)
    assert s["num_problems"] == 2 and s["num_samples"] == 4 and list(s["pass_at_k"]) == ["1", "2", "4"]
    assert s["pass_at_k"]["1"] == pytest.approx(0.125) and s["pass_at_k"]["4"] == 0.5
    assert s["by_size"]["3"]["pass_at_k"]["4"] == 1.0 and s["by_size"]["4"]["num_problems"] == 1
    assert s["format_rate"] == 7 / 8
    # by operand count too (paper 002's strata): the answers and the mistakes of each count's samples alone
    assert s["by_size"]["3"]["format_rate"] == 3 / 4 and s["by_size"]["4"]["format_rate"] == 1.0
    mixed = E.summarize([{"nums": [1, 2, 3], "target": 6, "completions": ["<answer>1+2*3</answer>", "<answer>1+2+3</answer>"],
                          "scores": [0.1, 1.0]},  # an answer off the target: a give-up's
                         {"nums": [1, 2, 3, 4], "target": 24, "completions": ["<answer>4*3*2</answer>", "<answer>1*2*3*4</answer>"],
                          "scores": [0.1, 1.0]}])  # the 1 left out
    assert mixed["by_size"]["3"]["mistakes"] == {"slip": 0.0, "reuse": 0.0, "giveup": 0.5, "malformed": 0.0}
    assert mixed["by_size"]["4"]["mistakes"] == {"slip": 0.0, "reuse": 0.5, "giveup": 0.0, "malformed": 0.0}
    assert mixed["mistakes"]["reuse"] == mixed["mistakes"]["giveup"] == 0.25
    # per-problem 0.25 and 0: sd 0.177, / sqrt(2)
    assert s["pass_at_1_stderr"] == pytest.approx(0.125)
    assert s["best_of_n"] == {"accuracy": 0.5, "avg_samples": pytest.approx((E.expected_samples(4, 1, 4) + 4) / 2)}
    assert s["arithmetic"]["steps"] == 1 and s["arithmetic"]["step_error"] == 0
    assert s["strategies"] == {"backward": {"share": 1 / 8, "pass@1": 1.0}, "random": {"share": 1 / 8, "pass@1": 0.0},
                               "other": {"share": 6 / 8, "pass@1": 0.0}}


@pytest.mark.parametrize("text, steps, wrong, claims, false", [
    # right steps, a false claim
    (" 16 - 1 = 15, left 6 15. 6 * 15 = 90. Target 97, found.", 2, 0, 1, 1),
    # a wrong sum, an honest 'back'
    (" 6 * 16 = 96, left 1 96. 1 + 96 = 112. Target 97, back.", 2, 1, 0, 0),
    (" 7 + 4 = 11, left 5 11. 5 * 11 = 55. Target 55, found.\n</think>", 2, 0, 1, 0),
    # a wrong step, and 54 is not 55
    (" 7 + 4 = 11, left 5 11. 5 * 11 = 54. Target 55, found.", 2, 1, 1, 1),
    # x / 0 is wrong, not a crash
    (" 9 / 0 = 3, left 2 3. 12 / 4 = 3. Target 3, found.", 2, 1, 1, 1),
    ("<answer>1 + 2</answer> no steps", 0, 0, 0, 0),
])
def test_arithmetic_diagnostics(text, steps, wrong, claims, false):
    a = E.arithmetic([text], [97 if "97" in text else 55])
    assert (a["steps"], a["claims"]) == (steps, claims)
    assert a["step_error"] == (wrong / steps if steps else 0) and a["false_claims"] == (false / claims if claims else 0)
    assert E.arithmetic([text] * 3, [0] * 3)["step_error"] == a["step_error"]


def test_cli_writes_contract_files_recomputes_and_plots(tmp_path):
    out = tmp_path / "eval"
    cmd = [sys.executable, "evaluate.py", "--model", "tiny", "--data", "gen:nums=3-4,range=1-20,test=6",
           "--num_problems", "6", "--num_samples", "4", "--max_new_tokens", "8", "--template", "compact", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    s = json.load(open(out / "summary.json"))
    assert set(s) == {"num_problems", "num_samples", "pass_at_k", "by_size", "format_rate", "best_of_n", "pass_at_1_stderr",
                      "arithmetic", "verification", "strategies", "mistakes"}
    assert set(s["mistakes"]) == {"slip", "reuse", "giveup", "malformed"}  # each kind's share (plumbing/traces.py)
    assert list(s["verification"]["budgets"]) == ["1", "2", "4"]
    assert s["num_problems"] == 6 and s["num_samples"] == 4 and set(s["pass_at_k"]) == {"1", "2", "4"}
    assert set(s["by_size"]) <= {"3", "4"} and set(s["best_of_n"]) == {"accuracy", "avg_samples"}
    rows = [json.loads(x) for x in open(out / "samples.jsonl")]
    assert len(rows) == 6 and all(len(x["completions"]) == len(x["scores"]) == 4 for x in rows)
    assert "pass@1" in r.stdout
    # recompute: a hand-written correct answer flips a score and the summary follows
    from verifier import solve
    rows[0]["completions"][0] = f"<answer>{solve(rows[0]['nums'], rows[0]['target'])}</answer>"
    (out / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    r = subprocess.run([sys.executable, "evaluate.py", "--recompute", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.load(open(out / "summary.json"))["pass_at_k"]["4"] >= 1 / 6
    png = tmp_path / "curves.png"
    r = subprocess.run([sys.executable, "evaluate.py", "--plot", f"{out},{out}", "--out", str(png)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_report_gathers_stages_in_pipeline_order_and_draws(tmp_path):
    """evaluate.py --run: results.json holds every stage's summary plus wall seconds, the tables
    list the stages in the pipeline's order (others after), and both PNGs are drawn from the RL
    stages' metrics."""
    def summary(p1):
        return {"num_problems": 2, "num_samples": 2, "pass_at_k": {"1": p1, "2": min(1.0, 2 * p1)}, "pass_at_1_stderr": 0.1,
                "by_size": {"3": {"num_problems": 1, "pass_at_k": {"1": p1, "2": p1}},
                            "4": {"num_problems": 1, "pass_at_k": {"1": 0.0, "2": 0.0}}},
                "format_rate": 1.0, "best_of_n": {"accuracy": p1, "avg_samples": 1.5},
                "arithmetic": {"steps": 10, "step_error": 0.125, "claims": 4, "false_claims": 0.25},
                "strategies": {"random": {"share": 0.6, "pass@1": 0.3}, "backward": {"share": 0.4, "pass@1": 0.0}},
                "mistakes": {"slip": 0.5, "reuse": 0.0, "giveup": 0.25, "malformed": 0.125}}
    for i, name in enumerate(["zzz_extra", "rloo", "sft", "rlt_student"]):
        (tmp_path / "eval" / name).mkdir(parents=True)
        (tmp_path / "eval" / name / "summary.json").write_text(json.dumps(summary(0.1 * (i + 1))))
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "wall_seconds").write_text("12\n")
    for name, keys in (("rloo", ["train/reward", "train/accuracy", "train/strategy/backward", "train/mistake/slip"]),
                       ("rlt", ["train/r_ss", "eval/r_ss"])):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **{k: s / 10 for k in keys}}) + "\n"
                                                               for s in range(3)))
    r = subprocess.run([sys.executable, "evaluate.py", "--run", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    res = json.load(open(tmp_path / "results.json"))
    assert list(res) == ["sft", "rloo", "rlt_student", "zzz_extra"]
    assert res["sft"]["wall_seconds"] == 12 and res["rloo"]["wall_seconds"] is None
    assert res["rloo"]["pass_at_k"]["1"] == pytest.approx(0.2)
    # a mixed test set: each stage's pass@1 and pass@k over all and each count (NUMBERS=3to4's results)
    counts = json.load(open(tmp_path / "results_by_size.json"))
    assert list(counts) == list(res) and counts["rloo"] == {"pass@1": {"all": pytest.approx(0.2), "3": pytest.approx(0.2), "4": 0.0},
                                                            "pass@2": {"all": pytest.approx(0.4), "3": pytest.approx(0.2), "4": 0.0}}
    assert "By operand count" in r.stdout
    # --publish on a mixed run: docs/studies/results_3to4.json, never the default's results.json or Table 1
    from plumbing.report import publish
    (tmp_path / "docs" / "studies").mkdir(parents=True)
    (tmp_path / "README.md").write_text("no markers: the default's Table 1 is not touched")
    publish(str(tmp_path), docs=str(tmp_path / "docs"), readme=str(tmp_path / "README.md"))
    lane = json.load(open(tmp_path / "docs" / "studies" / "results_3to4.json"))
    assert not (tmp_path / "docs" / "results.json").exists() and "NUMBERS=3to4" in lane["about"]
    assert lane["rloo"]["pass@2"] == {"all": 0.4, "3": 0.2, "4": 0.0} and lane["sft"]["wall_seconds"] == 12
    assert lane["rloo"]["problems"] == {"all": res["rloo"]["num_problems"],
                                        **{c: p["num_problems"] for c, p in res["rloo"]["by_size"].items()}}
    table1 = r.stdout.split("Table 2")[0]
    assert table1.index("sft") < table1.index("rloo") < table1.index("rlt_student") < table1.index("zzz_extra")
    assert "3 nums@1" in table1 and "avg n" in r.stdout and "0.125  0.250" in table1
    assert "rand %" in table1 and "0.600   0.300   0.400   0.000" in table1  # per strategy: share, pass@1
    assert "slip  reuse  giveu  malfo" in table1 and "0.250  0.500  0.000  0.250  0.125" in table1
    for png in ("pass_at_k.png", "rl_curves.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    r = subprocess.run([sys.executable, "evaluate.py", "--run", str(tmp_path / "nothing")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "run ./run_cpu.sh" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "evaluate.py", "--run", str(tmp_path), "--compare", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "give one of --run" in r.stderr and "Traceback" not in r.stderr


def test_search_probe_counts_tries_aim_and_repeats_by_hand():
    """benchmarks/search_probe.py: a try is aimed when its first step opens some solution, operands
    of + and * in either order; hand-counted on two samples of [9, 2, 13] -> 31 (9 * 2 + 13)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import search_probe
    hit = "2 * 9 = 18, left 13 18. 13 + 18 = 31. Target 31, found."
    miss = "13 + 9 = 22, left 2 22. 22 + 2 = 24. Target 31, back."
    stats = search_probe.try_stats([([9, 2, 13], 31, [[hit], [miss, miss]])])
    assert stats == pytest.approx({"tries/sample": 1.5, "repeated": 1 / 3, "hit/try": 1 / 3, "hit/first try": 0.5,
                                   "aimed": 1 / 3, "hit/aimed try": 1.0, "hit/other try": 0.0})


def test_verification_table_is_pass_at_n_and_eq5_by_budget_and_size():
    correct, sizes = [0, 1, 4, 2], [3, 3, 4, 4]
    v = E.verification(correct, 4, sizes)
    assert list(v["budgets"]) == ["1", "2", "4"] and list(v["by_size"]) == ["3", "4"]
    for N in (1, 2, 4):
        row = v["budgets"][str(N)]
        assert row["accuracy"] == pytest.approx(sum(E.pass_at_k(4, c, N) for c in correct) / 4)
        assert row["avg_samples"] == pytest.approx(sum(E.expected_samples(4, c, N) for c in correct) / 4)
    assert v["budgets"]["4"]["accuracy"] == 0.75                                  # one problem never solved
    assert v["by_size"]["4"]["1"]["accuracy"] == pytest.approx((1 + 0.5) / 2)     # 4/4 and 2/4 correct


class ScriptedSampler:
    """Answers problem i correctly from its draw k_i on (never if k_i is None): the live selector must
    stop there, and redraw only the problems not yet accepted."""

    def __init__(self, tasks, first_correct):
        self.tasks, self.first, self.draws, self.prompts_seen = tasks, first_correct, [0] * len(tasks), []

    def generate(self, prompts, n, *args):
        self.prompts_seen.append(len(prompts))
        texts = []
        for p in prompts:
            i = next(j for j, t in enumerate(self.tasks) if f"equals {t['target']}." in p)
            self.draws[i] += 1
            t, k = self.tasks[i], self.first[i]
            good = k is not None and self.draws[i] >= k
            expr = " + ".join(map(str, t["nums"])) if good else "0"
            texts.append(f"</think>\n<answer>{expr}</answer>")
        return type("R", (), {"texts": texts})


def test_live_selector_stops_at_the_first_verified_sample():
    tasks = [{"nums": [1, 2, 3], "target": 6}, {"nums": [2, 3, 4], "target": 9},
             {"nums": [5, 6, 7, 1], "target": 19}]
    sampler = ScriptedSampler(tasks, [1, 3, None])
    v = E.verify_live(sampler, tasks, 4, 0.6, 0.95, 20, 32, "compact", seed=0)
    assert sampler.draws == [1, 3, 4] and sampler.prompts_seen == [3, 2, 2, 1]    # accepted rows leave
    assert v["budgets"]["1"] == {"accuracy": 1 / 3, "avg_samples": 1.0}
    assert v["budgets"]["2"] == {"accuracy": 1 / 3, "avg_samples": (1 + 2 + 2) / 3}
    assert v["budgets"]["4"] == {"accuracy": 2 / 3, "avg_samples": (1 + 3 + 4) / 3}
    assert v["by_size"]["4"]["4"]["accuracy"] == 0.0 and v["by_size"]["3"]["4"]["accuracy"] == 1.0


def test_cli_test_time_runs_the_live_selector(tmp_path, tiny_ckpt):
    """Also --skip_problems: the problems after the first 3 of the split (RLT's warm-up samples other
    problems than its exports)."""
    from plumbing import tasks as D
    out, data = tmp_path / "e", "gen:nums=3,range=1-9,test=20,val=8"
    cmd = [sys.executable, "evaluate.py", "--model", tiny_ckpt, "--data", data, "--skip_problems", "3",
           "--num_problems", "4", "--num_samples", "2", "--max_new_tokens", "8", "--template", "compact",
           "--test_time", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    problems = [{"nums": x["nums"], "target": x["target"]} for x in map(json.loads, open(out / "samples.jsonl"))]
    assert problems == D.load_tasks(data, "test", 7)[3:]
    live = json.load(open(out / "summary.json"))["verification_live"]
    assert list(live["budgets"]) == ["1", "2"] and 1.0 <= live["budgets"]["2"]["avg_samples"] <= 2.0
    assert "test-time verification (live)" in r.stdout


def test_moving_mean_by_hand():
    from plumbing import report
    assert report.moving_mean([1, 3, 5, 7], 2) == [1, 2, 4, 6]
    assert report.moving_mean([0, 0, 9], 5) == [0, 0, 3]  # fewer than w at the start


def test_export_keeps_each_problems_first_accepted_sample_as_sft_rows(tmp_path):
    """evaluate.py --export (rejection sampling, paper 004's baseline): per problem the first sample
    the verifier accepts, in the prompt the template builds; a problem with none is left out; sft.py
    trains on the file as it is."""
    from plumbing import tasks as D
    from verifier import score
    records = [{"nums": [3, 5, 7], "target": 56, "completions": ["<answer>3 + 5</answer>", "<answer>(3 + 5) * 7</answer>",
                                                                "<answer>7 * (5 + 3)</answer>"]},
               {"nums": [2, 4, 9], "target": 17, "completions": ["<answer>2 * 4</answer>"] * 3}]
    for r in records:
        r["scores"] = [score(c, r["nums"], r["target"]) for c in r["completions"]]
    rows = E.accepted(records, "compact")
    assert [r["completion"] for r in rows] == ["<answer>(3 + 5) * 7</answer>"]
    assert rows[0]["query"] == D.make_prompt([3, 5, 7], 56, "compact") and rows[0]["target"] == 56
    path = str(tmp_path / "teacher.jsonl")
    D.write_jsonl(path, rows * 20)
    prompts, responses = D.sft_data(path, "train", 0, "compact", eval_problems=2)
    assert len(prompts) == 18 and responses(random.Random(0))[0] == rows[0]["completion"]
