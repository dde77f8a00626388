"""Most off-by-default variants of the GRPO step (train_lean.py holds the default). A choice among
several (--advantage, --policy-loss, --importance-level, --kl-estimator, --loss-agg, --kl-in,
--mismatch-correction) is a small function in a table keyed by its flag value (Table): train_lean.py
builds its tables from its defaults and this file's entries, and hands every table to the harness
(train_lean.py TABLES), which lists and checks them; --kl-in's and --mismatch-correction's are this
file's whole. A knob that is on or off is a Switch in SWITCHES: what it adds at each point of the
step, which runs only the switches set (on), and its rules against the other settings (check); a
choice whose function needs more than its formula declares a switch too (Clip-Cov's token masks,
GDPO's reward parts). The others live where they act: DAPO's merge in grpo/rollout.py, PPO-ptx in
ptx.py, LoRA in model.py, Muon and the schedules in optim.py. A new choice is one function, one
entry (here or in train_lean.py's table) and a formula test (tests/grpo/test_variants.py lists
them); its docstring is its --help text, and what it needs besides is declared on it (declares).
Why each: docs/algorithm.md.
"""
import dataclasses
import functools
import math
import types
import typing

import torch

from grpo import distributed, passes, ptx
from grpo.model import sync_reference
from grpo.rollout import flat_groups, merge, missing_groups
from grpo.settings import Settings


# ---- what a variant declares: the step, passes.py and the harness read it, never its name --------

DECLARED = {   # each property a variant function may declare, and its value where it does not
    "knobs": (),   # the settings it alone reads: given with another choice, a mistake
    "check": None,   # check(cfg): why it cannot run with the other settings (a message), or None
    "accepts_dual_clip": False,   # a policy loss whose clipped term --dual-clip bounds
    "token_ratios": False,   # a policy loss that needs a ratio per token (not per sequence)
    # a policy loss's clip: (clip-range, clip-range-high) -> the ratios below and above which the
    # statistics count a token as clipped, where not at 1 - clip-range and 1 + clip-range-high
    "clip_edges": None,
    "switch": None,   # what the step runs besides when it is chosen (a Switch, below)
    "per_sequence": False,   # a ratio or mismatch weight of one value per sequence
    "kl_estimator": None,   # a KL place's estimator where --kl-estimator is not given (reward: k1)
}


def declares(**properties):
    """Marks a variant function with properties of DECLARED (a name it lacks: a TypeError)."""
    unknown = set(properties) - set(DECLARED)
    if unknown:
        raise TypeError(f"not a property a variant declares: {', '.join(sorted(unknown))}")

    def mark(function):
        function.__dict__.update(properties)
        return function
    return mark


def declared(function, name: str):
    """What `function` (a table's entry) declares of property `name`, else its default."""
    return getattr(function, name, DECLARED[name])


# ---- what a variant adds to the step, point by point: the step runs only the variants set ------

@dataclasses.dataclass(frozen=True)
class Switch:
    """An off-by-default variant's additions to the step, each at a named point of it (train_lean.py
    calls the point's list as one, a Fold or a Merged: empty by default, so nothing runs there).
    One that is on or off is an entry of SWITCHES with its `on`; a table's choice declares its own
    (declares(switch=...)), which adds when chosen, and where it has an `on`, when that holds too.
    """
    on: typing.Callable = None   # cfg -> whether it is set
    # cfg -> why its settings cannot run with the others (one line, the harness's exit 2), or None;
    # checked before anything loads, whether the switch is on or not (its knobs without it)
    check: typing.Callable = None
    # after the scoring: (batch, draw, ctx) -> batch; draw(n) samples round n (unscored). Every
    # rank.
    rounds: typing.Callable = None
    # (name, f(batch, cfg, kl_coef, kl_estimators) -> [B]): taken off each reward before the
    # advantages, recorded by name
    penalty: tuple = None
    # before the advantages: (batch, ctx) -> {name: value}, given to the advantage by name (GDPO's
    # reward parts, every rank's rows). Every rank.
    advantage_inputs: typing.Callable = None
    # before the update: (batch, step, ctx, policy, guard) -> None, ctx grpo/settings.py Context:
    # what the update reads, put in batch.inputs (per row, picked per micro-batch, given to
    # grpo_loss by name) or batch.extra. Every rank.
    prepare: typing.Callable = None
    # before each mini-batch's micro-batches: (policy, batch, rows, mask, guard, cfg, autocast) ->
    # {name: [B, T]}, given to grpo_loss by name; chosen over every device's rows. Every rank.
    mini_batch: typing.Callable = None
    # t: the micro-batch's values per token (train_lean.py Tokens), read, never written
    pg: typing.Callable = None     # (pg, t, cfg) -> the policy-gradient term it changes
    loss: typing.Callable = None   # (per_token, t, cfg) -> each token's loss, after the KL
    reads_entropy: bool = False    # its loss term reads t.entropy (which then carries a gradient)
    stats: typing.Callable = None  # (t, cfg) -> {name: [B, T]}: summed over the loss tokens (a
    # grpo/sums.py Peak: their largest), recorded
    # after a mini-batch's micro-batches, before its optimizer step: (policy, batch, micro, cfg,
    # autocast, sums, update) -> None, a second loss's backward (update: the step's update index)
    backward: typing.Callable = None
    record: typing.Callable = None   # (totals, tokens, batch) -> entries; pops its sums from totals
    # after the update: (rec, step, policy, reference, kl, cfg) -> record entries
    after_step: typing.Callable = None


