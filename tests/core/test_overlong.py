import math

import pytest
import torch

from helpers import loss_config
from grpo.algorithm import grpo_loss, loss_denominator, overlong_penalty
from grpo.model import load_tokenizer
from grpo.rollout import truncated_rows


def test_truncated_rows_by_hand():
    eos = 0
    ids = torch.tensor([[5, 6, 0, 0],    # EOS at position 2: finished
                        [5, 6, 7, 8],    # no EOS within max_new_tokens 4: truncated
                        [5, 6, 7, 0],    # EOS as the last allowed token: finished
                        [0, 0, 0, 0]])   # EOS first: finished
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert truncated_rows(ids, mask, eos).tolist() == [False, True, False, False]


def test_truncated_rows_are_the_real_rollouts_without_eos(rollout64, tiny_model_dir):
    _, inputs, _, cmask, _, _ = rollout64
    eos = load_tokenizer(tiny_model_dir)("a", add_special_tokens=False)["input_ids"][0]  # the fixture's EOS
    completions = inputs[:, -cmask.shape[1]:]
    truncated = truncated_rows(completions, cmask, eos)
    assert torch.equal(truncated, ~(completions == eos).any(1))
    assert truncated.any() and not truncated.all()
    assert (cmask.sum(1)[truncated] == 24).all()  # the fixture's max_new_tokens


def test_masked_truncated_rows_carry_no_loss():
    ids = torch.tensor([[5, 0, 0], [5, 6, 7]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss_mask = mask * ~truncated_rows(ids, mask, 0)[:, None]
    logp = torch.tensor([[0.1, 0.05, 0.0], [0.1, 0.05, 0.0]], requires_grad=True)
    assert loss_denominator(loss_mask, loss_config(loss_agg="token-mean", max_new_tokens=3)) == 2
    assert loss_denominator(loss_mask, loss_config(loss_agg="seq-mean", max_new_tokens=3)) == 1
    assert loss_denominator(loss_mask, loss_config(loss_agg="dr-grpo", max_new_tokens=3)) == 6  # the constant keeps every row
    loss, stats = grpo_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), loss_mask, 2.0, loss_config())
    loss.backward()
    assert torch.equal(logp.grad[1], torch.zeros(3)) and (logp.grad[0, :2] != 0).all()
    assert stats["ratio_mean"] == pytest.approx(math.exp(0.1) + math.exp(0.05))  # the kept row's tokens only


def test_overlong_penalty_ramps_linearly_over_the_buffer():
    lengths = torch.tensor([1, 12, 13, 14, 15, 16])
    # max_new_tokens 16, buffer 4: 0 up to 12 tokens, then -0.5 per token of the 4 to -2 at 16
    assert overlong_penalty(lengths, 16, 4, 2.0).tolist() == [0.0, 0.0, -0.5, -1.0, -1.5, -2.0]
    assert overlong_penalty(lengths, 16, 16, 1.0).tolist() == pytest.approx([-1 / 16, -12 / 16, -13 / 16,
                                                                             -14 / 16, -15 / 16, -1.0])
