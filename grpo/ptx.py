"""The pretraining mix (--ptx-coef, InstructGPT's PPO-ptx): text that each update also learns by next-token loss,
so that a skill the reward does not train is not forgotten while the weights it shares move.

The text comes from --ptx-file (each non-empty line a text) or from the task's optional demonstrations(n, rng): n
texts, each a string or a (context, target) pair, such as a prompt and its answer. A string is learned whole; a
pair's context is read, not learned. Each is encoded as a prompt is (the BOS first when prompts get one), followed
by EOS, which is learned too. A step's texts are drawn with an rng seeded by (seed, step), so a resumed run learns
the same text; every device encodes all of them and takes its share, so the loss denominator (algorithm.ptx_loss)
needs no collective.
"""
import functools
import random
from dataclasses import dataclass

import torch

from grpo.rollout import left_pad
from harness.task import TaskError


@dataclass
class PtxBatch:
    """Texts for one optimizer update: input_ids and attention [N, L] (left padded), target [N, L - 1] (1 where the
    token after a position is learned) and tokens, the number of learned tokens in every device's share together."""
    input_ids: torch.Tensor
    attention: torch.Tensor
    target: torch.Tensor
    tokens: int

    def share(self, rank: int, world: int) -> "PtxBatch":
        """This device's rows (every world-th from rank); tokens stays the whole update's."""
        return PtxBatch(self.input_ids[rank::world], self.attention[rank::world], self.target[rank::world], self.tokens)


def source(task, path: str | None):
    """The function (n, rng) -> n texts that --ptx-coef learns: the lines of `path`, else the task's demonstrations.
    A TaskError (one line, exit 2) when there is none."""
    if path is not None:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:
            raise TaskError(f"--ptx-file {path} has no text: --ptx-coef learns its non-empty lines")
        return functools.partial(_draw_lines, lines)
    if not callable(getattr(task, "demonstrations", None)):
        raise TaskError(f"--ptx-coef needs text: give --ptx-file PATH (a file of lines), or a task with "
                        f"demonstrations(n, rng) ({getattr(task, 'name', type(task).__name__)} has none)")
    draw(task.demonstrations, 2, random.Random(0))   # a task's mistake shows at start-up, not after the first step
    return task.demonstrations


def draw(source, n: int, rng) -> list:
    """source(n, rng), checked: exactly n texts, each a string or a (context, target) pair of strings."""
    texts = source(n, rng)
    if not isinstance(texts, (list, tuple)):
        raise TaskError(f"the task's demonstrations({n}, rng) returned a {type(texts).__name__}, not a list of {n} texts")
    if len(texts) != n:
        raise TaskError(f"the task's demonstrations({n}, rng) returned {len(texts)} texts, not {n}")
    for text in texts:
        _pair(text)
    return texts


def _draw_lines(lines: list, n: int, rng) -> list:
    return [rng.choice(lines) for _ in range(n)]


def _pair(text) -> tuple[str, str]:
    if isinstance(text, str):
        return "", text
    if isinstance(text, (tuple, list)) and len(text) == 2 and all(isinstance(t, str) for t in text):
        return text[0], text[1]
    raise TaskError(f"a --ptx-coef text must be a string or a (context, target) pair of strings, not {text!r:.80}")


def encode(texts, tokenizer, prepend_bos: bool, context: int | None, device=None) -> PtxBatch:
    """One update's texts as a batch: [BOS] + context + target + EOS, the target and EOS learned; a text longer
    than the model's context keeps its first `context` tokens."""
    pairs = [_pair(t) for t in texts]
    eos = tokenizer.eos_token_id
    bos = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos] if prepend_bos else []
    rows, learned = [], []
    for head, tail in zip(tokenizer([c for c, _ in pairs], add_special_tokens=False)["input_ids"],
                          tokenizer([t for _, t in pairs], add_special_tokens=False)["input_ids"]):
        ids = (bos + head + tail + [eos])[:context]
        rows.append(ids)
        learned.append([0] * len(bos + head) + [1] * (len(ids) - len(bos + head)))
    ids, attention = left_pad(rows, eos, device)
    target = left_pad(learned, 0, device)[0][:, 1:].to(torch.float32)   # position t predicts token t + 1
    if not target.any():
        raise TaskError(f"no --ptx-coef text leaves a token to learn (the first: {texts[0]!r:.80})")
    return PtxBatch(ids, attention, target, int(target.sum().item()))


def step_batches(source, step_seed: int, updates: int, per_update: int, tokenizer, prepend_bos: bool, context,
                 device=None) -> list[PtxBatch]:
    """The texts of every optimizer update of a step, drawn from (seed, step) alone."""
    texts = draw(source, updates * per_update, random.Random(f"ptx {step_seed}"))   # apart from the prompts' stream
    return [encode(texts[u * per_update:(u + 1) * per_update], tokenizer, prepend_bos, context, device)
            for u in range(updates)]
