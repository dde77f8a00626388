"""Rollout: the step's record (Rollout) and how it is sampled (Sampler): prompts tokenized,
groups of completions drawn with a KV cache (grpo/decoders.py), the sampled ids and logprobs kept;
and DAPO's dynamic sampling, which builds the batch from several rounds. The trainer scores the
sampled ids; text is decoded for the reward only (why: docs/algorithm.md, "The default step").
"""
import dataclasses
import functools
from collections import Counter

import torch
from torch.nn.utils.rnn import pad_sequence

from grpo.decoders import generate, is_end
from grpo.model import context_length, end_ids


def flat_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] bool: whether a group (contiguous rows) is flat, its rewards all equal: no signal.
    Exactly equal, as the advantages zero a group's (grpo/variants.py zero_flat_groups)."""
    r = rewards.float().view(-1, group_size)
    return r.max(1).values == r.min(1).values


def stream_seed(seed: int, index: int) -> int:
    """The seed of item `index` of the stream `seed` (a step's prompts, a row's sampling): of the
    two alone, so a resume or another device count draws the same. Modulo 2**64, torch's seed
    range: a stream of a stream (a step's row) stays in it, the same number if it was in it."""
    return (seed * 1_000_003 + index) % 2**64


def wants_bos(choice: str, tokenizer) -> bool:
    """--prompt-bos: on, off, or auto (on when the tokenizer's BOS is its EOS, as in GPT-2)."""
    return choice == "on" or (choice == "auto" and tokenizer.bos_token_id == tokenizer.eos_token_id)


def start_ids(tokenizer, prepend_bos: bool) -> list:
    """The ids every prompt starts with: the tokenizer's BOS (its EOS without one), or nothing."""
    bos = tokenizer.bos_token_id
    return [tokenizer.eos_token_id if bos is None else bos] if prepend_bos else []


def render_conversation(tokenizer, conversation: list) -> list:
    """A conversation's ids (messages {"role", "content"}), as the tokenizer's chat template
    renders it with the generation prompt: the assistant's turn is what is sampled. The
    template writes its own BOS; a ValueError names a missing template or one that refuses."""
    if tokenizer.chat_template is None:
        raise ValueError(f"the task's prompts are conversations ({shown(conversation)}) and the "
                         f"model's tokenizer has no chat template: use an instruct model's, or "
                         f"give str prompts")
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    except Exception as e:   # jinja's TemplateError (a template's raise_exception) and others
        raise ValueError(f"the chat template refused the conversation {shown(conversation)}: "
                         f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}") from None
    return list(ids)


