"""Fixtures: tiny real models written to folders and loaded through from_pretrained, and a clean environment."""
import os

import pytest

from helpers import build_tiny_model


def pytest_configure(config):
    # make test runs both tiers (so does CI); make test-fast leaves the slow one out
    config.addinivalue_line("markers", "slow: real processes at length (torchrun-style gloo ranks, kill -9 and "
                                       "resume, engines, the full bad-input table, --compile)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init 2-layer GPT-2 with a byte-level BPE tokenizer (pad == EOS, dropout 0.1 in its config)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-gpt2")), seed=0)


@pytest.fixture(scope="session")
def tiny_rotary_dir(tmp_path_factory):
    """A random-init 2-layer Llama (rotary positions, 4 query heads on 2 K/V heads) with the tiny GPT-2's tokenizer."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")), seed=0, arch="llama")


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory):
    """A random-init 2-layer Qwen2 instruct model (scripts/make_tiny_model.py --arch qwen2
    --chat): a ChatML chat template, <|im_end|> its EOS and end of turn, <|endoftext|> its pad."""
    folder = str(tmp_path_factory.mktemp("tiny-chat"))
    return build_tiny_model(folder, seed=0, arch="qwen2", chat=True)


@pytest.fixture(params=["gpt2", "llama"])
def any_model_dir(request, tiny_model_dir, tiny_rotary_dir):
    return tiny_model_dir if request.param == "gpt2" else tiny_rotary_dir


@pytest.fixture
def clean_env(monkeypatch):
    """No GRPO_ variable of the caller's shell reaches an in-process train_lean.main()."""
    for name in [k for k in os.environ if k.startswith("GRPO_")]:
        monkeypatch.delenv(name)
