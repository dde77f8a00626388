"""scripts/plot_run.py: one run's or several runs' metrics.jsonl -> one PNG (reward left, held-out right)."""
import importlib.util
import os

from helpers import REPO, write_run

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
    assert capsys.readouterr().out.split() == [str(one), str(two)]


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
    right = drawn["fig"].axes[1]
    assert right.get_legend_handles_labels()[1] == ["acc (95% interval)", "margin"]
    bars = [c for c in right.containers if c.has_yerr]
    assert len(bars) == 1   # acc's, from acc_lo to acc_hi: at step 2, 0.0 to 0.7
    assert bars[0].lines[2][0].get_segments()[1].tolist() == [[2.0, 0.0], [2.0, 0.7]]


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