POINTS = [f.name for f in dataclasses.fields(Switch)
          if f.name not in ("on", "check", "reads_entropy")]
FOLDS = ("rounds", "pg", "loss")   # the points whose additions each change a value in turn
# the points every rank runs together, outside any retry: an addition there may call a collective
# (a gather over ranks); elsewhere it must not (tests/test_repository.py checks)
EVERY_RANK = ("rounds", "advantage_inputs", "prepare", "mini_batch")


# ---- a flag's choices: a table, handed to the harness by train_lean.py (TABLES) ------------------

class Table(dict):
    """A variant flag's choices, name -> function, the flag's default first: each name a value of
    the flag, each function's docstring its --help (a pair's first's). A name it lacks: a
    ValueError. Nothing registers it: train_lean.py hands its tables to the harness (TABLES)."""

    def __init__(self, flag: str, entries: dict):
        super().__init__(entries)
        self.flag = flag

    def __missing__(self, name):
        flag = "--" + self.flag.replace("_", "-")
        raise ValueError(f"{flag} {name!r} is not one of {', '.join(self)}")

    @property
    def default(self) -> str:
        return next(iter(self))

    def words(self) -> dict:
        """name -> what it does, as --help lists it: its docstring (AGGREGATIONS' entries are pairs
        (denominator, loss): the first's)."""
        return {name: " ".join(((f[0] if isinstance(f, tuple) else f).__doc__ or "").split())
                for name, f in self.items()}


def table(flag: str, default, others: dict) -> Table:
    """flag's Table: its default (named by the flag's default value, grpo/settings.py) first, then
    the others, by name."""
    return Table(flag, {Settings.__dataclass_fields__[flag].default: default, **others})


class Fold(list):
    """A point's additions that each change a value in turn (Switch's pg, loss, rounds): called
    with (value, *args), returns the value they leave (the value itself where there are none)."""

    def __call__(self, value, *args):
        for addition in self:
            value = addition(value, *args)
        return value


class Merged(list):
    """A point's additions each called in turn with the same arguments: returns what they return
    (a dict each, or None), merged in order ({} where there are none)."""

    def __call__(self, *args) -> dict:
        return {k: v for addition in self for k, v in (addition(*args) or {}).items()}


