"""GRPO on a small causal language model: the whole default step, in this file, top to bottom.

    python train_lean.py --batch-size 64          # 8 prompts x 8 completions per step
    python train_lean.py --task toy --help        # every flag (each also a GRPO_<FLAG> variable)
    torchrun --nproc_per_node 2 train_lean.py ... # data-parallel: each process takes whole groups

Variants (grpo/variants.py) are looked up in the tables below by flag value, or add to the step at
its `on.X(...)` points (nothing by default). The engine is grpo/, the harness (`run.`) harness/.
`# every rank` marks a call every rank makes together under torchrun. Why: docs/algorithm.md.
"""
import dataclasses
import functools
import math
import random
from collections import Counter

import torch

import tasks
from grpo import distributed, variants
from grpo.model import trainable_parameters
from grpo.optim import learning_rate, make_optimizer
from grpo.passes import loss_mask, reference_logprobs, token_logprobs
from grpo.rollout import flat_groups, stream_seed
from grpo.sums import Peak, Statistics, read_sums
from harness.run import Run


# ---- advantages: each completion against the other completions of its prompt ---------------------

def group_normalised(r, eps, **_):
    """(r - the group's mean) / (the group's std + eps), r [groups, G]; 0 for a group whose rewards
    are all equal (set, not computed: float rounding in the mean cannot leak a gradient)"""
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    return variants.zero_flat_groups(adv, r)


ADVANTAGES = variants.table("advantage", group_normalised, variants.ADVANTAGES)


def group_advantages(rewards, group_size: int, advantage="group", eps=1e-4, **inputs):
    """[N] advantages of the batch's rewards (groups contiguous), and the share of flat groups
    (rewards all equal). inputs: what a variant reads (gdpo: the reward's parts)."""
    r = rewards.float().view(-1, group_size)
    adv = ADVANTAGES[advantage](r, eps, default=group_normalised, **inputs)
    return adv.reshape(-1), flat_groups(rewards, group_size).float().mean().item()


# ---- the loss of a micro-batch: clipped surrogate + k3 KL, token-mean over the mini-batch --------

@dataclasses.dataclass(frozen=True)
class Tokens:
    """A micro-batch's values per token, [B, T] ([B, 1]: one per sequence), made once in grpo_loss
    and never changed: what the loss, its statistics and a variant's terms read."""
    logp: torch.Tensor       # log pi: this forward's, with the gradient
    old_logp: torch.Tensor   # log pi_old: the sampling weights'
    adv: torch.Tensor        # A: its completion's ([B, 1]), or shaped per token (--token-advantage)
    mask: torch.Tensor       # 1 at a loss token, else 0
    ratio: torch.Tensor      # r = pi / pi_old (per sequence with --importance-level sequence)
    clipped: torch.Tensor    # clip(r): r set back to the clip's edge where it is past it
    pg_mask: torch.Tensor    # the tokens with a policy gradient: the loss tokens (by default)
    entropy: torch.Tensor = None      # each position's (None where not computed)
    ref_logp: torch.Tensor = None     # the reference's (None without a KL term)
    train_logp: torch.Tensor = None   # the trainer's at the sampling weights, detached
    sampler_logp: torch.Tensor = None   # the sampler's, where the update measures the gap
    inputs: dict = dataclasses.field(default_factory=dict)   # a variant's, by name (cov_mask)


def per_sequence(adv, entropy, cfg):
    """its completion's advantage at every token (GRPO), [B, 1]"""
    return adv


def token_ratio(logp, old_logp, mask):
    """pi / pi_old per token (PPO, GRPO)"""
    return torch.exp(logp - old_logp)


@variants.declares(accepts_dual_clip=True)
def clipped_surrogate(ratio, t, cfg, **_):
    """PPO's -min(r A, clip(r, 1 - low, 1 + high) A): no gradient once r is past the clip on A's
    side."""
    surr1 = ratio * t.adv
    surr2 = t.clipped * t.adv
    return -torch.minimum(surr1, surr2)


def k3(logp, ref_logp):
    """KL(policy || reference) per sampled token, >= 0: exp(d) - d - 1 with d = ref_logp - logp."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def token_count(mask, cfg):
    """over the mini-batch's loss tokens"""
    return float(mask.sum().item())


# each flag's choices by value, the default's here (a name a table lacks: ValueError)
RATIOS = variants.table("importance_level", token_ratio, variants.RATIOS)
TOKEN_ADVANTAGES = variants.table("token_advantage", per_sequence, variants.TOKEN_ADVANTAGES)
POLICY_LOSSES = variants.table("policy_loss", clipped_surrogate, variants.POLICY_LOSSES)
KL_ESTIMATORS = variants.table("kl_estimator", k3, variants.KL_ESTIMATORS)
AGGREGATIONS = variants.table("loss_agg", (token_count, variants.token_sum), variants.AGGREGATIONS)
TABLES = {t.flag: t for t in (ADVANTAGES, RATIOS, TOKEN_ADVANTAGES, POLICY_LOSSES, KL_ESTIMATORS,
                              AGGREGATIONS, variants.KL_PLACES, variants.MISMATCH_CORRECTIONS)}


