"""Shared by the tests: one tiny random checkpoint, built once per session."""
import pytest
import torch

import common as C
from checkpoints import save_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The dir of a tiny random Qwen2 and its tokenizer (seed 0). Tests read it; none writes into it."""
    out = str(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    tok = C.build_tiny_tokenizer()
    save_checkpoint(C.build_tiny_model(tok), tok, out)
    return out