def zero_flat_groups(adv: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """adv [groups, G] with exactly 0 for a flat group, whose rewards r are all equal (set, not
    computed, so float rounding in a mean cannot leak a tiny gradient)."""
    return adv.masked_fill(flat_groups(r.reshape(-1), r.shape[1])[:, None], 0.0)


# ---- advantages (--advantage): r [groups, G] float -> [groups, G] --------------------------------

def batch_std(r, eps, **_):
    """(r - the group's mean) / (the whole batch's std + eps), every device's rows"""
    return zero_flat_groups((r - r.mean(1, keepdim=True)) / (r.reshape(-1).std() + eps), r)


def mean_only(r, eps, **_):
    """r - the group's mean (Dr. GRPO)"""
    return zero_flat_groups(r - r.mean(1, keepdim=True), r)


def rloo(r, eps, **_):
    """r - the mean of the group's other rewards (RLOO's leave-one-out baseline), not divided"""
    return zero_flat_groups(r - (r.sum(1, keepdim=True) - r) / (r.shape[1] - 1), r)


def reinforce_pp(r, eps, **_):
    """(r - the whole batch's mean) / (the batch's std + eps), every device's rows (REINFORCE++): a
    global baseline, so a group whose rewards are all equal still gets advantages"""
    return (r - r.mean()) / (r.std() + eps)


def reinforce_pp_baseline(r, eps, **_):
    """(r - the group's mean) / (the batch's std of those differences + eps)
    (REINFORCE++-baseline)"""
    adv = r - r.mean(1, keepdim=True)
    return zero_flat_groups(adv / (adv.std() + eps), r)


def maxrl(r, eps, **_):
    """(r - the group's mean) / (the group's mean + eps) (MaxRL): for rewards in {0, 1}, a rare
    success weighs more; a negative mean flips the sign"""
    return zero_flat_groups((r - r.mean(1, keepdim=True)) / (r.mean(1, keepdim=True) + eps), r)


def gdpo_check(cfg):
    """GDPO's advantages are the named parts' alone: a penalty off the reward would be lost."""
    if cfg.reward_weights is None:
        return ("--advantage gdpo normalises each part of the reward: name them with "
                "--reward-weights (e.g. correct=1,format=1)")
    penalty = next(iter(penalties(cfg)), None)
    if penalty:
        return (f"--advantage gdpo makes advantages of the reward's parts alone, which would leave "
                f"out {penalty}: leave one out")
    return None


def reward_parts(batch, ctx) -> dict:
    """GDPO's inputs: every rank's rows' --reward-weights parts [N, K], and their weights."""
    every = distributed.gather_objects(  # every rank
        torch.tensor(batch.parts, dtype=torch.float32))
    return {"parts": torch.cat(every), "weights": list(ctx.reward_weights)}


@declares(check=gdpo_check, switch=Switch(advantage_inputs=reward_parts))
def gdpo(r, eps, parts, weights, default):
    """each --reward-weights part normalised in its group as 'group' does, weighted and summed, then
    divided by the batch's std of the sums + eps (GDPO)"""
    adv = 0   # default: the flag's default, group normalisation
    for k, w in enumerate(weights):   # apart, a part of small spread is not drowned by a large one
        adv = adv + w * default(parts[:, k].float().view(r.shape), eps)
    return adv / (adv.std() + eps)   # the sum's batch mean is 0 already


ADVANTAGES = {"batch": batch_std, "none": mean_only, "rloo": rloo, "reinforce++": reinforce_pp,
              "reinforce++-baseline": reinforce_pp_baseline, "maxrl": maxrl, "gdpo": gdpo}


# ---- the importance ratio (--importance-level) and the policy-gradient term (--policy-loss) ------

@declares(per_sequence=True)
def sequence_ratio(logp, old_logp, mask):
    """per sequence (GSPO): the exp of the mean log-ratio, clipped per sequence; use clip ranges of
    a few 1e-4, such as 3e-4 low and 4e-4 high"""
    mask = mask.to(logp.dtype)
    return torch.exp(sequence_mean(logp - old_logp, mask))


def sequence_mean(x, mask):
    """[B, 1]: each sequence's mean of x over its tokens (mask [B, T], 0 or 1)."""
    return (x * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1)


RATIOS = {"sequence": sequence_ratio}


# ---- per-token advantages (--token-advantage): a shaping of A at each token, before any loss -----

def token_advantage_statistics(t, cfg) -> dict:
    """A per-token advantage's sum and sum of squares over the loss tokens."""
    return {"token_adv": t.adv, "token_adv_sq": t.adv ** 2}


def token_advantage_spread(totals, tokens: int, batch) -> dict:
    """The record's token_adv_std: the per-token advantage's spread over the loss tokens."""
    mean, square = totals["token_adv"] / tokens, totals.pop("token_adv_sq") / tokens
    return {"token_adv_std": math.sqrt(max(square - mean ** 2, 0))}


SHAPED = Switch(stats=token_advantage_statistics, record=token_advantage_spread)
# the switch of a table's choice that declares none: every per-token advantage's statistics
UNDECLARED = {"token_advantage": SHAPED}


@declares(knobs=("shaping_alpha", "shaping_kappa"))
def entropy_shaped(adv, entropy, cfg):
    """A + min(alpha H, |A| / kappa) at each token, H its entropy (no gradient): more credit where
    the policy was unsure, never past |A| / kappa, so A keeps its sign (Cheng et al. 2025)"""
    return adv + torch.minimum(cfg.shaping_alpha * entropy.detach(), adv.abs() / cfg.shaping_kappa)


TOKEN_ADVANTAGES = {"entropy": entropy_shaped}


def clip_bounds(cfg) -> tuple:
    """How far below and above 1 the clip is: (--clip-range, --clip-range-high or --clip-range)."""
    return cfg.clip_range, cfg.clip_range if cfg.clip_range_high is None else cfg.clip_range_high


def clip_edges(cfg, loss=None) -> tuple:
    """(1 - clip-range, 1 + clip-range-high), where clip(r) sets a ratio back to and the statistics
    count a token as clipped; or where the policy loss `loss` declares them (gmpo)."""
    edges = declared(loss, "clip_edges") or (lambda low, high: (1 - low, 1 + high))
    return edges(*clip_bounds(cfg))


def clip_region(ratio, clipped, adv) -> tuple:
    """(low, high) bool: the tokens whose ratio the clip set back on A's side, which get no
    gradient: up to its lower edge where A < 0, down to its upper edge where A > 0."""
    return (clipped > ratio) & (adv < 0), (clipped < ratio) & (adv > 0)


def cispo(ratio, t, cfg, **_):
    """-sg(min(r, 1 + clip-range-high)) A logp (CISPO, MiniMax-M1): the weight is capped, not the
    update, so every token keeps a gradient; no lower bound, as in its paper"""
    return -torch.clamp(ratio, max=1 + clip_bounds(cfg)[1]).detach() * t.adv * t.logp


@declares(knobs=("sapo_tau_pos", "sapo_tau_neg"))
def sapo(ratio, t, cfg, **_):
    """-(4 / tau) sigmoid(tau (r - 1)) A (SAPO): a soft gate instead of the clip, tau --sapo-tau-pos
    where A > 0 and --sapo-tau-neg where A < 0"""
    tau = torch.where(t.adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)   # slope 1 at r = 1, as PPO
    return -4 / tau * torch.sigmoid(tau * (ratio - 1)) * t.adv


@declares(token_ratios=True, clip_edges=lambda low, high: (math.exp(-low), math.exp(high)))
def gmpo(ratio, t, cfg, **_):
    """-A exp(the sequence's mean log-ratio, each token's clipped on A's side to -clip-range or
    clip-range-high) (GMPO: the geometric mean of the ratios; its paper clips at 0.4 both sides)"""
    low, high = clip_bounds(cfg)
    log_ratio, sign, mask = t.logp - t.old_logp, torch.sign(t.adv), t.mask
    log_ratio = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-low, high))
    return -t.adv * torch.exp(sequence_mean(log_ratio, mask))


