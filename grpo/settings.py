"""The algorithm's settings: the fields of the GRPO step's arithmetic (train_lean.py, grpo/), each
with its default, help, choices and range. harness/config.py's Config adds the rest to them: the
run's own (model, task, devices, output, checkpoints) and how the model is built and the work cut,
some of which grpo/ reads too (LoRA's in grpo/model.py). harness/cli.py makes every field a flag
--field-name and an override GRPO_FIELD_NAME. A variant's knob is a field here; a variant flag's
choices are its table's (train_lean.py TABLES, which main hands to the harness). Also here: the
batch's Layout and the step's Context (what grpo/ reads of its run).
"""
import typing
from dataclasses import dataclass, field

from grpo import optim


def opt(default, help, choices=None, const=None, path=None, auto=False, resume_free=False, resume_fixed=None,
        must=None, note=None, aliases=None, old_names=(), text=False):
    """A field. const: the flag may be given bare (`--resume` = `--resume latest`); path "in"/"out":
    a file the run reads / writes (out_dir: a folder), checked before loading; auto: "auto" stays
    itself; must: its range in RANGES, note: a hint its message adds; resume_free: may differ on
    --resume; resume_fixed="why": may not, even if --resume-allow-change names it; choices: a dict
    name -> what it does, listed in the help; aliases: another trainer's names -> a choice; old_names:
    the field's earlier names, still read (harness/config.py OLD_NAMES); text: its value is prose,
    taken as given (no word of it means unset). The help lists choices and aliases when shown
    (harness/cli.py); a variant flag's are read from its table then, so an entry added to the table
    later is listed too (grpo/variants.py Table)."""
    return field(default=default, metadata={"help": help, "choices": choices, "const": const, "path": path,
                                            "auto": auto, "resume_free": resume_free,
                                            "resume_fixed": resume_fixed, "must": must, "note": note,
                                            "aliases": aliases or {}, "old_names": tuple(old_names),
                                            "text": text})


# TRL's loss_type names for the same aggregations. TRL's "dapo" is exactly token-mean (its count is
# over the whole accumulated batch on all processes). TRL's "bnpo" aims at the same mean but divides
# each micro-batch by its own, per-process token count, so it equals token-mean only with one
# micro-batch on one device: here it is taken to mean token-mean. TRL's "dr_grpo" divides per
# micro-batch and averages, the same when micro-batches are of equal size, as here.
TRL_LOSS_TYPES = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean", "dr_grpo": "dr-grpo"}


