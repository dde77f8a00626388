"""scripts/plot_run.py: one run's or several runs' metrics.jsonl -> one PNG (reward left, held-out
rates beside it, other held-out numbers right)."""
import importlib.util
import json
import os

import pytest

import train_lean
from helpers import REPO, SMALL, write_run

SCRIPT = os.path.join(REPO, "scripts", "plot_run.py")


def plot_run():
    spec = importlib.util.spec_from_file_location("plot_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_run_and_two_seeds_make_pngs(tmp_path, capsys):
    script = plot_run()
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    a, b = write_run(tmp_path / "seed0", 0.0), write_run(tmp_path / "seed1", 0.05)
    script.main([a, str(one)])
    script.main([a, b, str(two), "--window", "2"])
    for png in (one, two):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert capsys.readouterr().out.splitlines() == [str(one), str(two)]   # paths may hold spaces


def test_it_labels_what_ran_and_draws_every_metric_with_its_interval(tmp_path, monkeypatch):
    """It titled any task "GRPO on the default model", dropped a metric with values below 0 and drew
    no intervals."""
    import json
    script = plot_run()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "settings.txt").write_text("settings (source: cli > env > task > default)\n"
                                                   "  --model  out/tiny    cli\n"
                                                   "  --task   add.py:Add  cli\n")
    evals = [{"kind": "eval", "step": s, "acc": 0.1 * s, "acc_lo": 0.0, "acc_hi": 0.3 * s + 0.1,
              "acc_n": 100, "margin": -2.0 + s, "eval_time_s": 1.0} for s in (0, 2)]
    with open(tmp_path / "run" / "metrics.jsonl", "w") as f:
        steps = [{"step": 1, "reward_mean": 0.2}, {"step": 2, "reward_mean": 0.3}]
        for r in [evals[0], *steps, evals[1]]:
            f.write(json.dumps(r) + "\n")
    drawn = {}
    monkeypatch.setattr(script, "save", lambda fig, title, png: drawn.update(fig=fig, title=title))
    script.main([str(tmp_path / "run" / "metrics.jsonl"), str(tmp_path / "p.png")])
    assert drawn["title"] == "GRPO, --task add.py:Add, --model out/tiny"
    _, rates, others = drawn["fig"].axes
    assert labels(rates)[0] == "acc (95% interval, n=100)" and labels(others) == ["margin"]
    bars = [c for c in rates.containers if c.has_yerr]
    assert len(bars) == 1   # acc's, from acc_lo to acc_hi: at step 2, 0.0 to 0.7
    assert bars[0].lines[2][0].get_segments()[1].tolist() == [[2.0, 0.0], [2.0, 0.7]]
    assert [line.get_ydata().tolist() for line in others.lines] == [[-2.0, 0.0]]


def labels(ax) -> list:
    """The entries of an axes' legend (the figure's legends are drawn from these)."""
    return [t.get_text() for t in ax.get_legend().get_texts()]


def figure_of(script, monkeypatch, argv):
    """The figure main(argv) draws, as save() gets it (nothing written)."""
    drawn = {}
    monkeypatch.setattr(script, "save", lambda fig, title, png: drawn.update(fig=fig))
    assert script.main(argv) == 0
    return drawn["fig"]