def token_covariance(logp, advantages):
    """[N] each token's (A - mean A)(logp - mean logp) over a mini-batch's N loss tokens."""
    return (advantages - advantages.mean()) * (logp - logp.mean())


def covariance_count(n: int, cfg) -> int:
    """How many of a mini-batch's n loss tokens Clip-Cov or KL-Cov act on: --cov-ratio, at least
    1."""
    return max(1, int(cfg.cov_ratio * n))


def covariance_band(logp, old_logp, advantages, cfg) -> torch.Tensor:
    """[N] bool: the tokens Clip-Cov detaches among a mini-batch's N loss tokens (every device's):
    k drawn, by a generator seeded by --seed, among those whose covariance term lies inside
    (--clip-cov-lb, --clip-cov-ub) and that the clip leaves alone: the same draw on every device
    for any micro-batch size or device count."""
    n = logp.numel()
    chosen = torch.zeros(n, dtype=torch.bool)
    if n == 0:
        return chosen
    cov, ratio = token_covariance(logp, advantages), torch.exp(logp - old_logp)
    low, high = clip_region(ratio, torch.clamp(ratio, *clip_edges(cfg)), advantages)
    inside = (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub) & ~(low | high)
    band = torch.nonzero(inside).squeeze(1)
    band = band[torch.argsort(cov[band])]
    draw = torch.randperm(band.numel(), generator=torch.Generator().manual_seed(cfg.seed))
    chosen[band[draw[:covariance_count(n, cfg)]]] = True
    return chosen


def highest_covariance(logp, old_logp, advantages, cfg) -> torch.Tensor:
    """[N] bool: the tokens KL-Cov penalises among a mini-batch's N loss tokens (every device's):
    the k of largest covariance term."""
    n = logp.numel()
    chosen = torch.zeros(n, dtype=torch.bool)
    if n == 0:
        return chosen
    top = torch.topk(token_covariance(logp, advantages), min(covariance_count(n, cfg), n))
    chosen[top.indices] = True
    return chosen


def chosen_tokens(choose, policy, batch, rows, mask, guard, cfg, autocast) -> dict:
    """{"cov_mask": [B, T] bool}: the tokens of the mini-batch `rows` that a policy loss acts on,
    chosen by choose(logp, old_logp, adv, cfg) (Clip-Cov's, KL-Cov's) over the mini-batch of every
    device before any micro-batch runs."""
    logp = passes.no_grad_pass(policy, batch, guard, cfg, autocast, rows)  # every rank
    carried = mask[rows].bool()
    adv = batch.advantages[rows][:, None].expand_as(logp)
    tokens = torch.stack([logp[carried], batch.old_logp[rows][carried], adv[carried]]).cpu()
    every = distributed.gather_objects(tokens)  # every rank
    start = sum(t.shape[1] for t in every[:distributed.rank()])
    chosen, mine = torch.zeros_like(mask, dtype=torch.bool), torch.zeros_like(carried)
    picked = choose(*torch.cat(every, 1), cfg)   # among every device's tokens
    mine[carried] = picked[start:start + int(carried.sum())].to(mine.device)
    chosen[rows] = mine
    return {"cov_mask": chosen}


