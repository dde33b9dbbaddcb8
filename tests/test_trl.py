"""The peer on our checkpoints, for real: an opt-in lane (`pip install -e '.[trl]'`, then
`python -m pytest -m trl`) that runs benchmarks/trl_peer.py, TRL's GRPOTrainer and RLOOTrainer loaded
as a TRL user loads a checkpoint (AutoTokenizer, AutoModelForCausalLM), for 2 steps of the pipeline's
recipe on a tiny checkpoint of ours, and reads back what it wrote."""
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.trl
pytest.importorskip("trl", reason="TRL is not installed: pip install -e '.[trl]'")


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_trl_trains_two_steps_on_a_checkpoint_of_ours_and_evaluate_reads_its_output(trainer, tmp_path):
    init = os.path.join(ROOT, "pretrained", "tiny-teacher")  # answers that score: rewards vary
    out = tmp_path / trainer
    done = subprocess.run([sys.executable, "benchmarks/trl_peer.py", trainer, "--init", init,
                           "--output_dir", str(out), "--max_steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 < r["time/sample"] < r["time/step"] for r in rows)
    # the teacher solves about half: TRL, reading it through AutoTokenizer, sees the same
    assert all(r["train/reward"] > 0.2 for r in rows), rows
    summary = json.load(open(out / "summary.json"))
    assert summary["steps"] == 2 and summary["peak_rss_gb"] > 0
    ev = subprocess.run([sys.executable, "evaluate.py", "--model", str(out), "--data",
                         "gen:nums=3,range=1-20,test=200,val=100", "--template", "compact",
                         "--num_problems", "8", "--num_samples", "2", "--max_new_tokens", "160",
                         "--out", str(tmp_path / "eval")], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.load(open(tmp_path / "eval" / "summary.json"))["pass_at_k"]["1"] > 0.1


def test_peer_sh_times_both_sides_on_one_checkpoint(tmp_path):
    """benchmarks/peer.sh, the side-by-side timing docs/studies/performance.md quotes: TRL's GRPO and
    ours, 2 steps each, one line a side with seconds a step, sampling and update, and peak memory."""
    init = os.path.join(ROOT, "pretrained", "tiny-teacher")
    done = subprocess.run(["bash", "benchmarks/peer.sh", init, str(tmp_path), "2", "fp32", "grpo"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if " s/step " in line}
    assert set(lines) == {"trl_grpo_fp32", "ours_grpo_fp32"}, done.stdout
    assert all(" peak " in line and " GB " in line for line in lines.values())
