"""GRPO on a small causal language model: the whole default step, in this file, top to bottom.

    python train_lean.py --batch-size 64          # 8 prompts x 8 completions per step
    python train_lean.py --task toy --help        # every flag (each also a GRPO_<FLAG> variable)
    torchrun --nproc_per_node 2 train_lean.py ... # data-parallel: each process takes whole groups

Off-by-default variants: grpo/variants.py, most looked up in the tables below by flag value (main
hands TABLES to the harness); the step's `for ... in on.X` loops run what the variants set add at
point X (none by default). Under the step, in grpo/: rollout.py, decoders.py, passes.py, model.py,
packing.py, variants.py, optim.py, distributed.py. The harness keeps the run safe and recorded,
called as `run.<something>`, and hands the step a Context (grpo/settings.py); grpo/ never imports
it. `# every rank` marks a call every rank makes together under torchrun. Why: docs/algorithm.md.
"""
import functools
import math
import random
from collections import Counter
from collections.abc import Mapping

import torch

import tasks
from grpo import distributed, variants
from grpo.model import trainable_parameters
from grpo.optim import learning_rate, make_optimizer
from grpo.passes import loss_mask, reference_logprobs, token_logprobs
from grpo.decoders import graph_mode
from grpo.rollout import Sampler, flat_groups, stream_seed
from harness.run import Run


# ---- advantages: each completion against the other completions of its prompt ---------------------

def group_normalised(r, eps, **_):
    """(r - the group's mean) / (the group's std + eps), r [groups, G]; 0 for a group whose rewards
    are all equal (set, not computed: float rounding in the mean cannot leak a gradient)"""
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    return variants.zero_flat_groups(adv, r)


ADVANTAGES = variants.Table("advantage", {"group": group_normalised, **variants.ADVANTAGES})


def group_advantages(rewards, group_size: int, advantage: str = "group", eps: float = 1e-4,
                     **inputs):
    """[N] advantages of the batch's rewards (groups contiguous), and the share of flat groups,
    whose rewards are all equal. inputs: what the advantage declares it reads (Switch
    advantage_inputs: --advantage gdpo's reward parts and weights), none by default."""
    r = rewards.float().view(-1, group_size)
    # a variant may build on the default (gdpo normalises each part as it does)
    adv = ADVANTAGES[advantage](r, eps, default=group_normalised, **inputs)
    return adv.reshape(-1), flat_groups(rewards, group_size).float().mean().item()


# ---- the loss of a micro-batch: clipped surrogate + k3 KL, token-mean over the mini-batch --------

def sequence_advantage(t, cfg, **_):
    """its completion's advantage at every token (GRPO), [B, 1]"""
    return t.adv


def token_ratio(logp, old_logp, mask):
    """pi / pi_old per token (PPO, GRPO)"""
    return torch.exp(logp - old_logp)


@variants.declares(accepts_dual_clip=True)
def clipped_surrogate(ratio, t, cfg, **_):
    """PPO's -min(r A, clip(r, 1 - low, 1 + high) A): no gradient once r is past the clip on A's
    side."""
    low, high = variants.clip_bounds(cfg)
    return -torch.minimum(ratio * t.adv, torch.clamp(ratio, 1 - low, 1 + high) * t.adv)


def k3(logp, ref_logp):
    """KL(policy || reference) per sampled token, >= 0: exp(d) - d - 1 with d = ref_logp - logp."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def token_count(mask, cfg):
    """over the mini-batch's loss tokens"""
    return float(mask.sum().item())


# each choice's default and variants by the flag's value (a name a table lacks: a ValueError)
RATIOS = variants.Table("importance_level", {"token": token_ratio, **variants.RATIOS})
TOKEN_ADVANTAGES = variants.Table("token_advantage", {"sequence": sequence_advantage,
                                                      **variants.TOKEN_ADVANTAGES})
POLICY_LOSSES = variants.Table("policy_loss", {"ppo": clipped_surrogate, **variants.POLICY_LOSSES})
KL_ESTIMATORS = variants.Table("kl_estimator", {"k3": k3, **variants.KL_ESTIMATORS})
AGGREGATIONS = variants.Table("loss_agg", {"token-mean": (token_count, variants.token_sum),
                                           **variants.AGGREGATIONS})
# every variant flag's table: main hands them to the harness, which lists and checks them
TABLES = {t.flag: t for t in (ADVANTAGES, RATIOS, TOKEN_ADVANTAGES, POLICY_LOSSES, KL_ESTIMATORS,
                              AGGREGATIONS, variants.KL_PLACES, variants.MISMATCH_CORRECTIONS)}


