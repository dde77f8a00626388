"""Metrics to TensorBoard or Weights & Biases as well as the JSONL file: --report-to none|tensorboard|wandb.

Neither package is a dependency of the trainer. Asking for one that is not installed raises
ReportError, one line naming the package to pip install (the trainer exits with code 2). wandb runs
offline unless WANDB_MODE says otherwise: the run is written under OUT_DIR/wandb and nothing leaves
the machine; `wandb sync` uploads it later. Only the main rank reports.
"""
import numbers
import os

KINDS = ("none", "tensorboard", "wandb")


class ReportError(RuntimeError):
    """A --report-to backend that cannot be used (exit code 2, one line, no traceback)."""


def scalars(record: dict, prefix: str = "") -> dict:
    """The numbers of a JSONL record by name, nested dicts as "outer/inner"; "step", text and bools left out."""
    out = {}
    for key, value in record.items():
        name = prefix + str(key)
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool) and name != "step":
            out[name] = float(value)
    return out


class _Nothing:
    def log(self, record: dict, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class _TensorBoard:
    def __init__(self, out_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ReportError("--report-to tensorboard needs the tensorboard package: "
                              "pip install tensorboard") from None
        self.writer = SummaryWriter(log_dir=os.path.join(out_dir, "tensorboard"))

    def log(self, record: dict, step: int) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, out_dir: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise ReportError("--report-to wandb needs the wandb package: pip install wandb") from None
        self.wandb = wandb
        os.makedirs(out_dir, exist_ok=True)
        # console "off": wandb leaves the trainer's stdout and stderr alone
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "lean-grpo"), dir=out_dir, config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"), settings=wandb.Settings(console="off"))

    def log(self, record: dict, step: int) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # waits for wandb's service process to write out the run before returning


def open_reporter(kind: str, out_dir: str, config_dict: dict):
    """A reporter with log(record, step) and close(): "none" does nothing, "tensorboard" writes events to
    OUT_DIR/tensorboard, "wandb" a run under OUT_DIR/wandb with the run's config. Raises ReportError."""
    if kind == "none":
        return _Nothing()
    if kind == "tensorboard":
        return _TensorBoard(out_dir)
    if kind == "wandb":
        return _WandB(out_dir, config_dict)
    raise ReportError(f"--report-to {kind!r} is not one of {', '.join(KINDS)}")
