"""What the tests share: paths, the tiny model builders, the real command line, reading what a run wrote.

Fixtures live in conftest.py; everything a test imports comes from here, never from another test file.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest
import torch
from safetensors.torch import load_file

import forked

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train_lean.py")
# 400 real RookWorld lines beside the repository (never copied into it); tests that read them skip without
ROOK_VAL = os.path.join(REPO, "..", "shared", "data", "rook_val_400.txt")
sys.path.insert(0, os.path.join(REPO, "scripts"))
from make_tiny_model import build_tiny_model  # noqa: E402,F401  (re-exported for the fixtures)
from chaos import children, process_alive, wait_until  # noqa: E402,F401  (re-exported: /proc, polling)

# tiny and fast: 4 prompts x 2 completions, short completions, a learning rate that moves the weights, and
# no held-out evaluation (the default task is chess, which evaluates by default: tests of it are elsewhere)
SMALL = ["--batch-size", "8", "--group-size", "2", "--max-new-tokens", "12", "--learning-rate", "1e-3",
         "--eval-interval", "0", "--log-level", "info"]
# timings and memory differ between runs; everything else in a record must not
VOLATILE = ("_time_s", "samples_per_s", "tokens_per_s", "rss_mb", "rss_peak_mb")

# a task whose reward has parts (--reward-weights names them), for a file: --task FILE:Parted
PARTED_TASK = """
from tasks.toy import ToyTask

class Parted(ToyTask):
    def reward_breakdown(self, prompt, completion):
        return {"reward": self.reward(prompt, completion), "letter": float(completion[:1] == prompt[7]),
                "short": 1 / (1 + len(completion))}
"""

# A user's task file (--task FILE:Evaluated): the toy task with its option (--width) and a held-out evaluation,
# whose call number $RAISE_AT_EVAL (from 1: with --eval-interval N, call k evaluates step (k-1)N) raises, as a
# buggy one would
EVALUATED_TASK = """
import dataclasses
import os
from tasks.toy import ToyTask

@dataclasses.dataclass
class Options:
    width: int = 10

class Evaluated(ToyTask):
    options = Options
    calls = 0

    def evaluate(self, complete):
        Evaluated.calls += 1
        if str(Evaluated.calls) == os.environ.get("RAISE_AT_EVAL"):
            raise RuntimeError("the evaluation broke")
        texts = complete(["Repeat a: ", "Repeat b: "])
        return {"n": len(texts), "first_letter_rate": sum(t[:1] == c for t, c in zip(texts, "ab")) / 2}
"""


# A user's conversational task (--task FILE:ChatToy): the toy task asked as a conversation with its
# own system message, for an instruct model. Given $EXPECT_SYSTEM, its reward raises unless the
# conversation it gets has that system message: what --system-prompt must make of the task's own
CHAT_TASK = """
import os
from tasks.toy import LETTERS, ToyTask

SYSTEM = "Repeat the letter ten times."


def ask(letter):
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Repeat {letter}: "}]


class ChatToy(ToyTask):
    name = "chat-toy"

    def prompts(self, n, rng):
        return [ask(rng.choice(LETTERS)) for _ in range(n)]

    def reward(self, prompt, completion):
        expected = os.environ.get("EXPECT_SYSTEM", prompt[0]["content"])
        if prompt[0] != {"role": "system", "content": expected}:
            raise ValueError(f"the reward got the system message {prompt[0]!r}")
        return self.score(prompt, completion)

    def score(self, prompt, completion):
        return ToyTask.reward(self, prompt[-1]["content"], completion)

    def evaluate(self, complete):
        prompts = [ask(c) for c in LETTERS]
        return {"acc": [self.score(p, c) == 1.0 for p, c in zip(prompts, complete(prompts))]}
"""


def small_vocab_model(tokenizer_dir: str, path: str, vocab_size: int = 300) -> str:
    """A tiny GPT-2 whose vocabulary is smaller than the tokenizer of tokenizer_dir it is saved with."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


def without_tokenizer(model_dir: str, path: str) -> str:
    """The model's config and weights alone: a folder copied without the tokenizer's files."""
    os.makedirs(path)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(model_dir, name), path)
    return str(path)


def env(**extra):
    """One thread (several test processes share the machine's cores), no hub access, no GRPO_ variables."""
    return user_env(OMP_NUM_THREADS="1", **extra)