def loss_denominator(mask, cfg) -> float:
    """This device's share of a mini-batch's denominator (its loss tokens by default); the caller
    sums it over devices and passes the total to every micro-batch's grpo_loss."""
    return AGGREGATIONS[cfg.loss_agg][0](mask, cfg)


def grpo_loss(logp, old_logp, advantages, mask, denominator: float, cfg, kl_coef: float = None,
              *, ref_logp=None, entropy=None, on=None, **inputs):
    """One micro-batch's loss, divided by its whole mini-batch's denominator over every device (so
    summed micro-batch gradients are one large batch's), and its statistics (sums over its loss
    tokens). kl_coef: the step's (default --kl-coef; none in the loss with --kl-in reward); inputs:
    [B, T] tensors by name that a variant's term reads (pg_mask, cov_mask, sampler_logp: the
    sampler's logprobs, measured against train_logp, by default this forward's); on: the run's
    variants.on(cfg)."""
    on = on or variants.on(cfg, TABLES)   # the variants set: their terms (none by default)
    kl_coef = variants.loss_kl_coef(cfg, cfg.kl_coef if kl_coef is None else kl_coef)
    adv = advantages[:, None].to(logp.dtype)
    t = variants.tokens(logp=logp, old_logp=old_logp, adv=adv, mask=mask.to(logp.dtype),
                        entropy=entropy, **{"train_logp": logp.detach(), **inputs})
    t.counted = t.mask   # the tokens with a policy gradient, which the clip statistics count
    t.adv = TOKEN_ADVANTAGES[cfg.token_advantage](t, cfg)   # [B, T] when shaped per token
    ratio = RATIOS[cfg.importance_level](logp, old_logp, t.mask)
    pg = POLICY_LOSSES[cfg.policy_loss](ratio, t, cfg, default=clipped_surrogate)   # clip-cov's
    for term in on.pg:   # --dual-clip, --top-entropy-quantile, --mismatch-correction
        pg = term(pg, t, cfg)
    per_token = pg.expand_as(logp)   # a sequence-level term is every token's
    if ref_logp is not None and kl_coef > 0:
        per_token = per_token + kl_coef * KL_ESTIMATORS[cfg.kl_estimator](logp, ref_logp)
    for term in on.loss:   # --entropy-coef's bonus
        per_token = term(per_token, t, cfg)
    loss = AGGREGATIONS[cfg.loss_agg][1](per_token, t.mask, denominator)
    return loss, statistics(ratio, t, ref_logp, cfg, on.stats)


def statistics(ratio, t, ref_logp, cfg, more=()) -> dict:
    """The micro-batch's statistics over its loss tokens, and those of `more` (a variant's: each
    t -> {name: [B, T]}): sums (the record divides them by the step's tokens), except mismatch_max:
    the largest |gap| between the trainer's logprobs and the sampler's, a max."""
    with torch.no_grad():
        ratio, adv, counted = ratio.expand_as(t.logp), t.adv, t.counted
        zeros = torch.zeros_like(t.logp)
        low, high = variants.clipped_tokens(  # clamped: no gradient
            ratio, adv, cfg, POLICY_LOSSES[cfg.policy_loss])
        dual = (adv < 0) & (ratio > (cfg.dual_clip or math.inf))
        stats = {   # the KL always by k3 (low variance), whichever estimator the loss uses
            "kl": zeros if ref_logp is None else k3(t.logp, ref_logp),
            "clip_frac": (low | high) * counted, "clip_low_frac": low * counted,
            "clip_high_frac": high * counted, "clip_dual_frac": dual * counted,
            "ratio_mean": ratio,
            "approx_kl": (ratio - 1) - torch.log(ratio),   # KL(old || new), as cleanrl logs it
            "entropy": zeros if t.entropy is None else t.entropy}
        if t.sampler_logp is not None:   # the sampler/trainer gap; k3 by expm1 (no cancellation)
            gap = t.train_logp - t.sampler_logp
            stats.update(mismatch_kl=torch.expm1(gap) - gap, mismatch_abs=gap.abs(),
                         mismatch_max=gap.abs())
        for extra in more:
            stats.update(extra(t))
        sums = [(v * t.mask).max() if k == "mismatch_max" else (v * t.mask).sum()
                for k, v in stats.items()]
        return Statistics(stats, torch.stack(sums))