def covariance_switch(choose) -> Switch:
    """What Clip-Cov and KL-Cov add to the step: the tokens choose picks (cov_mask), and the share
    of the tokens with a policy gradient they are (cov_frac)."""
    return Switch(mini_batch=functools.partial(chosen_tokens, choose),
                  stats=lambda t, cfg: {"cov_frac": t.inputs["cov_mask"] * t.pg_mask})


def clip_cov_check(cfg):
    """Clip-Cov's band must hold something."""
    if cfg.clip_cov_lb >= cfg.clip_cov_ub:
        return f"--clip-cov-lb {cfg.clip_cov_lb} must be below --clip-cov-ub {cfg.clip_cov_ub}"
    return None


@declares(knobs=("cov_ratio", "clip_cov_lb", "clip_cov_ub"), check=clip_cov_check,
          accepts_dual_clip=True, token_ratios=True,
          switch=covariance_switch(covariance_band))
def clip_cov(ratio, t, cfg, default):
    """ppo, with --cov-ratio of the mini-batch's tokens, drawn among those whose (A - mean)(logp -
    mean) lies in (--clip-cov-lb, --clip-cov-ub) and the clip left alone, detached (Clip-Cov)"""
    pg = default(ratio, t, cfg)   # PPO's surrogate
    return torch.where(t.inputs["cov_mask"], pg.detach(), pg)


@declares(knobs=("cov_ratio", "kl_cov_coef"), token_ratios=True,
          switch=covariance_switch(highest_covariance))
def kl_cov(ratio, t, cfg, **_):
    """-r A, plus --kl-cov-coef x |logp - logp_old| on the --cov-ratio of the mini-batch's tokens of
    highest (A - mean)(logp - mean) (KL-Cov)"""
    chosen = t.inputs["cov_mask"]
    return -ratio * t.adv + cfg.kl_cov_coef * (t.logp - t.old_logp).abs() * chosen


POLICY_LOSSES = {"cispo": cispo, "sapo": sapo, "gmpo": gmpo, "clip-cov": clip_cov, "kl-cov": kl_cov}


# ---- terms on the policy-gradient part: none by default ------------------------------------------

def dual_clip(pg, t, cfg):
    """dual-clip PPO: for A < 0 the term is at most -C A: no unbounded push from a large ratio."""
    return torch.where(t.adv < 0, torch.minimum(pg, -cfg.dual_clip * t.adv), pg)


def dual_clipped(t, cfg) -> dict:
    """--dual-clip's share: the tokens with A < 0 whose ratio is above C, bounded at -C A."""
    bounded = (t.adv < 0) & (t.ratio > cfg.dual_clip)
    return {"clip_dual_frac": bounded.expand_as(t.logp) * t.pg_mask}


def top_entropy_only(pg, t, cfg):
    """--top-entropy-quantile: only the high-entropy tokens (t.pg_mask, chosen before the loss)
    carry a policy gradient; the clip statistics count them alone."""
    return pg.expand_as(t.logp) * t.pg_mask


def entropy_bonus(per_token, t, cfg):
    """--entropy-coef: the loss minus the coefficient x each token's entropy."""
    return per_token - cfg.entropy_coef * t.entropy


# ---- the KL estimator (--kl-estimator) and where it goes (--kl-in) -------------------------------

def k1(logp, ref_logp):
    """the log-ratio logp - ref_logp (belongs in the reward)"""
    return logp - ref_logp


def k2(logp, ref_logp):
    """half its square"""
    return 0.5 * (logp - ref_logp) ** 2


KL_ESTIMATORS = {"k1": k1, "k2": k2}


def loss_kl_coef(cfg, kl_coef: float) -> float:
    """The coefficient of the loss's KL term: --kl-in's place's (none where the reward takes it)."""
    return KL_PLACES[cfg.kl_in](kl_coef)


def kl_reward_penalty(logp, ref_logp, mask, kl_coef: float, estimate) -> torch.Tensor:
    """[B] kl_coef x each sequence's summed per-token KL estimate (detached), taken off its reward
    with --kl-in reward before the advantages (k1 there gives the unbiased gradient:
    docs/algorithm.md)."""
    kl = estimate(logp.detach().float(), ref_logp.detach().float())
    return kl_coef * (kl * mask.float()).sum(1)


def kl_in_reward(batch, cfg, kl_coef: float, estimators: dict) -> torch.Tensor:
    """--kl-in reward: each sequence's KL penalty (kl_reward_penalty), on the host."""
    return kl_reward_penalty(batch.old_logp, batch.ref_logp, batch.completion_mask, kl_coef,
                             estimators[cfg.kl_estimator]).cpu()


# ---- where the KL goes (--kl-in): kl_coef -> the coefficient of the loss's KL term ---------------

def in_loss(kl_coef: float) -> float:
    """per token in the loss"""
    return kl_coef