def loss_denominator(mask, cfg) -> float:
    """This device's share of a mini-batch's denominator (its loss tokens by default)."""
    return AGGREGATIONS[cfg.loss_agg][0](mask, cfg)


def grpo_loss(logp, old_logp, advantages, mask, denominator: float, cfg, kl_coef: float = None,
              *, ref_logp=None, entropy=None, train_logp=None, sampler_logp=None, pg_mask=None,
              on=None, **inputs):
    """One micro-batch's loss over its mini-batch's denominator on every device (summed micro-batch
    gradients are then one large batch's), and its statistics; inputs: a variant's, by name."""
    on = on or variants.on(cfg, TABLES)   # the variants set: their terms (none by default)
    kl_coef = variants.loss_kl_coef(cfg, cfg.kl_coef if kl_coef is None else kl_coef)
    mask = mask.to(logp.dtype)
    # A: its completion's at every token ([B, 1]; shaped per token by --token-advantage)
    adv = TOKEN_ADVANTAGES[cfg.token_advantage](advantages[:, None].to(logp.dtype), entropy, cfg)
    ratio = RATIOS[cfg.importance_level](logp, old_logp, mask)   # pi / pi_old
    edges = variants.clip_edges(cfg, POLICY_LOSSES[cfg.policy_loss])   # 1 - low, 1 + high
    clipped = torch.clamp(ratio, *edges)   # clip(r)
    t = Tokens(logp=logp, old_logp=old_logp, adv=adv, mask=mask, ratio=ratio, clipped=clipped,
               pg_mask=mask if pg_mask is None else pg_mask, entropy=entropy, ref_logp=ref_logp,
               train_logp=logp.detach() if train_logp is None else train_logp,
               sampler_logp=sampler_logp, inputs=inputs)
    pg = POLICY_LOSSES[cfg.policy_loss](ratio, t, cfg, default=clipped_surrogate)   # PPO's
    pg = on.pg(pg, t, cfg)   # --dual-clip, --top-entropy-quantile, --mismatch-correction
    per_token = pg.expand_as(logp)   # a sequence-level term is every token's
    if ref_logp is not None and kl_coef > 0:
        per_token = per_token + kl_coef * KL_ESTIMATORS[cfg.kl_estimator](logp, ref_logp)
    per_token = on.loss(per_token, t, cfg)   # --entropy-coef's bonus
    loss = AGGREGATIONS[cfg.loss_agg][1](per_token, mask, denominator)   # the masked token-mean
    return loss, statistics(t, cfg, (MEASURED.stats, *on.stats))


def statistics(t, cfg, more=()) -> Statistics:
    """The micro-batch's statistics from the loss's own ratio and clip, summed over its loss tokens;
    `more`: MEASURED's and a variant's, each (t, cfg) -> {name: [B, T], or a Peak: the largest}."""
    with torch.no_grad():
        ratio, clipped = t.ratio.expand_as(t.logp), t.clipped.expand_as(t.logp)
        zeros, counted = torch.zeros_like(t.logp), t.pg_mask
        low, high = variants.clip_region(ratio, clipped, t.adv)   # set back on A's side
        stats = {   # the KL always by k3 (low variance), whichever estimator the loss uses
            "kl": zeros if t.ref_logp is None else k3(t.logp, t.ref_logp),
            "clip_frac": (low | high) * counted, "clip_low_frac": low * counted,
            "clip_high_frac": high * counted, "clip_dual_frac": zeros,   # --dual-clip's own
            "ratio_mean": ratio,
            "approx_kl": (ratio - 1) - torch.log(ratio),   # KL(old || new), as cleanrl logs it
            "entropy": zeros if t.entropy is None else t.entropy}
        for extra in more:
            stats.update(extra(t, cfg))
        return Statistics(stats, t.mask)


def sampler_gap(t, cfg) -> dict:
    """The sampler/trainer gap train_logp - sampler_logp, where the update has the sampler's: k3 by
    expm1 (no cancellation), |gap|, the tokens measured, the largest |gap|."""
    if t.sampler_logp is None:
        return {}
    gap = t.train_logp - t.sampler_logp
    return {"mismatch_kl": torch.expm1(gap) - gap, "mismatch_abs": gap.abs(),
            "mismatch_tokens": torch.ones_like(gap), "mismatch_max": Peak(gap.abs())}


