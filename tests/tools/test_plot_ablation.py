"""scripts/plot_ablation.py: settings of several seeds -> one PNG, a panel per held-out metric."""
import pytest

import plot_ablation
from helpers import write_run


def test_two_settings_of_two_seeds_make_one_png(tmp_path, capsys):
    runs = {name: [write_run(tmp_path / f"{name}{seed}", 0.05 * seed) for seed in (0, 1)] for name in ("a", "b")}
    png = tmp_path / "ablation.png"
    plot_ablation.main([str(png), *(f"setting {n}={','.join(paths)}" for n, paths in runs.items())])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert capsys.readouterr().out.split() == [str(png)]


def test_a_setting_without_its_runs_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        plot_ablation.main([str(tmp_path / "x.png"), "no runs"])
    assert exit_.value.code == 2 and "is not LABEL=PATH" in capsys.readouterr().err
