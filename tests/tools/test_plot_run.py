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