class Statistics(Mapping):
    """A micro-batch's statistics by name, floats, kept on the device as one tensor until the first
    is read (a read waits for the device): accumulate reads every micro-batch's at once."""

    def __init__(self, names, values):
        self.names, self.values, self.read = list(names), values, None

    def __getitem__(self, name):
        if self.read is None:
            self.read = dict(zip(self.names, self.values.tolist()))
        return self.read[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


# ---- the update: mini-batches of micro-batches, gradients summed over devices -------------------

def accumulate(policy, optimizer, batch, rows, micro, mask, denominator: float, cfg, autocast,
               kl_coef: float, update_index: int = 0, on=None, **inputs) -> Counter:
    """Forward and backward of one mini-batch (rows), cut into micro-batches by micro (rows or
    --micro-batch-tokens, harness/guards.py Micro), then a variant's second loss (the pretraining
    mix); returns the summed statistics. inputs: [B, ...] tensors by name for grpo_loss, each
    micro-batch's rows picked; on: the run's variants.on(cfg)."""
    optimizer.zero_grad(set_to_none=True)
    sums, on, parts = Counter(), on or variants.on(cfg, TABLES), []
    for part in micro.split(batch, rows):
        logp, entropy = token_logprobs(policy, batch, part, cfg, autocast, with_entropy=True,
                                       entropy_grad=on.reads_entropy)
        ref_logp = None if batch.ref_logp is None else batch.ref_logp[part]
        loss, stats = grpo_loss(logp, batch.old_logp[part], batch.advantages[part], mask[part],
                                denominator, cfg, kl_coef, ref_logp=ref_logp, entropy=entropy,
                                on=on, **{k: v[part] for k, v in inputs.items()})
        loss.backward()
        # float64 holds each float32 sum and token count exactly: the host reads the very values
        parts.append((stats.names, torch.cat([stats.values.double(), loss.detach().double()[None],
                                              mask[part].sum().double()[None]])))
    read = iter(torch.cat([values for _, values in parts]).tolist())   # the micro-batches' one read
    for names, _ in parts:   # summed on the host in micro-batch order, as they were
        stats = {name: next(read) for name in names}
        loss, tokens, peak = next(read), int(next(read)), stats.pop("mismatch_max", 0.0)
        sums.update(stats, loss=loss, tokens=tokens,
                    mismatch_tokens=tokens if "sampler_logp" in inputs else 0)
        sums["mismatch_max"] = max(sums["mismatch_max"], peak)
    for backward in on.backward:   # --ptx-coef's texts
        backward(policy, batch, micro, cfg, autocast, sums, update_index)
    return sums


def update(policy, optimizer, batch, cfg, layout, autocast, guard, kl_coef: float = None,
           on=None) -> dict:
    """--ppo-epochs passes over the batch in shuffled mini-batches, one optimizer step each; returns
    the step's record entries. A non-finite update is skipped (guard.step), the weights kept. on:
    the run's variants.on(cfg)."""
    params, kl_coef = trainable_parameters(policy), cfg.kl_coef if kl_coef is None else kl_coef
    B, mini = batch.input_ids.shape[0], layout.mini_batch_per_device
    mask, on = loss_mask(batch, cfg), on or variants.on(cfg, TABLES)
    totals, grad_norms, skipped, peaks = Counter(), [], 0, []
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B) if mini < B else torch.arange(B)
        for rows in order.split(mini):
            # the sampler/trainer gap, measured where the trainer's logprobs at the sampling
            # weights are known: the first update's own forward (or a variant's batch.inputs)
            inputs = {"sampler_logp": batch.sampler_logp} if not grad_norms else {}
            inputs.update(batch.inputs)
            # in batch order: a group's rows in one micro-batch share their prompt's forward
            rows = rows.sort().values.to(batch.input_ids.device, non_blocking=True)
            # the denominator is global: gradients summed over ranks are the one-process gradient
            count = loss_denominator(mask[rows], cfg)
            denominator = max(distributed.all_sum([count])[0], 1)  # every rank
            for chosen in on.mini_batch:   # tokens chosen over the mini-batch (Cov, top entropy)
                inputs.update(chosen(policy, batch, rows, mask, guard, cfg, autocast))  # every rank
            sums = guard.fit(functools.partial(  # every rank
                accumulate, policy, optimizer, batch, rows, mask=mask, denominator=denominator,
                cfg=cfg, autocast=autocast, kl_coef=kl_coef, update_index=len(grad_norms), on=on,
                **inputs))
            distributed.sum_gradients(params)  # every rank
            peaks.append(max(distributed.gather_objects(sums.pop("mismatch_max"))))  # every rank
            names = sorted(sums)
            sums = dict(zip(names, distributed.all_sum([sums[k] for k in names])))  # every rank
            # --max-grad-norm 0 is no clipping: an infinite bound scales by exactly 1
            bound = cfg.max_grad_norm or math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(params, bound).item()
            skipped += not guard.step(optimizer, sums["loss"], grad_norm)   # not finite
            totals.update(sums)
            grad_norms.append(grad_norm)
    return record(totals, grad_norms, skipped, peaks, batch, on.record)