# without a reference (--kl-coef 0) there is no KL to take off
@declares(kl_estimator="k1", switch=Switch(on=lambda cfg: cfg.kl_coef != 0,
                                           penalty=("kl_reward_penalty", kl_in_reward)))
def in_reward(kl_coef: float) -> float:
    """per sequence, subtracted from the reward before the advantages"""
    return 0.0   # the reward carries it: the loss has none


KL_PLACES = table("kl_in", in_loss, {"reward": in_reward})


class AdaptiveKL:
    """The KL coefficient: --kl-coef, or with --kl-target moved after each step toward the target KL
    per token (after_step: Ziegler et al.'s controller, as verl and OpenRLHF have it). The harness
    checkpoints state_dict()."""

    def __init__(self, cfg):
        self.cfg, self.coef = cfg, cfg.kl_coef

    def after_step(self, kl: float, completions: int) -> dict:
        """After a step of this KL per token: the next step's coefficient; the record's kl_coef (the
        one the step trained with)."""
        used, self.coef = self.coef, adaptive_kl_coef(self.coef, kl, completions, self.cfg)
        return {"kl_coef": used}

    def state_dict(self) -> dict:
        return {"kl_coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["kl_coef"]


def adaptive_kl_coef(coef: float, kl: float, completions: int, cfg) -> float:
    """The next coefficient: coef x (1 + clip(kl / kl_target - 1, -0.2, 0.2) x completions /
    kl_horizon). The error is clipped so one odd step cannot move it far; the horizon sets how fast
    it follows."""
    error = min(max(kl / cfg.kl_target - 1, -0.2), 0.2)
    return coef * (1 + error * completions / cfg.kl_horizon)


# ---- the loss's normaliser (--loss-agg): (this device's denominator, the micro-batch's loss) -----

def seq_count(mask, cfg):
    """each sequence's token mean, then over the sequences"""
    return float((mask.sum(1) > 0).sum().item())


def seq_mean(per_token, mask, denominator):
    return ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).sum() / denominator


def max_tokens(mask, cfg):
    """over max-new-tokens x sequences"""
    return float(mask.shape[0] * cfg.max_new_tokens)


def token_sum(per_token, mask, denominator):
    return (per_token * mask).sum() / denominator


AGGREGATIONS = {"seq-mean": (seq_count, seq_mean), "dr-grpo": (max_tokens, token_sum)}


# ---- the sampler mismatch (--mismatch-correction): w = pi_trainer / pi_sampler per token, detached

def trainer_logprobs(batch, step, ctx, policy, guard) -> None:
    """On a step of several updates, the trainer's logprobs at the weights that sampled (each
    forward gives its own until the first optimizer step) and the sampler's, for every update."""
    if ctx.layout.updates_per_step > 1:
        batch.inputs.update(train_logp=passes.no_grad_pass(  # every rank
            policy, batch, guard, ctx.cfg, ctx.autocast), sampler_logp=batch.sampler_logp)


def mismatch_corrected(pg, t, cfg):
    """Each token's term weighed by w = pi_trainer / pi_sampler (mismatch_weight), where the
    sampler's logprobs are given."""
    if t.sampler_logp is None:
        return pg
    return pg.expand_as(t.logp) * mismatch_weight(t.train_logp, t.sampler_logp, t.mask, cfg)


def weight_statistics(t, cfg) -> dict:
    """The correction's weights where it acted (mismatch_weight again: a detached formula): their
    mean, and the share it set to 0."""
    if t.sampler_logp is None:
        return {}
    weight = mismatch_weight(t.train_logp, t.sampler_logp, t.mask, cfg).expand_as(t.logp)
    return {"mismatch_weight": weight, "mismatch_zero_frac": weight == 0}


CORRECTED = Switch(prepare=trainer_logprobs, pg=mismatch_corrected, stats=weight_statistics)


@declares(knobs=("mismatch_cap",), switch=CORRECTED)
def tis(w, cfg):
    """x min(w, --mismatch-cap), w = pi_trainer / pi_sampler (truncated importance sampling)"""
    return w.clamp(max=cfg.mismatch_cap)


@declares(knobs=("mismatch_cap", "mismatch_low"), switch=CORRECTED)
def token_mask(w, cfg):
    """x w inside [--mismatch-low, --mismatch-cap], 0 outside: the token is dropped (IcePop)"""
    return w * ((w >= cfg.mismatch_low) & (w <= cfg.mismatch_cap))


@declares(knobs=("mismatch_cap", "mismatch_low"), per_sequence=True,
          switch=CORRECTED)
def sequence_mask(w, cfg):
    """x the sequence's w (its tokens' geometric mean) inside the band, 0 outside: the sequence
    dropped"""
    return token_mask(w, cfg)


def uncorrected(w, cfg):
    """none (the gap is measured in every record: mismatch_kl, mismatch_abs, mismatch_max)"""
    return torch.ones_like(w)


