"""One mini-batch's gradient under each set of loss knobs, accumulated over micro-batches, summed over ranks.

test_train_update.py calls minibatch_gradient in its own process, and runs this file once per rank
of a 2-process gloo group (CPU, a file:// rendezvous, nothing on the network):

    python grad_worker.py RANK WORLD INIT_FILE MODEL_DIR BATCH_FILE OUT_FILE

Each rank takes its contiguous share of the batch's rows (and of the pretraining mix's texts, every other) and runs the trainer's update functions on them:
the loss denominator summed over ranks, the top-entropy threshold from every rank's token entropies, the
micro-batches' gradients accumulated, then summed over ranks. Rank 0 saves {knobs name: gradient}.
"""
import sys

import torch

import train_lean as update
from grpo import distributed, passes, variants
from grpo.variants import top_entropy_threshold
from train_lean import TABLES, group_advantages, loss_denominator
from harness.config import Config   # update() takes a layout and a guard: the harness's
from harness.guards import Guard
from grpo.model import completion_logprobs
from grpo.ptx import PtxBatch
from grpo.rollout import Rollout

MAX_NEW_TOKENS = 24  # the rollout64 fixture's
TEMPERATURE = 1.5
GROUP = 8            # the rollout64 fixture's: 8 prompts x 8 completions
CHUNK_ROWS = 50      # token rows per output-head chunk: the chunked (checkpointed) path, entropies included
GSPO = {"importance_level": "sequence", "clip_low": 0.02, "clip_high": 0.03}
# Every choice of a variant's flag (train_lean.py TABLES: --advantage, --loss-agg, --importance-level,
# --kl-estimator, --kl-in, and any such flag to come) is a knob of its own, so a new choice is tested here without
# a line for it, unless its knobs' defaults leave it the defaults' gradient on this batch (below) or it needs other
# settings to run; an advantage gets the reward's parts (as_rollout). TRL's names for our aggregations are the same
# loss. The knobs with a number, and combinations, by hand.
CHOICES = {f"{flag} {choice}": {flag: choice} for flag, table in TABLES.items()
           for choice in table if choice != table.default}
# Clip-Cov's default band (1, 5) holds no token of this batch (a tiny random model's logprobs barely spread), which
# would make it the defaults' gradient: its generated knob takes a band that binds, and a share of 1%
CHOICES["policy_loss clip-cov"].update(clip_cov_lb=0.1, cov_ratio=0.01)
KNOBS = {
    "defaults": {},
    **CHOICES,
    "gspo token-mean": GSPO,
    "gspo seq-mean": {**GSPO, "loss_agg": "seq-mean"},
    "gspo dr-grpo": {**GSPO, "loss_agg": "dr-grpo"},
    "dual clip": {"dual_clip": 1.5},
    "entropy bonus": {"entropy_coef": 0.05},
    "top entropy token-mean": {"top_entropy_quantile": 0.2},
    "top entropy seq-mean": {"top_entropy_quantile": 0.2, "loss_agg": "seq-mean"},
    "top entropy dr-grpo": {"top_entropy_quantile": 0.2, "loss_agg": "dr-grpo"},
    "pretraining mix": {"ptx_coef": 0.5},   # the batch's "ptx" texts, learned beside the rollouts
    "cispo capped low": {"policy_loss": "cispo", "clip_high": 0.05},
    "sapo temperatures": {"policy_loss": "sapo", "sapo_tau_pos": 0.5, "sapo_tau_neg": 4.0},
    "gmpo seq-mean": {"policy_loss": "gmpo", "loss_agg": "seq-mean", "clip_low": 0.4, "clip_high": 0.4},
    "clip-cov wide band": {"policy_loss": "clip-cov", "cov_ratio": 0.05, "clip_cov_lb": 0.1, "clip_cov_ub": 20.0},
    "kl-cov dr-grpo": {"policy_loss": "kl-cov", "cov_ratio": 0.05, "kl_cov_coef": 0.5, "loss_agg": "dr-grpo"},
    "tis cap": {"mismatch_correction": "tis", "mismatch_cap": 1.3},
    "token mask band": {"mismatch_correction": "token-mask", "mismatch_low": 0.8, "mismatch_cap": 1.25},
    "sequence mask band": {"mismatch_correction": "sequence-mask", "mismatch_low": 0.97, "mismatch_cap": 1.03},
    "sequence mask seq-mean": {"mismatch_correction": "sequence-mask", "loss_agg": "seq-mean"},
    "all at once": {**GSPO, "loss_agg": "dr-grpo", "dual_clip": 1.2, "kl_estimator": "k2", "entropy_coef": 0.05,
                    "top_entropy_quantile": 0.3, "advantage": "batch", "ptx_coef": 0.3, "mismatch_correction": "tis"},
}


