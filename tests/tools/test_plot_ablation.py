"""scripts/plot_ablation.py: settings of several seeds -> one PNG, a panel per held-out metric."""
import json

import pytest

import plot_ablation
from helpers import write_run


def test_two_settings_of_two_seeds_make_one_png(tmp_path, capsys):
    runs = {name: [write_run(tmp_path / f"{name}{seed}", 0.05 * seed) for seed in (0, 1)] for name in ("a", "b")}
    png = tmp_path / "ablation.png"
    plot_ablation.main([str(png), *(f"setting {n}={','.join(paths)}" for n, paths in runs.items())])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert capsys.readouterr().out.splitlines() == [str(png)]   # a path may hold spaces


def test_a_setting_without_its_runs_is_a_usage_error(tmp_path, capsys):
    assert plot_ablation.main([str(tmp_path / "x.png"), "no runs"]) == 2
    err = capsys.readouterr().err
    assert "is not LABEL=PATH" in err and err.count("\n") == 1   # one line, no usage block


def write_items(metrics_path, per_step):
    """The metrics.items.jsonl beside a run's metrics.jsonl: step -> {metric: per-item scores}."""
    with open(metrics_path.replace("metrics.jsonl", "metrics.items.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "items": items}) + "\n" for s, items in per_step.items())


def test_first_draws_every_evaluation_on_its_first_items(tmp_path):
    # a whole set of 6 at the ends, a part of 2 between: --first 2 recomputes each end on the 2 items the part has
    path = write_run(tmp_path / "run", 0.0)
    write_items(path, {0: {"p_legal_rate": [1, 0, 1, 1, 1, 1], "a_format_rate": [0, 0, 1, 1, 1, 1]},
                       4: {"p_legal_rate": [1, 1, 0, 0, 0, 0], "a_format_rate": [1, 0, 0, 0, 0, 0]}})
    drawn = plot_ablation.load(path, 2, pytest.fail)
    assert [(drawn[s]["p_legal_rate"], drawn[s]["a_format_rate"]) for s in (0, 4)] == [(0.5, 0.0), (1.0, 0.5)]
    assert plot_ablation.load(path, 0, pytest.fail)[4]["p_legal_rate"] == 0.3   # without --first: the record's value


@pytest.mark.parametrize("case, expected", [("fewer items", "step 4 has fewer items: {'p_legal_rate': 1}"),
                                            ("no items file", "items.jsonl is missing"),
                                            ("a step of its own", "steps [0, 4] in "),
                                            ("a step without", "per-item scores at steps [0]")])
def test_first_without_the_items_it_needs_is_a_usage_error(tmp_path, capsys, case, expected):
    path = write_run(tmp_path / "run", 0.0)
    if case == "fewer items":
        write_items(path, {0: {"p_legal_rate": [1, 0, 1]}, 4: {"p_legal_rate": [1]}})
    if case == "a step of its own":
        write_items(path, {0: {"p_legal_rate": [1, 0]}, 4: {"p_legal_rate": [1, 0]}, 9: {"p_legal_rate": [1, 1]}})
    if case == "a step without":   # step 4's evaluation has no per-item scores: it would stay on other items
        write_items(path, {0: {"p_legal_rate": [1, 0]}})
    assert plot_ablation.main([str(tmp_path / "x.png"), "--first", "2", f"a={path}"]) == 2
    assert expected in capsys.readouterr().err


def test_a_missing_run_or_a_figure_on_its_input_is_one_line(tmp_path, capsys):
    # plot_run.py's checks (issue 54 case 12): each was a traceback
    path = write_run(tmp_path / "run", 0.0)
    (tmp_path / "l.png").symlink_to(path)
    for argv, said in (([str(tmp_path / "x.png"), f"a={tmp_path / 'none.jsonl'}"], "No such file"),
                       ([path.replace(".jsonl", ".txt"), f"a={path}"], "not .txt"),
                       ([str(tmp_path / "l.png"), f"a={path}"], f"lands on {path}")):
        assert plot_ablation.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("plot_ablation.py: error: ") and said in err, err