def shown(value, width: int = 60) -> str:
    """A value (a prompt, str or conversation) as a message shows it: its repr, cut to width."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def encode_prompts(tokenizer, prompts, prepend_bos: bool, max_new_tokens: int = 0,
                   context: int | None = None) -> list:
    """Token ids of each prompt: a str encoded (prepend_bos: BOS first), a conversation rendered by
    its chat template; ValueError unless max_new_tokens fit after it in context (the model's
    positions: past them a learned-position model indexes outside its embeddings)."""
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    ids = [start_ids(tokenizer, prepend_bos) + next(encoded) if isinstance(p, str)
           else render_conversation(tokenizer, p) for p in prompts]
    for prompt, row in zip(prompts, ids):
        if not row:
            raise ValueError(f"the prompt {shown(prompt)} encodes to no tokens with the model's "
                             f"tokenizer")
        if context is not None and len(row) + max_new_tokens > context:
            room = context - len(row)
            fix = f"lower --max-new-tokens to {room} or shorten" if room > 0 else "shorten"
            raise ValueError(f"a prompt of {len(row)} tokens ({shown(prompt, 40)}) plus "
                             f"--max-new-tokens {max_new_tokens} needs {len(row) + max_new_tokens} "
                             f"positions, more than the model's {context}: {fix} the task's "
                             f"prompts")
    return ids


def left_pad(rows, pad_id: int, device=None):
    """Stack id lists to [B, L], padded on the left, with the attention mask."""
    ids = [torch.tensor(r, dtype=torch.long) for r in rows]
    mask = pad_sequence([torch.ones_like(r) for r in ids], batch_first=True, padding_side="left")
    ids = pad_sequence(ids, batch_first=True, padding_value=pad_id, padding_side="left")
    # queued (the host tensors are staged at once): a copy that waits would wait for the device
    return ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)


@dataclasses.dataclass
class Rollout:
    """One step's batch on this device, filled stage by stage: sampled, scored (rewards), shaped
    (penalties, shaped_rewards), reference logprobs, advantages; a group's rows contiguous.
    input_ids and attention: the prompt (left-padded) and the completion (EOS after the first,
    masked) side by side. A field you add (a list per row, a [B], [B, T] or [B, prompt width + T]
    tensor) is carried by select_rows as these are.
    """
    prompts: list            # the prompt of each row
    texts: list              # each completion decoded, for the reward only (never re-tokenised)
    input_ids: torch.Tensor          # [B, prompt width + T]
    attention: torch.Tensor          # [B, prompt width + T]
    completion_mask: torch.Tensor    # [B, T]
    old_logp: torch.Tensor           # [B, T] the sampling logprobs, the policy's own (PPO's pi_old)
    truncated: torch.Tensor          # [B] bool: stopped by max_new_tokens before an EOS
    rewards: torch.Tensor = None     # [B] float32 on the host: what the task gave, never changed
    # [B] each, by name: what reward shaping takes off the task's rewards (--overlong-buffer,
    # --kl-in reward)
    penalties: dict = dataclasses.field(default_factory=dict)
    shaped_rewards: torch.Tensor = None  # [B] the advantages' input: the rewards less the penalties
    # the means of the reward's parts (the task's reward_breakdown), by name
    part_means: dict = dataclasses.field(default_factory=dict)
    parts: list = None   # per row, its --reward-weights parts' values in order ([] without)
    errors: dict = dataclasses.field(default_factory=dict)       # failed rewards by kind
    ref_logp: torch.Tensor = None    # [B, T] the frozen reference's, when the run has a KL penalty
    advantages: torch.Tensor = None  # [B] on the device
    # what a variant's additions put before the update (grpo/variants.py Switch.prepare): inputs,
    # per row tensors given to the loss by name; extra, anything else
    inputs: dict = dataclasses.field(default_factory=dict)
    extra: dict = dataclasses.field(default_factory=dict)
    # [B, T] under the distribution sampled from, which --top-k, --top-p and --min-new-tokens
    # truncate and renormalise (old_logp itself when nothing truncates): the sampler side of the
    # mismatch (grpo/variants.py mismatch_weight)
    sampler_logp: torch.Tensor = None

    def shape(self, penalties: dict) -> "Rollout":
        """penalties ({name: [B]}) and shaped_rewards: the task's rewards less each, in order."""
        self.penalties = penalties
        self.shaped_rewards = functools.reduce(torch.sub, penalties.values(), self.rewards)
        return self

    @property
    def completion_len(self) -> int:
        return self.completion_mask.shape[1]

    def score(self, scorer) -> "Rollout":
        """rewards, part_means, errors and parts from scorer(prompts, texts) (harness/task.py)."""
        rewards, self.part_means, self.errors, parts = scorer(self.prompts, self.texts)
        self.rewards = torch.from_numpy(rewards)
        self.parts = [[] for _ in self.texts] if parts is None else parts
        return self


def truncated_rows(completion_ids, completion_mask, ends) -> torch.Tensor:
    """[B] bool: the rows max_new_tokens stopped. completion_mask runs up to and including a row's
    first end (EOS or any of ends: grpo/decoders.py), so those whose last masked token is none."""
    lengths = completion_mask.sum(1)
    last = completion_ids.gather(1, (lengths - 1).clamp_min(0)[:, None]).squeeze(1)
    return (lengths > 0) & ~is_end(last, ends)


def decode_completions(tokenizer, completion_ids, mask, ends) -> list:
    """The text of each completion: its tokens before its first end (ends: an id or ids). The mask
    runs up to and including a row's first end: the ends it holds are that one, or none."""
    lengths = (mask.bool() & ~is_end(completion_ids, ends)).sum(1, keepdim=True)
    rows = torch.cat([completion_ids, lengths.to(completion_ids.dtype)], 1).tolist()   # one read
    return tokenizer.batch_decode([ids[:m] for *ids, m in rows], skip_special_tokens=False)


