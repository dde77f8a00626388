"""Bad input, tried systematically: every flag of the trainer (and of the chess task's options) with a
value of the wrong type, out of range or empty, plus missing, unreadable or wrong files, a folder that is
no model and task files that fail, output folders that are not this run's, damaged checkpoints, task files
whose prompts or min_reward are wrong, models whose tokenizer does not fit them. Each must exit with code 2
and one line naming the flag or file, with no traceback, before a model is loaded."""
import os
import pathlib
import shutil

import pytest

from harness import cli, config, rundir
from helpers import small_vocab_model, usage_error, without_tokenizer
from tasks.rookworld.task import MixOptions
from train_lean import TABLES

pytestmark = pytest.mark.slow   # the full bad-input table


def wrong_values(f) -> list:
    """Values no field of f's type accepts: another type, and empty where the field is not optional."""
    base, optional = cli._base_type(f)
    if f.metadata.get("choices"):
        return ["bogus"] + ([] if optional else [""])
    if base is bool:
        return ["maybe", ""]
    if base is int:
        return ["x", "1.5"] + ([] if optional else [""])
    if base is float:
        return ["x", "nan", "inf"] + ([] if optional else [""])
    return []


# (flag, value, what the line must say): ranges and rules each field has
RANGES = [
    ("--batch-size", "0", "at least 1"), ("--batch-size", "-8", "at least 1"), ("--group-size", "1", "at least 2"),
    ("--group-size", "0", "at least 1"), ("--mini-batch-size", "0", "at least 1"), ("--mini-batch-size", "48", "multiple"),
    ("--micro-batch-size", "0", "at least 1"), ("--micro-batch-size", "5", "does not divide"),
    ("--micro-batch-tokens", "0", "at least 1"),
    # a path of blanks trained into a folder named " " that every message showed as nothing
    ("--out-dir", " ", "starts or ends with a blank"), ("--log-file", "m.jsonl ", "starts or ends with a blank"),
    ("--ptx-file", " texts.txt", "starts or ends with a blank"),
    ("--generation-batch-size", "0", "at least 1"), ("--ppo-epochs", "0", "at least 1"),
    ("--logprob-chunk-size", "0", "at least 1"), ("--max-new-tokens", "0", "at least 1"),
    ("--min-new-tokens", "-1", "must be in"), ("--min-new-tokens", "999", "must be in"),
    ("--temperature", "-0.5", ">= 0"), ("--top-k", "-1", ">= 0"), ("--top-p", "0", "(0, 1]"), ("--top-p", "1.5", "(0, 1]"),
    ("--learning-rate", "0", "(0, 1)"), ("--learning-rate", "-0.0001", "(0, 1)"),
    ("--learning-rate", "1e308", "no AdamW or Muon update can make a weight non-finite"),
    ("--weight-decay", "-1", ">= 0"), ("--weight-decay", "20000", "keep their product below 1"),
    ("--max-grad-norm", "-1", ">= 0"), ("--clip-range", "0", "> 0"), ("--clip-range-high", "-0.1", "> 0"),
    ("--kl-coef", "-0.1", ">= 0"), ("--loss-agg", "mean", "not one of"), ("--dual-clip", "1", "> 1"),
    ("--dual-clip", "0.5", "> 1"), ("--entropy-coef", "-1", ">= 0"), ("--top-entropy-quantile", "0", "(0, 1]"),
    ("--top-entropy-quantile", "1.5", "(0, 1]"), ("--max-sampling-rounds", "-1", ">= 0"),
    ("--overlong-buffer", "-1", "must be in"), ("--overlong-buffer", "999", "must be in"),
    ("--overlong-penalty", "-1", ">= 0"), ("--steps", "0", "at least 1"), ("--eval-interval", "-1", ">= 0"),
    ("--save-interval", "-1", ">= 0"), ("--keep-checkpoints", "0", "at least 1"), ("--max-nonfinite", "0", "at least 1"),
    ("--task-mix", "1.5", "[0, 1]"), ("--task-mix", "-0.1", "[0, 1]"), ("--stockfish-depth", "0", "at least 1"),
    ("--eval-samples", "0", "at least 1"), ("--stockfish-timeout", "0", "> 0"), ("--fen-similarity", "1", "[0, 1)"),
    ("--resume-allow-change", "bogus", "'bogus' is not a setting"), ("--resume-allow-change", ",", "names no setting"),
    ("--resume-allow-change", "steps", "--steps may change on --resume without it"),
    ("--resume-allow-change", "learning_rate", "applies only with --resume"),
    ("--trace-memory", "-1", ">= 0"), ("--trace-memory", "1", "trace 2 or more"), ("--trace-memory-after", "-1", ">= 0"),
    ("--lr-warmup-ratio", "1", "[0, 1)"), ("--min-lr-ratio", "-0.1", "[0, 1)"), ("--ref-sync-alpha", "0", "(0, 1]"),
    ("--ref-sync-steps", "-1", ">= 0"), ("--lora-rank", "-1", ">= 0"), ("--lora-alpha", "0", "> 0"),
    ("--lora-target-modules", "c_attn", "with --lora-rank 0"),
    ("--ptx-coef", "-1", ">= 0"), ("--ptx-batch-size", "0", "at least 1"), ("--demo-mix", "1.5", "[0, 1]"),
    ("--sapo-tau-pos", "0", "> 0"), ("--sapo-tau-neg", "-1", "> 0"), ("--cov-ratio", "0", "(0, 1]"),
    ("--cov-ratio", "1.5", "(0, 1]"), ("--kl-cov-coef", "-1", ">= 0"),
    ("--sapo-tau-pos", "2", "is a knob of --policy-loss sapo, and the run's is ppo"),
    ("--clip-cov-ub", "9", "is a knob of --policy-loss clip-cov"), ("--cov-ratio", "0.1", "clip-cov or kl-cov"),
    ("--shaping-alpha", "0.3", "is a knob of --token-advantage entropy, and the run's is sequence"),
    ("--shaping-kappa", "0.5", "at least 1"), ("--shaping-alpha", "-1", ">= 0"),
    ("--stop-grace", "0", "(0, 1e6]"), ("--reward-timeout", "-1", "[0, 1e6]"),
    # issue 72 finding 16: accepted, then an OverflowError (timestamp out of range)
    ("--stop-grace", "1e12", "--stop-grace 1000000000000.0 must be in (0, 1e6]"),
    ("--reward-timeout", "1e12", "[0, 1e6]"),
    ("--advantage", "gdpo", "name them with --reward-weights"),
    ("--reward-weights", "a", "'a' is not name=weight"), ("--reward-weights", "a=1,a=2", "each name once"),
    ("--reward-weights", "a=inf", "'a=inf' is not name=weight"), ("--reward-weights", "=1", "is not name=weight"),
]


