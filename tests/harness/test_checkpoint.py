"""Checkpoints and resume: a run killed with SIGKILL and resumed equals an uninterrupted one, exactly."""
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import forked

from helpers import (EVALUATED_TASK, PROCESS_DEADLINE_S, SMALL, TRAIN, env, line_starting,
                     one_line_error, read_jsonl, records, train, usage_error, user_env, weights)
from harness import checkpoint


def wait_for(predicate, proc, timeout=PROCESS_DEADLINE_S):
    """Polls predicate while proc runs; the deadline (from the process's start, so generous) only
    stops a hung run."""
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended early:\n{proc.communicate()[1][-2000:]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def saved_steps(out):
    return [int(n[5:]) for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step_")] \
        if os.path.isdir(os.path.join(out, "checkpoints")) else []


@pytest.mark.slow
def test_sigkill_then_resume_equals_an_uninterrupted_run(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    steps = 8
    args = [TRAIN, "--model", tiny_model_dir, *SMALL, "--steps", str(steps), "--save-interval", "1",
            "--keep-checkpoints", "2"]
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    # a user's environment (every thread), not the one thread of the other tests
    done = forked.run([*args, "--out-dir", whole], user_env(), PROCESS_DEADLINE_S)
    assert done.returncode == 0

    proc = forked.start([*args, "--out-dir", cut], user_env(), stdout=False)
    wait_for(lambda: max(saved_steps(cut), default=0) >= 2, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    killed_at = max(saved_steps(cut))
    assert killed_at < steps, "the run finished before the kill: nothing was tested"
    assert len(records(os.path.join(cut, "metrics.jsonl"))) >= killed_at

    resumed = forked.run([*args, "--out-dir", cut, "--resume"], user_env(), PROCESS_DEADLINE_S)
    assert resumed.returncode == 0, resumed.stderr
    assert f"after step {killed_at}" in resumed.stdout  # it did continue from the checkpoint, not restart

    # every logged number (rewards, losses, KL, gradient norms, ...) of every step, and the final weights
    assert records(os.path.join(cut, "metrics.jsonl")) == records(os.path.join(whole, "metrics.jsonl"))
    final = f"checkpoints/step_{steps:06d}"
    a, b = weights(os.path.join(whole, final)), weights(os.path.join(cut, final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(saved_steps(cut)) == [steps - 1, steps]  # the last K only

    # a checkpoint is a plain transformers folder
    model = AutoModelForCausalLM.from_pretrained(os.path.join(cut, final))
    tok = AutoTokenizer.from_pretrained(os.path.join(cut, final))
    assert torch.equal(model.state_dict()["lm_head.weight"], b["transformer.wte.weight"])
    assert tok.eos_token_id is not None


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])   # SIGHUP: issue 72
def test_a_signal_finishes_the_step_saves_and_exits_0(tiny_model_dir, tmp_path, sig):
    out = str(tmp_path / "out")
    proc = forked.start([TRAIN, "--model", tiny_model_dir, *SMALL, "--steps", "1000", "--out-dir", out],
                        env())
    metrics = os.path.join(out, "metrics.jsonl")
    wait_for(lambda: os.path.exists(metrics) and len(open(metrics).readlines()) >= 2, proc)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=PROCESS_DEADLINE_S)
    assert proc.returncode == 0, stderr
    done = len(records(metrics))
    assert done < 1000 and saved_steps(out) == [done]  # the step in flight was finished, logged and saved
    assert "stopped after step" in stdout


@pytest.mark.slow
def test_under_nohup_a_closed_terminal_leaves_the_run_going(tiny_model_dir, tmp_path):
    """SIGHUP stops a run (issue 72 finding 3), unless the run was started with it ignored: nohup
    asks the run to outlive its terminal."""
    out = str(tmp_path / "out")
    metrics = os.path.join(out, "metrics.jsonl")
    proc = subprocess.Popen([sys.executable, TRAIN, "--model", tiny_model_dir, *SMALL, "--steps",
                             "4", "--out-dir", out], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    wait_for(lambda: os.path.exists(metrics) and len(open(metrics).readlines()) >= 1, proc)
    proc.send_signal(signal.SIGHUP)
    stdout, stderr = proc.communicate(timeout=PROCESS_DEADLINE_S)
    assert proc.returncode == 0 and "SIGHUP" not in stdout + stderr, stderr
    assert len(records(metrics)) == 4


# train_lean.py with harness/checkpoint.py's argv[1] (save: a checkpoint, save_model: the final
# model) raising the signal argv[2] as it starts writing: a Ctrl-C or kill -TERM in the write
SIGNAL_IN_WRITE = """
import os, signal, sys
from harness import checkpoint
import train_lean
write = getattr(checkpoint, sys.argv[1])
def signalled(*args, **kwargs):
    signal.raise_signal(getattr(signal, sys.argv[2]))
    return write(*args, **kwargs)
setattr(checkpoint, sys.argv[1], signalled)
train_lean.main(sys.argv[3:])
"""


@pytest.mark.slow   # a process of its own (or a traced run): seconds
@pytest.mark.parametrize("write,sig", [("save_model", "SIGTERM"), ("save_model", "SIGINT"),
                                       ("save", "SIGTERM")])
def test_a_signal_during_the_final_save_waits_for_it(tiny_model_dir, tmp_path, write, sig):
    # issue 46 case 1: it died in the write (exit 143, only model.tmp left); Ctrl-C saved nothing
    out = tmp_path / "out"
    args = [*run_args(tiny_model_dir, "toy"), "--steps", "1", "--out-dir", str(out)]
    (tmp_path / "signal_in_write.py").write_text(SIGNAL_IN_WRITE)
    result = forked.run([str(tmp_path / "signal_in_write.py"), write, sig, *args], env(),
                        PROCESS_DEADLINE_S)
    assert result.returncode == 0, result.stderr
    assert checkpoint.model_step(str(out / "model")) == 1 and not (out / "model.tmp").exists()
    # the step, whole, for --resume
    assert checkpoint.damage(str(out / "checkpoints" / "step_000001")) is None


def test_pruning_deletes_only_what_the_checkpoint_lists(tiny_model_dir, tmp_path, capsys):
    """Issue 72 finding 1: a figure a tool wrote into OUT/checkpoints/step_N was deleted without a
    word with the checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    first = checkpoint.save(str(tmp_path), 1, model, tokenizer, {}, keep=1)
    os.makedirs(os.path.join(first, "notes"))
    for name in ("p.png", "notes/n.txt"):
        with open(os.path.join(first, name), "w") as f:
            f.write("mine")
    checkpoint.save(str(tmp_path), 2, model, tokenizer, {}, keep=1)
    aside = tmp_path / "checkpoints" / "kept-step_000001"
    assert not os.path.exists(first) and sorted(os.listdir(aside)) == ["notes", "p.png"]
    assert (aside / "notes" / "n.txt").read_text() == "mine"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"train_lean.py: checkpoint {first} held files the run did not write (notes/n.txt, "
        f"p.png): kept in {aside} as the checkpoint was deleted")
    assert saved_steps(tmp_path) == [2]


def test_candidates_skip_half_written_and_incomplete_checkpoints(tmp_path):
    folder = tmp_path / "checkpoints"
    for name, complete in (("step_000002", True), ("step_000010", False), (".tmp-step_000012", True),
                           ("damaged-step_000014", True)):
        (folder / name).mkdir(parents=True)
        if complete:
            (folder / name / checkpoint.STATE).write_bytes(b"x")
    assert checkpoint.candidates(str(tmp_path)) == [str(folder / "step_000002")]
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in"):
        checkpoint.resolve(str(tmp_path / "elsewhere"), str(tmp_path))


def test_rng_states_round_trip_through_a_saved_file(tmp_path):
    import random

    import numpy as np
    states = checkpoint.rng_states()
    torch.save(states, tmp_path / "rng.pt")
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_a_dynamic_sampling_run_resumes_exactly(tiny_model_dir, tmp_path, clean_env, user_threads):
    # the extra rounds draw from the step's own seeded prompt stream, so a resumed run redoes them exactly
    import train_lean
    args = ["--model", tiny_model_dir, "--task", "toy", "--batch-size", "8", "--group-size", "4",
            "--max-new-tokens", "8", "--learning-rate", "1e-3", "--dynamic-sampling", "--log-level", "warning",
            "--save-final", "false", "--eval-interval", "0"]
    train_lean.main([*args, "--steps", "3", "--out-dir", str(tmp_path / "straight")])
    train_lean.main([*args, "--steps", "2", "--save-interval", "2", "--out-dir", str(tmp_path / "resumed")])
    train_lean.main([*args, "--steps", "3", "--resume", "--out-dir", str(tmp_path / "resumed")])
    straight, resumed = records(tmp_path / "straight" / "metrics.jsonl"), records(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed == straight
    assert all(r["groups_drawn"] >= 2 for r in straight)



def test_a_scheduled_run_with_a_moving_reference_resumes_exactly(tiny_model_dir, tmp_path,
                                                                 clean_env, capsys, user_threads):
    # the learning rate is a function of the step; the reference that --ref-sync-steps moves is in the checkpoint
    import train_lean
    args = ["--model", tiny_model_dir, "--task", "toy", "--batch-size", "8", "--group-size", "4", "--max-new-tokens",
            "8", "--learning-rate", "1e-2", "--lr-scheduler", "cosine", "--lr-warmup-steps", "1", "--min-lr-ratio",
            "0.1", "--ref-sync-steps", "1", "--ref-sync-alpha", "0.5", "--kl-coef", "0.5", "--steps", "4",
            "--eval-interval", "0", "--log-level", "warning", "--save-final", "false"]
    train_lean.main([*args, "--out-dir", str(tmp_path / "straight")])
    train_lean.main([*args, "--save-interval", "2", "--out-dir", str(tmp_path / "resumed")])
    step_2 = tmp_path / "resumed" / "checkpoints" / "step_000002"
    train_lean.main([*args, "--resume", str(step_2), "--out-dir", str(tmp_path / "resumed")])
    straight, resumed = records(tmp_path / "straight" / "metrics.jsonl"), records(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed == straight
    assert [r["lr"] for r in straight] == pytest.approx([1e-2, 1e-2, 1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi / 3)),
                                                         1e-3 + 9e-3 * 0.5 * (1 + math.cos(2 * math.pi / 3))])
    assert straight[2]["kl"] > 0   # the reference moved and the KL term sees it
    # the KL term dropped on purpose: the moved reference is not needed, and said so (it was an AttributeError)
    train_lean.main([*args, "--steps", "5", "--resume", "--kl-coef", "0", "--ref-sync-steps", "0", "--resume-allow-change",
                     "kl_coef,ref_sync_steps", "--out-dir", str(tmp_path / "resumed")])
    # from step 4, the last step's checkpoint every run keeps
    assert "step_000004 holds the reference --ref-sync-steps moved; --kl-coef 0 has no KL term, so it is " \
           "not used" in capsys.readouterr().err
    assert records(tmp_path / "resumed" / "metrics.jsonl")[-1]["kl"] == 0

def run_args(model, task, *extra):
    return ["--model", model, *SMALL, "--task", task, *extra]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """--task for EVALUATED_TASK: the toy task with an option (--width) and an evaluation."""
    path = tmp_path_factory.mktemp("task") / "evaluated.py"
    path.write_text(EVALUATED_TASK)
    return f"{path}:Evaluated"


@pytest.fixture(scope="module")
def two_saved_steps(tiny_model_dir, tmp_path_factory, evaluated):
    """A run of 2 steps with a checkpoint after each; each test that changes it works on a copy."""
    out = tmp_path_factory.mktemp("saved") / "out"
    result = train(*run_args(tiny_model_dir, evaluated, "--steps", "2", "--save-interval", "1", "--out-dir", str(out),
                             "--log-completions", str(out / "completions.jsonl")))
    assert result.returncode == 0, result.stderr
    return out


def copy_of(out, tmp_path):
    shutil.copytree(out, tmp_path / "out")
    return tmp_path / "out"


@pytest.mark.slow
def test_resume_refuses_other_settings_and_allows_the_named_ones(two_saved_steps, evaluated,
                                                                 tiny_model_dir, tiny_rotary_dir,
                                                                 tmp_path, capsys, clean_env):
    out = copy_of(two_saved_steps, tmp_path)
    ckpt = out / "checkpoints" / "step_000002"
    resume = ["--steps", "3", "--out-dir", str(out), "--resume"]
    line = usage_error([*run_args(tiny_model_dir, evaluated, *resume, "--batch-size", "16",
                                  "--group-size", "4", "--learning-rate", "5e-4")], capsys)
    assert f"--resume: {ckpt} was trained with other settings: --batch-size 8 -> 16; --group-size 2 -> 4; " \
           f"--learning-rate 0.001 -> 0.0005" in line
    assert "--resume-allow-change batch_size,group_size,learning_rate" in line
    line = usage_error([*run_args(tiny_rotary_dir, evaluated, *resume)], capsys)
    assert f"--model {tiny_model_dir} -> {tiny_rotary_dir}" in line   # it would be the KL reference, silently
    line = usage_error([*run_args(tiny_model_dir, "chess-env", *resume)], capsys)
    assert f"--task {evaluated} -> chess-env" in line
    line = usage_error([*run_args(tiny_model_dir, evaluated, *resume, "--width", "4")], capsys)
    assert "--width 10 -> 4" in line   # a task's option defines the run too
    line = usage_error([*run_args(tiny_model_dir, evaluated, "--steps", "2", "--out-dir", str(out),
                                  "--resume")], capsys)
    assert f"--steps 2: the checkpoint {ckpt} is at step 2 already" in line   # it would train nothing, silently

    # on purpose: the named change is said; settings that do not define the run change freely
    result = train(*run_args(tiny_model_dir, evaluated, *resume, "--learning-rate", "5e-4", "--resume-allow-change",
                             "learning-rate", "--micro-batch-size", "4", "--save-interval", "3",
                             "--log-completions", str(out / "completions.jsonl")))
    assert result.returncode == 0, result.stderr
    assert "resuming with changed settings (--resume-allow-change): --learning-rate 0.001 -> 0.0005" in result.stderr
    assert "after step 2" in result.stdout
    assert checkpoint.saved_settings(str(out / "checkpoints" / "step_000003"))["learning_rate"] == 5e-4


@pytest.mark.slow
def test_a_checkpoint_without_a_manifest_or_a_setting_is_refused(two_saved_steps, evaluated,
                                                                 tiny_model_dir, tmp_path, capsys,
                                                                 clean_env):
    # not what this trainer writes: a manifest is the last file of every checkpoint, the settings every field
    out = copy_of(two_saved_steps, tmp_path)
    ckpt = out / "checkpoints" / "step_000002"
    args = run_args(tiny_model_dir, evaluated, "--steps", "3", "--out-dir", str(out),
                    "--log-completions", str(out / "completions.jsonl"))
    state = torch.load(ckpt / checkpoint.STATE, weights_only=True)
    del state["config"]["top_p"]
    torch.save(state, ckpt / checkpoint.STATE)
    checkpoint.write_manifest(ckpt)   # intact, as files go
    line = usage_error([*args, "--resume", str(ckpt)], capsys)
    assert "was trained with other settings: --top-p (not recorded) -> 1.0" in line
    os.remove(ckpt / checkpoint.MANIFEST)
    line = usage_error([*args, "--resume", str(ckpt)], capsys)
    assert f"the checkpoint is damaged ({checkpoint.MANIFEST} is missing)" in line


@pytest.mark.parametrize("name", ["model.safetensors", checkpoint.STATE])
@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_said_and_the_intact_one_used(two_saved_steps, evaluated,
                                                                     tiny_model_dir, tmp_path, name,
                                                                     capsys, clean_env):
    out = copy_of(two_saved_steps, tmp_path)
    newest = out / "checkpoints" / "step_000002"
    os.truncate(newest / name, os.path.getsize(newest / name) // 2)   # what a full disk or a bad copy leaves
    args = run_args(tiny_model_dir, evaluated, "--steps", "3", "--out-dir", str(out),
                    "--log-completions", str(out / "completions.jsonl"))
    line = usage_error([*args, "--resume", str(newest)], capsys)   # named itself, it is refused
    assert "the checkpoint is damaged" in line and name in line

    # the finished run's model is of step 2, newer than the intact checkpoint: a bare --resume would refuse to go
    # behind it (test_a_resume_behind_a_finished_model_is_refused_or_branches_keeping_it); a run killed before it
    shutil.rmtree(out / "model")
    result = train(*args, "--resume")
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert len(said) == 1 and str(newest) in said[0] and "moved aside" in said[0], result.stderr
    assert "after step 1" in result.stdout   # from the intact one before it
    assert (out / "checkpoints" / "damaged-step_000002" / name).exists()   # kept for a look, never the latest again
    assert [r["step"] for r in records(out / "metrics.jsonl")] == [1, 2, 3]

    for ckpt in (out / "checkpoints").glob("step_*"):   # no intact checkpoint left: exit 2, one line
        os.truncate(ckpt / name, 10)
    line = usage_error([*args, "--resume"], capsys)
    assert "no intact checkpoint in" in line and "damaged" in line


@pytest.mark.slow
def test_a_failure_after_a_completed_step_keeps_it_for_resume(evaluated, tiny_model_dir, tmp_path):
    # the default --save-interval 0; the task's evaluation raises at step 2 (its 2nd call: steps 0, 2, 4)
    args = run_args(tiny_model_dir, evaluated, "--steps", "4", "--eval-interval", "2")
    failed = train(*args, "--out-dir", str(tmp_path / "cut"), extra_env={"RAISE_AT_EVAL": "2"})
    assert failed.returncode == 1
    assert "Traceback" in failed.stderr and "RuntimeError: the evaluation broke" in failed.stderr
    assert f"the run failed after step 2: saved it to {tmp_path / 'cut' / 'checkpoints' / 'step_000002'}" \
        in failed.stderr
    resumed = train(*args, "--out-dir", str(tmp_path / "cut"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "after step 2" in resumed.stdout

    whole = train(*args, "--out-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    steps = [[r for r in records(tmp_path / run / "metrics.jsonl") if "kind" not in r] for run in ("cut", "whole")]
    assert [r["step"] for r in steps[0]] == [1, 2, 3, 4] and steps[0] == steps[1]
    a, b = weights(tmp_path / "cut" / "model"), weights(tmp_path / "whole" / "model")
    assert all(torch.equal(a[k], b[k]) for k in a)   # the resumed run ends as the uninterrupted one


@pytest.mark.slow
def test_a_run_that_failed_at_its_last_step_finishes_on_resume(evaluated, tiny_model_dir, tmp_path,
                                                               capsys, clean_env):
    # issue 46 case 13: "continue with --resume", which then refused: "nothing to train"; the final
    # model and the evaluation after the last step were never written
    out = tmp_path / "out"
    args = run_args(tiny_model_dir, evaluated, "--steps", "2", "--eval-interval", "2", "--out-dir",
                    str(out))
    failed = train(*args, extra_env={"RAISE_AT_EVAL": "2"})   # the evaluation after step 2
    assert failed.returncode == 1 and "continue with --resume" in failed.stderr, failed.stderr
    finished = train(*args, "--resume")
    assert finished.returncode == 0, finished.stderr
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r.get("kind")] == [0, 2]
    a, b = weights(out / "model"), weights(out / "checkpoints" / "step_000002")
    assert checkpoint.model_step(str(out / "model")) == 2
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "nothing to train" in usage_error([*args, "--resume"], capsys)   # nothing is owed now
    # killed in the final save (SIGKILL waits for nothing): the step's checkpoint was written first
    killed = subprocess.run([sys.executable, "-c", SIGNAL_IN_WRITE, "save_model", "SIGKILL", *args,
                             "--overwrite"], env=env(), capture_output=True, text=True,
                            timeout=PROCESS_DEADLINE_S)
    assert killed.returncode == -signal.SIGKILL and not (out / "model").exists()
    finished = train(*args, "--resume")
    assert finished.returncode == 0, finished.stderr
    assert checkpoint.model_step(str(out / "model")) == 2
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r.get("kind")] == [0, 2]


@pytest.mark.slow
def test_a_finished_run_extends_with_its_optimizer_state(tiny_model_dir, tmp_path):
    # issue 46 case 20: without periodic checkpoints, --resume --steps 3 after 2 steps was refused;
    # only a fresh AdamW from OUT/model was offered. The last step's checkpoint is kept now
    args = run_args(tiny_model_dir, "toy")
    done = train(*args, "--steps", "2", "--out-dir", str(tmp_path / "cut"))
    assert done.returncode == 0, done.stderr
    # the header says so (it said "only when stopped or aborted")
    assert "checkpoints" in done.stdout and "at the end and when stopped or aborted" in " ".join(
        done.stdout.split())
    more = train(*args, "--steps", "3", "--out-dir", str(tmp_path / "cut"), "--resume")
    assert more.returncode == 0, more.stderr
    assert "after step 2" in more.stdout
    whole = train(*args, "--steps", "3", "--out-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    # the same as the run that went on: AdamW's moments, the RNG states and the step came back
    cut, whole = tmp_path / "cut" / "metrics.jsonl", tmp_path / "whole" / "metrics.jsonl"
    assert records(cut) == records(whole)
    a, b = weights(tmp_path / "cut" / "model"), weights(tmp_path / "whole" / "model")
    assert checkpoint.model_step(str(tmp_path / "cut" / "model")) == 3
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_users_files_in_the_model_folder_are_kept_when_the_run_replaces_it(tiny_model_dir, tmp_path,
                                                                               capsys):
    """Issue 59 case 2: --resume replaced OUT/model whole, deleting a model card and a figure put
    there without a word. What the trainer wrote it replaces; anything else is kept, and said."""
    from grpo.model import load_policy, load_tokenizer
    policy, tokenizer = load_policy(tiny_model_dir, "cpu"), load_tokenizer(tiny_model_dir)
    folder = str(tmp_path / "model")
    checkpoint.save_model(folder, policy, tokenizer, 2)
    assert capsys.readouterr().err == ""
    (tmp_path / "model" / "README.md").write_text("# my card")
    os.makedirs(tmp_path / "model" / "figures")
    (tmp_path / "model" / "figures" / "p.png").write_bytes(b"png")
    (tmp_path / "model" / "config.json").write_text("{}")   # the trainer's own file: replaced
    checkpoint.save_model(folder, policy, tokenizer, 3)
    assert (tmp_path / "model" / "README.md").read_text() == "# my card"
    assert (tmp_path / "model" / "figures" / "p.png").read_bytes() == b"png"
    assert (tmp_path / "model" / "config.json").read_text() != "{}"
    assert checkpoint.model_step(folder) == 3
    said = capsys.readouterr().err
    assert "kept what" in said and "README.md, figures/p.png" in said
    checkpoint.save_model(folder, policy, tokenizer, 4)   # kept again: still not the trainer's
    assert (tmp_path / "model" / "README.md").exists() and "README.md" in capsys.readouterr().err


def test_a_resume_after_the_tasks_file_was_edited_says_so_and_marks_the_record(tiny_model_dir, tmp_path,
                                                                                capsys):
    """Issue 59 case 8: --resume after the task's file was edited went on with no note, the records
    then mixing two tasks' rewards."""
    import train_lean
    (tmp_path / "mine.py").write_text("from tasks.toy import ToyTask\n\nclass Mine(ToyTask):\n    pass\n")
    args = ["--model", tiny_model_dir, *SMALL, "--task", f"{tmp_path / 'mine.py'}:Mine",
            "--out-dir", str(tmp_path / "run")]
    train_lean.main([*args, "--steps", "2"])
    train_lean.main([*args, "--steps", "3", "--resume"])   # unedited: nothing said
    assert "task's code changed" not in capsys.readouterr().err
    assert "task_changed" not in read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]
    with open(tmp_path / "mine.py", "a") as f:
        f.write("    # a fix to the reward\n")
    train_lean.main([*args, "--steps", "5", "--resume"])
    err = capsys.readouterr().err
    assert f"--resume: the task's code changed since step 3 was saved ({tmp_path / 'mine.py'}" in err
    marked = [r.get("task_changed") for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert marked[:3] == [None] * 3 and " -> " in marked[3] and marked[4] is None


def test_a_resume_after_a_module_the_task_imports_was_edited_says_so(tiny_model_dir, tmp_path,
                                                                    capsys):
    """Issue 72 finding 7: the fingerprint missed the modules beside the task's file (the README
    says a task file imports them): a reward edited there changed a resumed run unsaid."""
    import train_lean
    (tmp_path / "helper_72.py").write_text("def score(prompt, completion):\n    return 0.5\n")
    (tmp_path / "uses.py").write_text("from helper_72 import score\nfrom tasks.toy import "
                                      "ToyTask\n\nclass Uses(ToyTask):\n    reward = "
                                      "staticmethod(score)\n")
    args = ["--model", tiny_model_dir, *SMALL, "--task", f"{tmp_path / 'uses.py'}:Uses",
            "--out-dir", str(tmp_path / "run")]
    train_lean.main([*args, "--steps", "1"])
    with open(tmp_path / "helper_72.py", "a") as f:
        f.write("# a fix to the reward\n")
    train_lean.main([*args, "--steps", "2", "--resume"])
    assert "--resume: the task's code changed since step 1 was saved" in capsys.readouterr().err
    assert " -> " in read_jsonl(tmp_path / "run" / "metrics.jsonl")[1]["task_changed"]


def test_a_resume_on_another_device_count_is_refused_in_one_line(tiny_model_dir, tmp_path, monkeypatch,
                                                                  capsys):
    """Issue 59 case 6: a 2-rank run resumed in one process (and the reverse) neither went on
    exactly nor refused (step 4's reward 0.5417 instead of 0.5000): the default generation batch
    and the random streams follow the device count."""
    import train_lean
    args = ["--model", tiny_model_dir, *SMALL, "--task", "toy", "--out-dir", str(tmp_path / "run")]
    train_lean.main([*args, "--steps", "1"])
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "localhost"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)   # as torchrun --nproc_per_node 2 would start it
    with pytest.raises(SystemExit) as e:
        train_lean.main([*args, "--steps", "2", "--resume"])
    assert e.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "was saved by a run on 1 device(s) and this one runs on 2" in line
    assert line.endswith("resume it on 1 (torchrun --nproc_per_node 1), or start a new run from its "
                         f"weights (--model {tmp_path / 'run' / 'checkpoints' / 'step_000001'})")


HUNG_REWARD = """
import os, time
from tasks.toy import ToyTask

class Hung(ToyTask):
    calls = 0

    def reward(self, prompt, completion):
        Hung.calls += 1
        if Hung.calls == 9 and os.environ.get("HANG"):   # step 2's first reward (8 a step)
            print("hung", flush=True)
            time.sleep(600)
        return super().reward(prompt, completion)
"""


def hung_run(tiny_model_dir, tmp_path, *more):
    """The arguments of a 3-step run whose step 2 hangs in its first reward (with HANG set)."""
    (tmp_path / "hung.py").write_text(HUNG_REWARD)
    return [sys.executable, TRAIN, "--model", tiny_model_dir, *SMALL, "--task",
            f"{tmp_path / 'hung.py'}:Hung", "--steps", "3", "--save-interval", "0",
            "--out-dir", str(tmp_path / "out"), *more]


@pytest.mark.slow
@pytest.mark.parametrize("signals,grace", [(1, "2"), (2, "60")], ids=["one-then-grace", "two"])
def test_a_signal_in_a_hung_step_saves_the_last_finished_one_and_exits(tiny_model_dir, tmp_path,
                                                                      signals, grace):
    """Issue 59 case 3: a reward that never returned kept the step from ending; a second SIGTERM
    exited 143 with no line and no checkpoint, the steps trained lost (and launchers send one)."""
    args = hung_run(tiny_model_dir, tmp_path, "--stop-grace", grace)
    out = tmp_path / "out"
    proc = forked.start(args[1:], env(HANG="1"))
    line_starting(proc, "hung", PROCESS_DEADLINE_S)
    for _ in range(signals):
        proc.send_signal(signal.SIGTERM)
        time.sleep(1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert f"stopped (SIGTERM) in step 2: saved step 1 to {out / 'checkpoints' / 'step_000001'}" in err
    assert "Traceback" not in err
    again = train(*args[2:], "--resume")
    assert again.returncode == 0, again.stderr
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_a_reward_past_the_timeout_gives_the_step_up_saving_the_last(tiny_model_dir, tmp_path):
    args = hung_run(tiny_model_dir, tmp_path, "--reward-timeout", "2")
    hung = forked.run(args[1:], env(HANG="1"), PROCESS_DEADLINE_S)
    assert hung.returncode == 1 and "Traceback" not in hung.stderr, hung.stderr
    lines = hung.stderr.splitlines()
    assert "train_lean.py: rewards: 0 of 8 scored in --reward-timeout 2 s: the step is given up" in lines
    assert (f"train_lean.py: stopped (--reward-timeout 2 s) in step 2: saved step 1 to "
            f"{tmp_path / 'out' / 'checkpoints' / 'step_000001'}; continue with --resume") in lines


def no_bigger_files_than(limit: int):
    """preexec_fn: no file of the process may grow past `limit` bytes; a write past it fails with EFBIG
    (SIGXFSZ ignored), as on a full disk, and without root."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_full_disk_at_the_final_save_is_said_beside_the_traceback(tiny_model_dir, tmp_path):
    # the logs fit, the weights (600 KB) do not: the final save fails, and so does the checkpoint after it
    result = subprocess.run([sys.executable, TRAIN, *run_args(tiny_model_dir, "toy", "--steps", "2",
                                                              "--out-dir", str(tmp_path))],
                            env=env(), capture_output=True, text=True, timeout=PROCESS_DEADLINE_S,
                            preexec_fn=no_bigger_files_than(100_000))
    assert result.returncode == 1 and "Traceback" in result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("train_lean.py: could not save step 2")]
    assert len(said) == 1 and "the steps after the start are lost" in said[0], result.stderr
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl")] == [1, 2]


FILLED_AT_STEP_2 = """
import os
from tasks.toy import ToyTask

class Filler(ToyTask):
    calls = 0

    def reward(self, prompt, completion):
        Filler.calls += 1
        if Filler.calls == 9:   # step 2's first reward (8 a step): the disk fills under the run
            disk = os.environ["DISK"]
            with open(os.path.join(disk, "filler"), "wb") as f:
                f.write(bytes(os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - 100_000))
        return super().reward(prompt, completion)
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs: a real full disk")
def test_a_full_disk_at_a_checkpoint_is_named_and_the_room_check_counts_every_checkpoint(
        tiny_model_dir, tmp_path):
    """Issue 72 finding 10: a full disk at a periodic checkpoint was "unexpected pos 64 vs 0" and
    iostream errors; the start-up room check counted one checkpoint where --keep-checkpoints 2
    holds three at once (two kept, one being written)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)]).returncode:
        pytest.skip("no tmpfs mount here")
    try:
        (tmp_path / "filler.py").write_text(FILLED_AT_STEP_2)
        args = ["--model", tiny_model_dir, *SMALL, "--task", f"{tmp_path / 'filler.py'}:Filler",
                "--steps", "3", "--save-interval", "1", "--out-dir", str(disk / "out")]
        refused = train(*args, "--keep-checkpoints", "3")   # 13 x 616 KB weights
        assert "6 MB free on its disk, but the trained model and the 4 checkpoint(s) it holds at " \
               "once take about 8 MB (13 x the weights of" in one_line_error(refused)
        full = train(*args, extra_env={"DISK": str(disk)})
        assert full.returncode == 1, full.stderr
        said = (f"checkpoint step 2 was not written: the disk of {disk / 'out' / 'checkpoints'} is "
                f"full")
        assert f"could not save step 2 after the failure either (DiskFull: {said}" in full.stderr
        last = full.stderr.strip().splitlines()[-1]
        assert last.startswith(f"harness.checkpoint.DiskFull: {said}")
        assert saved_steps(disk / "out") == [1]   # and no partial one left taking the room
        assert os.listdir(disk / "out" / "checkpoints") == ["step_000001"]
    finally:
        subprocess.run(["umount", str(disk)])


@pytest.mark.slow
def test_resuming_an_older_checkpoint_moves_the_later_ones_aside(two_saved_steps, evaluated, tiny_model_dir,
                                                                 tmp_path):
    # step 1 resumed with another learning rate: step 2 of the first run belongs to the abandoned future, so
    # neither pruning nor a later bare --resume may pick it over the new run's own checkpoints
    out = copy_of(two_saved_steps, tmp_path)
    ckpts = out / "checkpoints"
    # refused after its settings passed (its --model, allowed to change, holds no weights): nothing is moved yet
    empty = tmp_path / "no-weights"
    empty.mkdir()
    shutil.copy(os.path.join(tiny_model_dir, "config.json"), empty)
    refused = train(*run_args(str(empty), evaluated, "--steps", "2", "--out-dir", str(out), "--resume",
                              str(ckpts / "step_000001"), "--resume-allow-change", "model,learning_rate",
                              "--learning-rate", "5e-4"))
    assert refused.returncode == 2 and "error: cannot load --model" in refused.stderr, refused.stderr
    assert sorted(os.listdir(ckpts)) == ["step_000001", "step_000002"]
    assert not list(out.glob("*abandoned*"))
    branch = train(*run_args(tiny_model_dir, evaluated, "--steps", "2", "--save-interval", "5", "--out-dir", str(out),
                             "--resume", str(ckpts / "step_000001"), "--learning-rate", "5e-4",
                             "--resume-allow-change", "learning_rate"))
    assert branch.returncode == 0, branch.stderr
    assert f"the later checkpoint {ckpts / 'step_000002'} is moved aside to {ckpts / 'abandoned-step_000002'}" \
        in branch.stderr
    assert checkpoint.saved_settings(str(ckpts / "step_000002"))["learning_rate"] == 5e-4   # the new run's own
    assert checkpoint.saved_settings(str(ckpts / "abandoned-step_000002"))["learning_rate"] == 1e-3
    # the first run's record of step 2 too, in the log as it was (the branch's log has its own step 2)
    assert [r["step"] for r in records(out / "metrics.jsonl.abandoned-after-step_000001")] == [1, 2]
    later = train(*run_args(tiny_model_dir, evaluated, "--steps", "3", "--out-dir", str(out), "--resume",
                            "--learning-rate", "5e-4"))
    assert later.returncode == 0, later.stderr   # the same settings as the branch it continues
    assert f"resumed from {ckpts / 'step_000002'}" in later.stdout


@pytest.mark.slow
def test_a_checkpoint_under_another_steps_name_is_damaged(two_saved_steps, tmp_path):
    # intact files, but copied under a later step's name: trusted, --resume would say "after step 3" with
    # step 1's weights, and the prompt stream and schedule would skip two steps
    out = copy_of(two_saved_steps, tmp_path)
    ckpts = out / "checkpoints"
    shutil.copytree(ckpts / "step_000001", ckpts / "step_000003")
    with pytest.raises(checkpoint.CheckpointError, match="records step 1, but the folder's name says step 3"):
        checkpoint.resolve(str(ckpts / "step_000003"), str(out))   # named itself: refused
    assert checkpoint.resolve("latest", str(out), set_aside=True) == str(ckpts / "step_000002")
    assert (ckpts / "damaged-step_000003").is_dir() and not (ckpts / "step_000003").exists()


@pytest.mark.slow
def test_a_checkpoint_set_aside_resumes_as_a_new_run(two_saved_steps, evaluated, tiny_model_dir,
                                                     tmp_path, capsys, clean_env):
    # issue 46 case 14: --resume OUT/checkpoints/abandoned-step_N called an intact checkpoint
    # damaged (AttributeError: 'NoneType'): its name was not step_N
    out = copy_of(two_saved_steps, tmp_path)
    ckpts = out / "checkpoints"
    os.rename(ckpts / "step_000001", ckpts / "abandoned-step_000001.2")   # as set_aside_later names
    shutil.copytree(ckpts / "step_000002", tmp_path / "best")   # a copy named without its step
    assert checkpoint.resolve(str(ckpts / "abandoned-step_000001.2"), str(out)) == \
        str(ckpts / "abandoned-step_000001.2")
    assert checkpoint.step_of(str(tmp_path / "best")) == 2 and not checkpoint.damage(
        str(tmp_path / "best"))
    args = run_args(tiny_model_dir, evaluated, "--steps", "2", "--resume",
                    str(ckpts / "abandoned-step_000001.2"))
    line = usage_error([*args, "--out-dir", str(out)], capsys)   # not in the run's line
    assert "which --resume reads: pass another --out-dir" in line
    branch = train(*args, "--out-dir", str(tmp_path / "branch"))
    assert branch.returncode == 0, branch.stderr
    assert "after step 1" in branch.stdout
    assert [r["step"] for r in records(tmp_path / "branch" / "metrics.jsonl")] == [2]


@pytest.mark.slow
def test_a_resume_behind_a_finished_model_is_refused_or_branches_keeping_it(
        two_saved_steps, evaluated, tiny_model_dir, tmp_path, capsys, clean_env):
    # the run is resumed to step 3 at another learning rate, and the checkpoint at its end is lost
    # (deleted, or set aside as damaged): its model and record of step 3 are newer than the newest
    # checkpoint (step 2), and a later bare --resume would replace them unsaid
    out = copy_of(two_saved_steps, tmp_path)
    ckpts, logs = out / "checkpoints", ["--log-completions", str(out / "completions.jsonl")]
    on = train(*run_args(tiny_model_dir, evaluated, "--steps", "3", "--out-dir", str(out), "--resume", *logs,
                         "--learning-rate", "5e-4", "--resume-allow-change", "learning_rate", "--save-interval", "0"))
    assert on.returncode == 0, on.stderr
    shutil.rmtree(ckpts / "step_000003")
    assert checkpoint.model_step(str(out / "model")) == 3
    assert checkpoints_in(ckpts) == ["step_000002"]
    finished = weights(out / "model")
    line = usage_error([*run_args(tiny_model_dir, evaluated, "--steps", "4", "--out-dir", str(out),
                                          "--resume", *logs)], capsys)
    assert f"{out / 'model'} was trained to step 3, but the newest checkpoint, {ckpts / 'step_000002'}, is at " \
           f"step 2: resuming would replace step 3 and that model" in line
    assert f"--resume {ckpts / 'step_000002'} to branch off step 2" in line

    # named: it branches off step 2; the later model and records are moved aside, not deleted
    branch = train(*run_args(tiny_model_dir, evaluated, "--steps", "4", "--out-dir", str(out),
                             "--resume", str(ckpts / "step_000002"), *logs))
    assert branch.returncode == 0, branch.stderr
    aside = out / "abandoned-model-step_000003"
    assert f"the later model {out / 'model'} is moved aside to {aside}" in branch.stderr
    kept = weights(aside)
    assert all(torch.equal(kept[k], finished[k]) for k in finished)
    old = records(out / "metrics.jsonl.abandoned-after-step_000002")
    assert [r["step"] for r in old if "kind" not in r] == [1, 2, 3]
    assert {r["step"] for r in read_jsonl(out / "completions.jsonl.abandoned-after-step_000002")} == {1, 2, 3}
    new = [r for r in records(out / "metrics.jsonl") if "kind" not in r]
    assert [r["step"] for r in new] == [1, 2, 3, 4] and new[2]["lr"] == 1e-3   # step 3 redone at the checkpoint's
    assert checkpoint.model_step(str(out / "model")) == 4


def checkpoints_in(folder):
    return sorted(p.name for p in folder.iterdir())