def test_a_real_run_draws_rates_on_a_rate_axis_and_the_reward_with_its_mean(
        tiny_model_dir, tmp_path, monkeypatch, clean_env):
    """Issue 60: item counts (NAME_n, p_n: 1000) shared the rates' axis and flattened them at 0."""
    train_lean.main(["--model", tiny_model_dir, *SMALL, "--task", "toy", "--steps", "4",
                     "--eval-interval", "2", "--out-dir", str(tmp_path / "run")])
    log = str(tmp_path / "run" / "metrics.jsonl")
    records = [json.loads(line) for line in open(log)]
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4] and evals[0]["acc_n"] == 5
    script = plot_run()
    fig = figure_of(script, monkeypatch, [log, str(tmp_path / "run.png"), "--window", "2"])
    reward, rates = fig.axes   # no other held-out numbers: no third panel

    # the reward: every step's faint, and the trailing mean over them solid
    raw = [r["reward_mean"] for r in records if "kind" not in r]
    faint, mean = reward.lines
    assert faint.get_ydata().tolist() == raw and faint.get_alpha() < 1
    assert mean.get_gid() == "mean reward_mean" and mean.get_ydata().tolist() == [
        raw[0], (raw[0] + raw[1]) / 2, (raw[1] + raw[2]) / 2, (raw[2] + raw[3]) / 2]
    assert "trailing 2-step mean" in labels(reward)[1]

    # the rates: acc and reward with their intervals, each point and band inside the axis' [0, 1]
    assert labels(rates)[:2] == ["acc (95% interval, n=5)", "reward (95% interval, n=5)"]
    assert not any(label.endswith("_n") for label in labels(rates))
    low, high = rates.get_ylim()
    assert 0 <= low < high <= 1
    assert all(0 <= y <= high for line in rates.lines for y in line.get_ydata())
    assert [c.lines[0].get_gid() for c in rates.containers] == ["acc", "reward"]
    for bars, key in zip(rates.containers, ("acc", "reward")):
        assert bars.lines[0].get_ydata().tolist() == [r[key] for r in evals]
        # each evaluation's error bar from NAME_lo to NAME_hi, at its step (set a little apart)
        segments = bars.lines[2][0].get_segments()
        assert [s[:, 1].tolist() for s in segments] == [[r[f"{key}_lo"], r[f"{key}_hi"]]
                                                        for r in evals]
        assert [s[0, 0] for s in segments] == pytest.approx([0, 2, 4], abs=0.2)
    # the first metric at its steps, the others just after: none before step 0 (issue 70)
    assert rates.containers[0].lines[0].get_xdata().tolist() == [0, 2, 4]
    assert min(x for line in rates.lines for x in line.get_xdata()) == 0


def test_counts_stay_off_the_rate_axis_and_changes_are_marked(tmp_path, monkeypatch):
    """A chess-like log: p_n and NAME_n are counts of items, drawn nowhere; an evaluation whose
    interval clears the first one's is marked, one whose interval overlaps it is not."""
    script = plot_run()
    evals = [{"kind": "eval", "step": 0, "p_n": 1000, "p_legal_rate": 0.02, "p_legal_rate_lo": 0.01,
              "p_legal_rate_hi": 0.03, "p_legal_rate_n": 1000, "a_format_rate": 0.9,
              "a_format_rate_lo": 0.85, "a_format_rate_hi": 0.95, "a_format_rate_n": 1000},
             {"kind": "eval", "step": 5, "p_n": 200, "p_legal_rate": 0.05, "p_legal_rate_lo": 0.035,
              "p_legal_rate_hi": 0.07, "p_legal_rate_n": 200, "a_format_rate": 0.88,
              "a_format_rate_lo": 0.8, "a_format_rate_hi": 0.93, "a_format_rate_n": 200},
             {"kind": "eval", "step": 10, "p_n": 1000, "p_legal_rate": 0.025,
              "p_legal_rate_lo": 0.015, "p_legal_rate_hi": 0.035, "p_legal_rate_n": 1000,
              "a_format_rate": 0.7, "a_format_rate_lo": 0.67, "a_format_rate_hi": 0.73,
              "a_format_rate_n": 1000}]
    steps = [{"step": s, "reward_mean": 0.1 * s} for s in range(1, 11)]
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in [evals[0], *steps[:5], evals[1],
                                                          *steps[5:], evals[2]]))
    fig = figure_of(script, monkeypatch, [str(log), str(tmp_path / "p.png")])
    reward, rates = fig.axes   # p_n is no metric of its own: no third panel for it
    assert labels(rates)[:2] == ["p_legal_rate (95% interval, n=200/1000)",
                                 "a_format_rate (95% interval, n=200/1000)"]
    assert all(y <= 1 for line in rates.lines for y in line.get_ydata())
    assert 0 <= rates.get_ylim()[0] < rates.get_ylim()[1] <= 1
    marked = [(line.get_xdata().tolist(), line.get_ydata().tolist(), line.get_marker())
              for line in rates.lines if line.get_gid() == script.CHANGED]
    # p_legal_rate at step 5 above, a_format_rate at step 10 below; the rest overlap step 0's
    assert [(x, y, mark) for [x], y, mark in marked] == [
        (pytest.approx(5, abs=0.3), [0.05], script.UP),
        (pytest.approx(10, abs=0.3), [0.7], script.DOWN)]
    assert "95% interval wholly above the first evaluation's (step 0)" in labels(rates)
    assert script.eval_metrics(evals, rates_only=True) == ["p_legal_rate", "a_format_rate"]