@dataclasses.dataclass(frozen=True)
class Sampler:
    """A run's sampling, its settings fixed once (the harness's Run.sampler builds it; frozen, as
    generate()'s settings are made from them once): sample() draws a step's rollouts."""
    policy: torch.nn.Module
    tokenizer: object
    _: dataclasses.KW_ONLY   # the settings by name: several are ints or floats side by side
    group_size: int
    prepend_bos: bool
    generation_batch: int
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_new_tokens: int
    autocast: object     # the context generate() runs under (grpo/model.py model_autocast)
    device: torch.device
    compile: bool = False
    graph: str = None    # the decode step replayed as a CUDA graph ("capture") or checked ("check")
    ends: tuple = dataclasses.field(init=False)   # EOS, and an instruct model's end of turn
    context: int = dataclasses.field(init=False)  # the model's positions (None: not declared)
    # truncated sampling: the distribution drawn from is not the policy's, its logprobs are kept
    truncates: bool = dataclasses.field(init=False)
    settings: dict = dataclasses.field(init=False)   # generate()'s

    def __post_init__(self):   # the model's, read once, and what follows from the settings
        ends = end_ids(self.policy, self.tokenizer)
        truncates = self.temperature > 0 and (self.top_k > 0 or self.top_p < 1
                                              or self.min_new_tokens > 0)
        settings = dict(
            end_ids=ends, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, min_new_tokens=self.min_new_tokens,
            autocast=self.autocast, compile=self.compile, with_sampler=truncates,
            group_size=self.group_size, graph=self.graph)
        for name, value in (("ends", ends), ("context", context_length(self.policy.config)),
                            ("truncates", truncates), ("settings", settings)):
            object.__setattr__(self, name, value)   # frozen: set once, here

    def sample(self, prompts: list, *, seed: int, first_row: int) -> Rollout:
        """group_size completions of each prompt, generation_batch rows at a time, each chunk seeded
        by seed and its first row in the global batch: the same rollouts on any number of devices
        (for the same generation batch) and after a resume."""
        group_size, ends, eos = self.group_size, self.ends, self.ends[0]
        ids = encode_prompts(self.tokenizer, prompts, self.prepend_bos, self.max_new_tokens,
                             self.context)
        prompt_ids, prompt_mask = left_pad([r for r in ids for _ in range(group_size)], eos,
                                           self.device)
        chunks, chunk = [], self.generation_batch
        for s in range(0, prompt_ids.shape[0], chunk):
            torch.manual_seed(stream_seed(seed, first_row + s))
            chunks.append(generate(self.policy, prompt_ids[s:s + chunk], prompt_mask[s:s + chunk],
                                   **self.settings))
        width, pad = max(c.ids.shape[1] for c in chunks), torch.nn.functional.pad
        def joined(name, value=0):   # the chunks' rows in order, right-padded to the widest
            return torch.cat([pad(t, (0, width - t.shape[1]), value=value)
                              for t in (getattr(c, name) for c in chunks)])
        completion, mask, logp = joined("ids", eos), joined("mask"), joined("logp")
        sampler_logp = joined("sampler_logp") if self.truncates else logp
        return Rollout(prompts=[p for p in prompts for _ in range(group_size)],
                       texts=decode_completions(self.tokenizer, completion, mask, ends),
                       input_ids=torch.cat([prompt_ids, completion], 1),
                       attention=torch.cat([prompt_mask, mask], 1), completion_mask=mask,
                       old_logp=logp, sampler_logp=sampler_logp,
                       truncated=truncated_rows(completion, mask, ends))


# ---- DAPO's dynamic sampling: the batch made of the groups that are not flat of several rounds --

def missing_groups(round_rewards: list, group_size: int, groups: int) -> int:
    """How many groups that are not flat the rounds so far lack for a batch of `groups` (0:
    enough)."""
    found = sum(int((~flat_groups(r, group_size)).sum()) for r in round_rewards)
    return max(0, groups - found)