def user_env(**extra):
    """A user's environment: the default threads (every core); no hub access, no GRPO_ variables."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("GRPO_") and k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    e.update(HF_HUB_OFFLINE="1", PYTHONPATH=REPO, **extra)
    return e


def line_starting(proc, prefix: str, timeout: float) -> str:
    """The first stdout line of `proc` that starts with `prefix`; the process is killed if none comes within
    `timeout` seconds (start-up under load is slow, so deadlines are measured from such a line on)."""
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        for line in proc.stdout:
            if line.startswith(prefix):
                return line
    finally:
        killer.cancel()
    raise AssertionError(f"no line starting with {prefix!r}: {proc.stderr.read()[-2000:] if proc.stderr else ''}")


# a deadline for a whole process that only stops a hung one: generous enough for start-up and a few
# steps on a loaded machine (load 6 on 2 vCPUs, torch's import from a cold page cache); a test never
# times its subject
PROCESS_DEADLINE_S = 900


def train(*args, timeout=PROCESS_DEADLINE_S, extra_env=None, cwd=None):
    """train_lean.py run to its end in a process of its own, one thread, no GRPO_ variables from the
    caller's environment: a subprocess.CompletedProcess. The process is forked from a server that
    imported the trainer once (harness/forked.py's reason: a fresh interpreter spends about 8 s
    importing torch and transformers, most of the slow tier's time)."""
    return forked.run([TRAIN, *args], env(**(extra_env or {})), timeout, cwd)


def usage_error(argv, capsys) -> str:
    """The one stderr line of train_lean.main(argv) run in this process, checked to exit 2 with just
    that line (the command line's own path, without the seconds a process takes to start)."""
    import pytest
    import train_lean
    with pytest.raises(SystemExit) as exit_:
        train_lean.main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2, (argv, err[-500:])
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("train_lean.py: error: "), err
    return err


def trained_in_process(*argv) -> str:
    """train_lean.main(argv) in this process without the caller's GRPO_ variables, for a fixture
    wider than a test (where capsys and monkeypatch are not): its stdout. A run several tests
    share."""
    import contextlib
    import io
    import train_lean
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("GRPO_")}
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            train_lean.main(list(argv))
    finally:
        os.environ.update(saved)
    return stdout.getvalue()


def one_line_error(result) -> str:
    """The one stderr line of a run that exited 2 (a usage error), checked to be just that."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("train_lean.py: error: "), result.stderr
    return lines[0]


def means(metrics: dict) -> dict:
    """What a task's evaluate() returned, each per-item list as its mean (the number the eval record holds)."""
    return {k: sum(map(float, v)) / len(v) if isinstance(v, (list, tuple)) else v for k, v in metrics.items()}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def records(path):
    """A run's records without the keys that differ between identical runs (timings, memory)."""
    return [{k: v for k, v in r.items() if not k.endswith(VOLATILE)} for r in read_jsonl(path)]


def weights(checkpoint_dir):
    return load_file(os.path.join(checkpoint_dir, "model.safetensors"))


def loss_config(**knobs):
    """The settings grpo_loss reads (grpo/settings.py), from the loss's knobs as the tests write them: clip_low / clip_high are
    --clip-range / --clip-range-high, and there is no KL term unless kl_coef is given."""
    from grpo.settings import Settings
    k = dict(knobs)
    return Settings(kl_coef=k.pop("kl_coef", 0.0), clip_range=k.pop("clip_low", 0.2),
                  clip_range_high=k.pop("clip_high", None), **k)


def write_run(folder, offset):
    """A run folder whose metrics.jsonl holds four step records and two chess-like eval records (for the plots)."""
    os.makedirs(folder)
    evals = [{"kind": "eval", "step": s, "p_n": 2, "a_n": 2, "p_legal_rate": 0.3 + offset, "a_format_rate": 0.6}
             for s in (0, 4)]
    steps = [{"step": s, "reward_mean": 0.3 + offset + 0.01 * s, "reward_policy_legal": 0.2} for s in range(1, 5)]
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in [evals[0], *steps, evals[1]])
    return os.path.join(folder, "metrics.jsonl")


def header_rows(stdout: str) -> tuple:
    """The header (its title and the indented lines under it) and its rows, name -> value: a row's
    first line is its name and value two spaces apart, the lines under it (indented further)
    continue a value that wrapped, at a space, which a path may hold too."""
    lines = stdout.splitlines()
    end = next(i for i, line in enumerate(lines[1:], 1) if not line.startswith(" "))
    rows = {}
    for line in lines[1:end]:
        row = re.fullmatch(r"  (\S+(?: \S+)*)  +(.*)", line)
        if row:
            name = row[1]
            rows[name] = row[2]
        else:
            rows[name] += " " + line.strip()
    return "\n".join(lines[:end]), rows


# torch.compile's C++ build on the CPU (inductor) hands its temporary paths to g++ unquoted: under a
# TMPDIR with a space every such compilation fails, whatever the code compiled
INDUCTOR_BUILDS = pytest.mark.skipif(" " in tempfile.gettempdir(),
                                     reason="TMPDIR has a space, which torch inductor's g++ call splits")