MISMATCH_CORRECTIONS = table("mismatch_correction", uncorrected, {
    "tis": tis, "token-mask": token_mask, "sequence-mask": sequence_mask})


def mismatch_weight(train_logp, sampler_logp, mask, cfg):
    """The detached weight of each token's policy-gradient term [B, T] ([B, 1] sequence-mask)."""
    train, correct = train_logp.detach(), MISMATCH_CORRECTIONS[cfg.mismatch_correction]
    w = (sequence_ratio(train, sampler_logp, mask) if declared(correct, "per_sequence")
         else torch.exp(train - sampler_logp))
    return correct(w, cfg)


# ---- the tokens a term acts on, chosen over the whole mini-batch of every device -----------------

def top_entropy_threshold(entropies: torch.Tensor, quantile: float) -> float:
    """The entropy at or above which a token is among the top `quantile` of a mini-batch's loss
    tokens (1-D, every device's): ceil(quantile x n) kept, at least one, every token tied with the
    last too."""
    n = entropies.numel()
    if n == 0:
        return math.inf
    keep = max(1, math.ceil(quantile * n - 1e-9))  # the 1e-9: 0.1 * 30 is 3.0000000000000004
    return torch.kthvalue(entropies.detach().float().cpu(), n - keep + 1).values.item()


def high_entropy_tokens(policy, batch, rows, mask, guard, cfg, autocast) -> dict:
    """{"pg_mask": [B, T] bool}: the tokens of the mini-batch `rows` among its top
    --top-entropy-quantile by entropy, the threshold taken over the mini-batch of every device
    before any micro-batch runs."""
    entropy = passes.no_grad_pass(  # every rank
        policy, batch, guard, cfg, autocast, rows, entropy=True)
    carried = mask[rows].bool()
    every = distributed.gather_objects(entropy[carried].cpu())  # every rank
    threshold = top_entropy_threshold(torch.cat(every), cfg.top_entropy_quantile)
    chosen = torch.zeros_like(mask, dtype=torch.bool)
    chosen[rows] = entropy >= threshold
    return {"pg_mask": chosen}


# ---- reward shaping: DAPO's overlong penalty -----------------------------------------------------

def overlong_penalty(lengths: torch.Tensor, cfg) -> torch.Tensor:
    """[B] rewards to take off (>= 0): 0 up to max_new_tokens - overlong_buffer tokens (the EOS
    counted), then linear up to overlong_penalty at max_new_tokens (DAPO's soft overlong
    punishment)."""
    buffer = cfg.overlong_buffer
    over = (lengths.float() - (cfg.max_new_tokens - buffer)).clamp(0, buffer)
    return cfg.overlong_penalty * over / buffer


# ---- across the step: DAPO's dynamic sampling, the KL's controller, TR-DPO's moving reference ----

def dynamic_sampling(first, draw, ctx):
    """--dynamic-sampling (DAPO): more rounds (draw(n), scored) while any rank lacks groups whose
    rewards differ, then the batch of this rank's groups, those not flat first (grpo/rollout.py
    merge), merge's counts kept for the record (rounds_drawn)."""
    cfg, group_size, groups = ctx.cfg, ctx.cfg.group_size, ctx.layout.prompts_per_device
    rounds = [first]
    while len(rounds) <= cfg.max_sampling_rounds and distributed.any_rank(  # every rank
            missing_groups([r.rewards for r in rounds], group_size, groups) > 0):
        rounds.append(draw(len(rounds)).score(ctx.score))
    batch, counts = merge(rounds, group_size, groups, ctx.tokenizer.eos_token_id)
    batch.extra["rounds"] = counts
    return batch


def rounds_drawn(totals, tokens, batch) -> dict:
    """--dynamic-sampling's record entries: the groups drawn, dropped and kept though flat."""
    return batch.extra["rounds"]


def steer_kl(rec, step, policy, reference, kl, cfg) -> dict:
    """--kl-target: the next step's coefficient, from this step's KL (AdaptiveKL.after_step)."""
    return kl.after_step(rec["kl"], cfg.batch_size)


