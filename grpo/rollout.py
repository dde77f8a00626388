"""Rollout: tokenize prompts, sample groups of completions with a KV cache, keep the sampled ids and logprobs.

The sampled token ids are what the trainer scores; text is decoded only for the reward. Re-tokenising
decoded text would give different tokens (BPE is not a bijection on what a model can emit), and the
logprobs would then belong to a sequence the policy never sampled.
"""
from collections import Counter
from dataclasses import dataclass, field

import torch

from grpo.algorithm import merge_rounds
from grpo.decoders import decoder_for
from grpo.model import context_length, position_ids_from_mask
from harness.task import TaskError


def logprob_temperature(temperature: float) -> float:
    """The temperature of the distribution whose logprobs are trained on.

    Sampling and training must use the same one, so that the behaviour logprobs recorded while
    sampling equal the policy's logprobs at the first update (ratio == 1). Greedy decoding has no
    distribution of its own; its logprobs are taken at temperature 1.
    """
    return temperature if temperature > 0 else 1.0


def wants_bos(choice: str, tokenizer) -> bool:
    """--prompt-bos: on, off, or auto (on when the tokenizer's BOS is its EOS, as in GPT-2)."""
    return choice == "on" or (choice == "auto" and tokenizer.bos_token_id == tokenizer.eos_token_id)


def encode_prompts(tokenizer, prompts, prepend_bos: bool, max_new_tokens: int = 0, context: int | None = None) -> list:
    """Token ids of each prompt; with prepend_bos, the tokenizer's BOS (GPT-2: <|endoftext|>) first.

    With context (the model's positions, grpo/model.py context_length) each prompt must leave room for
    max_new_tokens: past it a learned-position model indexes outside its embeddings. Else a TaskError
    naming the prompt, its length, the limit and what to change."""
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"] if len(prompts) else []
    if prepend_bos:
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = [[bos] + row for row in ids]
    for prompt, row in zip(prompts, ids):
        if not row:
            raise TaskError(f"the prompt {prompt[:60]!r} encodes to no tokens with the model's tokenizer")
        if context is not None and len(row) + max_new_tokens > context:
            fix = (f"lower --max-new-tokens to {context - len(row)} or shorten" if len(row) < context else "shorten")
            raise TaskError(f"a prompt of {len(row)} tokens ({prompt[:40]!r}...) plus --max-new-tokens "
                            f"{max_new_tokens} needs {len(row) + max_new_tokens} positions, more than the model's "
                            f"{context}: {fix} the task's prompts")
    return ids


def left_pad(rows, pad_id: int, device=None):
    """Stack id lists to [B, L], padded on the left, with the attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def completion_mask(completion_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 up to and including each row's first EOS, 0 after it.

    Built from the position of the first EOS, never from `token == pad`: with pad == EOS (GPT-2)
    that would mask the EOS the policy chose to emit, so it would never learn to stop.
    """
    is_eos = completion_ids == eos_id
    width = completion_ids.shape[1]
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], width, dtype=torch.long))
    return (torch.arange(width, device=completion_ids.device)[None, :] <= first[:, None]).long()


