"""The packed forwards' attention shapes over a run, at their own widths and bucketed
(grpo/packing.py bucket(), on by default on CUDA): how many distinct shapes, and what the buckets
cost in padding.

    python bench/shapes.py -- --steps 3 --eval-interval 0          # the main job, 3 steps
    python bench/shapes.py -- --model /tmp/tiny --task toy --steps 3 --eval-interval 0

Runs train_lean.main with these flags in this process (one thread) and records each packed forward's
lengths; prints, unbucketed and bucketed, the distinct attention block shapes (heads [S, Wh, Wh],
tails [R, Wt, Wh + Wt]) and the distinct packed token counts, and the share of attention query rows
and score cells (query x key) the buckets add. Nothing is timed: the same on any machine.
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

import train_lean  # noqa: E402
from grpo import packing  # noqa: E402


def blocks(head_len, tail_len, buckets: bool) -> tuple:
    """(head block shape, tail block shape or None) of one packed forward."""
    lo = packing.layout(head_len, tail_len, torch.zeros_like(tail_len) if tail_len is not None
                        else None, buckets)
    head = (*lo.head.shape, lo.head.shape[1])
    return head, None if lo.tail is None else (*lo.tail.shape, lo.tail_keys.shape[1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[1:] if argv[:1] == ["--"] else argv
    calls, layout, step, stepping = [], packing.layout, train_lean.train_step, []

    def recorded(head_len, tail_len=None, parent=None, buckets=False):
        if stepping:   # not the model's packing probe (packing.fit)
            calls.append((head_len.clone(), None if tail_len is None else tail_len.clone()))
        return layout(head_len, tail_len, parent, buckets)

    def train_step(*args, **kwargs):
        stepping.append(True)
        try:
            return step(*args, **kwargs)
        finally:
            stepping.clear()

    torch.set_num_threads(1)
    packing.layout, train_lean.train_step = recorded, train_step
    try:
        train_lean.main(flags)
    finally:
        packing.layout, train_lean.train_step = layout, step
    print(f"{len(calls)} packed forwards")
    cost = {}
    for buckets in (False, True):
        shapes = [blocks(h, t, buckets) for h, t in calls]
        rows = sum(h[0] * h[1] + (t[0] * t[1] if t else 0) for h, t in shapes)
        cells = sum(h[0] * h[1] * h[2] + (t[0] * t[1] * t[2] if t else 0) for h, t in shapes)
        cost[buckets] = rows, cells
        print(f"{'bucketed' if buckets else 'own widths'}: {len(set(shapes))} distinct shapes "
              f"({len({h for h, _ in shapes})} head, {len({t for _, t in shapes})} tail blocks), "
              f"{rows} query rows, {cells} score cells")
    (rows, cells), (b_rows, b_cells) = cost[False], cost[True]
    tokens = {int(h.sum()) + (0 if t is None else int(t.sum())) for h, t in calls}
    print(f"the buckets add {b_rows / rows - 1:.1%} query rows and {b_cells / cells - 1:.1%} score "
          f"cells; packed token counts (the projections' rows, not bucketed): {len(tokens)} "
          f"distinct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
