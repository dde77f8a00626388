"""The size of the algorithm: the files the training step runs (train_lean.py and grpo/), with their
non-blank and total lines: the files README's "Where things are" names (tests/harness/test_readme.py
checks), counted here rather than quoted there, where every change would move the number.

    python scripts/count_step.py
"""
import glob
import os

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


def main() -> None:
    rows = [(path, *lines(path)) for path in files()]
    rows.append((f"{len(rows)} files", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    width = max(len(r[0]) for r in rows)
    print(f"{'':<{width}}  non-blank    all")
    for name, code, total in rows:
        print(f"{name:<{width}}  {code:>9}  {total:>5}")


if __name__ == "__main__":
    main()