def merge_rounds(round_rewards: list, group_size: int, groups: int):
    """Choose `groups` groups from rounds (round_rewards: a 1-D reward tensor per round, in draw
    order): those not flat first, then the earliest flat ones (docs/algorithm.md, "Dynamic
    sampling"). Returns (rows, counts): rows, LongTensor indices of the chosen groups' rows in the
    rounds' rows concatenated, in draw order; counts, groups_drawn, groups_dropped (drawn, not
    kept), groups_uninformative (kept although flat). ValueError if too few were drawn.
    """
    flat = torch.cat([flat_groups(r, group_size) for r in round_rewards])
    drawn = flat.numel()
    if drawn < groups:
        raise ValueError(f"{drawn} groups drawn, fewer than the batch's {groups}")
    order = torch.argsort(flat.int(), stable=True)  # those not flat first, each in draw order
    chosen = torch.sort(order[:groups]).values
    rows = (chosen[:, None] * group_size + torch.arange(group_size)).reshape(-1)
    counts = {"groups_drawn": drawn, "groups_dropped": drawn - groups,
              "groups_uninformative": int(flat[chosen].sum())}
    return rows, counts


def mean_parts(means: list) -> dict:
    """The reward's part means of several rounds or devices (dicts), averaged name by name."""
    return {k: sum(m.get(k, 0.0) for m in means) / len(means) for k in means[0]}


def select_rows(rollouts: list, rows: torch.Tensor, pad_id: int) -> Rollout:
    """Rows of several rollouts (indices into their rows in order) as one Rollout, every per-row
    field carried: lists picked, [B] tensors indexed, [B, T] completion tensors right-padded to the
    widest T, and [B, prompt + T] tensors re-padded on both sides (input_ids with pad_id, others
    with 0). The padding is masked and positions come from the mask, so every row's logprobs are
    unchanged. Other fields (dicts) start empty."""
    widths = [r.input_ids.shape[1] - r.completion_len for r in rollouts]
    width, T = max(widths), max(r.completion_len for r in rollouts)   # prompt columns, completion
    pad, pick = torch.nn.functional.pad, rows.tolist()
    chosen = {}
    for f in dataclasses.fields(rollouts[0]):
        parts = [getattr(r, f.name) for r in rollouts]
        if isinstance(parts[0], list):
            every = [x for part in parts for x in part]
            chosen[f.name] = [every[i] for i in pick]
        elif isinstance(parts[0], torch.Tensor) and parts[0].dim() == 1:
            chosen[f.name] = torch.cat(parts)[rows.to(parts[0].device)]
        elif isinstance(parts[0], torch.Tensor):
            value = pad_id if f.name == "input_ids" else 0
            full = parts[0].shape[1] == rollouts[0].input_ids.shape[1]   # prompt + completion columns
            if not full and parts[0].shape[1] != rollouts[0].completion_len:   # padding would misalign its columns
                raise ValueError(f"Rollout.{f.name} is {list(parts[0].shape)}: select_rows carries [B], [B, T] and "
                                 f"[B, prompt width + T] tensors; give another shape its own merge")
            chosen[f.name] = torch.cat([
                torch.cat([pad(t[:, :w], (width - w, 0), value=value),
                           pad(t[:, w:], (0, T - r.completion_len), value=value)], 1)
                if full else pad(t, (0, T - r.completion_len), value=value)
                for t, w, r in zip(parts, widths, rollouts)])[rows.to(parts[0].device)]
    return type(rollouts[0])(**chosen)


def merge(rounds: list, group_size: int, groups: int, pad_id: int):
    """DAPO's dynamic sampling: the batch of `groups` groups from scored generation rounds
    (merge_rounds chooses them, those not flat first), with the rounds' reward part means averaged
    and errors summed; returns (batch, merge_rounds' counts)."""
    rows, counts = merge_rounds([r.rewards for r in rounds], group_size, groups)
    batch = select_rows(rounds, rows, pad_id)
    batch.part_means = mean_parts([r.part_means for r in rounds])
    batch.errors = dict(sum((Counter(r.errors) for r in rounds), Counter()))
    return batch, counts
