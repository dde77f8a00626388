"""The optimizer (--optimizer): AdamW, or Muon for the hidden weight matrices and AdamW for the rest
(embeddings, output head, biases, norms), Muon's updates scaled to AdamW's size so --learning-rate
and --weight-decay serve both (why: docs/algorithm.md, "The optimizer"); and the learning rate's
schedule (--lr-scheduler).
"""
import math

import torch

from grpo.model import trainable_parameters

OPTIMIZERS = {  # --optimizer
    "adamw": "AdamW for every weight",
    "muon": "Muon for the hidden 2-D weight matrices, AdamW for the embeddings, output head, biases and norms",
}


class Optimizers:
    """Optimizers over disjoint parameters, stepped as one: the part of torch.optim.Optimizer the
    trainer uses (param_groups for the learning rate, state, zero_grad, step, a state dict for
    checkpoints, a step hook)."""

    def __init__(self, parts: list):
        self.parts = parts

    @property
    def param_groups(self) -> list:
        return [g for o in self.parts for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.parts for p, s in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.parts:
            o.step()

    def state_dict(self) -> dict:
        return {"parts": [o.state_dict() for o in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        if "parts" not in state or len(state["parts"]) != len(self.parts):
            raise ValueError("the checkpoint's optimizer state is not this --optimizer's")
        for o, s in zip(self.parts, state["parts"]):
            o.load_state_dict(s)

    def register_step_post_hook(self, hook):
        return self.parts[-1].register_step_post_hook(hook)   # every part steps together: one call per update


def hidden_matrices(model) -> list:
    """The trainable 2-D weights that are neither an embedding (tokens, positions) nor the output head."""
    outside = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings()
    if head is not None:
        outside.add(id(head.weight))
    return [p for p in trainable_parameters(model) if p.ndim == 2 and id(p) not in outside]


def make_optimizer(model, cfg):
    """--optimizer over the model's trainable parameters, at --learning-rate with --weight-decay."""
    params = trainable_parameters(model)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    if cfg.optimizer != "muon":
        raise ValueError(f"optimizer {cfg.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    hidden = hidden_matrices(model)
    chosen = {id(p) for p in hidden}
    rest = [p for p in params if id(p) not in chosen]
    parts = [torch.optim.Muon(hidden, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                              adjust_lr_fn="match_rms_adamw")] if hidden else []
    parts += [torch.optim.AdamW(rest, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)] if rest else []
    return Optimizers(parts)


# ---- the learning rate of each step --------------------------------------------------------------

LR_SCHEDULES = {  # --lr-scheduler
    "constant": "--learning-rate throughout",
    "linear": "down in a straight line towards --min-lr-ratio x --learning-rate",
    "cosine": "down along half a cosine towards --min-lr-ratio x --learning-rate",
}


def learning_rate(step: int, cfg) -> float:
    """The learning rate of step `step` (1, 2, ... cfg.steps), of the step alone (a resume continues
    it exactly): s / W x the rate over a warmup of W steps, then from the full rate down toward the
    floor (min_lr_ratio x the rate), the last step still above it (docs/algorithm.md)."""
    base = cfg.learning_rate
    warmup = cfg.lr_warmup_steps or round(cfg.lr_warmup_ratio * cfg.steps)
    if step <= warmup:
        return base * step / warmup
    if cfg.lr_scheduler == "constant":
        return base
    progress, floor = (step - warmup - 1) / max(1, cfg.steps - warmup), cfg.min_lr_ratio * base
    fall = {"linear": 1 - progress, "cosine": (1 + math.cos(math.pi * progress)) / 2}
    return floor + (base - floor) * fall[cfg.lr_scheduler]   # a schedule without a formula: raises