def kl_target_problem(cfg) -> str | None:
    """--kl-target needs a KL term to steer; --kl-horizon, a target; and a horizon long enough that
    a step moves the coefficient by at most 20 percent (the error is clipped to +-0.2, its step,
    x batch / horizon, is not)."""
    if cfg.kl_target and not cfg.kl_coef:
        return (f"--kl-target {cfg.kl_target} steers the KL coefficient, and --kl-coef 0 has no KL "
                f"term: pass a --kl-coef above 0 to start from, or leave --kl-target out")
    if cfg.kl_horizon != type(cfg).__dataclass_fields__["kl_horizon"].default and not cfg.kl_target:
        return (f"--kl-horizon {cfg.kl_horizon} without --kl-target (a fixed --kl-coef): give a "
                f"--kl-target, or leave --kl-horizon out")
    if cfg.kl_target and 5 * cfg.kl_horizon <= cfg.batch_size:
        n, h = cfg.batch_size, cfg.kl_horizon
        return (f"--kl-horizon {h} with --batch-size {n}: a step below --kl-target would multiply "
                f"the KL coefficient by 1 - 0.2 x {n} / {h} = {1 - 0.2 * n / h:.3g}, to 0 or past "
                f"it; give --kl-horizon {n // 5 + 1} or more (from {n}, a step moves it by at most "
                f"20 percent)")
    return None


def follow_policy(rec, step, policy, reference, kl, cfg) -> dict:
    """--ref-sync-steps N (TR-DPO): every N steps the reference moves toward the policy."""
    if step % cfg.ref_sync_steps == 0:
        sync_reference(reference, policy, cfg.ref_sync_alpha)
    return {}


def ref_sync_problem(cfg) -> str | None:
    """A moving reference needs one (a KL term), and one of its own weights (not LoRA's)."""
    if cfg.ref_sync_steps and not cfg.kl_coef:
        return (f"--ref-sync-steps {cfg.ref_sync_steps} moves the reference, and --kl-coef 0 has "
                f"none: pass a --kl-coef above 0, or leave --ref-sync-steps out")
    if cfg.ref_sync_steps and cfg.lora_rank:
        return (f"--ref-sync-steps {cfg.ref_sync_steps} with --lora-rank {cfg.lora_rank}: the "
                f"reference is the policy's own weights with the adapters off, which cannot move "
                f"alone; leave one out")
    return None


def overlong(batch, cfg, kl_coef: float, estimators: dict) -> torch.Tensor:
    """--overlong-buffer: DAPO's overlong penalty of each completion (overlong_penalty)."""
    return overlong_penalty(batch.completion_mask.sum(1).cpu(), cfg)


# the variants that are on or off, in the order their additions run at each point
SWITCHES = {
    "dynamic-sampling": Switch(on=lambda cfg: cfg.dynamic_sampling, rounds=dynamic_sampling,
                               record=rounds_drawn),
    "overlong-buffer": Switch(on=lambda cfg: bool(cfg.overlong_buffer),
                              penalty=("overlong_penalty", overlong)),
    "pretraining-mix": Switch(on=lambda cfg: cfg.ptx_coef != 0, check=ptx.problem,
                              prepare=ptx.prepare, backward=ptx.backward, record=ptx.record),
    "dual-clip": Switch(on=lambda cfg: cfg.dual_clip is not None, pg=dual_clip, stats=dual_clipped),
    "top-entropy": Switch(on=lambda cfg: cfg.top_entropy_quantile < 1,
                          mini_batch=high_entropy_tokens, pg=top_entropy_only),
    "entropy-bonus": Switch(on=lambda cfg: cfg.entropy_coef != 0, loss=entropy_bonus,
                            reads_entropy=True),
    "kl-target": Switch(on=lambda cfg: bool(cfg.kl_target), check=kl_target_problem,
                        after_step=steer_kl),
    "ref-sync": Switch(on=lambda cfg: bool(cfg.ref_sync_steps), check=ref_sync_problem,
                       after_step=follow_policy),
}


def on(cfg, tables: dict) -> types.SimpleNamespace:
    """The additions to the step of the variants set, point by point (Switch), each a Fold or a
    Merged (FOLDS say which), empty by default: those of SWITCHES that are on, then the switches
    the choices of the flags' tables (train_lean.py TABLES) declare, where chosen (and their `on`
    holds)."""
    chosen = list(SWITCHES.values())
    for flag, choices in tables.items():
        if getattr(cfg, flag) != choices.default:   # the default adds nothing
            choice = choices[getattr(cfg, flag)]
            chosen.append(declared(choice, "switch") or UNDECLARED.get(flag))
    chosen = [s for s in chosen if s is not None and (s.on is None or s.on(cfg))]
    return types.SimpleNamespace(reads_entropy=any(s.reads_entropy for s in chosen), **{
        point: (Fold if point in FOLDS else Merged)(
            getattr(s, point) for s in chosen if getattr(s, point) is not None)
        for point in POINTS})


def penalties(cfg) -> list:
    """What takes a penalty off the reward in this run, as its flags say it: each on/off switch's
    (its SWITCHES name is its flag), then --kl-in's place's."""
    said = [f"--{name}" for name, switch in SWITCHES.items() if switch.penalty and switch.on(cfg)]
    place = declared(KL_PLACES[cfg.kl_in], "switch")
    return said + ([f"--kl-in {cfg.kl_in}"] if place and place.penalty and place.on(cfg) else [])
