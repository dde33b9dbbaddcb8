"""benchmarks/gpu_smoke.sh at tiny scale on the CPU: the GPU smoke test's own path (every stage's
script through its README flags, the per-phase marks, the JSON lines), so it cannot rot before a
GPU runs it."""
import json
import math
import os
import subprocess
import sys

from conftest import ROOT


def test_gpu_smoke_tiny_writes_a_finite_line_per_stage(tmp_path):
    """Measured: 10-13 s on 2 busy cores. Broken on purpose (grpo.py's micro-batch loop raising, in
    a copy of the repo), its line read ok false with the error and where, this test failed on it,
    and every other stage still ran."""
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", "benchmarks/gpu_smoke.sh", "--tiny", "--work", str(tmp_path / "w")],
                       cwd=ROOT, env={**env, "OUT": str(tmp_path)}, capture_output=True,
                       text=True, timeout=300)
    lines = [json.loads(x) for x in (tmp_path / "gpu_smoke.jsonl").read_text().splitlines()]
    by = {x["stage"]: x for x in lines}
    assert list(by) == ["setup", "sft", "evaluate", "opd", "grpo", "rloo", "sft_lora", "ipo", "rlt",
                        "summary"]
    for name, row in by.items():
        why = f"{name}: {row.get('error')} {row.get('where')}\n{r.stderr[-3000:]}"
        assert row["ok"] is True, why
    assert r.returncode == 0, r.stderr[-3000:]

    def positive(x):
        return isinstance(x, (int, float)) and math.isfinite(x) and x > 0
    for name in ("sft", "rloo", "grpo", "opd", "sft_lora", "ipo", "rlt"):
        row = by[name]
        assert row["finite"] and row["steps"] >= 2, row
        assert all(map(positive, row["update_tokens_per_s"])), row
        assert positive(row["estimate_gb"]["update"]), row  # memory.py read the same command
        assert positive(row["eval_tokens_per_s"]), row
    for name in ("rloo", "grpo", "opd", "rlt"):  # the rollouts: every row to its budget, the fp32 canary
        row = by[name]
        assert all(map(positive, row["sample_tokens_per_s"])), row
        assert all(0 <= g < 1e-3 for g in row["sampler_gap"]), row
        assert "diagnose_steps" not in row, row  # the README's commands leave --term_grads off
    assert positive(by["evaluate"]["eval_tokens_per_s"])
    assert by["setup"]["prompt_tokens"] > 200  # the base template, the walkthrough's prompt


def test_gpu_smoke_tiny_sampler_stage(tmp_path):
    """`--stages sampler` on the CPU: the HF sampler's dynamic and static loops timed at both row
    counts (a line each as it ends), launches per step and each loop's sampler gap at the first,
    the graph's line skipped with its reason (CUDA only). Measured: ~8 s.
    Broken on purpose (the static loop raising, in a copy of the repo), its run lines read ok
    false with the error, the dynamic loop's still ran, and this test failed."""
    r = subprocess.run(["bash", "benchmarks/gpu_smoke.sh", "--tiny", "--stages", "sampler",
                        "--work", str(tmp_path / "w")], cwd=ROOT,
                       env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)},
                       capture_output=True, text=True, timeout=300)
    lines = [json.loads(x) for x in (tmp_path / "gpu_smoke.jsonl").read_text().splitlines()]
    runs = [x for x in lines if x["stage"] == "sampler/run"]
    assert runs[0] == {"stage": "sampler/run", "decode": "graph", "ok": None,
                       "skipped": runs[0]["skipped"]} and "CUDA only" in runs[0]["skipped"]
    assert [(x["rows"], x["decode"], x["ok"]) for x in runs[1:]] == [
        (16, "dynamic", True), (16, "static", True), (32, "dynamic", True), (32, "static", True)]
    for x in runs[1:]:
        assert x["new_tokens"] == 8 and x["decode_steps"] == 7, x  # a random model never stops
        assert x["tokens_per_s"] > 0 and x["decode_tokens_per_s"] > 0 and x["step_ms"] > 0, x
    stage = next(x for x in lines if x["stage"] == "sampler")
    assert stage["ok"] is True and stage["errors"] == [], (stage, r.stderr[-3000:])
    for d in ("dynamic", "static"):
        assert stage["checks"][f"launches/{d}"]["aten_ops"] > 0  # a CPU launches no kernel
        assert 0 <= stage["checks"][f"sampler_gap/{d}"] < 1e-5  # fp32 on both sides
    assert lines[-1]["stage"] == "summary" and lines[-1]["ok"] is True and r.returncode == 0


def test_sampler_stage_compares_tokens_and_logprobs(monkeypatch):
    """The graph-against-static check: rows whose tokens differ, the first token where any does,
    and log-prob differences over each row's shared prefix only."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    # gpu_smoke sets HF_HUB_OFFLINE=1 on import: restored after this test, so that the hub's
    # one-line errors later in the suite still see the network missing (test_robustness.py)
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "1"))
    from gpu_smoke import compare

    from common import Rollouts
    a = Rollouts([[1]], [[5, 6, 7], [8, 9]], [[-1.0, -2.0, -3.0], [-0.5, -0.25]], ["", ""],
                 [False, False])
    assert compare(a, a) == {"tokens_identical": True, "rows_differing": 0,
                             "first_differing_token": None, "logprob_max_abs_diff": 0.0,
                             "logprob_mean_abs_diff": 0.0}
    b = Rollouts([[1]], [[5, 6, 4], [8, 9]], [[-1.0, -2.5, -9.0], [-0.5, -0.25]], ["", ""],
                 [False, False])
    got = compare(a, b)
    assert got["tokens_identical"] is False and got["rows_differing"] == 1
    assert got["first_differing_token"] == 2 and got["logprob_max_abs_diff"] == 0.5
