"""Is B really better than A? Two evaluations of the same held-out items, compared item by item.

    python compare_runs.py RUN_A RUN_B      the last evaluation of each run (--step-a / --step-b pick others)
    python compare_runs.py RUN              one run before and after: its first evaluation (A) against its last (B)

RUN is a run folder (its metrics.items.jsonl: the per-item scores the trainer writes for every metric a task's
evaluate() gives per item), or that file, or a metrics .jsonl whose .items.jsonl lies beside it. Per metric it
prints both values with their 95% intervals, the difference B - A with its paired 95% interval (a bootstrap that
draws the same items for both) and a verdict: "B higher", "A higher" or "no detectable difference". For a rate
(every score 0 or 1) the verdict also needs the exact McNemar test to agree (p < 0.05), and the items only one
side got right are shown: on few items the bootstrap alone is too sure (harness/intervals.py).

Exit codes: 0 compared (whatever the verdicts); 1 with --fail-if-lower when some metric is detectably lower in B
(a CI gate: every metric is read as higher-is-better, --metrics picks those that are); 2 bad input, one line: a
missing run or evaluation, a line of the items file that is no record, or two evaluations that
cannot be paired: of different held-out items (the prompts the evaluations asked for differ, or a
metric's item count does), of different tasks, or one evaluation with itself.
"""
import argparse
import json
import os
import sys

from harness import intervals, log

EXIT_OK, EXIT_LOWER, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # one line and exit 2, without argparse's usage block: a script's log should say what was wrong
        raise UsageError(message)


def items_file(run: str) -> str:
    """The per-item scores' file of RUN: a folder, the .items.jsonl itself, or the metrics .jsonl beside it."""
    if os.path.isdir(run):
        path = log.items_path(os.path.join(run, log.METRICS))
    elif run.endswith(".items.jsonl"):
        path = run
    else:
        path = log.items_path(run)
    if os.path.isfile(path):
        return path
    if not os.path.exists(run):
        raise UsageError(f"{run} does not exist")
    raise UsageError(f"{run} holds no per-item scores ({path} is missing): the trainer writes them when the task's "
                     f"evaluate() gives a metric per item (a list of scores), and this run's did not, or it never "
                     f"evaluated")


def evaluations(run: str) -> dict:
    """step -> the evaluation's per-item record ({"prompts", "prompts_sha256", "task", "items"}), in
    step order; each record checked (problem)."""
    path = items_file(run)
    found = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                record = line
            wrong = "it is not JSON" if record is line else log.items_problem(record)
            if wrong:
                raise UsageError(f"{path} line {number} is not a record of per-item scores: "
                                 f"{wrong}")
            found[record["step"]] = record
    if not found:
        raise UsageError(f"{path} holds no evaluation")
    return dict(sorted(found.items()))


def pick(evals: dict, step, default: str, run: str) -> tuple:
    if step is None:
        step = min(evals) if default == "first" else max(evals)
    if step not in evals:
        raise UsageError(f"{run} has no evaluation at step {step} (it has {', '.join(map(str, evals))})")
    return step, evals[step]


def check_same_items(a: dict, b: dict, where_a: str, where_b: str) -> None:
    """The same held-out items of the same task, scored on as many items, with differences a float
    holds."""
    # a record written before the task was recorded matches any
    if a.get("task", b.get("task")) != b.get("task", a.get("task")):
        raise UsageError(f"{where_a} and {where_b} evaluated different tasks ({a['task']} and "
                         f"{b['task']}) on the same prompts: a paired comparison needs the same "
                         f"task")
    if a["prompts_sha256"] != b["prompts_sha256"]:
        raise UsageError(f"{where_a} and {where_b} evaluated different held-out items ({a['prompts']} and "
                         f"{b['prompts']} prompts asked, sha256 {a['prompts_sha256'][:12]} and "
                         f"{b['prompts_sha256'][:12]}): a paired comparison needs the same items")
    for name in sorted(a["items"].keys() & b["items"].keys()):
        if len(a["items"][name]) != len(b["items"][name]):
            raise UsageError(f"{where_a} and {where_b} scored {name!r} on {len(a['items'][name])} and "
                             f"{len(b['items'][name])} items: a paired comparison needs the same items")
        if intervals.overflows(a["items"][name] + b["items"][name]):
            raise UsageError(f"{where_a} and {where_b} scored {name!r} with items too large to "
                             f"compare: sums of their differences overflow a float")


def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="one run (first evaluation against last) or two (A, B)")
    parser.add_argument("--step-a", type=int, help="A's evaluation step (default: its last; one run: its first)")
    parser.add_argument("--step-b", type=int, help="B's evaluation step (default: its last)")
    parser.add_argument("--metrics", help="comma-separated metric names to compare (default: every per-item metric)")
    parser.add_argument("--fail-if-lower", action="store_true",
                        help="exit 1 when some compared metric is detectably lower in B")
    try:
        args = parser.parse_args(argv)
        if len(args.runs) > 2:
            raise UsageError(f"give one run or two, not {len(args.runs)}")
        run_a, run_b = args.runs[0], args.runs[-1]
        same = os.path.realpath(items_file(run_a)) == os.path.realpath(items_file(run_b))
        evals_a = evaluations(run_a)
        evals_b = evals_a if same else evaluations(run_b)
        step_a, a = pick(evals_a, args.step_a, "first" if len(args.runs) == 1 else "last", run_a)
        step_b, b = pick(evals_b, args.step_b, "last", run_b)
        where_a, where_b = f"A ({run_a} step {step_a})", f"B ({run_b} step {step_b})"
        if same and step_a == step_b:   # one file, however named: the folder, or its .jsonl
            raise UsageError(f"{run_a} has one evaluation (step {step_a}): nothing to compare it with; give two runs"
                             if len(evals_a) == 1 else f"A and B are the same evaluation ({run_a} step {step_a})")
        check_same_items(a, b, where_a, where_b)
        names = sorted(a["items"].keys() & b["items"].keys(), key=list(a["items"]).index)
        if args.metrics:
            wanted = [m.strip() for m in args.metrics.split(",") if m.strip()]
            missing = [m for m in wanted if m not in names]
            if missing:
                raise UsageError(f"--metrics {missing[0]!r} is not a per-item metric of both evaluations "
                                 f"(they share {', '.join(names) or 'none'})")
            names = wanted
        if not names:
            raise UsageError(f"{where_a} and {where_b} share no per-item metric")
    except UsageError as e:
        print(f"compare_runs.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"A: {run_a} step {step_a}\nB: {run_b} step {step_b}\nthe same held-out items ({a['prompts']} prompts asked, "
          f"sha256 {a['prompts_sha256'][:12]}); each metric: A and B [95% interval], B - A [paired 95% interval]")
    width = max(map(len, names))
    verdicts = {}
    for name in names:
        text, verdicts[name] = intervals.paired_row(a["items"][name], b["items"][name])
        print(f"  {name:<{width}}  {text}")
    for side, only in (("A", a["items"].keys() - b["items"].keys()), ("B", b["items"].keys() - a["items"].keys())):
        if only and not args.metrics:
            print(f"only {side} has {', '.join(sorted(only))}: not compared")
    lower = [n for n, v in verdicts.items() if v == "A higher"]
    if args.fail_if_lower and lower:
        print(f"lower in B: {', '.join(lower)} (--fail-if-lower: exit {EXIT_LOWER})")
        return EXIT_LOWER
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
