"""monitor_memory.py end to end: usage errors, --from-log, watching a run (a fake trainer for the
mechanics, the real train_lean.py with and without an injected leak, traced), Ctrl-C, kill -9, the
sweep, and what the plots show."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import monitor_memory
import memwatch
from monitor_memory import read_log
from helpers import REPO as ROOT
from helpers import children, process_alive, wait_until
MONITOR = os.path.join(ROOT, "monitor_memory.py")
FAKE = os.path.join(ROOT, "tests", "tools", "fake_trainer.py")
TRAINER = os.path.join(ROOT, "train_lean.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def monitor(*args, cwd, env=None):
    return subprocess.run([sys.executable, MONITOR, *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=env)


def write_log(path, rss):
    with open(path, "w") as f:
        for step, mb in enumerate(rss, start=1):
            f.write(json.dumps({"step": step, "loss": 0.0, "rss_mb": mb}) + "\n")
        f.write('{"step": 999, "rss_mb": 1')  # a line still being written: must be ignored


@pytest.mark.parametrize("args", [
    ["--from-log", "no/such/file.jsonl"],
    ["--sweep", "8,x"],
    ["--from-log", "a.jsonl", "--sweep", "8,16"],
    ["--warmup", "-1", "--from-log", "a.jsonl"],
    ["--trainer", FAKE, "--steps", "5", "--", "--steps", "7"],
    ["--trainer", FAKE, "--sweep", "8,12", "--", "--group-size", "8", "--log-file", "x"],
    ["--trainer", FAKE, "--sweep", "8,12", "--", "--group-size", "8"],
    ["--trainer", FAKE, "200", "--steps", "100"],                 # STEPS and --steps disagree
    ["--trainer", FAKE, "200", "64", "--batch-size", "32"],
    ["--trainer", FAKE, "200", "64", "7"],                        # a third positional
    ["--trainer", FAKE, "200", "x"],
    ["--trainer", FAKE, "0"],
    ["--from-log", "a.jsonl", "200"],
    ["--trainer", FAKE, "--sweep", "8,16", "5", "8", "--", "--group-size", "8"],
    ["--from-log", "a.jsonl", "--trace"],
    ["--trainer", FAKE, "--sweep", "8,16", "--trace", "--", "--group-size", "8"],
    ["--trainer", FAKE, "10", "--trace-steps", "5"],                         # without --trace
    ["--trainer", FAKE, "10", "--trace", "--trace-steps", "1"],              # nothing to compare
    ["--trainer", FAKE, "10", "--trace", "--", "--trace-memory", "5"],       # --trace sets it
    # written after the whole run: it was a traceback then, and exit 1 (the LEAK code)
    ["--trainer", FAKE, "10", "--summary", "no/such/folder/s.json"],
    ["--trainer", FAKE, "10", "--plot", "."],
    ["--from-log", "a.jsonl", "--plot", "x.foo"],   # issue 59 case 12: a traceback at the end
    ["--from-log", "a.jsonl", "--plot", "plot"],
])
def test_usage_errors_exit_2_with_one_line(tmp_path, args):
    (tmp_path / "a.jsonl").write_text("")
    r = monitor(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "error:" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, said", [
    # issue 54 case 4: the summary overwrote the log it analysed (through a link too), exit 3 unsaid
    (["--from-log", "a.jsonl", "--summary", "a.jsonl"],
     "--summary a.jsonl lands on a.jsonl, which --from-log reads: pass another --summary"),
    (["--from-log", "a.jsonl", "--summary", "link"], "--summary link lands on a.jsonl, which "
                                                      "--from-log reads"),
    (["--from-log", "a.jsonl", "--plot", "p.png", "--summary", "p.png"],
     "--summary p.png lands on p.png, which --plot writes"),
    (["--trainer", FAKE, "10", "--summary", "run/m.jsonl", "--", "--log-file", "run/m.jsonl"],
     "--summary run/m.jsonl lands on run/m.jsonl, which the watched run writes"),
    # issue 54 case 13: "no such file"
    (["--from-log", "run"], "--from-log run is a folder: pass the run's log, run/metrics.jsonl"),
    # issue 72 finding 1: written where the run deletes it at its next save
    (["--from-log", "a.jsonl", "--summary", "run/checkpoints/step_000006/s.json"],
     "--summary run/checkpoints/step_000006/s.json lies inside {run}/checkpoints, which the run "
     "in {run} keeps (and prunes) its checkpoints in: pass another --summary"),
    (["--from-log", "a.jsonl", "--plot", "run/model/p.png"],
     "--plot run/model/p.png lies inside {run}/model, which the run in {run} replaces with its "
     "trained model at its end"),
])
def test_an_output_on_an_input_and_a_folder_to_read_are_one_line(tmp_path, args, said):
    (tmp_path / "a.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "link").symlink_to(tmp_path / "a.jsonl")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    for folder in ("model", "checkpoints/step_000006"):
        (tmp_path / "run" / folder).mkdir(parents=True)
    said = said.format(run=tmp_path / "run")
    r = monitor(*args, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(f"monitor_memory.py: error: {said}"), r.stderr
    assert r.stderr.count("\n") == 1 and (tmp_path / "a.jsonl").read_text() == '{"step": 1}\n'


def test_the_monitors_own_failure_is_a_traceback_and_no_verdicts_code(tmp_path):
    # Python's exit status 1 read as the verdict LEAK: a disk that fills as the summary is written
    (tmp_path / "a.jsonl").write_text('{"step": 1}\n')
    r = monitor("--from-log", "a.jsonl", "--summary", "/dev/full", cwd=tmp_path)
    assert r.returncode == 4 and "Traceback" in r.stderr and "No space left" in r.stderr, r.stderr


def test_a_sweep_takes_the_group_size_the_task_declares(tmp_path, capsys):
    """It assumed 8 unless --group-size was given."""
    (tmp_path / "four.py").write_text("from tasks.toy import ToyTask\n\nclass Four(ToyTask):\n"
                                      "    trainer_settings = {'group_size': 4}\n")
    task = f"{tmp_path / 'four.py'}:Four"
    assert monitor_memory.main(["--sweep", "4,6", "--", "--task", task]) == 2
    assert "every batch size must be a multiple of the group size 4 " in capsys.readouterr().err
    assert monitor_memory.main(["--sweep", "8", "--", "--task", task, "--bogus", "1"]) == 2
    assert "the trainer's flags: unrecognized arguments: --bogus 1" in capsys.readouterr().err


def test_from_log_clean_leaking_and_short(tmp_path):
    write_log(tmp_path / "clean.jsonl", [1500 + (s % 3) for s in range(120)])
    r = monitor("--from-log", "clean.jsonl", "--summary", "s.json", "--plot", "p.png", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["verdict"] == "ok" and summary["records"] == 120
    assert abs(summary["series"]["rss_mb"]["slope_mb_per_step"]) < 0.05
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC

    write_log(tmp_path / "leak.jsonl", [1500 + 1.0 * s for s in range(120)])
    r = monitor("--from-log", "leak.jsonl", "--summary", "s.json", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "LEAK" in r.stdout
    assert json.loads((tmp_path / "s.json").read_text())["series"]["rss_mb"]["slope_mb_per_step"] == pytest.approx(1.0)

    write_log(tmp_path / "short.jsonl", [1500 + 5.0 * s for s in range(25)])
    r = monitor("--from-log", "short.jsonl", cwd=tmp_path)
    assert r.returncode == 3 and "too few points" in r.stdout


def test_watch_follows_the_child_and_judges_it(tmp_path):
    r = monitor("--trainer", FAKE, "--steps", 120, "--batch-size", 8, "--every", 50, "--summary", "s.json",
                "--", "--log-file", "run/m.jsonl", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split()[0] for line in r.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert rows == ["1", "50", "100"]  # the first record, then every 50 steps
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["records"] == 120 and summary["mode"] == "watch" and summary["trainer_exit_code"] == 0

    r = monitor("--trainer", FAKE, "--steps", 120, "--", "--log-file", "run/m.jsonl", "--leak-mb", 1.0,
                cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    # The log file already held the first run's records: only the new run's are judged.
    assert "120 training records" in r.stdout


def test_steps_and_batch_size_as_positionals(tmp_path):
    # `monitor_memory.py 200 64`, the seed documents' usage; the same value given both ways is no conflict
    r = monitor("--trainer", FAKE, 120, 8, "--steps", 120, "--summary", "s.json", "--", "--log-file", "m.jsonl",
                cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--steps 120 --batch-size 8 --log-file" in r.stdout.splitlines()[0]
    assert json.loads((tmp_path / "s.json").read_text())["records"] == 120


def started_with(ignored=()):
    """A preexec_fn: the monitor starts with SIGINT and SIGHUP at their defaults (whatever this test process
    inherited: a shell's background job ignores SIGINT, and Python then leaves Ctrl-C ignored), `ignored` ignored."""
    def reset():
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    return reset


def start_watching(tmp_path, args, rows, ignored=(), **popen):
    """The monitor started with `args`; returns (monitor, trainer pid) once it has printed `rows` table rows."""
    p = subprocess.Popen([sys.executable, MONITOR, *args], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=started_with(ignored), **popen)
    seen = 0
    for line in p.stdout:  # wait for evidence of the run, not for a time
        seen += line.strip()[:1].isdigit()
        if seen >= rows:
            break
    (trainer,) = children(p.pid)
    return p, trainer


def watch_forever(tmp_path, **popen):
    """The monitor watching a fake trainer that would run for minutes; returns (monitor, trainer pid, marker)."""
    marker = tmp_path / "stopped.txt"
    p, trainer = start_watching(tmp_path, ["--trainer", FAKE, "100000", "--every", "1", "--", "--log-file", "m.jsonl",
                                           "--sleep", "0.005", "--interrupted-marker", str(marker)], 10, **popen)
    return p, trainer, marker


def test_an_error_in_the_monitor_still_stops_the_trainer(tmp_path):
    # A reader that goes away (`monitor_memory.py ... | head`): the next row raises BrokenPipeError
    p, trainer, marker = watch_forever(tmp_path)
    p.stdout.close()
    p.wait(timeout=120)
    assert p.returncode != 0 and "BrokenPipeError" in p.stderr.read()
    assert marker.read_text() == "stopped by SIGINT\n"   # the clean stop, not an orphan
    assert not process_alive(trainer)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_kill_or_a_closed_terminal_stops_the_trainer(tmp_path, sig):
    p, trainer, marker = watch_forever(tmp_path)
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert "interrupted: stopping the trainer" in out, out + err
    assert marker.read_text() == "stopped by SIGINT\n" and not process_alive(trainer)


def test_under_nohup_a_closed_terminal_leaves_the_run_going(tmp_path):
    # nohup starts the monitor with SIGHUP ignored: the hang-up must not stop the run it asked to outlive it
    p, trainer, marker = watch_forever(tmp_path, ignored=(signal.SIGHUP,))
    lines = []   # the monitor's rows, read as it prints them: a full pipe would stall it, stopped or not
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    log = tmp_path / "m.jsonl"
    steps = lambda: log.read_text().count('"step"')   # noqa: E731
    at_hangup = steps()
    p.send_signal(signal.SIGHUP)
    # the trainer writes 50 more steps after the hang-up (a stopped one writes none), and is never stopped
    assert wait_until(lambda: steps() >= at_hangup + 50, timeout=60), "the hang-up stopped the run"
    assert process_alive(trainer) and not marker.exists() and not any("interrupted" in line for line in lines)
    p.send_signal(signal.SIGTERM)   # a kill still stops it cleanly
    p.wait(timeout=120)
    reader.join(timeout=30)
    out, err = "".join(lines), p.stderr.read()
    assert "interrupted: stopping the trainer" in out, out + err
    assert marker.read_text() == "stopped by SIGINT\n" and not process_alive(trainer)


def test_watch_reports_a_crashed_trainer_with_exit_3(tmp_path):
    r = monitor("--trainer", FAKE, "--steps", 100, "--", "--log-file", "m.jsonl", "--fail-at", 60,
                cwd=tmp_path)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "exited with code 1" in r.stdout and "simulated crash" in r.stdout


def test_a_watched_run_gets_a_folder_of_its_own(tmp_path):
    # out/ holds an earlier run (the trainer's default folder): the watched run writes elsewhere, and says where
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text('{"step": 1, "rss_mb": 1.0}\n')
    r = monitor("--trainer", FAKE, 30, 8, "--summary", "s.json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (folder,) = [p for p in (tmp_path / "out").iterdir() if p.name.startswith("monitor-")]
    assert f"--out-dir out/{folder.name} --log-file out/{folder.name}/metrics.jsonl" in r.stdout.splitlines()[0]
    assert len(read_log(folder / "metrics.jsonl")) == 33   # 30 steps and 3 eval records, the run's own
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == '{"step": 1, "rss_mb": 1.0}\n'
    r = monitor("--trainer", FAKE, 30, 8, "--", "--out-dir", "mine", cwd=tmp_path)   # one given is used
    assert r.returncode == 0 and "--out-dir mine --log-file mine/metrics.jsonl" in r.stdout, r.stdout + r.stderr


def test_a_trainer_that_fails_before_its_first_record_is_said_without_a_table(tmp_path):
    r = monitor("--trainer", FAKE, "--steps", 30, "--", "--log-file", "m.jsonl", "--fail-at", 1, cwd=tmp_path)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "the trainer exited with code 1 before its first step's record" in r.stdout and "simulated crash" in r.stdout
    assert "memory trend" not in r.stdout and "series" not in r.stdout
    assert "verdict: not judged (the trainer failed)" in r.stdout


def test_evidence_from_before_the_run_is_not_this_runs(tmp_path):
    # a resumed run's folder still holds the last run's trace until this run's window writes its own
    stale = tmp_path / "out" / "memory" / "trace.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"from_step": 1, "to_step": 5, "ended_early": False, "sites": [], "tensors": []}))
    os.utime(stale, (time.time() - 60, time.time() - 60))
    r = monitor("--trainer", FAKE, "--steps", 30, "--trace", "--summary", "s.json", "--", "--log-file", "m.jsonl",
                "--out-dir", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "s.json").read_text())["evidence"] is None
    assert "no evidence" in r.stdout and "steps 1-5" not in r.stdout


def test_trainer_flag_errors_are_usage_errors(tmp_path):
    r = monitor("--trainer", FAKE, "--steps", 10, "--", "--log-file", "m.jsonl", "--no-such-flag", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "unrecognized arguments: --no-such-flag" in r.stdout


def test_ctrl_c_stops_the_child_cleanly_and_still_analyses(tmp_path):
    marker = tmp_path / "stopped.txt"
    p, _ = start_watching(tmp_path, ["--trainer", FAKE, "100000", "--every", "1", "--summary", "s.json", "--",
                                     "--log-file", "m.jsonl", "--sleep", "0.005", "--interrupted-marker", str(marker)], 40)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
    assert marker.read_text() == "stopped by SIGINT\n"  # the child got its clean stop
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["interrupted"] is True and summary["verdict"] == "ok"
    assert summary["records"] >= 40
    assert "verdict: no leak" in out


def test_sweep_table_fit_and_out_of_memory(tmp_path):
    # The fake's peak is 100 MB + 10 MB x batch; batch 64 fails as CUDA OOM does; a 0.4 GiB
    # (409.6 MB) budget puts batch 32's 420 MB peak just over it.
    r = monitor("--trainer", FAKE, "--sweep", "8,16,32,64", "--steps", 3, "--budget-gb", 0.4,
                "--summary", "s.json", "--plot", "sweep.png", "--",
                "--group-size", 8, "--device", "cpu", "--oom-above", 32, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert [(row["batch_size"], row["status"], row["peak_mb"]) for row in s["rows"]] == [
        (8, "OK", 180.0), (16, "OK", 260.0), (32, "OOM", 420.0), (64, "OOM", None)]
    assert s["rows"][2]["note"] == "ran, but its peak is over the budget"
    assert s["fixed_mb"] == pytest.approx(100.0) and s["per_sample_mb"] == pytest.approx(10.0)
    # The line allows (409.6 - 100) / 10 = 30.96 -> 24 in groups of 8; 32 was measured not to fit.
    assert s["largest_batch"] == 24
    assert "largest batch that fits in 0.4 GiB: 24" in r.stdout
    assert (tmp_path / "sweep.png").read_bytes()[:8] == PNG_MAGIC


def test_sweep_stops_a_cpu_run_that_outgrows_the_budget(tmp_path):
    # Batch 16 really holds 400 MB; with a 0.3 GiB budget the monitor must kill it itself.
    r = monitor("--trainer", FAKE, "--sweep", "8,16", "--steps", 2, "--budget-gb", 0.3, "--summary", "s.json",
                "--", "--group-size", 8, "--device", "cpu", "--hold-mb-above", 8, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [(row["status"], row.get("note")) for row in rows] == [("OK", None), ("OOM", "killed at the budget")]
    assert "no fit" in r.stdout


def test_sweep_of_a_failing_trainer_exits_3(tmp_path):
    r = monitor("--trainer", FAKE, "--sweep", "8,16", "--steps", 2, "--", "--group-size", 8, "--device", "cpu",
                "--fail-at", 1, cwd=tmp_path)
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout.count("FAIL") == 2 and "simulated crash" in r.stdout


# --- the real trainer ---------------------------------------------------------------------------

needs_trainer = pytest.mark.skipif(not os.path.isfile(TRAINER), reason="train_lean.py not merged yet")

# A user's task whose reward keeps every completion's data: a numpy array (Python's allocators, so
# tracemalloc sees it and names its line) and a tensor (torch's allocator: only the census of live
# tensors sees it). 128 + 64 kB of touched memory per completion: 1.5 MB per step at batch 8.
LEAKY_TASK = """
import numpy as np
import torch
from tasks.toy import ToyTask

LEAK = {leak}


class LeakyToy(ToyTask):
    name = "leaky_toy"

    def __init__(self, **options):   # the toy task's (--eval-k, ...)
        super().__init__(**options)
        self.seen = []

    def reward(self, prompt, completion):
        if LEAK:
            self.seen.append(np.full(2**14, len(completion), dtype=np.float64))  # the leak
            self.seen.append(torch.full((128, 128), float(len(completion))))
        return super().reward(prompt, completion)
"""

# Small enough to be quick on two shared cores, long enough for a clear verdict: 30 steps, 10 of
# them warm-up, leaves 20 points, all traced (the first is the evidence's baseline). The tiny model's
# RSS moves by about 0.1 MB from step to step, so a 1.5 MB/step leak fits far above the 0.25
# threshold, and a clean run's slope is ~0.
TRAIN = ["--group-size", "4", "--max-new-tokens", "8", "--device", "cpu", "--seed", "0"]
# One thread: the tiny model gains nothing from more, and on a shared two-core machine extra
# threads only wait for each other.
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")


@needs_trainer
@pytest.mark.slow
@pytest.mark.parametrize("leak", [True, False])
def test_a_leaking_reward_is_named_by_phase_line_and_tensors(tmp_path, tiny_model_dir, leak):
    task = tmp_path / "leaky.py"
    task.write_text(LEAKY_TASK.format(leak=leak))
    line = next(i for i, text in enumerate(task.read_text().splitlines(), 1) if text.endswith("# the leak"))
    r = monitor("--steps", 30, "--batch-size", 8, "--warmup", 10, "--trace", "--summary", "s.json", "--",
                "--model", tiny_model_dir, "--task", f"{task}:LeakyToy", "--out-dir", "run", *TRAIN, cwd=tmp_path,
                env=ONE_THREAD)
    assert r.returncode == (1 if leak else 0), r.stdout + r.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    rss, evidence = summary["series"]["rss_mb"], summary["evidence"]
    assert rss["points"] == 20 and (evidence["from_step"], evidence["to_step"]) == (11, 30)
    if not leak:   # traced, and still no leak: tracing's own memory does not read as one
        assert rss["verdict"] == "ok" and abs(rss["slope_mb_per_step"]) < 0.1 and summary["growing"] == []
        assert not any(s["site"].startswith(str(task)) and s["mb"] > 0.1 for s in evidence["sites"])
        assert "verdict: no leak" in r.stdout
        return
    assert rss["verdict"] == "LEAK" and rss["slope_mb_per_step"] == pytest.approx(1.5, rel=0.25)
    (grows,) = summary["growing"]
    assert (grows["family"], grows["phase"]) == ("rss", "score") and grows["mb_per_step"] == pytest.approx(1.5, rel=0.25)
    assert "it grows in score (rewards)" in r.stdout
    # 19 steps of leak between the baseline (end of step 11) and the end of step 30: 8 x 128 kB each
    site = evidence["sites"][0]
    assert site["site"] == f"{task}:{line}" and site["mb"] == pytest.approx(19.0, rel=0.05)
    assert f" leaky.py:{line}  " in r.stdout   # printed by its name under the working directory
    tensors = evidence["tensors"][0]
    assert (tensors["shape"], tensors["dtype"], tensors["device"], tensors["count"]) == ([128, 128], "float32", "cpu", 152)
    assert "+152 x (128, 128) float32 cpu" in r.stdout


@needs_trainer
@pytest.mark.slow
def test_kill_9_of_the_monitor_ends_its_trainer(tmp_path, tiny_model_dir):
    p, trainer = start_watching(tmp_path, ["--steps", "100000", "--batch-size", "8", "--every", "1", "--", "--model",
                                           tiny_model_dir, "--task", "toy", "--out-dir", "run", *TRAIN], 3, env=ONE_THREAD)
    p.kill()   # SIGKILL: no handler of the monitor runs
    p.communicate()
    try:
        assert wait_until(lambda: not process_alive(trainer), timeout=15), "the trainer outlived its monitor"
    finally:
        if process_alive(trainer):
            os.kill(trainer, signal.SIGKILL)
    # its parent-death signal is SIGTERM, the trainer's clean stop: the step finished, a checkpoint saved
    output = (tmp_path / "run" / "train_output.txt").read_text()
    assert "SIGTERM: finishing this step" in output and "stopped after step" in output


@needs_trainer
@pytest.mark.slow
def test_the_monitor_watches_the_real_trainer_after_an_earlier_run_in_out(tmp_path, tiny_model_dir):
    # `monitor_memory.py 200 64` after any run: the trainer's default out/ holds that run's records, which it
    # refuses to write into (exit 2); the monitor gives it a folder of its own
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text('{"step": 1}\n')
    r = monitor(3, 8, "--warmup", 0, "--", "--model", tiny_model_dir, "--task", "toy", "--eval-interval", "0", *TRAIN,
                cwd=tmp_path, env=ONE_THREAD)
    assert "exited with code" not in r.stdout, r.stdout + r.stderr
    assert "memory trend after a warm-up of 0 records (3 training records" in r.stdout


# --- what the plots show -------------------------------------------------------------------------

def test_the_leak_plot_spans_the_threshold_over_the_run_so_flat_memory_looks_flat():
    flat = [{"step": s, "rss_mb": 400.0 + 0.1 * (s % 3)} for s in range(1, 201)]
    fig = monitor_memory.run_figure(flat, memwatch.analyse(flat))
    low, high = fig.axes[0].get_ylim()
    assert high - low >= memwatch.LEAK_MB_PER_STEP * 199 and low < 400.0 < 400.2 < high
    leak = [{"step": s, "rss_mb": 400.0 + 2.0 * s} for s in range(1, 201)]
    low, high = monitor_memory.run_figure(leak, memwatch.analyse(leak)).axes[0].get_ylim()
    assert 2.0 * 199 <= high - low < 2.0 * 199 * 1.2   # wider than the minimum: the data's own range


def test_the_leak_plots_legend_covers_none_of_its_lines():
    flat = [{"step": s, "rss_mb": 400.0 + 0.1 * (s % 3)} for s in range(1, 201)]
    fig = monitor_memory.run_figure(flat, memwatch.analyse(flat))
    fig.tight_layout()   # laid out as monitor_memory.save writes it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in fig.axes:
        legend, panel = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert legend.x0 >= panel.x1   # beside the panel
        assert legend.x1 <= fig.bbox.x1   # and inside the picture


def test_the_sweep_plot_ticks_are_the_batch_sizes():
    rows = [{"batch_size": b, "peak_mb": 300 + 0.7 * b, "samples_per_s": 10 + b / 10, "status": "OK"} for b in (48, 64, 80)]
    fig = monitor_memory.sweep_figure({"rows": rows, "device": "cpu", "budget_mb": 24000.0, "fixed_mb": 300.0,
                                       "per_sample_mb": 0.7})
    fig.canvas.draw()
    for ax in fig.axes:   # a log axis within a decade would label its minor ticks "5x10^1", "6x10^1", ...
        assert [t.get_text() for t in ax.get_xticklabels()] == ["48", "64", "80"]
        assert [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()] == []


@needs_trainer
@pytest.mark.slow
def test_real_trainer_sweep_point(tmp_path, tiny_model_dir):
    # One size: the table, fit and OOM logic are covered with the fake above; this checks that
    # the real trainer's records give a peak, a step time and a throughput; run twice, the second sweep
    # starts its points over in the folders of the first (the trainer refuses a used folder otherwise)
    for _ in range(2):
        r = monitor("--sweep", "8", "--steps", 2, "--summary", "s.json", "--", "--model", tiny_model_dir,
                    "--task", "toy", *TRAIN, cwd=tmp_path, env=ONE_THREAD)
        assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    (row,) = summary["rows"]
    assert row["status"] == "OK" and row["exit_code"] == 0
    assert row["peak_mb"] > 50 and row["samples_per_s"] > 0 and row["step_time_s"] > 0
    assert summary["budget_mb"] > 1024  # the machine's RAM


def test_a_damaged_line_is_named_by_number_and_the_run_stays_one(tmp_path):
    """Issue 59 case 11: one record with "rss_mb": "abc" in the middle of a log made "the log holds
    2 runs" (the first 21 records dropped, the damaged one counted); a non-JSON line was skipped
    with no word."""
    lines = []
    for step in range(1, 41):
        rec = {"step": step, "rss_mb": 500.0 + 0.01 * step, "gen_rss_mb": 400.0}
        if step == 22:
            rec["rss_mb"] = "abc"
        lines.append(json.dumps(rec))
        if step == 30:
            lines.append("not json at all")
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    r = monitor("--from-log", "m.jsonl", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        "monitor_memory.py: m.jsonl line 22 is no record (its 'rss_mb' is 'abc', not a number): skipped",
        "monitor_memory.py: m.jsonl line 31 is no record (it is not JSON): skipped"]
    assert "39 training records, steps 1-40" in r.stdout and "runs" not in r.stdout


def test_readings_that_are_no_numbers_are_named_and_the_leak_still_found(tmp_path):
    """Issue 72 findings 8 and 17: two NaN readings turned a 3 MB/step leak into "no leak", exit 0;
    null readings were dropped unnamed; a deeply nested line was a RecursionError."""
    lines = [json.dumps({"step": s, "rss_mb": 500.0 + 3 * s}) for s in range(1, 61)]
    lines[9] = json.dumps({"step": 10, "rss_mb": float("nan")})   # Python's json writes NaN
    lines[19] = json.dumps({"step": 20, "rss_mb": float("inf")})
    lines[29] = json.dumps({"step": 30, "rss_mb": None})
    lines[39] = "[" * 100_000 + "]" * 100_000
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    r = monitor("--from-log", "m.jsonl", cwd=tmp_path)
    assert r.returncode == 1 and "LEAK" in r.stdout, r.stdout + r.stderr
    assert r.stderr.splitlines() == [
        "monitor_memory.py: m.jsonl line 10 is no record (its 'rss_mb' is 'nan', not a number): "
        "skipped",
        "monitor_memory.py: m.jsonl line 20 is no record (its 'rss_mb' is 'inf', not a number): "
        "skipped",
        "monitor_memory.py: m.jsonl line 30 is no record (its 'rss_mb' is 'None', not a number): "
        "skipped",
        "monitor_memory.py: m.jsonl line 40 is no record (it is not JSON): skipped"]


def test_non_finite_readings_never_carry_a_verdict():
    steps = list(range(60))
    values = [500.0 + 3 * s for s in steps]
    values[20] = values[40] = float("nan")
    assert memwatch.judge_series(steps, values)["verdict"] == "LEAK"
