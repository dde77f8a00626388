"""--optimizer (grpo/optim.py): AdamW by default; muon gives the hidden 2-D matrices to torch.optim.Muon and the rest
to AdamW, steps both as one, and a resumed run continues both optimizers' state exactly."""
import copy

import torch

from grpo.model import load_policy
from grpo.optim import Optimizers, hidden_matrices, make_optimizer
from grpo.settings import Settings as Config
from helpers import records


def test_the_default_is_adamw_over_every_weight(tiny_model_dir):
    model = load_policy(tiny_model_dir, "cpu")
    optimizer = make_optimizer(model, Config())
    assert type(optimizer) is torch.optim.AdamW
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tiny_model_dir):
    model = load_policy(tiny_model_dir, "cpu")
    optimizer = make_optimizer(model, Config(optimizer="muon"))
    muon, adamw = optimizer.parts
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    names = {id(p): n for n, p in model.named_parameters()}
    to_muon = sorted(names[id(p)] for g in muon.param_groups for p in g["params"])
    to_adamw = sorted(names[id(p)] for g in adamw.param_groups for p in g["params"])
    assert sorted(to_muon + to_adamw) == sorted(names.values())   # each weight in one of them, once
    assert to_muon and all(n.endswith(("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                                       "mlp.c_proj.weight")) for n in to_muon)
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= set(to_adamw)   # the head is wte (tied)
    assert all(n.endswith(("bias", "wte.weight", "wpe.weight")) or ".ln_" in n for n in to_adamw)
    assert [id(p) for p in hidden_matrices(model)] == [id(p) for g in muon.param_groups for p in g["params"]]


def test_one_step_is_muons_on_the_matrices_and_adamws_on_the_rest(tiny_model_dir):
    model = load_policy(tiny_model_dir, "cpu")
    twin = copy.deepcopy(model)
    for m in (model, twin):
        for p in m.parameters():
            p.grad = torch.sin(torch.arange(p.numel(), dtype=torch.float32)).reshape(p.shape)
    make_optimizer(model, Config(optimizer="muon", learning_rate=1e-2, weight_decay=0.1)).step()
    hidden = {id(p) for p in hidden_matrices(twin)}
    torch.optim.Muon([p for p in twin.parameters() if id(p) in hidden], lr=1e-2, weight_decay=0.1,
                     adjust_lr_fn="match_rms_adamw").step()
    torch.optim.AdamW([p for p in twin.parameters() if id(p) not in hidden], lr=1e-2, weight_decay=0.1).step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_the_composite_state_dict_round_trips(tiny_model_dir):
    model = load_policy(tiny_model_dir, "cpu")
    optimizer = make_optimizer(model, Config(optimizer="muon"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = optimizer.state_dict()
    again = make_optimizer(model, Config(optimizer="muon"))
    again.load_state_dict(state)
    assert isinstance(again, Optimizers) and len(again.state) == len(list(model.parameters()))
    muon_state = again.parts[0].state_dict()["state"]
    assert all("momentum_buffer" in s for s in muon_state.values())


def test_a_muon_run_trains_and_resumes_exactly(tiny_model_dir, tmp_path, clean_env, user_threads):
    import train_lean
    args = ["--model", tiny_model_dir, "--task", "toy", "--batch-size", "8", "--group-size", "4", "--max-new-tokens",
            "8", "--learning-rate", "1e-2", "--optimizer", "muon", "--steps", "4",
            "--eval-interval", "0", "--log-level", "warning", "--save-final", "false"]
    train_lean.main([*args, "--out-dir", str(tmp_path / "straight")])
    train_lean.main([*args, "--steps", "2", "--save-interval", "2", "--out-dir", str(tmp_path / "resumed")])
    train_lean.main([*args, "--resume", "--out-dir", str(tmp_path / "resumed")])
    straight, resumed = records(tmp_path / "straight" / "metrics.jsonl"), records(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed == straight
    assert all(r["grad_norm"] > 0 and r["loss"] == r["loss"] for r in straight)
    assert straight[-1]["kl"] > 0   # the policy moved away from the reference


def test_every_listed_schedule_has_a_formula_and_one_without_raises():
    """A schedule added to LR_SCHEDULES without a formula in learning_rate fails loudly, not as
    another schedule."""
    import dataclasses
    import pytest
    from grpo.optim import LR_SCHEDULES, learning_rate
    for name in LR_SCHEDULES:
        assert learning_rate(3, Config(steps=4, lr_scheduler=name)) > 0
    unknown = dataclasses.replace(Config(steps=4), lr_scheduler="wsd")
    with pytest.raises(KeyError):
        learning_rate(3, unknown)
