"""Shared by the reliability tests: the real command line, and reading what a run wrote."""
import json
import os
import subprocess
import sys

from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train_lean.py")
# tiny and fast: 4 prompts x 2 completions, short completions, a learning rate that moves the weights, and
# no held-out evaluation (the default task is chess, which evaluates by default: tests of it are elsewhere)
SMALL = ["--batch-size", "8", "--group-size", "2", "--max-new-tokens", "12", "--learning-rate", "1e-3",
         "--eval-interval", "0", "--log-level", "info"]
# timings and memory differ between runs; everything else in a record must not
VOLATILE = ("_time_s", "samples_per_s", "tokens_per_s", "rss_mb", "rss_peak_mb")


def env(**extra):
    """One thread, so float reductions run in the same order in every process; no hub access."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    e.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT, **extra)
    return e


def train(*args, timeout=120, **kw):
    return subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True, env=env(),
                          timeout=timeout, **kw)


def records(path):
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.endswith(VOLATILE)} for line in f]


def weights(checkpoint_dir):
    return load_file(os.path.join(checkpoint_dir, "model.safetensors"))