def config_for(knobs: dict) -> Config:
    """The trainer's settings for a set of loss knobs (clip_low / clip_high are --clip-range / --clip-range-high)."""
    k = dict(knobs)
    return Config(temperature=TEMPERATURE, logprob_chunk_size=CHUNK_ROWS, max_new_tokens=MAX_NEW_TOKENS,
                  kl_coef=0.05, clip_range=k.pop("clip_low", 0.2), clip_range_high=k.pop("clip_high", None), **k)


def as_rollout(batch, cfg, rank: int, world: int) -> Rollout:
    """This rank's rows of the batch, with advantages from every rank's rewards (as the trainer makes them); for
    GDPO two parts of the reward: the reward and its sign, weighted 1 and 0.5."""
    parts = torch.stack([batch["rewards"], batch["rewards"].sign()], 1)
    advantages, _ = group_advantages(batch["rewards"], GROUP, cfg.advantage, parts=parts, weights=[1.0, 0.5])
    n = batch["cmask"].shape[0] // world
    mine = {k: v[rank * n:(rank + 1) * n] for k, v in {**batch, "adv": advantages}.items() if k != "ptx"}
    return Rollout(prompts=[""] * n, texts=[""] * n, input_ids=mine["inputs"], attention=mine["attention"],
                   completion_mask=mine["cmask"], old_logp=mine["old"], truncated=torch.zeros(n, dtype=torch.bool),
                   ref_logp=mine["ref"], advantages=mine["adv"], sampler_logp=mine["sampler"])


def per_micro_batch_entropy_mask(model, rollout, mask, micro, cfg):
    """The mistake the tests guard against: a top-entropy threshold from each micro-batch's own tokens."""
    parts = []
    for rows in torch.arange(mask.shape[0]).split(micro):
        with torch.no_grad():
            entropy = completion_logprobs(model, rollout.input_ids[rows], rollout.attention[rows], mask.shape[1],
                                          TEMPERATURE, CHUNK_ROWS, with_entropy=True)[1]
        parts.append(entropy >= top_entropy_threshold(entropy[mask[rows].bool()], cfg.top_entropy_quantile))
    return torch.cat(parts)


def minibatch_gradient(model, batch, knobs, micro, *, rank=0, world=1, threshold_per_micro_batch=False,
                       tokens=0):
    """The flat gradient of this rank's rows of the mini-batch `batch`, micro rows per forward/backward
    (tokens: as many as hold that many real tokens, --micro-batch-tokens),
    through the trainer's own update functions (train_lean.py, grpo/passes.py): the denominator summed over ranks, the
    top-entropy threshold over every rank's tokens, the micro-batches accumulated, the ranks summed."""
    cfg = config_for(knobs)
    rollout = as_rollout(batch, cfg, rank, world)
    rows = torch.arange(rollout.input_ids.shape[0])
    mask = passes.loss_mask(rollout, cfg)
    denominator = distributed.all_sum([loss_denominator(mask, cfg)])[0]
    guard = Guard(micro, rows.shape[0], print, tokens=tokens)   # the cut and its out-of-memory retry
    params = [p for p in model.parameters() if p.requires_grad]
    sampler = rollout.old_logp if rollout.sampler_logp is None else rollout.sampler_logp
    inputs = {"sampler_logp": sampler}
    for chosen in variants.on(cfg, TABLES).mini_batch:   # top entropy's, clip-cov's and kl-cov's tokens
        inputs.update(chosen(model, rollout, rows, mask, guard, cfg, None))
    if threshold_per_micro_batch:   # in place of the mini-batch's threshold
        inputs["pg_mask"] = per_micro_batch_entropy_mask(model, rollout, mask, micro, cfg)
    # the pretraining mix: every rank holds the update's texts and takes its share (grpo/ptx.py)
    if cfg.ptx_coef:
        rollout.extra["ptx"] = [PtxBatch(**batch["ptx"]).for_device(rank, world)]
    update.accumulate(model, torch.optim.SGD(params, lr=0.0), rollout, rows, guard.cut, mask, denominator, cfg,
                      None, cfg.kl_coef, **inputs)
    distributed.sum_gradients(params)
    return torch.cat([p.grad.reshape(-1) for p in params])


def main(rank, world, init_file, model_dir, batch_file, out_file):
    from grpo.model import load_policy
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = load_policy(model_dir, "cpu")
    batch = torch.load(batch_file)
    grads = {name: minibatch_gradient(model, batch, knobs, micro=8, rank=rank, world=world)
             for name, knobs in KNOBS.items()}
    if rank == 0:
        torch.save(grads, out_file)
    distributed.close()


if __name__ == "__main__":  # with the repository on PYTHONPATH (helpers.env)
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:7])
