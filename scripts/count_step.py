"""The size of the algorithm: the files the training step runs (train_lean.py and grpo/), with their
non-blank and total lines: the files README's "Where things are" names (tests/harness/test_readme.py
checks), counted here rather than quoted there, where every change would move the number. With
--traced, the default path instead: the lines of every function of the repository that a 2-step toy
run calls inside its training step (a function's whole span, each line once), file by file; then the
default path as its budget counts it, named: all of train_lean.py (the step's file is read whole)
plus the traced spans of grpo/, and that without grpo/decoders.py.

    python scripts/count_step.py
    python scripts/count_step.py --traced     # a tiny model built in a temporary folder, 2 steps
"""
import glob
import inspect
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def files() -> list:
    """train_lean.py, then grpo/'s modules (its empty __init__.py left out), relative to the
    repository."""
    grpo = glob.glob("grpo/*.py", root_dir=REPO)
    return ["train_lean.py", *sorted(p for p in grpo if os.path.basename(p) != "__init__.py")]


def lines(path: str) -> tuple:
    """(non-blank lines, all lines) of the file at path, relative to the repository."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        text = f.read().splitlines()
    return sum(1 for line in text if line.strip()), len(text)


OURS = ("train_lean.py", "grpo", "harness", "tasks")   # the algorithm, then the harness and task


def traced() -> dict:
    """{file: set of its line numbers} of the repository's functions called inside train_step during
    a 2-step toy run with the defaults (one thread, no evaluation)."""
    sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]
    import torch
    import train_lean
    from make_tiny_model import build_tiny_model
    torch.set_num_threads(1)
    seen, spans = {}, {}

    def profile(frame, event, _):
        code = frame.f_code
        path = os.path.relpath(code.co_filename, REPO)
        if event == "call" and code not in spans and path.split(os.sep)[0] in OURS:
            try:
                source, first = inspect.getsourcelines(code)
            except (OSError, TypeError):   # generated code: no source to count
                source, first = [], 0
            spans[code] = [first + i for i, text in enumerate(source) if text.strip()]
            seen.setdefault(path, set()).update(spans[code])
    step = train_lean.train_step

    def traced_step(*args, **kwargs):
        sys.setprofile(profile)
        try:
            return step(*args, **kwargs)
        finally:
            sys.setprofile(None)
    train_lean.train_step = traced_step
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(os.path.join(tmp, "tiny"), seed=0)
        train_lean.main(["--model", model, "--task", "toy", "--steps", "2", "--batch-size", "8",
                         "--group-size", "4", "--max-new-tokens", "8", "--eval-interval", "0",
                         "--log-level", "warning", "--out-dir", os.path.join(tmp, "run")])
    return seen


def main() -> None:
    if sys.argv[1:] not in ([], ["--traced"]):
        print(f"count_step.py: unknown arguments {' '.join(sys.argv[1:])} (usage: count_step.py [--traced])",
              file=sys.stderr)
        sys.exit(2)
    if sys.argv[1:] == ["--traced"]:
        seen = traced()
        rows = sorted((path, len(numbers)) for path, numbers in seen.items())
        width = max(len(path) for path, _ in rows)
        print(f"{'':<{width}}  lines of the functions the default step calls (non-blank)")
        for path, n in rows:
            print(f"{path:<{width}}  {n:>5}")
        whole = lines("train_lean.py")[0]
        path = whole + sum(n for name, n in rows if name.startswith("grpo"))
        decoder = len(seen.get(os.path.join("grpo", "decoders.py"), set()))
        print(f"the default path: {path} lines (all {whole} of train_lean.py, and the traced "
              f"functions of grpo/)")
        print(f"the default path without grpo/decoders.py: {path - decoder} lines")
        return
    rows = [(path, *lines(path)) for path in files()]
    rows.append((f"{len(rows)} files", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    width = max(len(r[0]) for r in rows)
    print(f"{'':<{width}}  non-blank    all")
    for name, code, total in rows:
        print(f"{name:<{width}}  {code:>9}  {total:>5}")


if __name__ == "__main__":
    main()
