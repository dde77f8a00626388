"""The chess tasks through train_lean.py: reward components and eval records in the JSONL, --eval-only,
and the start-up errors (exit 2, one line). In-process (main(argv)): a subprocess would spend most of
its time importing torch again; test_train.py covers the command line itself."""
import os
import re
import subprocess
import sys

import pytest

import forked

import train_lean
from tasks.rookworld.engine import find_stockfish
from safetensors.torch import load_file

from helpers import REPO, env, line_starting, process_alive, read_jsonl as records, user_env, wait_until
from helpers import records as stable_records



SMALL = ["--batch-size", "8", "--group-size", "4", "--max-new-tokens", "8", "--eval-samples", "3",
         "--eval-full-samples", "3"]


def test_chess_run_logs_components_and_evals(tiny_model_dir, tmp_path, capsys, clean_env):
    task = "chess" if find_stockfish() else "chess-env"   # without an engine, the A: half still runs
    mix = ["--task-mix", "0.5", "--stockfish-depth", "6"] if task == "chess" else []
    train_lean.main(["--model", tiny_model_dir, "--task", task, "--steps", "2", "--eval-interval", "1",
                     "--out-dir", str(tmp_path), *mix, *SMALL])
    stdout = capsys.readouterr().out
    recs = records(tmp_path / "metrics.jsonl")
    evals = [r for r in recs if r.get("kind") == "eval"]
    steps = [r for r in recs if "kind" not in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and [r["step"] for r in steps] == [1, 2]
    assert recs[0]["kind"] == "eval"   # before training starts
    for r in evals:
        assert r["a_n"] == 3 and 0 <= r["a_exact_acc"] <= 1
        assert (r["p_n"] == 3 and 0 <= r["p_best_move_acc"] <= 1) if task == "chess" else "p_n" not in r
    env_keys = {"reward_env_format", "reward_env_fen", "reward_env_reward", "reward_env_exact"}
    policy_keys = {"reward_policy_best", "reward_policy_format", "reward_policy_legal"}
    seen = set().union(*steps)
    assert env_keys <= seen
    assert policy_keys <= seen or task == "chess-env"
    assert "eval at step 0" in stdout and "a_exact_acc" in stdout


def test_default_run_evaluates_before_and_after(tiny_model_dir, tmp_path, clean_env):
    # no --eval-interval: a chess run still reports held-out metrics before training and after its last
    # step (3 is not a multiple of the default interval); greedy only (a task without evaluate(): test_task.py)
    train_lean.main(["--model", tiny_model_dir, "--task", "chess-env", "--steps", "3", "--out-dir",
                     str(tmp_path / "chess"), *SMALL])
    evals = [r for r in records(tmp_path / "chess" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 3] and not [k for r in evals for k in r if "@" in k]


def test_the_first_and_last_evaluations_score_the_whole_set_and_those_between_a_subset(tiny_model_dir, tmp_path,
                                                                                       capsys, clean_env):
    # --eval-full-samples items per kind before training and after the last step, where a run's before and after are
    # compared (compare_runs.py pairs them); --eval-samples, the first of them, every --eval-interval between
    small = [a for a in SMALL if a not in ("--eval-samples", "--eval-full-samples", "3")]
    train_lean.main(["--model", tiny_model_dir, "--task", "chess-env", "--steps", "3", "--eval-interval", "1",
                     "--eval-samples", "2", "--eval-full-samples", "5", "--out-dir", str(tmp_path / "run"), *small])
    evals = [r for r in records(tmp_path / "run" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [(r["step"], r["a_n"], r["a_exact_acc_n"]) for r in evals] == [(0, 5, 5), (1, 2, 2), (2, 2, 2), (3, 5, 5)]
    asked = [line["prompts"] for line in records(tmp_path / "run" / "metrics.items.jsonl")]
    assert asked == [5, 2, 2, 5]
    train_lean.main(["--eval-only", "--model", tiny_model_dir, "--task", "chess-env", "--eval-samples", "2",
                     "--eval-full-samples", "4", *small])   # --eval-only: the whole set too
    assert re.search(r"\n  a_n +4\n", capsys.readouterr().out)


def test_eval_only_prints_the_table(tiny_model_dir, tmp_path, capsys, clean_env):
    # needs no engine: the held-out set carries its answers
    train_lean.main(["--eval-only", "--model", tiny_model_dir, "--stockfish-path", "/nonexistent",
                     "--task", "chess", "--out-dir", str(tmp_path), *SMALL])
    stdout = capsys.readouterr().out
    assert "eval at step 0" in stdout and "p_n              3" in stdout and "a_n              3" in stdout
    assert "p_legal_rate" in stdout and "step 1/" not in stdout
    assert not os.path.exists(tmp_path / "metrics.jsonl")   # nothing overwritten without --log-file


def test_eval_only_with_samples_reports_pass_at_k_beside_the_greedy_numbers(tiny_model_dir, tmp_path, capsys,
                                                                            clean_env):
    train_lean.main(["--eval-only", "--model", tiny_model_dir, "--stockfish-path", "/nonexistent", "--task", "chess",
                     "--eval-k", "2", "--eval-n", "3", "--log-file", str(tmp_path / "eval.jsonl"),
                     "--out-dir", str(tmp_path), *SMALL])
    (record,) = records(tmp_path / "eval.jsonl")
    table = capsys.readouterr().out
    for name in ("p_best_move", "a_next_fen"):   # pass@k >= pass@1, whose unbiased estimate mean@n is
        assert 0 <= record[f"{name}_mean@3"] <= record[f"{name}_pass@2"] <= 1 and f"{name}_pass@2" in table
    assert {"p_best_move_acc", "a_next_fen_acc", "p_n", "a_n"} <= set(record) and record["p_n"] == 3


@pytest.mark.parametrize("args, message", [
    (["--task", "chess-policy", "--stockfish-path", "/nonexistent/stockfish"], "use --task chess-env"),
    (["--task", "toy", "--data", __file__], "--data is not a flag of train_lean.py nor of --task toy"),
    (["--task", "chess-env", "--eval-n", "1", "--eval-k", "2"], "--eval-n 1 must be at least --eval-k 2"),
    (["--task", "chess", "--task-mix", "1.5"], "--task-mix 1.5 must be in [0, 1]"),
    (["--task", "chess", "--reward-weights", "env_fenn=1"], "--reward-weights names env_fenn: chess's reward has no "
                                                            "such part (its reward_parts: policy_best, "),
    (["--task", "chess", "--task-mix", "1", "--reward-weights", "env_fen=1"], "names env_fen: chess's reward has no"),
    (["--task", "chess-env", "--data", "no-such-file.txt"], "--data no-such-file.txt: no such file"),
    (["--task", "chess-env", "--data", os.path.join(REPO, "README.md")],
     "lines are not RookWorld P:/A: samples"),
])
def test_chess_usage_errors_exit_2_with_one_line(args, message, tmp_path, capsys, clean_env):
    # every one of these is caught before a model is loaded
    with pytest.raises(SystemExit) as exit_:
        train_lean.main(["--model", "unused", "--out-dir", str(tmp_path), "--log-level", "warning", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().count("\n") == 0 and message in err


CRASHING = """
import sys
import train_lean
real, calls = train_lean.grpo_loss, []
def crash_at_the_third_call(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
        print("engines", *train_lean_engines(), flush=True)
        raise RuntimeError("simulated crash in the update")
    return real(*args, **kwargs)
def train_lean_engines():
    import os
    return [p for p in os.listdir("/proc") if p.isdigit() and open(f"/proc/{p}/stat").read().split(")")[1].split()[1]
            == str(os.getpid())]
train_lean.grpo_loss = crash_at_the_third_call
train_lean.main(sys.argv[1:])
"""


@pytest.mark.slow
@pytest.mark.skipif(find_stockfish() is None, reason="needs Stockfish")
def test_a_crash_mid_run_exits_1_promptly_and_leaves_no_engine(tiny_model_dir, tmp_path):
    (tmp_path / "crash.py").write_text(CRASHING)
    with open(tmp_path / "stderr", "w") as stderr_file:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "crash.py"), "--model", tiny_model_dir, "--task", "chess",
                                 "--stockfish-depth", "4", "--steps", "5", "--batch-size", "8", "--group-size", "4",
                                 "--max-new-tokens", "8", "--eval-interval", "0", "--out-dir", str(tmp_path / "run")],
                                stdout=subprocess.PIPE, stderr=stderr_file, text=True, env=env())
        engines = [int(p) for p in line_starting(proc, "engines", timeout=300).split()[1:]]
        try:   # from the crash on: a hang fails here
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"no exit within 30 s of the crash: {(tmp_path / 'stderr').read_text()[-2000:]}")
    stderr = (tmp_path / "stderr").read_text()
    assert proc.returncode == 1 and "RuntimeError: simulated crash in the update" in stderr
    assert engines and wait_until(lambda: not any(process_alive(p) for p in engines), timeout=5)


@pytest.mark.slow
@pytest.mark.skipif(find_stockfish() is None, reason="needs Stockfish")
def test_the_main_job_killed_and_resumed_equals_an_uninterrupted_run(tmp_path):
    """`make train` (the shipped model; the chess task declares --ptx-coef 1) killed with SIGKILL after a checkpoint and
    resumed ends with the records and weights of a run of the same seed that was never stopped: the second run is
    both the same-seed repeat and the resume. On a user's default threads (every core: the update
    still runs on --update-threads 1); one thread: tests/tools/test_chaos.py's toy runs."""
    run_env = user_env()
    args = [os.path.join(REPO, "train_lean.py"), "--steps", "4", "--save-interval", "2",
            "--eval-interval", "0"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    done = forked.run([*args, "--out-dir", str(whole)], run_env, 900)
    assert done.returncode == 0, done.stderr[-2000:]
    proc = forked.start([*args, "--out-dir", str(cut)], run_env, stdout=False, stderr=False)
    wait_until(lambda: (cut / "checkpoints" / "step_000002").is_dir() or proc.poll() is not None, timeout=900)
    proc.kill()
    assert proc.wait() == -9, "the run ended before it was killed: nothing was tested"
    resumed = forked.run([*args, "--out-dir", str(cut), "--resume"], run_env, 900)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert stable_records(cut / "metrics.jsonl") == stable_records(whole / "metrics.jsonl")
    a, b = (load_file(str(d / "model" / "model.safetensors")) for d in (whole, cut))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
