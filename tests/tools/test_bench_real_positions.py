"""bench/real_positions.py and bench/engine_agreement.py: the agreement shares against a direct count,
a real run on a few real lines with a tiny model and real Stockfish, and a clean skip without the
data. Their main() runs in this process, on the command line given in sys.argv."""
import importlib
import os
import sys

import pytest

from bench.engine_agreement import agreement
from bench.real_positions import METRICS, tables
from tasks.rookworld.engine import find_stockfish

from helpers import ROOK_VAL


def row(*moves):
    return {"moves": list(moves)}


def test_agreement_counts_each_share_directly():
    deep = [row("e2e4", "d2d4"), row("g1f3", "c2c4"), row("a2a3", "b2b3"), row("h2h3", "g2g3")]
    shallow = [row("e2e4", "b1c3"),            # same best
               row("c2c4", "g1f3"),            # deep best second, shallow best in deep top
               row("b1c3", "a2a4"),            # neither
               row("g2g4", "h2h4", "h2h3")]    # deep best third: in the top 5, shallow best not in deep
    shares = agreement(shallow, deep)
    assert shares == {"best agrees": 1 / 4, "deep best in top 5": 3 / 4, "shallow best in deep top 5": 2 / 4}


def test_the_tables_give_each_rate_its_interval_and_pair_later_models_with_the_first():
    before = {k: [1] * 10 + [0] * 90 for k in METRICS}               # 10% of 100 positions
    gained = {k: [1] * 10 + [1] * 20 + [0] * 70 for k in METRICS}    # the same 10 and 20 more: +20 points
    lost = {k: [0] * 10 + [0] * 90 for k in METRICS}                 # the 10 lost
    mixed = {k: [0] * 10 + [1] * 11 + [0] * 79 for k in METRICS}     # 10 lost, 11 others gained: McNemar p = 1
    text = tables([("before", before), ("gained", gained), ("lost", lost), ("mixed", mixed)])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "10.0% [5.5, 17.4]" in text.splitlines()[2]              # Wilson at 10 / 100
    later = text.split("Against before")[1]
    assert "+20.0 [" in later and later.count("higher") == 4 and later.count("lower") == 4
    assert later.count("no detectable difference") == 4 and "+1.0 [" in later
    assert set(rows) >= {"model", "before", "gained", "lost", "mixed"}
    assert tables([("only", before)]).count("\n") == 2               # one model: no paired table


def bench(script, *args, monkeypatch, capsys):
    """bench/SCRIPT's main() in this process, as `python bench/SCRIPT ARGS` runs it (it reads
    sys.argv): (its exit code, its stdout)."""
    main = importlib.import_module(f"bench.{script[:-3]}").main
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) or e.code is None else 1
    return code or 0, capsys.readouterr().out


@pytest.mark.parametrize("script", ["real_positions.py", "engine_agreement.py"])
def test_without_the_data_file_it_says_so_and_exits_0(script, tmp_path, monkeypatch, capsys):
    args = ["--data", tmp_path / "absent.txt", "--cache-dir", tmp_path]
    if script == "real_positions.py":
        args.append("unused-model")
    code, out = bench(script, *args, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and "not found: skipped" in out, out


@pytest.mark.skipif(not os.path.exists(ROOK_VAL), reason="no ../shared/data/rook_val_400.txt")
@pytest.mark.skipif(find_stockfish() is None, reason="needs Stockfish")
def test_a_tiny_model_on_real_lines_gets_a_table_row_and_cached_analyses(tiny_model_dir, tmp_path,
                                                                         monkeypatch, capsys):
    args = [tiny_model_dir, tiny_model_dir, "--limit", "6", "--depth", "4", "--cache-dir", tmp_path,
            "--batch", "3"]
    code, out = bench("real_positions.py", *args, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, out
    assert "6 real P: positions" in out and out.count(f"| {tiny_model_dir} | ") == 3
    assert out.count("+0.0 [+0.0, +0.0] no detectable difference") == 4   # a model against itself
    cache = (tmp_path / "analysis_d4.jsonl").read_text().splitlines()
    assert len(cache) == 6
    again = bench("real_positions.py", *args, monkeypatch=monkeypatch, capsys=capsys)   # cached
    assert again == (0, out) and len((tmp_path / "analysis_d4.jsonl").read_text().splitlines()) == 6
    code, agree = bench("engine_agreement.py", "--limit", "6", "--depths", "4", "--deep", "4",
                        "--cache-dir", tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and "| 4 | 100.0% | 100.0% | 100.0% |" in agree, agree
