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
