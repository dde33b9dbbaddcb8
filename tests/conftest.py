"""Shared by the tests: paths, the tiny generated task set, and one tiny random checkpoint per
session."""
import os
import sys
import tempfile

import pytest
import torch

from plumbing import models as M
from plumbing.checkpoints import save_checkpoint

# scripts run as subprocesses from here
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    """Under pytest-xdist (`-n auto` in pyproject's addopts: one worker a core) each worker, and
    every script it starts, gets its share of the cores, not all of them each. The generated
    training splits they keep (plumbing/tasks.py: generated) go to a folder of the session's."""
    os.environ["COUNTDOWN_CACHE"] = tempfile.mkdtemp(prefix="countdown-tests-")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        n = max(1, torch.get_num_threads() // workers)
        torch.set_num_threads(n)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS",
                    "TORCHINDUCTOR_COMPILE_THREADS"):
            os.environ[var] = str(n)


@pytest.fixture(scope="session", autouse=True)
def warm_python(tmp_path_factory):
    """Every `python script.py` a test starts (through sys.executable, $PYTHON, $PY) forks from one
    interpreter per worker that has imported torch and transformers (tests/warm_python.py), instead
    of importing them again (~3 s each). WARM_PYTHON=0: real interpreters."""
    import shutil
    import subprocess
    if os.environ.get("WARM_PYTHON") == "0" or sys.platform != "linux":
        yield
        return
    d = tmp_path_factory.mktemp("warm")
    real, sock, shim = sys.executable, str(d / "sock"), d / "python"
    server = subprocess.Popen([real, os.path.join(ROOT, "tests", "warm_python.py"), "--serve", sock,
                               str(os.getpid())])  # it dies with this worker, however the worker ends
    shim.write_text(f'#!/bin/sh\nexec "{real}" -I -S "{os.path.join(ROOT, "tests", "warm_python.py")}" '
                    f'"{real}" "$@"\n')
    shim.chmod(0o755)
    os.environ["WARM_PYTHON"], os.environ["WARM_PYTHON_REAL"], sys.executable = sock, real, str(shim)
    try:
        yield
    finally:
        sys.executable = real
        os.environ.pop("WARM_PYTHON", None)
        os.environ.pop("WARM_PYTHON_REAL", None)
        server.kill()
        server.wait()
        shutil.rmtree(d, ignore_errors=True)


# 20 test + 8 val problems: every script's --data in the tests
GEN = "gen:nums=3,range=1-9,test=20,val=8"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The dir of a tiny random Qwen2 and its tokenizer (seed 0). Tests read it; none writes into
    it."""
    out = str(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    tok = M.build_tiny_tokenizer()
    save_checkpoint(M.build_tiny_model(tok), tok, out)
    return out


def gap_bound(bf16, vllm=False):
    """The weight-sync canary's bound (train/sampler_gap: mean |sampler − trainer| log-prob) for a
    trainer computing in bf16 or fp32 beside an fp32 sampler. fp32: float noise (measured ~2e-7 with
    the HF sampler; vLLM's own kernels: 1e-4). bf16: the trainer's rounding, measured 6e-4 to 1.1e-3
    on the tiny model and 1.9e-3 on the pipeline's SFT model, while a sampler one step stale at lr
    1e-3 is 0.2 off (tests/test_rl_signal.py): 1e-2 tells the two apart."""
    return 1e-2 if bf16 else (1e-4 if vllm else 1e-5)


def run_cli(script, *args):
    """`python script args...` as its cli() runs it, in this process (no interpreter to start: the
    one-line error checks ran 3-4 s each as subprocesses): the exit code and stderr, as
    subprocess.run returns them. An exception that is not a one-line error propagates."""
    import contextlib
    import importlib
    import io
    from types import SimpleNamespace

    from plumbing.flags import cli
    module, out, err, argv = importlib.import_module(script[:-3]), io.StringIO(), io.StringIO(), sys.argv
    sys.argv, code = [script, *args], 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli(module.main)
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
