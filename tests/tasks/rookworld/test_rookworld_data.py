"""The RookWorld file reader: prompts of both kinds, malformed lines skipped and counted."""
import os
import random

import pytest

from harness.task import TaskError
from tasks.rookworld.data import read_rookworld
from tasks.rookworld.task import ChessEnvTask

from helpers import ROOK_VAL
A_LINE = ("8/2k2b2/R1p4r/3p1p2/P7/2P2B1P/5PPK/4R3 w - - 1 31+a6a5+f7e7 h5f3 e6f7 b1b6 h8h6 a1e1 e7d8 "
          "b6a6 d8c7 a6a5+8/2k2b2/2p4r/R2p1p2/P7/2P2B1P/5PPK/4R3 b - - 2 31+0.001+0+0")
P_LINE = ("P: 2b3k1/Q4rqn/p2p4/4p3/p6p/2PP3P/BP3PP1/R5K1 b - - 0 34                                    "
          "M: a4a3 c8f5 h7f6 h7g5 h7f8      E: -3.06 -2.82 -3.21 -3.16 -2.3            B: h7f6")


def test_reader_keeps_good_lines_and_counts_the_rest(tmp_path):
    path = tmp_path / "mixed.txt"
    lines = [P_LINE, "A: " + A_LINE, A_LINE, "", "   ",
             "P: 2b3k1/Q4rqn/p2p4 b - - 0 34    M: a4a3",              # FEN is no position
             "P: 2b3k1/Q4rqn/p2p4/4p3/p6p/2PP3P/BP3PP1/R5K1 b - - 0 34",  # no M:
             "A: 8/8/8+e2e4+e2e4+8/8+0.001+0+0",                        # too few fields, no position
             A_LINE.replace("+a6a5+", "+a6a!+"),                        # move is no UCI
             "hello world"]
    path.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe garbage\r\n")
    data = read_rookworld(str(path))
    assert data.policy == [P_LINE[:P_LINE.index("M:")]]
    assert data.env == ["A: " + A_LINE[:A_LINE.index("+8/2k2b2/2p4r")] + "+"] * 2
    assert data.skipped == 6
    assert "6 malformed lines skipped" in data.summary(str(path))


def test_task_draws_prompts_from_the_file(tmp_path, capsys):
    path = tmp_path / "env.txt"
    path.write_text(A_LINE + "\nnot a line\n")
    task = ChessEnvTask(data=str(path))
    assert "1 malformed lines skipped" in capsys.readouterr().out
    prompts = task.prompts(5, random.Random(0))
    assert set(prompts) == {"A: " + A_LINE[:A_LINE.index("+8/2k2b2/2p4r")] + "+"}
    assert task.reward(prompts[0], A_LINE.split("+", 3)[3]) == pytest.approx(1.0)
    with pytest.raises(TaskError):
        ChessEnvTask(data=str(tmp_path / "absent.txt"))
    only_p = tmp_path / "p.txt"
    only_p.write_text(P_LINE + "\n")
    with pytest.raises(TaskError):
        ChessEnvTask(data=str(only_p))


def test_real_file_reads_without_loss():
    path = ROOK_VAL
    if not os.path.exists(path):
        pytest.skip("../shared/data/rook_val_400.txt is absent (it is not part of the repository)")
    data = read_rookworld(path)
    assert len(data.policy) == 400 and not data.env and data.skipped == 0
