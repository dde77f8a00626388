"""train_lean.py with the guard's optimizer step replaced by a plain optimizer.step(): no per-step
copy of the weights and the optimizer's state (harness/guards.py Guard.step), as issue 52 asks of
the default. A bench runner for memory measurements only; it keeps no non-finite update out.

    python bench/plain_step.py [train_lean.py flags]
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from harness import guards  # noqa: E402


def plain_step(self, optimizer, params, loss, grad_norm):
    optimizer.step()
    self.nonfinite_streak = 0
    return True


if __name__ == "__main__":
    guards.Guard.step = plain_step
    import train_lean  # noqa: E402
    train_lean.main(sys.argv[1:])