@dataclass
class Settings:
    # batch arithmetic (harness/config.py batch_layout checks how it splits)
    batch_size: int = opt(64, "completions per step, global across devices", must="at least 1")
    group_size: int = opt(8, "completions per prompt; prompts per step = batch / group", must="at least 1")
    mini_batch_size: typing.Optional[int] = opt(None, "completions per optimizer update (default: batch)",
                                                must="at least 1")
    ppo_epochs: int = opt(1, "passes over each step's rollouts", must="at least 1")
    # sampling
    max_new_tokens: int = opt(144, "new tokens per completion at most", must="at least 1")
    min_new_tokens: int = opt(0, "new tokens every completion gets at least: EOS cannot be sampled before "
                              "(its probability still counts in the logprobs; 0: off)")
    temperature: float = opt(1.0, "sampling temperature; 0 means greedy", must=">= 0", note="0 means greedy")
    top_k: int = opt(0, "sample from the k most likely tokens (0: off)", must=">= 0", note="0 means off")
    top_p: float = opt(1.0, "nucleus sampling threshold (1: off)", must="in (0, 1]")
    # algorithm
    learning_rate: float = opt(1e-4, "learning rate (1e-4 suits the shipped 5M-parameter default model; "
                               "use about 1e-5 for a 124M model such as RookWorld-LM)", must="in (0, 1)",
                               note="below 1, no AdamW or Muon update can make a weight non-finite: "
                                    "docs/failures.md")
    lr_scheduler: str = opt("constant", "the learning rate over the run, after its warmup", optim.LR_SCHEDULES)
    lr_warmup_steps: int = opt(0, "steps whose learning rate rises linearly to --learning-rate (0: none)", must=">= 0")
    lr_warmup_ratio: float = opt(0.0, "the warmup as a share of --steps, instead of --lr-warmup-steps", must="in [0, 1)")
    min_lr_ratio: float = opt(0.0, "the floor linear and cosine decay to, a share of --learning-rate", must="in [0, 1)")
    optimizer: str = opt("adamw", "the optimizer (both at --learning-rate)", optim.OPTIMIZERS,
                         resume_fixed="the checkpoint holds that optimizer's state (its moments and steps), which no "
                                      "other optimizer reads; start a new run from OUT_DIR/model to change it")
    weight_decay: float = opt(0.0, "decoupled weight decay (AdamW's, and Muon's)", must=">= 0")
    max_grad_norm: float = opt(1.0, "gradient-norm clipping (0: off, as in transformers' "
                               "Trainer; the norm is still measured)", must=">= 0")
    clip_range: float = opt(0.2, "PPO clip range (low side, and high side unless --clip-range-high)", must="> 0")
    clip_range_high: typing.Optional[float] = opt(None, "PPO clip range on the high side (default: --clip-range)",
                                                  must="> 0")
    kl_coef: float = opt(0.02, "k3 KL penalty against the frozen reference (0: no reference model)", must=">= 0")
    kl_target: typing.Optional[float] = opt(None, "adaptive KL: --kl-coef is where the coefficient starts, and each "
                                            "step moves it toward this KL per token (the record's kl, its kl_coef; "
                                            "default off)", must="> 0")
    kl_horizon: int = opt(10000, "--kl-target: completions over which the coefficient moves by at most 20 percent",
                          must="at least 1")
    ref_sync_steps: int = opt(0, "every N steps the reference moves toward the policy (TR-DPO; 0: it stays the "
                              "starting model)", must=">= 0")
    ref_sync_alpha: float = opt(1.0, "with --ref-sync-steps: reference = alpha x policy + (1 - alpha) x reference "
                                "(1: a copy of the policy)", must="in (0, 1]")
    advantage: str = opt("group", "each completion's advantage", old_names=("scale_rewards",))
    loss_agg: str = opt("token-mean", "the loss normaliser", aliases=TRL_LOSS_TYPES)
    importance_level: str = opt("token", "the importance ratio")
    dual_clip: typing.Optional[float] = opt(None, "dual-clip PPO: for negative advantages the loss is at most "
                                            "C x |A| (C > 1, e.g. 3; default off)", must="> 1",
                                            note="the bound is C x |A|")
    token_advantage: str = opt("sequence", "each token's advantage, which every --policy-loss reads: "
                               "its completion's, or a shaping of it per token")
    shaping_alpha: float = opt(0.4, "--token-advantage entropy: the weight alpha of the token's entropy",
                               must=">= 0")
    shaping_kappa: float = opt(2.0, "--token-advantage entropy: the shaping stays within |A| / kappa",
                               must="at least 1")
    policy_loss: str = opt("ppo", "the policy-gradient term")
    sapo_tau_pos: float = opt(1.0, "--policy-loss sapo: the gate's temperature where A > 0", must="> 0")
    sapo_tau_neg: float = opt(1.05, "--policy-loss sapo: the gate's temperature where A < 0 (above the positive one: "
                              "off-policy negative updates fade sooner)", must="> 0")
    cov_ratio: float = opt(2e-4, "--policy-loss clip-cov or kl-cov: the share of a mini-batch's loss tokens they act on "
                           "(at least one token)", must="in (0, 1]")
    clip_cov_lb: float = opt(1.0, "--policy-loss clip-cov: the covariance term above which a token may be detached")
    clip_cov_ub: float = opt(5.0, "--policy-loss clip-cov: the covariance term below which a token may be detached")
    kl_cov_coef: float = opt(1.0, "--policy-loss kl-cov: the weight of |logp - logp_old| on its tokens", must=">= 0")
    reward_weights: typing.Optional[str] = opt(None, "the reward as a weighted sum of the task's reward_breakdown "
                                               "parts, name=weight,... (e.g. correct=1,format=0.2); with "
                                               "--advantage gdpo each part is normalised in its group first")
    kl_estimator: str = opt("k3", "the KL estimator (docs/algorithm.md says which belongs where; with --kl-in "
                            "reward the default is k1)")
    kl_in: str = opt("loss", "where the KL penalty goes")
    mismatch_correction: str = opt("none", "the correction of the gap between the sampler's logprobs and the trainer's "
                                   "(their ratio w, detached, weighs each token's policy-gradient term)")
    mismatch_cap: float = opt(2.0, "--mismatch-correction: the largest weight w kept (tis: the cap; the masks: the "
                              "band's top)", must="at least 1")
    mismatch_low: float = opt(0.5, "--mismatch-correction token-mask or sequence-mask: the band's bottom",
                              must="in [0, 1)")
    entropy_coef: float = opt(0.0, "entropy bonus: the loss minus this x the mean token entropy (0: off)", must=">= 0")
    top_entropy_quantile: float = opt(1.0, "only this share of a mini-batch's tokens, the highest-entropy ones, "
                                      "carry the policy-gradient loss (1: all)", must="in (0, 1]",
                                      note="1: every token")
    dynamic_sampling: bool = opt(False, "DAPO: drop groups whose rewards are all equal and sample more prompts "
                                 "until the batch is full of groups that carry a signal")
    max_sampling_rounds: int = opt(4, "--dynamic-sampling: extra generation rounds per step at most", must=">= 0")
    mask_truncated: bool = opt(False, "completions cut off at --max-new-tokens (no EOS) carry no loss")
    overlong_buffer: int = opt(0, "DAPO's soft overlong penalty: the last N tokens before --max-new-tokens "
                               "lower the reward linearly, down to -overlong-penalty at the limit (0: off)")
    overlong_penalty: float = opt(1.0, "the reward lost by a completion that reaches --max-new-tokens "
                                  "(with --overlong-buffer)", must=">= 0")
    # the pretraining mix (InstructGPT's PPO-ptx): next-token loss on plain text, against forgetting
    ptx_coef: float = opt(0.0, "weight of the pretraining-mix term: the mean next-token loss on plain text, added "
                          "to each update's loss (PPO-ptx; 0: off)", must=">= 0")
    ptx_batch_size: int = opt(16, "--ptx-coef's texts per optimizer update, global across devices", must="at least 1")
    # the streams of prompts and samples
    seed: int = opt(0, "seed for prompts, sampling and initialisation (numpy's range)",
                    must="in [0, 2**32)")
    # how long the run is (the learning-rate schedule spans it) and how the logprobs are chunked
    steps: int = opt(700, "training steps", must="at least 1", resume_free=True)
    logprob_chunk_size: int = opt(2048, "token rows of the vocabulary log-softmax computed at once",
                                  must="at least 1", resume_free=True)


