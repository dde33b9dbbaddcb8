"""Shared by the tests: paths, the tiny generated task set, and one tiny random checkpoint per
session."""
import os

import pytest
import torch

import models as M
from checkpoints import save_checkpoint

# scripts run as subprocesses from here
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