def cases():
    fields = {**cli.variant_fields(TABLES), **config.fields_of(MixOptions)}
    table = [(config.flag(name), value, config.flag(name)) for name, f in fields.items() for value in wrong_values(f)]
    table += RANGES
    return table


CASES = cases()


PROMPTS = """
class Base:
    name = "base"
    def prompts(self, n, rng): return ["Repeat a: "] * n
    def reward(self, prompt, completion): return 0.0
class Fewer(Base):
    def prompts(self, n, rng): return ["Repeat a: "] * (n - 1)
class Empty(Base):
    def prompts(self, n, rng): return []
class NotStr(Base):
    def prompts(self, n, rng): return [b"Repeat a: "] * n
class Long(Base):
    def prompts(self, n, rng): return ["Repeat a: " * 200] * n
class NanFloor(Base):
    min_reward = float("nan")
class FewTexts(Base):
    def demonstrations(self, n, rng): return ["a text"] * (n - 1)
class BytesTexts(Base):
    def demonstrations(self, n, rng): return [b"a text"] * n
class EmptyText(Base):
    def demonstrations(self, n, rng): return [""] * n
class EmptyTarget(Base):
    def demonstrations(self, n, rng): return [("Repeat a: ", "")] * n
class LongContext(Base):
    def demonstrations(self, n, rng): return [("Repeat a: " * 200, "a")] * n
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dir, tiny_rotary_dir):
    root = tmp_path_factory.mktemp("bad")
    (root / "prompts.py").write_text(PROMPTS)
    without_tokenizer(tiny_model_dir, root / "no-tokenizer")
    without_tokenizer(tiny_rotary_dir, root / "llama-no-tokenizer")
    small_vocab_model(tiny_model_dir, root / "small-vocab")
    (root / "a-file").write_text("not a folder\n")
    (root / "empty-model").mkdir()
    (root / "not-rookworld.txt").write_text("hello\nworld\n")
    (root / "blank.txt").write_text("\n  \n")
    (root / "raises.py").write_text("raise ValueError('broken on import')\n")
    (root / "no-reward.py").write_text("class T:\n    name = 't'\n    def prompts(self, n, rng): return ['x'] * n\n")
    (root / "bad-options.py").write_text("class T:\n    options = 3\n")
    (root / "syntax.py").write_text("def broken(:\n")
    (root / "finished").mkdir()
    (root / "finished" / "metrics.jsonl").write_text('{"step": 1}\n')   # an earlier run's record
    (root / "damaged-checkpoint").mkdir()
    (root / "damaged-checkpoint" / "trainer_state.pt").write_bytes(b"PK\x03\x04 cut short")
    (root / "huge-model").mkdir()   # weights as big as the free disk (sparse): no room for a checkpoint
    with open(root / "huge-model" / "model.safetensors", "wb") as f:
        f.truncate(shutil.disk_usage(root).free)
    (root / "busy").mkdir()
    with rundir.lock(str(root / "busy")):   # another run's lock on the folder, held while the tests run
        yield root


def file_cases(root):
    return [
        (["--model", str(root / "nowhere")], "no such folder"),
        (["--model", str(root / "empty-model"), "--eval-interval", "0"], "cannot load --model"),
        (["--model", str(root / "a-file")], "--model"),
        (["--data", str(root / "missing.txt")], "no such file"),
        (["--ptx-coef", "1", "--ptx-file", str(root / "missing.txt")], "no such file"),
        (["--ptx-file", str(root / "not-rookworld.txt")], "with --ptx-coef 0 (no pretraining mix)"),
        # the default --task chess declares --ptx-coef 1 (tasks/rookworld/task.py): the toy task's is 0
        (["--ptx-batch-size", "4"], "with --ptx-coef 0 (no pretraining mix)"),
        (["--ptx-coef", "1", "--ptx-file", str(root / "blank.txt")], "has no text"),
        (["--ptx-coef", "1", "--task", "toy"], "--ptx-coef needs text: give --ptx-file PATH"),
        (["--ptx-coef", "1", "--task", f"{root / 'prompts.py'}:FewTexts"], "demonstrations(2, rng) returned 1 texts"),
        (["--ptx-coef", "1", "--task", f"{root / 'prompts.py'}:BytesTexts"], "pair of strings, not b'a text'"),
        (["--ptx-coef", "1", "--task", f"{root / 'prompts.py'}:EmptyText"], "demonstrations(2, rng) returned '': an "
                                                                            "empty text teaches the model to end at once"),
        (["--ptx-coef", "1", "--task", f"{root / 'prompts.py'}:EmptyTarget"], "returned ('Repeat a: ', ''): an empty "
                                                                              "target teaches the model to end at once"),
        (["--ptx-coef", "1", "--task", f"{root / 'prompts.py'}:LongContext"], "a --ptx-coef text's context of 602 "
                                                                              "tokens (with BOS) ('Repeat a: Repeat a"),
        (["--data", str(root)], "no such file"),
        (["--task", "chess-env", "--data", str(root / "not-rookworld.txt")], "not RookWorld P:/A: samples"),
        (["--out-dir", str(root / "a-file" / "out")], "cannot write to"),
        (["--log-file", str(root / "a-file" / "m.jsonl")], "cannot write to"),
        (["--log-completions", str(root / "a-file" / "c.jsonl")], "cannot write to"),
        (["--log-file", str(root / "empty-model")], "empty-model is a folder: pass the path of a file to write"),
        (["--log-completions", str(root / "empty-model")], "is a folder: pass the path of a file to write"),
        (["--out-dir", str(root) + "/out\udcff"], "out\\xff has a byte that is not UTF-8"),   # argv byte 0xff
        (["--resume", str(root / "nowhere")], "no checkpoint"),
        (["--task", f"{root / 'raises.py'}:T"], "raised ValueError: broken on import"),
        (["--task", f"{root / 'syntax.py'}:T"], "raised SyntaxError"),
        (["--task", f"{root / 'missing.py'}:T"], "not found"),
        (["--task", f"{root / 'no-reward.py'}:T", "--eval-interval", "0"], "has no 'reward'"),
        (["--task", f"{root / 'no-reward.py'}:Nope"], "has no attribute Nope"),
        (["--task", f"{root / 'bad-options.py'}:T"], "options must be a dataclass"),
        (["--task", "no.such.module:T"], "cannot import"),
        (["--task", "chess", "--stockfish-path", str(root / "nowhere")], "no executable Stockfish"),
        (["--report-to", "tensorboard"] if not _importable("tensorboard") else ["--report-to", "x"], "--report-to"),
        (["--overwrite", "--resume"], "pass only one of them"),
        (["--out-dir", str(root / "finished")], "holds an earlier run's records"),
        (["--out-dir", str(root / "busy")], "is in use by another run"),
        (["--resume", str(root / "damaged-checkpoint")], "the checkpoint is damaged"),
        (["--model", str(root / "huge-model")], "free on its disk"),
        # the task and the model: checked with the tokenizer and the model's config, before the weights load
        (["--model", str(root / "no-tokenizer")], "its tokenizer has no vocabulary"),
        (["--model", str(root / "llama-no-tokenizer")], "it has no tokenizer: the folder lacks the tokenizer's files "
                                                        "(tokenizer.json, tokenizer.model, or vocab.json and merges.txt): "
                                                        "copy them from where the model came from"),
        (["--model", str(root / "small-vocab")], "token ids up to 319, but the model's vocab_size is 300"),
        (["--task", f"{root / 'prompts.py'}:Fewer"], "prompts(2, rng) returned 1 prompts, not 2"),
        (["--task", f"{root / 'prompts.py'}:Empty"], "prompts(2, rng) returned 0 prompts, not 2"),
        (["--task", f"{root / 'prompts.py'}:NotStr"], "returned b'Repeat a: ' as prompt 0"),
        (["--task", f"{root / 'prompts.py'}:Long"], "more than the model's 512: shorten the task's prompts"),
        (["--max-new-tokens", "510"], "plus --max-new-tokens 510 needs 515 positions, more than the model's 512: "
                                      "lower --max-new-tokens to 507"),
        (["--task", f"{root / 'prompts.py'}:NanFloor"], "min_reward nan is not a finite number"),
        # the policy-loss variants and the reward's parts: combinations
        (["--policy-loss", "clip-cov", "--clip-cov-lb", "6"], "--clip-cov-lb 6.0 must be below --clip-cov-ub 5.0"),
        (["--policy-loss", "gmpo", "--importance-level", "sequence"], "works on token ratios"),
        (["--policy-loss", "sapo", "--dual-clip", "3"], "--policy-loss sapo has none: leave one out"),
        (["--advantage", "gdpo", "--reward-weights", "a=1", "--overlong-buffer", "4"],
         "would leave out --overlong-buffer"),
        (["--advantage", "gdpo", "--reward-weights", "a=1", "--kl-in", "reward"], "would leave out --kl-in reward"),
        (["--task", "toy", "--reward-weights", "a=1"], "weighs the parts of the task's reward_breakdown, and toy has none"),
    ]



def _importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


FILE_CASES = len(file_cases(pathlib.Path("unused")))


def expect_usage_error(argv, needle, capsys):
    err = usage_error(argv, capsys)
    assert needle in err, (needle, err)


@pytest.mark.parametrize("flag, value, needle", CASES, ids=[f"{f}={v!r}" for f, v, _ in CASES])
def test_a_bad_value_of_every_flag_exits_2_with_one_line(flag, value, needle, tmp_path, capsys, clean_env):
    # the chess task's options are flags only when a chess task is chosen (the default, here explicit)
    expect_usage_error(["--task", "chess", "--model", "unused", "--out-dir", str(tmp_path), flag, value],
                       needle, capsys)


@pytest.mark.parametrize("i", range(FILE_CASES))
def test_bad_files_and_tasks_exit_2_with_one_line(i, files, tiny_model_dir, tmp_path, capsys, clean_env):
    args, needle = file_cases(files)[i]
    base = ["--model", tiny_model_dir, "--batch-size", "8", "--group-size", "4", "--max-new-tokens", "4",
            "--steps", "1", "--out-dir", str(tmp_path), "--log-level", "warning"]
    if "--task" not in args:
        base += ["--task", "chess-env"] if "--data" in args else ["--task", "toy"]
    expect_usage_error(base + args, needle, capsys)


def test_the_same_values_from_the_environment_are_caught_alike(tmp_path, capsys, monkeypatch, clean_env):
    for flag, value, needle in CASES[::7]:
        monkeypatch.setenv(config.env_name(flag[2:].replace("-", "_")), value)
        expect_usage_error(["--task", "chess", "--model", "unused", "--out-dir", str(tmp_path)],
                           needle.replace(flag, config.env_name(flag[2:].replace("-", "_")))
                           if needle == flag else needle, capsys)
        monkeypatch.delenv(config.env_name(flag[2:].replace("-", "_")))


@pytest.mark.parametrize("world,said", [
    ("2", "WORLD_SIZE=2 is set, but not RANK: torchrun sets it"),
    ("two", "WORLD_SIZE=two is no device count: torchrun sets it")])
def test_world_size_without_torchrun_is_one_line_and_locks_nothing(world, said, tiny_model_dir,
                                                                   tmp_path, capsys, monkeypatch,
                                                                   clean_env):
    """Issue 72 finding 15: WORLD_SIZE left by a cluster's shell was KeyError: 'LOCAL_RANK', and
    the run's folder stayed locked."""
    monkeypatch.setenv("WORLD_SIZE", world)
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    expect_usage_error(["--model", tiny_model_dir, "--task", "toy", "--out-dir",
                        str(tmp_path / "out")], said, capsys)
    assert not os.path.exists(tmp_path / "out")