@dataclass(frozen=True)
class Layout:
    """The batch arithmetic of a run: how a step's completions split over devices, updates and passes."""
    devices: int
    prompts_per_step: int           # = groups per step
    prompts_per_device: int
    completions_per_step: int       # = --batch-size
    completions_per_device: int
    mini_batch: int                 # completions per optimizer update, global
    mini_batch_per_device: int
    micro_batch: int                # completions per forward/backward on one device (auto: where probing starts)
    micro_batch_auto: bool
    micro_tokens: int               # --micro-batch-tokens's budget (0: cut by rows; auto: set later)
    micro_tokens_auto: bool
    grad_accum_steps: int
    updates_per_step: int
    generation_batch: int           # completions sampled at once on one device


@dataclass(frozen=True)
class Context:
    """What the step reads of its run besides the models and the batch, fixed once the run starts
    training (the harness's Run.start_training builds it, train_lean.py main passes it down):
    grpo/ reads these, never an object of the harness."""
    cfg: Settings                 # the run's settings (harness/config.py Config: these and more)
    layout: Layout                # the batch's sizes
    rank: int                     # this process among world (1 without torchrun)
    world: int
    device: object                # torch.device the models and the batch live on
    autocast: object              # what the forwards run under (grpo/model.py model_autocast)
    tokenizer: object
    prepend_bos: bool             # a prompt starts with BOS (grpo/rollout.py wants_bos)
    context_length: typing.Optional[int]   # the model's positions (None: unbounded)
    # (prompts, completions) -> (rewards, part means, errors by kind, each row's --reward-weights
    # parts or None): the task's reward, its failures made loud (harness/task.py Scorer)
    score: typing.Callable
    reward_weights: tuple         # --reward-weights' weights, in the order of the rows' parts
    mix_source: typing.Optional[typing.Callable] = None   # --ptx-coef's texts: (n, rng) -> texts
    on: object = None   # the variants set: what each adds at each point (grpo/variants.py on)
