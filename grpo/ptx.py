"""The pretraining mix (--ptx-coef, InstructGPT's PPO-ptx): text each update also learns by
next-token loss, so a skill the reward does not train is not forgotten. A text is a string (learned
whole) or a (context, target) pair (the context read, not learned), encoded as a prompt is, then
EOS. A step's texts depend on (seed, step) alone; each device encodes all and takes its share.
Where the texts come from, and why: docs/ptx.md.
"""
import random
from dataclasses import dataclass

import torch

from grpo.model import completion_logprobs
from grpo.rollout import left_pad, start_ids, stream_seed


@dataclass
class PtxBatch:
    """Texts for one optimizer update: input_ids and attention [N, L] (left padded), target
    [N, L - 1] (1 where the token after a position is learned) and tokens, the number of learned
    tokens in every device's share together."""
    input_ids: torch.Tensor
    attention: torch.Tensor
    target: torch.Tensor
    tokens: int
    cut: int = 0    # the update's texts longer than the model's context, learned cut to it (every device's)

    def for_device(self, rank: int, world: int) -> "PtxBatch":
        """This device's rows (every world-th from rank); tokens and cut stay the whole update's."""
        return PtxBatch(self.input_ids[rank::world], self.attention[rank::world], self.target[rank::world], self.tokens,
                        self.cut)


def encode(texts, tokenizer, prepend_bos: bool, context: int | None, device=None) -> PtxBatch:
    """One update's texts as a batch: [BOS] + context + target + EOS, the target and EOS learned; a
    text longer than the model's context keeps its first `context` tokens (counted in cut).
    ValueError for a pair whose context alone leaves no position for its target."""
    pairs = [("", t) if isinstance(t, str) else tuple(t) for t in texts]
    eos, bos = tokenizer.eos_token_id, start_ids(tokenizer, prepend_bos)
    rows, learned, cut = [], [], 0
    for pair, head, tail in zip(pairs, tokenizer([c for c, _ in pairs], add_special_tokens=False)["input_ids"],
                                tokenizer([t for _, t in pairs], add_special_tokens=False)["input_ids"]):
        start, ids = bos + head, bos + head + tail + [eos]
        if context is not None and len(start) >= context:
            raise ValueError(f"a --ptx-coef text's context of {len(start)} tokens{' (with BOS)' if bos else ''} "
                             f"({pair[0]!r:.40}...) fills the model's {context} positions: no room is left for its "
                             f"target; shorten the task's demonstrations")
        if context is not None and len(ids) > context:
            ids, cut = ids[:context], cut + 1
        rows.append(ids)
        learned.append([0] * len(start) + [1] * (len(ids) - len(start)))
    ids, attention = left_pad(rows, eos, device)
    target = left_pad(learned, 0)[0][:, 1:].to(torch.float32)   # position t predicts token t + 1
    if not target.any():   # on the host: no wait for the device
        raise ValueError(f"no --ptx-coef text leaves a token to learn (the first: {texts[0]!r:.80})")
    return PtxBatch(ids, attention, target.to(device, non_blocking=True), int(target.sum().item()),
                    cut)


def step_batches(source, step_seed: int, updates: int, per_update: int, tokenizer, prepend_bos: bool, context,
                 device=None) -> list[PtxBatch]:
    """The texts of every optimizer update of a step, drawn from (seed, step) alone: source(n, rng)
    gives n texts, each a string or a (context, target) pair (harness/task.py mix_source checks what
    a task returns)."""
    texts = source(updates * per_update, random.Random(f"ptx {step_seed}"))   # apart from the prompts' stream
    return [encode(texts[u * per_update:(u + 1) * per_update], tokenizer, prepend_bos, context, device)
            for u in range(updates)]


def problem(cfg) -> str | None:
    """The mix's settings without the mix (--ptx-coef 0)."""
    default = type(cfg).__dataclass_fields__["ptx_batch_size"].default
    if (cfg.ptx_file or cfg.ptx_batch_size != default) and not cfg.ptx_coef:
        given = f"file {cfg.ptx_file}" if cfg.ptx_file else f"batch-size {cfg.ptx_batch_size}"
        return (f"--ptx-{given} with --ptx-coef 0 (no pretraining mix): give --ptx-coef above 0, "
                f"or leave it out")
    return None


def prepare(batch, step: int, ctx, policy, guard) -> None:
    """Before the step's update: batch.extra["ptx"], this device's share of each update's texts
    (step_batches) from the run's source (ctx.mix_source: the task's demonstrations, or
    --ptx-file); ctx: the run's grpo/settings.py Context."""
    cfg = ctx.cfg
    every = step_batches(ctx.mix_source, stream_seed(cfg.seed, step), ctx.layout.updates_per_step,
                         cfg.ptx_batch_size, ctx.tokenizer, ctx.prepend_bos, ctx.context_length,
                         ctx.device)
    batch.extra["ptx"] = [b.for_device(ctx.rank, ctx.world) for b in every]


def ptx_loss(logp: torch.Tensor, target: torch.Tensor, denominator: float, coef: float):
    """One micro-batch's term: coef x the next-token loss of its target tokens (logp, target
    [N, L]), divided by the update's target tokens over every device, so micro-batches and devices
    sum to coef x the mean loss per target token. Returns (loss, the summed negative log-likelihood,
    detached)."""
    nll = -(logp * target).sum()
    return coef * nll / denominator, nll.detach()


def backward(policy, batch, micro, cfg, autocast, sums, update: int) -> None:
    """Forward and backward of this device's share of update `update`'s texts (prepare), in
    micro-batches (micro.split, each text whole); adds loss, ptx_nll and ptx_tokens to sums (every
    device reports them, zero too)."""
    mix = batch.extra["ptx"][update]
    sums.update(ptx_nll=0.0, ptx_tokens=0)
    parts = []
    for part in micro.split(mix, shared=0):
        logp = completion_logprobs(policy, mix.input_ids[part], mix.attention[part], mix.target.shape[1], 1.0,
                                   cfg.logprob_chunk_size, autocast, share_prompts=False,
                                   predict=mix.target[part])   # the head only at learned tokens
        loss, nll = ptx_loss(logp, mix.target[part], mix.tokens, cfg.ptx_coef)
        loss.backward()
        # float64 holds the float32 values exactly: read once after the last micro-batch
        parts.append(torch.stack([loss.detach(), nll, mix.target[part].sum()]).double())
    for loss, nll, tokens in torch.stack(parts).tolist() if parts else ():   # summed in order
        sums.update(loss=loss, ptx_nll=nll, ptx_tokens=tokens)


def record(totals, tokens: int, batch) -> dict:
    """The record's ptx_loss, the mix's mean loss per learned token (not x --ptx-coef), and ptx_cut,
    its texts cut to the model's context."""
    nll, learned = totals.pop("ptx_nll"), max(totals.pop("ptx_tokens"), 1)
    return {"ptx_loss": nll / learned, "ptx_cut": sum(b.cut for b in batch.extra["ptx"])}