def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One index per row with probability probs[row, index] (rows need not sum to exactly 1).

    Inverse-CDF sampling: the first index whose running sum exceeds a uniform draw scaled to the
    row's total. Only an index with probability > 0 can be that first one. The same distribution as
    torch.multinomial, which on CPU costs ~10x more (158 ms vs 13 ms for 64 x 50257 per token).
    """
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, banned: int = None):
    """Draw one token per row; return it with its logprob under the temperature-scaled distribution.

    The logprob is taken before top-k/top-p truncation (and before `banned`, a token id that may
    not be drawn now): it is the policy's own logprob, the same quantity the training forward
    computes, so the first update is exactly on-policy.
    """
    logits = logits.float() / logprob_temperature(temperature)
    logprobs = torch.log_softmax(logits, dim=-1)
    filtered = logits
    if banned is not None:
        filtered = filtered.clone()
        filtered[:, banned] = float("-inf")  # a scalar fill: no index tensor copied to the device every token
    if temperature == 0:
        token = filtered.argmax(-1)
    else:
        if top_k > 0 and top_k < logits.shape[-1]:
            kth = torch.topk(filtered, top_k, dim=-1).values[:, -1:]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if top_p < 1.0:
            sorted_logits, order = torch.sort(filtered, descending=True, dim=-1)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            # drop a token when the tokens ranked above it already hold top_p of the mass
            drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
            filtered = filtered.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logprobs.exp() if filtered is logits else torch.softmax(filtered, dim=-1)
        token = _draw(probs)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


# rows that have all finished are noticed only every this many steps: a check reads a flag back from the
# device (a host synchronisation), and the steps past the end are trimmed off, so the outputs are the same
DONE_CHECK_EVERY = 8


@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, *, eos_id: int, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, min_new_tokens: int = 0, autocast=None, compile: bool = False):
    """Sample one completion per row of a left-padded prompt batch.

    Returns completion_ids [B, T], completion_mask [B, T] and the sampling logprobs [B, T], where T is
    the number of decode steps until every row has stopped at its first EOS (at least min_new_tokens,
    at most max_new_tokens). Rows that have finished keep receiving EOS, which the mask hides. EOS
    cannot be drawn before min_new_tokens (its probability still counts in the recorded logprob).
    compile runs the decode step through torch.compile (CUDA: as a replayed graph) where the model
    has a preallocated decoder (grpo/decoders.py); the first call pays the compilation.
    """
    autocast = autocast or torch.autocast(prompt_ids.device.type, enabled=False)
    with autocast:  # entered once: autocast keeps its bf16 copies of the weights for the whole loop
        return _generate(model, prompt_ids, prompt_mask, eos_id, max_new_tokens, temperature, top_k, top_p,
                         min_new_tokens, compile)


def _generate(model, prompt_ids, prompt_mask, eos_id, max_new_tokens, temperature, top_k, top_p, min_new_tokens,
              compile=False):
    batch = prompt_ids.shape[0]
    # the rows of a group share their prompt: each distinct one is prefilled once, then its KV is copied
    prompts, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], 1), dim=0, return_inverse=True)
    width = prompt_ids.shape[1]
    out = model(input_ids=prompts[:, :width], attention_mask=prompts[:, width:],
                position_ids=position_ids_from_mask(prompts[:, width:]), use_cache=True, logits_to_keep=1)
    decoder = decoder_for(model, out.past_key_values, inverse, prompt_mask, max_new_tokens, compile=compile)
    logits = out.logits[inverse, -1]
    done = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    tokens = torch.full((batch, max_new_tokens), eos_id, dtype=torch.long, device=prompt_ids.device)
    logprobs = torch.zeros((batch, max_new_tokens), device=prompt_ids.device)
    for step in range(max_new_tokens):
        token, logprob = sample_token(logits, temperature, top_k, top_p,
                                      banned=eos_id if step < min_new_tokens else None)
        token = token.masked_fill(done, eos_id)
        tokens[:, step], logprobs[:, step] = token, logprob
        done |= token == eos_id
        if step + 1 == max_new_tokens or ((step + 1) % DONE_CHECK_EVERY == 0 and bool(done.all())):
            break
        logits = decoder(token, step)
    mask = completion_mask(tokens[:, :step + 1], eos_id)
    if bool(done.all()):  # end at the step the last row finished: the latest first EOS (never before min_new_tokens)
        step = int(mask.sum(1).max()) - 1
    completion_ids, logprobs = tokens[:, :step + 1], logprobs[:, :step + 1]
    return completion_ids, mask[:, :step + 1], logprobs


@dataclass
class Rollout:
    """One step's batch on this device, the record its stages fill in turn: sampled (prompts, completions,
    their ids and logprobs), then scored (rewards), then the reference's logprobs, then the advantages.
    The rows of a group are contiguous.

    input_ids = prompt_ids + completion_ids and attention = prompt_mask + completion_mask, side by side:
    the prompts left-padded to a common width, the completions right-padded with EOS after each row's
    first EOS (the mask hides it)."""
    prompts: list            # the prompt of each row
    texts: list              # each completion decoded, for the reward only (never re-tokenised)
    input_ids: torch.Tensor          # [B, prompt width + T]
    attention: torch.Tensor          # [B, prompt width + T]
    completion_mask: torch.Tensor    # [B, T]
    old_logp: torch.Tensor           # [B, T] the sampling logprobs
    truncated: torch.Tensor          # [B] bool: stopped by max_new_tokens before an EOS
    # scored (score), then shaped: DAPO's overlong penalty, the KL penalty with --kl-in reward
    rewards: torch.Tensor = None     # [B] float32 on the host: what the task gave (with --overlong-buffer's penalty)
    train_rewards: torch.Tensor = None   # [B] what the advantages are made of: rewards, less a KL penalty
    components: dict = field(default_factory=dict)   # the reward's parts (the task's reward_breakdown), means
    errors: dict = field(default_factory=dict)       # failed rewards by kind
    ref_logp: torch.Tensor = None    # [B, T] the frozen reference's, when the run has a KL penalty
    advantages: torch.Tensor = None  # [B] on the device

    @property
    def completion_len(self) -> int:
        return self.completion_mask.shape[1]

    def score(self, scorer) -> "Rollout":
        """Fill rewards, components and errors with scorer(prompts, completions) (harness/task.py Scorer)."""
        rewards, self.components, self.errors = scorer(self.prompts, self.texts)
        self.rewards = torch.from_numpy(rewards)
        return self


def truncated_rows(completion_ids: torch.Tensor, completion_mask: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B] bool: the completions that end without an EOS, i.e. were stopped by max_new_tokens.

    completion_mask runs up to and including a row's first EOS (grpo/rollout.py), so a row is
    truncated exactly when its last masked token is not EOS.
    """
    lengths = completion_mask.sum(1)
    last = completion_ids.gather(1, (lengths - 1).clamp_min(0)[:, None]).squeeze(1)
    return (lengths > 0) & (last != eos_id)


