"""The first screen: a header that says what runs and where its results go, the full settings table in
OUT_DIR/settings.txt (one of the run's records) and on the console with --log-level debug."""
import re

import pytest
import torch

import tasks
import train_lean
from harness import cli, screen
from harness.config import batch_layout
from grpo.model import load_policy
from helpers import EVALUATED_TASK, SMALL, header_rows, read_jsonl, without_tokenizer
from train_lean import TABLES


def toy(model, out, *extra):
    return ["--model", model, "--task", "toy", *SMALL, "--steps", "1", "--out-dir", str(out), *extra]


def test_the_header_says_what_runs_and_where_its_results_go(tiny_model_dir, tmp_path, capsys, clean_env):
    out = tmp_path / "run"
    train_lean.main(toy(tiny_model_dir, out))
    stdout = capsys.readouterr().out
    header, rows = header_rows(stdout)
    assert header.startswith("train_lean.py: GRPO, steps 1-1\n")
    # a dozen rows, whatever the length of the paths in them (TMPDIR's: a long one wraps)
    assert list(rows) == ["model", "decoder", "update", "task", "device", "batch", "kl",
                          "evaluation", "given", "out dir", "metrics", "checkpoints",
                          "final model", "settings"], header
    assert all(len(line) <= 120 or " " not in line.strip() for line in header.splitlines()), header
    for name, value in (("model", f"{tiny_model_dir}: GPT2LMHeadModel, 0.153M parameters"),
                        ("decoder", "GPT2Decoder (fast GPT-2 path)"),
                        ("update", "real tokens only (packed: each prompt once, no padding in "
                                   "a matmul)"),
                        ("task", "toy"), ("device", "cpu, fp32"),
                        ("batch", "4 prompts x 2 = 8 completions per step; 1 update of 8, "
                                  "micro-batch 8 (no accumulation)"),
                        ("evaluation", "off (--eval-interval 0)"), ("out dir", f"{out}"),
                        ("metrics", f"{out / 'metrics.jsonl'}"),
                        ("final model", f"{out / 'model'} at the end"),
                        ("settings", f"{out / 'settings.txt'} (every setting; --log-level debug "
                                     "shows them)")):
        assert rows[name] == value, (name, header)
    # the settings given, nothing else; the 60-line table is in the run folder, not on the screen
    assert rows["given"] == ("--batch-size 8, --group-size 2, --max-new-tokens 12, "
                             f"--learning-rate 0.001, --steps 1, --model {tiny_model_dir}, "
                             f"--task toy, --eval-interval 0, --out-dir {out}, --log-level info")
    assert "settings (source" not in stdout and "--prompt-bos" not in stdout
    table = (out / "settings.txt").read_text()
    assert table.startswith("settings (source: cli > env > task > default)\n")
    assert "batch layout (per device | global)" in table
    assert re.search(r"--steps\s+1\s+cli", table) and re.search(r"--prompt-bos\s+auto\s+default", table)