def per_token_measured(totals, tokens: int, batch) -> dict:
    """The gap's record entries: per token measured (not per loss token), the largest as it is."""
    if "mismatch_tokens" not in totals:
        return {}
    measured = max(totals.pop("mismatch_tokens"), 1)
    return {"mismatch_kl": totals.pop("mismatch_kl") / measured,
            "mismatch_abs": totals.pop("mismatch_abs") / measured,
            "mismatch_max": float(totals.pop("mismatch_max"))}


# in every record, beside the loss's own statistics, as a variant's would be
MEASURED = variants.Switch(stats=sampler_gap, record=per_token_measured)


# ---- the update: mini-batches of micro-batches, gradients summed over devices -------------------

def accumulate(policy, optimizer, batch, rows, micro, mask, denominator: float, cfg, autocast,
               kl_coef: float, update_index: int = 0, on=None, **inputs) -> Counter:
    """Forward and backward of one mini-batch (rows) in micro-batches (harness/guards.py Micro),
    then a variant's second loss (--ptx-coef); returns the summed statistics."""
    optimizer.zero_grad(set_to_none=True)
    on, parts = on or variants.on(cfg, TABLES), []
    for part in micro.split(batch, rows):
        logp, entropy = token_logprobs(   # the entropy with a gradient for --entropy-coef
            policy, batch, part, cfg, autocast, with_entropy=True, entropy_grad=on.reads_entropy)
        ref_logp = None if batch.ref_logp is None else batch.ref_logp[part]
        loss, stats = grpo_loss(logp, batch.old_logp[part], batch.advantages[part], mask[part],
                                denominator, cfg, kl_coef, ref_logp=ref_logp, entropy=entropy,
                                on=on, **{k: v[part] for k, v in inputs.items()})
        loss.backward()
        parts.append((stats, loss.detach(), mask[part].sum()))
    sums = read_sums(parts)   # one read of the device for every micro-batch
    on.backward(policy, batch, micro, cfg, autocast, sums, update_index)   # --ptx-coef's texts
    return sums


def update(policy, optimizer, batch, cfg, layout, autocast, guard, kl_coef=None, on=None) -> dict:
    """--ppo-epochs passes over the batch in shuffled mini-batches, one optimizer step each; returns
    the step's record entries. A non-finite update is skipped (guard.step), the weights kept."""
    params, kl_coef = trainable_parameters(policy), cfg.kl_coef if kl_coef is None else kl_coef
    B, mini = batch.input_ids.shape[0], layout.mini_batch_per_device
    mask, on = loss_mask(batch, cfg), on or variants.on(cfg, TABLES)
    totals, grad_norms, skipped = Counter(), [], 0
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B) if mini < B else torch.arange(B)
        for rows in order.split(mini):
            # the sampler/trainer gap: measured at the sampling weights, the first update's
            inputs = {"sampler_logp": batch.sampler_logp} if not grad_norms else {}
            # in batch order: a group's rows in one micro-batch share their prompt's forward
            rows = rows.sort().values.to(batch.input_ids.device, non_blocking=True)
            # the denominator is global: gradients summed over ranks are the one-process gradient
            count = loss_denominator(mask[rows], cfg)
            denominator = max(distributed.all_sum([count])[0], 1)  # every rank
            inputs.update(batch.inputs, **on.mini_batch(  # every rank   (a variant's inputs)
                policy, batch, rows, mask, guard, cfg, autocast))
            sums = guard.fit(functools.partial(  # every rank
                accumulate, policy, optimizer, batch, rows, mask=mask, denominator=denominator,
                cfg=cfg, autocast=autocast, kl_coef=kl_coef, update_index=len(grad_norms), on=on,
                **inputs))
            distributed.sum_gradients(params)  # every rank
            every = Counter()   # over every device, in rank order (a Largest: the largest)
            for sums_of_rank in distributed.gather_objects(sums):  # every rank
                every.update(sums_of_rank)
            # --max-grad-norm 0 is no clipping: an infinite bound scales by exactly 1
            bound = cfg.max_grad_norm or math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(params, bound).item()
            skipped += not guard.step(optimizer, every["loss"], grad_norm)   # not finite
            totals.update(every)
            grad_norms.append(grad_norm)
    return record(totals, grad_norms, skipped, batch, (MEASURED.record, *on.record))


def record(totals, grad_norms, skipped: int, batch, more=()) -> dict:
    """The update's record entries: statistics per loss token, loss and gradient norm per update;
    `more`: MEASURED's and a variant's, each popping the sums it divides itself."""
    tokens, updates = max(totals.pop("tokens"), 1), len(grad_norms)
    out = {k: v for extra in more for k, v in extra(totals, tokens, batch).items()}   # they pop
    loss = totals.pop("loss") / updates
    return {**out, "loss": loss, **{k: v / tokens for k, v in totals.items()},
            "grad_norm": sum(grad_norms) / updates, "skipped_nonfinite": skipped}


