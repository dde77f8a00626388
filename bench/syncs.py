"""Host synchronisations per training step and phase, counted on any device (grpo/syncs.py says what
counts and how the CPU's count differs from a GPU's).

    python bench/syncs.py                          # a tiny GPT-2, the toy task, defaults, 3 steps
    python bench/syncs.py --model models/rook-tiny --task chess --steps 2   # the main job
    python bench/syncs.py --args "--kl-coef 0" --places

Runs train_lean.py's steps in this process, one thread, no evaluation, and counts what each step's
phases make (gen, score, ref, train, as run.phase_done marks them; "end" is run.end_step: the
record), then prints each step's counts and, with --places, the lines that made them. A step's
total is its four phases': what "end" reads are host tensors on a GPU (the rewards, and what the
train phase's .cpu() copied), shown apart. The decoder's check of which rows finished runs on the
CPU every step, on CUDA as grpo/decoders.py's Checks spaces it: counted as on CUDA unless
--cpu-checks (the outputs are the same either way).
"""
import argparse
import os
import shlex
import sys
import tempfile
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]

import torch  # noqa: E402

import train_lean  # noqa: E402
from grpo import decoders  # noqa: E402
from grpo.syncs import SyncCounter  # noqa: E402
from harness.run import Run  # noqa: E402
from make_tiny_model import build_tiny_model  # noqa: E402

PHASES = ("gen", "score", "ref", "train")   # train_step's; then "end", run.end_step's


def count_steps(argv: list, cpu_checks: bool = False) -> list:
    """[(phase -> its synchronisations' (kind, where) events)] of each step of train_lean.main(argv)
    (one thread)."""
    steps, counter, marks = [], SyncCounter(), []
    train_step, end_step, phase_done = train_lean.train_step, Run.end_step, Run.phase_done

    def counted_step(*args, **kwargs):
        marks[:] = [("start", 0)]
        with counter:
            return train_step(*args, **kwargs)

    def mark(run, name):
        marks.append((name, counter.count))
        return phase_done(run, name)

    def counted_end(run, *args):
        marks.append(("train", counter.count))
        with counter:
            end_step(run, *args)
        marks.append(("end", counter.count))
        steps.append({b: counter.events[i:j] for (_, i), (b, j) in zip(marks, marks[1:])})
        counter.events.clear()

    torch.set_num_threads(1)
    spacing = decoders.check_spacing
    train_lean.train_step, Run.end_step, Run.phase_done = counted_step, counted_end, mark
    if not cpu_checks:   # the checks spaced as on CUDA
        decoders.check_spacing = lambda device: spacing(torch.device("cuda"))
    try:
        train_lean.main(argv)
    finally:
        train_lean.train_step, Run.end_step, Run.phase_done = train_step, end_step, phase_done
        decoders.check_spacing = spacing
    return steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", help="a model folder (default: a tiny GPT-2 built in a temp folder)")
    p.add_argument("--task", default="toy")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--args", default="", help="more train_lean.py flags, one string")
    p.add_argument("--cpu-checks", action="store_true",
                   help="the decoder's check of which rows finished every step, as the CPU runs it")
    p.add_argument("--places", action="store_true", help="the lines that synchronised, per step")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="syncs-") as tmp:
        model = a.model or build_tiny_model(os.path.join(tmp, "tiny"), seed=0)
        flags = ["--model", model, "--task", a.task, "--steps", str(a.steps), "--eval-interval",
                 "0", "--log-level", "warning", "--out-dir", os.path.join(tmp, "run"),
                 *shlex.split(a.args)]
        steps = count_steps(flags, a.cpu_checks)
    spacing = "every step" if a.cpu_checks else (
        "at least every {} steps, at most {} x the steps drawn".format(
            *decoders.check_spacing(torch.device("cuda"))))
    print(f"host synchronisations per step ({' '.join(flags[2:4] + shlex.split(a.args))}; the "
          f"decoder's checks {spacing})")
    print("step  " + "".join(f"{name:>7}" for name in PHASES) + "  total    end")
    for i, phases in enumerate(steps, 1):
        counts = [len(phases[name]) for name in PHASES]
        print(f"{i:>4}  " + "".join(f"{n:>7}" for n in counts) + f"  {sum(counts):>5}"
              f"  {len(phases['end']):>5}")
    if a.places:
        places = Counter((name, *event) for phases in steps for name, events in phases.items()
                         for event in events)
        print(f"\nwhere, per step (over {len(steps)} steps):")
        order = (*PHASES, "end")
        for (name, what, where), n in sorted(places.items(), key=lambda kv: order.index(kv[0][0])):
            print(f"  {name:<6}{n / len(steps):>6.1f}  {what:<8} {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