def test_the_settings_file_is_one_of_the_runs_records(tiny_model_dir, tmp_path, capsys, clean_env):
    out = tmp_path / "run"
    train_lean.main(toy(tiny_model_dir, out))
    before = (out / "settings.txt").read_text()
    with pytest.raises(SystemExit) as exit_:   # a folder with an earlier run's records: refused, settings named
        train_lean.main(toy(tiny_model_dir, out, "--seed", "5"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{out / 'settings.txt'}" in err and "--overwrite" in err
    assert (out / "settings.txt").read_text() == before
    train_lean.main(toy(tiny_model_dir, out, "--seed", "5", "--overwrite", "--log-level", "debug"))
    stdout, err = capsys.readouterr()
    assert "settings.txt" in err.splitlines()[0] and "--overwrite: deleted" in err
    assert re.search(r"--seed\s+5\s+cli", (out / "settings.txt").read_text())
    assert re.search(r"--seed\s+5\s+cli", stdout) and "batch layout (per device | global)" in stdout   # debug: shown
    # a run that stopped before its first record (a --model without a tokenizer; one that is not
    # there is refused before settings are written) leaves its settings alone: the next run
    # replaces them
    failed = tmp_path / "failed"
    with pytest.raises(SystemExit):
        train_lean.main(toy(without_tokenizer(tiny_model_dir, tmp_path / "no-tokenizer"), failed))
    assert (failed / "settings.txt").exists() and not (failed / "metrics.jsonl").exists()
    train_lean.main(toy(tiny_model_dir, failed))
    assert tiny_model_dir in (failed / "settings.txt").read_text() and read_jsonl(failed / "metrics.jsonl")


def test_an_unset_setting_says_what_it_comes_to_or_off():
    loaded = cli.load(["--batch-size", "32", "--group-size", "4", "--task", "chess-env"], {"GRPO_SEED": "3"},
                      tasks.BUILTIN, tables=TABLES)
    text = screen.describe(loaded.cfg, loaded.options, loaded.sources, batch_layout(loaded.cfg))
    assert re.search(r"--batch-size\s+32\s+cli", text) and re.search(r"--seed\s+3\s+env", text)
    assert re.search(r"--mini-batch-size\s+32 \(derived\)\s+default", text)
    assert re.search(r"--micro-batch-size\s+32 \(derived\)", text)
    assert re.search(r"--generation-batch-size\s+32 \(derived\)", text)
    assert re.search(r"--clip-range-high\s+0.2 \(derived\)", text)   # = --clip-range
    assert re.search(r"--log-file\s+out/metrics.jsonl \(derived\)", text)
    for off in ("dual-clip", "log-completions", "resume", "resume-allow-change"):
        assert re.search(rf"--{off}\s+off\s+default", text), off
    assert re.search(r"--eval-only\s+false\s+default", text)   # as the command line spells it
    assert not re.search(r"\sderived\s", text)   # never a bare "derived"
    assert "gradient-accumulation steps" in text and "optimizer updates per step" in text
    assert "options of --task chess-env" in text and re.search(r"--data\s+none\s+default", text)


def test_the_batch_in_one_line_over_two_devices():
    loaded = cli.load(["--task", "toy", "--batch-size", "16", "--group-size", "4", "--mini-batch-size", "8",
                       "--micro-batch-size", "2", "--ppo-epochs", "2", "--generation-batch-size", "4"], {},
                      tasks.BUILTIN, tables=TABLES)
    layout = batch_layout(loaded.cfg, world=2)
    # 16 / 4 = 4 prompts; 8 completions per device; 16 / 8 mini-batches x 2 epochs = 4 updates; 8 / 2 devices
    # = 4 completions of a mini-batch per device, 2 per micro-batch: 2 accumulation steps
    assert screen.batch_line(loaded.cfg, layout) == (
        "4 prompts x 4 = 16 completions per step over 2 devices (8 each); 4 updates of 8 (2 epochs), micro-batch 2 "
        "per device (2 accumulation steps); sampled 4 at a time per device")
    auto = cli.load(["--task", "toy", "--micro-batch-size", "auto"], {}, tasks.BUILTIN, tables=TABLES).cfg
    assert "micro-batch auto (probed before training)" in screen.batch_line(auto, batch_layout(auto))


def test_the_header_of_an_evaluation_and_of_a_model_without_a_fast_path(tiny_model_dir, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    task = tmp_path / "evaluated.py"
    task.write_text(EVALUATED_TASK)
    loaded = cli.load(["--model", tiny_model_dir, "--task", f"{task}:Evaluated", "--eval-only", "--compile"], {},
                      tasks.BUILTIN, tables=TABLES)
    text = screen.header(loaded, batch_layout(loaded.cfg), torch.device("cpu"), load_policy(tiny_model_dir, "cpu"),
                         None)
    assert text.startswith("train_lean.py: evaluation only")
    assert "GPT2Decoder (fast GPT-2 path), compiled (--compile on)" in text
    assert "the task's evaluate() on the model, then exit (--eval-only)" in text
    assert "writes      nothing (the results are printed; --log-file keeps them)" in text
    assert "batch" not in text and "out dir" not in text
    # a GPT-2 variant the fast path does not compute: the generic path, and --compile is said to do nothing
    generic = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0,
                                         scale_attn_by_inverse_layer_idx=True))
    text = " ".join(screen.header(loaded, batch_layout(loaded.cfg), torch.device("cpu"), generic, None).split())
    assert "HFDecoder (generic HF forward" in text and "--compile has no effect on it" in text


def test_the_header_names_the_metrics_file_the_run_writes(tiny_model_dir, tmp_path, capsys, clean_env):
    log_file = tmp_path / "elsewhere" / "m.jsonl"
    train_lean.main(toy(tiny_model_dir, tmp_path / "run", "--log-file", str(log_file)))
    flat = " ".join(capsys.readouterr().out.split())
    assert f" metrics {log_file} " in flat and log_file.exists()


def test_the_header_names_the_pretraining_mix_and_its_text(tiny_model_dir, tmp_path, capsys, clean_env):
    text = tmp_path / "text.txt"
    text.write_text("a line to learn\n")
    train_lean.main(toy(tiny_model_dir, tmp_path / "run", "--ptx-coef", "0.5", "--ptx-file", str(text)))
    flat = " ".join(capsys.readouterr().out.split())
    assert f" ptx 0.5 x next-token loss on 16 texts per update from {text} " in flat
    train_lean.main(toy(tiny_model_dir, tmp_path / "plain"))
    assert " ptx " not in capsys.readouterr().out   # off: no row


def test_the_header_names_the_kl_estimator_and_k1_is_the_default_in_the_reward(tiny_model_dir):
    # --kl-in reward kept k3, which grpo/algorithm.py says belongs in the loss: now k1 unless one is named
    model = load_policy(tiny_model_dir, "cpu")
    rows = {(): "kl 0.02 x k3 per token in the loss",
            ("--kl-in", "reward"): "kl 0.02 x k1 (--kl-in reward's default; --kl-estimator names another) per "
                                   "sequence, subtracted from the reward before the advantages",
            ("--kl-in", "reward", "--kl-estimator", "k3"): "kl 0.02 x k3 per sequence, subtracted from the reward",
            ("--kl-coef", "0"): "kl off (--kl-coef 0: no reference model)"}
    for argv, row in rows.items():
        loaded = cli.load(["--model", tiny_model_dir, "--task", "toy", *argv], {}, tasks.BUILTIN, tables=TABLES)
        assert loaded.cfg.kl_estimator == ("k1" if argv == ("--kl-in", "reward") else "k3")
        text = " ".join(screen.header(loaded, batch_layout(loaded.cfg), torch.device("cpu"), model, None).split())
        assert f" {row}" in text, (argv, text)
    env = cli.load(["--model", tiny_model_dir, "--task", "toy"], {"GRPO_KL_IN": "reward", "GRPO_KL_ESTIMATOR": "k2"},
                   tasks.BUILTIN, tables=TABLES)
    assert env.cfg.kl_estimator == "k2"   # named in the environment: kept


def test_a_tasks_declared_setting_is_shown_with_the_source_task(tiny_model_dir, tmp_path, capsys, clean_env):
    (tmp_path / "declares.py").write_text("from tasks.toy import ToyTask\n\nclass Declares(ToyTask):\n"
                                          "    trainer_settings = {'temperature': 0.5, 'top_k': 3}\n\n"
                                          "class Bad(ToyTask):\n    trainer_settings = {'top_k': -3}\n")
    out, task = tmp_path / "run", f"{tmp_path / 'declares.py'}:Declares"
    args = ["--model", tiny_model_dir, "--task", task, *SMALL, "--steps", "1", "--out-dir", str(out)]
    train_lean.main([*args, "--top-k", "4"])
    flat = " ".join(capsys.readouterr().out.split())
    assert ", --temperature 0.5 (task), " in flat and "--top-k 4," in flat and "--top-k 3" not in flat
    table = (out / "settings.txt").read_text()
    assert re.search(r"--temperature\s+0.5\s+task\n", table) and re.search(r"--top-k\s+4\s+cli\n", table)
    with pytest.raises(SystemExit) as exit_:   # refused at start-up as the same flag value is: exit 2, one line
        train_lean.main([*args, "--task", f"{tmp_path / 'declares.py'}:Bad", "--overwrite"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "--task " in err and "Bad's trainer_settings: --top-k -3 must be >= 0" in err


def test_a_long_system_prompt_of_several_lines_is_one_row_and_cut_in_the_header(tiny_model_dir):
    system = ("You are a careful assistant.\n"
              "Answer with the letter only, ten times, and nothing else at all.")
    loaded = cli.load(["--model", tiny_model_dir, "--task", "toy", "--system-prompt", system], {},
                      tasks.BUILTIN, tables=TABLES)
    layout = batch_layout(loaded.cfg)
    table = screen.describe(loaded.cfg, loaded.options, loaded.sources, layout)
    row = r"\n  --system-prompt\s+'You are a careful assistant.\\nAnswer .* else at all.'  cli\n"
    assert re.search(row, table)   # whole, on one row
    assert re.search(r"\n  --seed\s{36,}0\s+default\n", table) is None   # the others not as wide
    model = load_policy(tiny_model_dir, "cpu")
    text = " ".join(screen.header(loaded, layout, torch.device("cpu"), model, None).split())
    cut = "'You are a careful assistant.\\nAnswer with the letter onl... (93 characters)"
    assert f"--system-prompt {cut}" in text