def record(totals, grad_norms, skipped: int, peaks, batch, more=()) -> dict:
    """The update's record entries: statistics per loss token, loss and gradient norm per update,
    the sampler/trainer gap's per token measured; `more`: a variant's (totals, tokens, batch) ->
    entries, which pops the sums it reads itself."""
    tokens, updates = max(totals.pop("tokens"), 1), len(grad_norms)
    out = {}
    for extra in more:
        out.update(extra(totals, tokens, batch))
    measured = max(totals.pop("mismatch_tokens"), 1)
    out.update({"loss": totals.pop("loss") / updates, "mismatch_max": max(peaks),
                **{k: v / (measured if k.startswith("mismatch") else tokens)
                   for k, v in totals.items()},
                "grad_norm": sum(grad_norms) / updates, "skipped_nonfinite": skipped})
    return out


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
        ctx = run.context   # what the step reads of the run: grpo/settings.py Context
        on = variants.on(cfg, TABLES)   # the variants set: what each adds at each point of the step
        sampler = Sampler(   # the policy's completions of prompts, with the run's settings
            policy, tokenizer, group_size=cfg.group_size,
            prepend_bos=ctx.prepend_bos, generation_batch=ctx.layout.generation_batch,
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
            top_p=cfg.top_p, min_new_tokens=cfg.min_new_tokens, autocast=ctx.autocast,
            device=ctx.device, compile=cfg.compile == "on",
            graph=graph_mode(cfg.decode_graph, ctx.device, cfg.compile == "on"))
        for step in run.steps():  # every rank   (checkpoints, a stop on Ctrl-C, the final model)
            rec, rows = train_step(  # every rank
                step, ctx, run, task, sampler, policy, reference, optimizer, guard, kl, on)
            run.end_step(rec, rows)  # every rank   (the record, the line, the evaluation when due)


def train_step(step, ctx, run, task, sampler, policy, reference, optimizer, guard, kl, on):
    """One GRPO step on this rank's share: its record (the stages add to it) and every rank's rows
    of it (run.check_rewards gathers them). ctx: what the step reads of the run (grpo/settings.py
    Context); on: what the variants set add at each point (none by default)."""
    cfg, layout, rank, world = ctx.cfg, ctx.layout, ctx.rank, ctx.world
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
    for rounds in on.rounds:   # --dynamic-sampling: more rounds while groups are flat
        batch, counts = rounds(  # every rank
            batch, lambda n: draw(n).score(ctx.score), cfg, G, P, ctx.tokenizer.eos_token_id)
        rec.update(counts)
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
    inputs = {}
    for gather in on.advantage_inputs:   # --advantage gdpo's reward parts, every rank's
        inputs.update(gather(batch, ctx))  # every rank
    adv, rec["frac_zero_std"] = group_advantages(rewards, G, cfg.advantage, **inputs)
    batch.advantages = adv[rank * B:(rank + 1) * B].to(ctx.device, non_blocking=True)
    rows = run.check_rewards(step, batch, rec)  # every rank   (all failed: the run stops)
    # ---- update: clipped PPO surrogate + KL, mini-batches of micro-batches ----------------------
    rec["lr"] = learning_rate(step, cfg)   # --lr-scheduler, after its warmup
    for group in optimizer.param_groups:
        group["lr"] = rec["lr"]
    for prepare in on.prepare:   # --ptx-coef's texts, --mismatch-correction's logprobs
        prepare(batch, step, ctx, policy, guard)  # every rank
    rec.update(update(  # every rank
        policy, optimizer, batch, cfg, layout, ctx.autocast, guard, kl.coef, on))
    for after in on.after_step:   # --kl-target's coefficient, --ref-sync-steps' reference move
        rec.update(after(rec, step, policy, reference, kl, cfg))
    return rec, rows


if __name__ == "__main__":
    main()