def test_bad_inputs_and_outputs_are_one_line_and_exit_2(tmp_path, capsys):
    """Issue 54 case 12: a missing input, a folder, a damaged line or an out.txt output were
    tracebacks; the figure on its own input overwrote it."""
    script = plot_run()
    run = write_run(tmp_path / "run", 0.0)
    (tmp_path / "damaged.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    (tmp_path / "link.png").symlink_to(run)
    for argv, said in (
            ([str(tmp_path / "none.jsonl"), "a.png"], f"{tmp_path / 'none.jsonl'}: No such file"),
            ([str(tmp_path / "run"), "a.png"], f"{tmp_path / 'run'} is a folder: pass the run's "
                                               f"metrics file, {run}"),
            ([str(tmp_path / "damaged.jsonl"), "a.png"], "damaged.jsonl line 2 is not a record of "
                                                         "a run (a JSON object with its step)"),
            ([run, str(tmp_path / "out.txt")], "a figure is written as .png (or .pdf, .svg, ...), "
                                               "not .txt"),
            ([run, str(tmp_path / "link.png")], f"PNG {tmp_path / 'link.png'} lands on {run}, "
                                                f"which METRICS reads: pass another PNG")):
        assert script.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("plot_run.py: error: ") and said in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.txt").exists() and os.path.getsize(run) > 0
    torn = tmp_path / "torn.jsonl"   # a run being written: its last line unfinished
    torn.write_text(open(run).read() + '{"step": 9, "rew')
    assert script.main([str(torn), str(tmp_path / "torn.png")]) == 0


def test_nothing_to_draw_a_bad_window_or_figure_path_is_one_line_and_exit_2(tmp_path, capsys):
    """Issue 60: an empty log drew a blank figure and exited 0; --window 0 divided by zero; a figure
    inside the run's model folder was written where the trainer replaces the folder."""
    script = plot_run()
    run = write_run(tmp_path / "run", 0.0)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "evals.jsonl").write_text('{"kind": "eval", "step": 0, "acc": 0.5}\n')
    inside_model = str(tmp_path / "run" / "model" / "plot.png")
    inside_checkpoint = str(tmp_path / "run" / "checkpoints" / "step_000003" / "p.png")
    for argv, said in (
            ([str(tmp_path / "empty.jsonl"), "a.png"],
             f"{tmp_path / 'empty.jsonl'} holds no step record (it is empty)"),
            ([str(tmp_path / "evals.jsonl"), "a.png"],
             f"{tmp_path / 'evals.jsonl'} holds no step record (only eval records)"),
            ([run, "a.png", "--window", "0"], "--window 0: the trailing mean needs at least 1"),
            ([run, "a.png", "--window", "-3"], "--window -3: the trailing mean needs at least 1"),
            ([run, "a.png", "--window", "two"], "argument --window: invalid int value: 'two'"),
            ([run, str(tmp_path / "x.foo")], f"PNG {tmp_path / 'x.foo'}: a figure is written as "
                                             f".png (or .pdf, .svg, ...), not .foo"),
            ([run, inside_model], f"PNG {inside_model} lies inside {tmp_path / 'run' / 'model'}, "
                                  f"which the run in {tmp_path / 'run'} replaces with its trained "
                                  f"model at its end"),
            # issue 72 finding 1: drawn, then deleted with the checkpoint two steps later
            ([run, inside_checkpoint], f"PNG {inside_checkpoint} lies inside "
                                       f"{tmp_path / 'run' / 'checkpoints'}, which the run in "
                                       f"{tmp_path / 'run'} keeps (and prunes) its checkpoints "
                                       f"in")):
        assert script.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("plot_run.py: error: ") and said in err and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "run" / "model") and not os.path.exists("a.png")
    assert not os.path.exists(inside_checkpoint)


def test_a_log_with_no_reward_or_a_line_nested_past_any_depth_is_one_line(tmp_path, capsys):
    """Issue 72 findings 12 and 17: records without reward values drew a blank figure, exit 0; a
    deeply nested JSON line was a RecursionError."""
    script = plot_run()
    (tmp_path / "none.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n"
                                                 for s in (1, 2)))
    (tmp_path / "nan.jsonl").write_text('{"step": 1, "reward_mean": NaN}\n{"step": 2}\n')
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + '\n{"step": 1}\n')
    for name, said in (("none", "none.jsonl holds no reward to plot: 2 of its 2 step records "
                                "have no finite reward_mean"),
                       ("nan", "nan.jsonl holds no reward to plot: 2 of its 2 step records have "
                               "no finite reward_mean"),
                       ("deep", "deep.jsonl line 1 is not a record of a run")):
        assert script.main([str(tmp_path / f"{name}.jsonl"), str(tmp_path / "p.png")]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    assert not os.path.exists(tmp_path / "p.png")
