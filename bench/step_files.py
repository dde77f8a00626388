"""How many of the repository's files one training step calls into, which calls go from one file to another, and
how many of those files are on the algorithm path (train_lean.py and grpo/) rather than the harness or the task.

    python bench/step_files.py            # the toy task on a tiny GPT-2, the default algorithm
    python bench/step_files.py --args "--kl-in reward --dynamic-sampling"

It runs two steps of train_lean.py in this process and follows every Python call of the second step (from
its Phases.start to the end of the run; no evaluation, no final save) with sys.setprofile. A call is counted
where it lands in a file of this repository (train_lean.py, grpo/, harness/, tasks/), its caller being the
nearest frame in one. Printed: the files, the edges (file A calls into file B), and the pairs of files that call into each
other both ways (the ping-pong a reader follows back and forth). Nothing is timed: the counts are the same on
any machine.
"""
import argparse
import os
import shlex
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]
OURS = tuple(os.path.join(REPO, p) for p in ("train_lean.py", "grpo" + os.sep, "harness" + os.sep, "tasks" + os.sep))
# the layers a file belongs to, by where it lives: what a researcher reads to hold the algorithm, and the rest
LAYERS = {"algorithm path": ("train_lean.py", "grpo/"), "harness": ("harness/",), "task": ("tasks/",)}

import train_lean  # noqa: E402
from make_tiny_model import build_tiny_model  # noqa: E402


def repo_file(frame):
    """The nearest frame at or above `frame` in a file of this repository: its path from the root, or None."""
    while frame is not None and not frame.f_code.co_filename.startswith(OURS):
        frame = frame.f_back
    return None if frame is None else os.path.relpath(frame.f_code.co_filename, REPO)


def follow(argv: list) -> set:
    """(caller file, called file) of every call of the second step between two files of the repository."""
    edges, on = set(), []

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(OURS):
            return
        if frame.f_code.co_name == "start" and frame.f_code.co_filename.endswith("memory.py") \
                and frame.f_locals.get("step") == 2:
            on.append(True)
        if on:
            edges.add((repo_file(frame.f_back), repo_file(frame)))

    sys.setprofile(profile)
    try:
        train_lean.main(argv)
    finally:
        sys.setprofile(None)
    return {(a, b) for a, b in edges if a is not None and a != b}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--args", default="", help="more train_lean.py flags")
    extra = shlex.split(parser.parse_args().args)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(os.path.join(tmp, "model"))
        edges = follow(["--model", model, "--task", "toy", "--steps", "2", "--batch-size", "8", "--group-size", "4",
                        "--max-new-tokens", "12", "--eval-interval", "0", "--save-final", "false",
                        "--log-level", "warning", "--out-dir", os.path.join(tmp, "out"), *extra])
    files = sorted({f for edge in edges for f in edge})
    both = sorted({tuple(sorted(e)) for e in edges if e[::-1] in edges})
    print(f"one step calls into {len(files)} files, {len(edges)} edges between files, "
          f"{len(both)} pairs calling each other both ways")
    print("; ".join(f"{sum(f.startswith(where) for f in files)} on the {layer}" if layer != "task" else
                    f"{sum(f.startswith(where) for f in files)} of the task" for layer, where in LAYERS.items()))
    for f in files:
        print(f"  {f:30} calls into: {', '.join(sorted(b for a, b in edges if a == f)) or '-'}")
    for a, b in both:
        print(f"  both ways: {a} <-> {b}")


if __name__ == "__main__":
    main()
