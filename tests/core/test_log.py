"""The JSONL logs on --resume: a torn last line (a kill or a full disk mid-write) is dropped with a note; a damaged
line before it is dropped loudly, the file as it was kept beside it."""
import pytest

from helpers import SMALL, read_jsonl, train


@pytest.mark.slow
def test_torn_and_damaged_lines_are_dropped_on_resume_and_said(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    metrics, completions = out / "metrics.jsonl", out / "completions.jsonl"
    args = ["--model", tiny_model_dir, *SMALL, "--task", "toy", "--save-interval", "1", "--out-dir", str(out),
            "--log-completions", str(completions)]
    first = train(*args, "--steps", "2")
    assert first.returncode == 0, first.stderr
    for path in (metrics, completions):   # a record cut off mid-write: no newline, not JSON
        with open(path, "ab") as f:
            f.write(b'{"step": 3, "reward_mean": 0.2, "comp')

    resumed = train(*args, "--steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    for path in (metrics, completions):
        assert f"{path}: dropped its torn last line" in resumed.stderr
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3]   # every line parses again
    assert sorted({r["step"] for r in read_jsonl(completions)}) == [1, 2, 3] and len(read_jsonl(completions)) == 24

    # a line that is no record before the last one: not what a kill leaves; said, dropped, the file kept aside
    lines = metrics.read_bytes().splitlines(keepends=True)
    damaged = lines[0] + b"\x00\x00\x00 not a record\n" + b"".join(lines[1:])
    metrics.write_bytes(damaged)
    again = train(*args, "--steps", "4", "--resume")
    assert again.returncode == 0, again.stderr
    assert f"{metrics}: line(s) 2 of 4 hold no JSON record" in again.stderr
    assert (out / "metrics.jsonl.damaged").read_bytes() == damaged
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3, 4]