def _pad_sides(t: torch.Tensor, width: int, P: int, T: int, value: int) -> torch.Tensor:
    """t [B, width + completion]: its first width columns left-padded to P, the rest right-padded to T."""
    pad = torch.nn.functional.pad
    return torch.cat([pad(t[:, :width], (P - width, 0), value=value),
                      pad(t[:, width:], (0, T - (t.shape[1] - width)), value=value)], 1)


def select_rows(rollouts: list, rows: torch.Tensor, pad_id: int) -> Rollout:
    """Rows of several rollouts (indices into their rows in order) as one Rollout: prompts re-padded on the
    left and completions on the right to the widest of them; the padding is masked and positions come
    from the mask, so every row's logprobs are unchanged."""
    widths = [r.input_ids.shape[1] - r.completion_len for r in rollouts]
    P, T = max(widths), max(r.completion_len for r in rollouts)
    pad = torch.nn.functional.pad
    pick = rows.tolist()
    prompts = [p for r in rollouts for p in r.prompts]
    texts = [t for r in rollouts for t in r.texts]
    return Rollout(prompts=[prompts[i] for i in pick], texts=[texts[i] for i in pick],
                   input_ids=torch.cat([_pad_sides(r.input_ids, w, P, T, pad_id) for r, w in zip(rollouts, widths)])[rows],
                   attention=torch.cat([_pad_sides(r.attention, w, P, T, 0) for r, w in zip(rollouts, widths)])[rows],
                   completion_mask=torch.cat([pad(r.completion_mask, (0, T - r.completion_len)) for r in rollouts])[rows],
                   old_logp=torch.cat([pad(r.old_logp, (0, T - r.completion_len)) for r in rollouts])[rows],
                   truncated=torch.cat([r.truncated for r in rollouts])[rows],
                   rewards=None if rollouts[0].rewards is None else torch.cat([r.rewards for r in rollouts])[rows])


def merge(rounds: list, group_size: int, groups: int, pad_id: int):
    """DAPO's dynamic sampling: the batch of `groups` groups from scored generation rounds (algorithm.merge_rounds
    chooses them, informative ones first), with the rounds' reward components averaged and errors summed;
    returns (batch, merge_rounds' counts)."""
    rows, counts = merge_rounds([r.rewards for r in rounds], group_size, groups)
    batch = select_rows(rounds, rows, pad_id)
    batch.components = {k: sum(r.components.get(k, 0.0) for r in rounds) / len(rounds) for k in rounds[0].components}
    batch.errors = dict(sum((Counter(r.errors) for r in rounds), Counter()))
    return batch, counts


