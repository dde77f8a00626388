"""Fixtures: tiny real models written to folders and loaded through from_pretrained, and a clean environment."""
import os

import pytest
import torch

from helpers import build_tiny_model

# the user's CPU threads: every core, or their OMP_NUM_THREADS (torch reads it when it starts). This
# process runs on one (the session's fixtures too), as the subprocesses of helpers.env do: on a busy
# machine OpenMP's idle threads spin (at load 10 on 2 vCPUs a tiny model's gradient took 20 times
# the CPU and 50 times the wall time on 2 threads that it took on 1)
USER_THREADS = torch.get_num_threads()
torch.set_num_threads(1)


def pytest_collection_modifyitems(session, config, items):
    """The files with the most slow tests first (make test's two workers take whole files in this
    order): a long file taken last leaves one worker running it alone (longest first)."""
    slow = {}
    for item in items:
        slow[item.fspath] = slow.get(item.fspath, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.fspath])   # stable: a file's tests keep their order


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


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread again after each test, whatever it set."""
    yield
    torch.set_num_threads(1)


@pytest.fixture
def user_threads():
    """The user's CPU threads (every core by default) for a test in this process of what a user
    relies on: a run that resumes, or repeats, bit for bit."""
    torch.set_num_threads(USER_THREADS)