# ---- the run: every step in order ---------------------------------------------------------------

def main(argv=None):
    # every setting checked (a bad one exits 2 with one line), OUT_DIR locked, the devices joined
    run = Run(argv, TABLES, builtin=tasks.BUILTIN, default_task=tasks.DEFAULT)  # every rank
    cfg = run.cfg
    with run:   # every way out closes what the run opened; a failure after a step saves that step
        task = run.open_task()   # and --ptx-coef's texts
        policy, reference, tokenizer = run.load_models()   # reference: None without a KL term
        if cfg.eval_only:
            return run.evaluate_only()
        optimizer = make_optimizer(policy, cfg)   # AdamW, or --optimizer muon (grpo/optim.py)
        kl = variants.AdaptiveKL(cfg)   # --kl-coef; with --kl-target a controller's, checkpointed
        guard = run.start_training(optimizer, kl)  # every rank
        ctx = run.context   # what the step reads of the run (and ctx.on, the variants set)
        sampler = run.sampler(policy)   # grpo/rollout.py Sampler with the run's settings
        for step in run.steps():  # every rank   (checkpoints, a stop on Ctrl-C, the final model)
            rec, rows = train_step(  # every rank
                step, ctx, run, task, sampler, policy, reference, optimizer, guard, kl)
            run.end_step(rec, rows)  # every rank   (the record, the line, the evaluation when due)


def train_step(step, ctx, run, task, sampler, policy, reference, optimizer, guard, kl):
    """One GRPO step on this rank's share: its record, and every rank's rows of it. ctx: what the
    step reads of the run (grpo/settings.py Context), ctx.on what the variants set add."""
    cfg, layout, rank, world, on = ctx.cfg, ctx.layout, ctx.rank, ctx.world, ctx.on
    G, P, B = cfg.group_size, layout.prompts_per_device, layout.completions_per_device
    rec, rng = {"step": step}, random.Random(stream_seed(cfg.seed, step))

    def draw(round: int):   # prompts, G completions each; a later round's rows past earlier ones
        prompts = task.prompts(layout.prompts_per_step, rng)[rank * P:(rank + 1) * P]
        first_row = (round * world + rank) * B
        return sampler.sample(prompts, seed=stream_seed(cfg.seed, step), first_row=first_row)
    # ---- rollout: G completions per prompt, sampled ids and logprobs kept -----------------------
    batch = draw(0)
    run.phase_done("gen")
    # ---- rewards: the task's, of the decoded text; shaping takes penalties off them later ------
    batch = batch.score(ctx.score)   # harness/task.py score: --reward-weights, a failure's floor
    batch = on.rounds(batch, draw, ctx)  # every rank   (--dynamic-sampling's more rounds)
    run.phase_done("score")
    # ---- reference logprobs, once per row: the KL penalty ----------------------------------------
    if reference is not None:
        batch.ref_logp = reference_logprobs(  # every rank
            reference, batch, cfg, ctx.autocast, guard)
    # shaped_rewards: the task's rewards less the penalties (--overlong-buffer, --kl-in reward)
    batch.shape({name: penalty(batch, cfg, kl.coef, KL_ESTIMATORS) for name, penalty in on.penalty})
    run.phase_done("ref")
    # ---- advantages: each completion against its group, every rank's groups ---------------------
    rewards = torch.cat(distributed.gather_objects(batch.shaped_rewards))  # every rank
    inputs = on.advantage_inputs(batch, ctx)  # every rank   (--advantage gdpo's reward parts)
    adv, rec["frac_zero_std"] = group_advantages(rewards, G, cfg.advantage, **inputs)
    batch.advantages = adv[rank * B:(rank + 1) * B].to(ctx.device, non_blocking=True)
    rows = run.check_rewards(step, batch, rec)  # every rank   (all failed: the run stops)
    # ---- update: clipped PPO surrogate + KL, mini-batches of micro-batches ----------------------
    rec["lr"] = learning_rate(step, cfg)   # --lr-scheduler, after its warmup
    for group in optimizer.param_groups:
        group["lr"] = rec["lr"]
    on.prepare(batch, step, ctx, policy, guard)  # every rank   (--ptx-coef, --mismatch-correction)
    rec.update(update(  # every rank
        policy, optimizer, batch, cfg, layout, ctx.autocast, guard, kl.coef, on))
    rec.update(on.after_step(rec, step, policy, reference, kl, cfg))   # --kl-target, TR-DPO
    return rec, rows


if __name__ == "__main__":
    main()