def sample_groups(policy, tokenizer, prompts: list, *, group_size: int, prepend_bos: bool, generation_batch: int,
                  seed: int, first_row: int, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                  min_new_tokens: int, autocast, device, compile: bool = False) -> Rollout:
    """group_size completions of each prompt, generation_batch rows at a time.

    Each chunk's sampling is seeded by seed and the chunk's first row in the global batch (first_row plus
    its offset here): the rollouts depend neither on the number of devices (for the same generation batch) nor on
    a resume."""
    eos = tokenizer.eos_token_id
    ids = encode_prompts(tokenizer, prompts, prepend_bos, max_new_tokens, context_length(policy.config))
    prompt_ids, prompt_mask = left_pad(ids, eos, device)
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(group_size, 0), prompt_mask.repeat_interleave(group_size, 0)
    chunks = []
    for s in range(0, prompt_ids.shape[0], generation_batch):
        torch.manual_seed(seed * 1_000_003 + first_row + s)
        chunks.append(generate(policy, prompt_ids[s:s + generation_batch], prompt_mask[s:s + generation_batch],
                               eos_id=eos, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, min_new_tokens=min_new_tokens, autocast=autocast, compile=compile))
    width = max(c[0].shape[1] for c in chunks)
    pad = torch.nn.functional.pad
    completion_ids = torch.cat([pad(c[0], (0, width - c[0].shape[1]), value=eos) for c in chunks])
    completion_mask = torch.cat([pad(c[1], (0, width - c[1].shape[1])) for c in chunks])
    old_logp = torch.cat([pad(c[2], (0, width - c[2].shape[1])) for c in chunks])
    return Rollout(prompts=[p for p in prompts for _ in range(group_size)],
                   texts=decode_completions(tokenizer, completion_ids, completion_mask, eos),
                   input_ids=torch.cat([prompt_ids, completion_ids], 1),
                   attention=torch.cat([prompt_mask, completion_mask], 1),
                   completion_mask=completion_mask, old_logp=old_logp,
                   truncated=truncated_rows(completion_ids, completion_mask, eos))


def decode_completions(tokenizer, completion_ids, mask, eos_id: int) -> list:
    """The text of each completion: its tokens up to, not including, its first EOS."""
    texts = []
    for ids, m in zip(completion_ids.tolist(), mask.sum(1).tolist()):
        ids = ids[:m]
        if ids and ids[-1] == eos_id:
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids, skip_special_tokens=False))
    return texts


def eval_completions(model, tokenizer, prompts: list, n: int = None, temperature: float = None, *, prepend_bos: bool,
                     max_new_tokens: int, batch: int, seed: int = 0, device=None, autocast=None) -> list:
    """Completions for evaluation (a task's evaluate(complete)), not training, `batch` rows at a time.

    Without n: the greedy completion of each prompt (list[str]). With n: n completions of each prompt sampled at
    temperature (default 1.0; no top-k/top-p), as one list of n per prompt. Each batch's sampling is seeded by seed
    and its first row (the same at every evaluation of a run: two evaluations differ only by the weights) inside a
    fork of torch's RNG, so training draws afterwards exactly what it would have drawn without the evaluation."""
    if n is None and temperature is not None:
        raise TaskError(f"complete(prompts, temperature={temperature}) samples only with n, the completions per "
                        f"prompt: complete(prompts, n=8, temperature={temperature})")
    if n is not None and not (isinstance(n, int) and n >= 1 and (temperature is None or temperature > 0)):
        raise TaskError(f"complete(prompts, n={n!r}, temperature={temperature!r}): n must be an int >= 1 and the "
                        f"temperature > 0 (greedy: complete(prompts))")
    sample_at = 0.0 if n is None else 1.0 if temperature is None else temperature
    eos = tokenizer.eos_token_id
    ids = encode_prompts(tokenizer, prompts, prepend_bos, max_new_tokens, context_length(model.config))
    rows = [row for row in ids for _ in range(n or 1)]
    kind = torch.device(device or "cpu").type
    texts = []
    with torch.random.fork_rng(devices=[] if kind == "cpu" else [device], device_type=kind):
        for s in range(0, len(rows), batch):
            torch.manual_seed(seed * 1_000_003 + s)
            row_ids, mask = left_pad(rows[s:s + batch], eos, device)
            out_ids, out_mask, _ = generate(model, row_ids, mask, eos_id=eos, max_new_tokens=max_new_tokens,
                                            temperature=sample_at, autocast=autocast)
            texts += decode_completions(tokenizer, out_ids, out_mask, eos)
    return texts if n is None else [texts[i:i + n] for i in range(0, len(texts), n)]
