"""Is it learning, and how long will it take? What the console says as the run goes (rank 0):

- each step's reward beside its running mean and that mean's change since the run's start, with a
  95% interval (harness/intervals.py trend);
- the time left and the whole job's, evaluations included: steps at the pace since the first
  (warm-up and compiling left out), the evaluation after the last step at the cost of the first
  whole one, those between at the last one's (the first's until one is timed);
- after each evaluation, each per-item metric against the earliest evaluation of the same items,
  paired (as compare_runs.py does); after the last, the before-and-after table.
"""
import json
import time

from harness import intervals, log


class Progress:
    def __init__(self, cfg, start_step: int, evaluating: bool, metrics_path: str, items_path: str):
        self.cfg, self.start_step, self.evaluating = cfg, start_step, evaluating
        self.items_path = items_path
        # a resumed run's trend starts where the run did: the records the checkpoint kept
        self.rewards = [r["reward_mean"] for r in _lines(metrics_path)
                        if r.get("kind") is None and isinstance(r.get("reward_mean"), float)]
        self.evals = {r["step"]: r for r in _lines(items_path) if not log.items_problem(r)}
        self.full_s = self.between_s = None   # an evaluation's seconds: a whole one, one between
        self.eval_s = 0.0                     # evaluations' seconds since the first step ended
        self.first = None                     # (step, time) at the end of this process's first step
        self.said_job = False

    # ---- the reward ---------------------------------------------------------------------------

    def reward(self, rec: dict) -> str:
        """The step's running mean and its change since the start, for the console line ("" until
        4 steps)."""
        if isinstance(rec.get("reward_mean"), float):
            self.rewards.append(rec["reward_mean"])
        t = intervals.trend(self.rewards)
        if t is None:
            return ""
        d = max(3, intervals.decimals(t["lo"], t["hi"]))
        s = intervals.signed
        return (f"~{t['mean']:.{d}f} ({s(t['diff'], d)} [{s(t['lo'], d)}, {s(t['hi'], d)}]"
                f"{' ' + t['verdict'] if t['verdict'] else ''})")

    def legend(self) -> str:
        w = intervals.TREND_WINDOW
        return (f"reward ~M (D [lo, hi]): the mean reward of the last {w} steps and its change "
                f"since the first {w} (half the steps while fewer than {2 * w}), a 95% interval; "
                f"up / down: it leaves 0")

    # ---- time ---------------------------------------------------------------------------------

    def evaluated(self, step: int, seconds: float, full: bool) -> None:
        if full:
            self.full_s = seconds if self.full_s is None else self.full_s
        else:
            self.between_s = seconds
        if self.first is not None:
            self.eval_s += seconds

    def evals_left(self, step: int) -> tuple:
        """(evaluations between, whole ones) still to run after `step`."""
        if not self.evaluating or step >= self.cfg.steps:
            return 0, 0
        n = self.cfg.eval_interval
        between = sum(1 for s in range(step + 1, self.cfg.steps) if s % n == 0)
        return between, 1

    def pace(self, step: int):
        """Seconds a step, from the steps after this process's first (evaluations left out); None
        until a second step has ended."""
        now = time.perf_counter()
        if self.first is None:
            self.first = (step, now)
        if self.first[0] == step:
            return None
        return (now - self.first[1] - self.eval_s) / (step - self.first[0])

    def eval_cost(self, step: int) -> tuple:
        """(seconds of the evaluations left, of which the last one's)."""
        between, whole = self.evals_left(step)
        full = self.full_s or self.between_s or 0.0
        last = whole * full
        return between * (self.between_s or full) + last, last

    def eta(self, step: int, pace) -> float | None:
        if pace is None or step == self.cfg.steps:
            return None
        return pace * (self.cfg.steps - step) + self.eval_cost(step)[0]

    def job(self, step: int, pace) -> str | None:
        """Once, when a step's pace is known (and with evaluations, one has been timed): what the
        whole job takes on this machine, evaluations' share, and when the last evaluation costs
        more than the training, how to make it cheaper."""
        if self.said_job or pace is None or (self.evaluating and self.full_s is None
                                             and self.between_s is None):
            return None
        self.said_job = True
        steps = self.cfg.steps - self.start_step
        train = pace * steps
        done_evals = self.full_s if self.start_step == 0 and self.full_s else 0.0
        left, last = self.eval_cost(self.first[0] if self.first else step)
        evals = done_evals + left
        what = "the whole job" if self.start_step == 0 else "the rest of the job"
        line = (f"{what}: about {log.duration(train + evals)} on this machine: {steps} steps "
                f"at {pace:.1f} s ({log.duration(train)})")
        if self.evaluating:
            line += (f", evaluations {log.duration(evals)} ({evals / (train + evals):.0%}; "
                     f"estimated from the first)")
        if last > train:
            task = self.cfg.task or "T"
            line += (f". The evaluation after the last step (about {log.duration(last)}) costs "
                     f"more than the training: fewer held-out items make it cheaper, its "
                     f"intervals wider as 1 / sqrt(items) (the task's options: --task {task} "
                     f"--help)")
        return line

    def share(self, seconds: float, elapsed: float) -> str | None:
        """A long evaluation says its share of the run so far."""
        if elapsed > 0 and seconds / elapsed >= 0.2:
            return (f"that evaluation took {log.duration(seconds)}, {seconds / elapsed:.0%} of the "
                    f"run so far")
        return None

    # ---- held-out metrics ---------------------------------------------------------------------

    def compare(self, step: int, entry: dict | None) -> list[str]:
        """Lines after the evaluation at `step` (entry: its per-item record, None when the task
        gives none): each per-item metric against the earliest evaluation of the same items,
        paired; after the last step, the whole before-and-after table."""
        if not entry or not entry.get("items"):
            return []
        base = next((e for s, e in sorted(self.evals.items()) if s < step and same_items(e, entry)),
                    None)
        self.evals[step] = entry
        if base is None:
            return []
        names = [n for n in entry["items"] if n in base["items"]]
        rows = {n: intervals.paired_row(base["items"][n], entry["items"][n]) for n in names}
        if step == self.cfg.steps:
            width = max(map(len, names))
            return ([f"before and after: step {base['step']} -> {step}, the same "
                     f"{entry['prompts']} held-out prompts; each metric: before, after [95% "
                     f"interval], after - before [paired 95% interval]"] +
                    [f"  {n:<{width}}  {rows[n][0]}".replace("B higher", "higher after")
                     .replace("A higher", "lower after").replace(" only B", " only after")
                     .replace(" only A", " only before") for n in names])
        moved = [f"{n} {'up' if v == 'B higher' else 'down'}" for n, (_, v) in rows.items()
                 if v != "no detectable difference"]
        return [f"against step {base['step']} (the same items, paired): "
                + (", ".join(moved) if moved else "no detectable change")
                + f" of {len(names)} per-item metric{'s' * (len(names) > 1)}"]


def same_items(a: dict, b: dict) -> bool:
    return (a.get("prompts_sha256") == b.get("prompts_sha256") and a.get("task") == b.get("task")
            and all(len(a["items"][n]) == len(b["items"][n]) for n in a["items"].keys()
                    & b["items"].keys()))


def _lines(path: str):
    """The JSON records of a file, those that are not skipped (a file not there: none)."""
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except OSError:
        return
    with f:
        for line in f:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict):
                yield record
