"""What keeps a long run alive: out-of-memory retries, non-finite updates, and a clean stop on a signal."""
import contextlib
import functools
import gc
import math
import os
import signal
import threading

import torch

from grpo import distributed
from grpo.model import completion_logprobs, logprob_temperature, trainable_parameters


def is_oom(e: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or an allocator failure on CPU (a plain RuntimeError)."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in str(e) or "can't allocate memory" in str(e)))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def smaller_micro(micro: int, mini: int):
    """The largest divisor of the mini-batch at most micro / 2 (or None below 1): accumulation over
    micro-batches that divide the mini-batch keeps the gradient that of the whole mini-batch."""
    for m in range(micro // 2, 0, -1):
        if mini % m == 0:
            return m
    return None


class Micro:
    """How the update cuts a mini-batch into forwards: `rows` rows at a time, or with a token budget
    (--micro-batch-tokens) as many rows, in order, as hold at most `tokens` real tokens (a run of
    rows sharing a prompt counts it once, as the packed forward runs it once; a row over the budget
    runs alone). Every cut gives the same gradient: each micro-batch's loss is divided by the whole
    mini-batch's denominator. most: the largest micro-batch's rows since Guard.fit's try began."""

    def __init__(self, rows: int, tokens: int = 0):
        self.rows, self.tokens, self.most = rows, tokens, 0

    def __str__(self):
        return f"{self.tokens} tokens" if self.tokens else str(self.rows)

    def split(self, batch, rows=None, shared=None) -> list:
        """batch's rows (None: every row) in micro-batches: index tensors (slices of every row when
        cut by rows). shared: the prompt's columns (default: those before the completion; 0 when
        the rows share nothing)."""
        n = batch.input_ids.shape[0]
        if not self.tokens:
            self.most = max(self.most, min(self.rows, n if rows is None else len(rows)))
            if rows is None:
                return [slice(s, s + self.rows) for s in range(0, n, self.rows)]
            return list(rows.split(self.rows))
        rows = torch.arange(n, device=batch.input_ids.device) if rows is None else rows
        parts, start, used = [], 0, 0
        for i, (head, tail, same) in enumerate(zip(*row_tokens(batch, rows, shared))):
            cost = tail + (0 if same and i > start else head)
            if i > start and used + cost > self.tokens:
                parts.append(rows[start:i])
                start, cost = i, tail + head
            used = cost if i == start else used + cost
        parts.append(rows[start:])
        self.most = max(self.most, *(len(p) for p in parts))
        return parts

    def smaller(self, mini: int):
        """The cut after an out-of-memory (None: none smaller): the rows halved to a divisor of the
        mini-batch, or the token budget halved while a micro-batch still held several rows."""
        if self.tokens:
            return Micro(self.rows, self.tokens // 2) if self.most > 1 else None
        rows = smaller_micro(self.rows, mini)
        return None if rows is None else Micro(rows)


def row_tokens(batch, rows, shared=None):
    """Per row of batch's `rows`: its prompt's real tokens, its completion's, and whether its prompt
    is the row before's (lists)."""
    ids, att = batch.input_ids[rows], batch.attention[rows]
    w = ids.shape[1] - batch.completion_len if shared is None else shared
    same = torch.zeros(len(rows), dtype=torch.bool, device=ids.device)
    if w and len(rows) > 1:
        same[1:] = (ids[1:, :w] == ids[:-1, :w]).all(1) & (att[1:, :w] == att[:-1, :w]).all(1)
    return att[:, :w].sum(1).tolist(), att[:, w:].sum(1).tolist(), same.tolist()


@contextlib.contextmanager
def cpu_threads(n: int):
    """PyTorch's CPU threads set to n (0: left as they are) inside, restored after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n:
            torch.set_num_threads(before)


class Guard:
    """What keeps the update alive, handed to the update (train_lean.py) and grpo/passes.py: the micro-batch size and its out-of-memory retry
    (fit), and the optimizer's step, skipped when not finite, with the count of such updates in a
    row (step). notes: this step's retries, said as they happen and counted in the step's record."""

    def __init__(self, micro: int, mini: int, info, nonfinite_streak: int = 0, threads: int = 0,
                 tokens: int = 0):
        self.cut, self.mini, self.info = Micro(micro, tokens), mini, info
        self.nonfinite_streak, self.notes = nonfinite_streak, []
        self.threads = threads   # --update-threads: the CPU threads fit's passes run on (0: all)

    def fit(self, run):
        """run(cut), a Micro, made smaller (cut.smaller) until it fits in memory; self.cut keeps
        the one that fitted. `run` must start from a clean slate (zeroed gradients) each call. All ranks agree on
        each retry, so no rank waits in a collective for one that ran out of memory.

        On --update-threads (1 by default) CPU threads: on several, PyTorch's backward gave gradients that differed
        in the last bits from one process to the next (same seed, same inputs), so same-seed runs drifted apart and a
        resumed run did not end where the straight one did; on one thread they are the same bits every time."""
        while True:
            try:
                self.cut.most = 0
                with cpu_threads(self.threads):
                    result, oom = run(self.cut), False
            except Exception as e:  # noqa: BLE001 - anything but an out-of-memory is re-raised
                if not is_oom(e):
                    raise
                result, oom = None, True
            if not distributed.any_rank(oom):  # every rank
                return result
            # the exception (and its frames' tensors) is released by now
            result = None
            free_memory()
            smaller = self.cut.smaller(self.mini)
            if smaller is None:
                raise torch.OutOfMemoryError("out of memory with a micro-batch of 1: lower --max-new-tokens, "
                                             "use --dtype bf16 or a smaller model")
            self.notes.append(f"out of memory at micro-batch {self.cut}: freed memory, retrying "
                              f"with {smaller}")
            self.info(self.notes[-1])
            self.cut = smaller

    def step(self, optimizer, loss: float, grad_norm: float) -> bool:
        """Step the optimizer unless its summed loss or gradient norm is not finite (the update is
        then skipped: weights and optimizer state untouched). From finite gradients at a
        --learning-rate below 1, an AdamW or Muon step cannot make a weight non-finite, so nothing
        is copied or checked after it (docs/failures.md). Returns whether it stepped; counts the
        skipped updates in a row."""
        ok = math.isfinite(loss) and math.isfinite(grad_norm)
        if ok:
            optimizer.step()
        else:   # one bad batch must not poison the weights or the optimizer's moments
            optimizer.zero_grad(set_to_none=True)
        self.nonfinite_streak = 0 if ok else self.nonfinite_streak + 1
        return ok


def _fit_test(policy, optimizer, moments: int, longest: int, eos: int, cut: Micro, cfg, autocast):
    """One forward and backward of a micro-batch of rows of the longest sequence, each run whole
    (cut's rows, or as many as its token budget holds), with AdamW's moments' memory held."""
    stand_in = torch.empty(moments, device=next(policy.parameters()).device)
    rows = max(1, cut.tokens // longest) if cut.tokens else cut.rows
    cut.most = rows
    ids = torch.full((rows, longest), eos, device=stand_in.device)
    logp = completion_logprobs(policy, ids, torch.ones_like(ids), cfg.max_new_tokens,
                               logprob_temperature(cfg.temperature), cfg.logprob_chunk_size,
                               autocast, share_prompts=False)
    logp.sum().backward()
    optimizer.zero_grad(set_to_none=True)
    del stand_in


def _moments(policy, optimizer) -> int:
    """AdamW's two moments' elements before they exist (none once the optimizer has state)."""
    return 0 if optimizer.state else sum(2 * p.numel() for p in trainable_parameters(policy))


def probe_micro_batch(guard: Guard, policy, optimizer, longest: int, eos: int, cfg, autocast) -> int:
    """Set guard.cut to the largest micro-batch (a divisor of the per-device mini-batch, or a token
    budget halved) whose forward and backward fit at the longest sequence; AdamW's two moments do
    not exist before the first update, so a stand-in holds their place."""
    moments = _moments(policy, optimizer)
    guard.fit(functools.partial(_fit_test, policy, optimizer, moments, longest, eos,  # every rank
                                cfg=cfg, autocast=autocast))
    guard.notes.clear()
    return guard.cut.rows


def saved_bytes(model, forward) -> int:
    """Bytes autograd saves for backward in forward(), less the model's weights, their bf16 casts
    and the head's vocabulary-wide tensors (a chunk at a time, counted apart)."""
    weights = {p.untyped_storage().data_ptr(): p.numel() for p in model.parameters()}
    vocab, seen = model.config.vocab_size, {}

    def pack(t):
        s = t.untyped_storage()
        cast = t.dtype == torch.bfloat16 and t.numel() in weights.values() and t.dim() == 2
        logits = t.dim() and t.shape[-1] == vocab
        if s.data_ptr() not in weights and not cast and not logits:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def free_bytes(device: torch.device) -> int:
    """What the process may still allocate: CUDA's free memory, or the host's available memory
    (Linux's MemAvailable, within the cgroup's limit when one is set)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                free = min(free, int(limit) - int(g.read()))
    return free


# of the free memory, what a budget may fill: the rest is the allocator's and the runtime's slack
FILL = 0.8


def token_budget(free: int, fixed: int, per_token: float, longest: int, mini: int) -> int:
    """The tokens of per_token bytes in FILL of the free bytes less fixed ones, down to a power of
    two (the same budget from one start to the next as free memory wavers: the cut orders the
    gradient's sums, so decides its last bits); at least one row of the longest sequence, at most
    the mini-batch's rows of it."""
    tokens = max(int((FILL * free - fixed) // per_token), 1)
    return min(max(2 ** (tokens.bit_length() - 1), longest), mini * longest)


def probe_token_budget(guard: Guard, policy, optimizer, longest: int, eos: int, cfg, autocast):
    """Set guard.cut's token budget (--micro-batch-tokens auto) from the memory free now: what
    autograd saves per token (counted on two rows of the longest sequence), the rest held by the
    gradients, AdamW's moments and the head's backward (a chunk); then one forward and backward at
    it, halved until it fits. Returns (budget, bytes saved per token, bytes free)."""
    device = next(policy.parameters()).device
    ids = torch.full((2, longest), eos, device=device)
    per_token = saved_bytes(policy, lambda: completion_logprobs(
        policy, ids, torch.ones_like(ids), cfg.max_new_tokens, logprob_temperature(cfg.temperature),
        cfg.logprob_chunk_size, autocast, share_prompts=False)) / ids.numel()
    grads = sum(p.numel() for p in trainable_parameters(policy) if p.grad is None)
    chunk = min(cfg.logprob_chunk_size, guard.mini * cfg.max_new_tokens)
    head = 5 * chunk * policy.config.vocab_size   # the head's backward: 5 [chunk, V] fp32
    free = free_bytes(device)
    fixed = 4 * (_moments(policy, optimizer) + grads + head)
    guard.cut = Micro(guard.mini, token_budget(free, fixed, per_token, longest, guard.mini))
    probe_micro_batch(guard, policy, optimizer, longest, eos, cfg, autocast)   # every rank
    return guard.cut.tokens, per_token, free


def nonfinite_abort(step: int, streak: int, path: str) -> str:
    """What the run says when it gives up after --max-nonfinite skipped updates in a row."""
    return (f"aborting at step {step}: the last {streak} optimizer updates had a non-finite loss, "
            f"gradient norm or weights and were skipped; checkpoint {path} holds the weights from "
            f"before them. Lower --learning-rate or check the task's rewards, then --resume")


class StoppedBySignal(BaseException):
    """The step under way given up: a second SIGINT/SIGTERM, or the first once the step has had
    --stop-grace seconds to finish (a reward that never returns, a long evaluation, a rank waiting
    for one that will not come). Not an Exception: no `except Exception` in a task or the trainer
    takes it for a failed reward. The run's saver keeps the last finished step (harness/checkpoint.py
    Saver); the run exits `code`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.why, self.code = signum, signal.Signals(signum).name, 128 + signum


class Exiting(SystemExit):
    """The run's own exit on a stop before the steps (harness/run.py _terminated): a task fence
    (harness/task.py fenced) passes it on where it takes a SystemExit for the task's own."""


class RewardTimeout(StoppedBySignal):
    """A step's rewards ran past --reward-timeout: the step is given up as a signal would (exit 1)."""

    def __init__(self, seconds: float):
        BaseException.__init__(self, seconds)
        self.signum, self.why, self.code = None, f"--reward-timeout {seconds:g} s", 1


# how long a step given up may take to end (a stop or a timeout raised into it) before the run
# saves the last finished step and ends the process where it stands
STUCK_S = 5.0


@contextlib.contextmanager
def time_limit(seconds: float, stuck=None):
    """Inside, RewardTimeout once `seconds` have passed (0: never), raised by a SIGALRM handler: a
    call blocked in the main thread (a pipe, a socket, a sleep) returns for it. A task that swallows
    it cannot disarm it: it is raised again every second, the block raises it once it returns, and
    STUCK_S after the first, stuck(why, code) is called (it saves and ends the process)."""
    if not seconds:
        yield
        return
    fired = []

    def expired(signum, frame):
        fired.append(1)
        if stuck is not None and len(fired) > STUCK_S:
            stuck(RewardTimeout(seconds).why, 1, "the task's code swallowed the timeout")
        raise RewardTimeout(seconds)
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if fired:   # a reward returned a score for a call the timeout cut short
        raise RewardTimeout(seconds)


def stop_signals() -> list:
    """The signals that stop a run: SIGINT, SIGTERM and SIGHUP (a closed terminal or SSH session),
    less those ignored when it starts: a run under nohup (SIGHUP) or in a script's background
    (SIGINT) is meant to outlive them."""
    return [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
            if signal.getsignal(s) is not signal.SIG_IGN]


class StopOnSignal:
    """A stop signal (stop_signals) sets `requested`; the loop finishes its step, saves and exits 0.
    The step has `grace` seconds: then, or at a second signal, it is given up (StoppedBySignal), the
    last finished step is saved and the run exits 128 + the signal's number; except while a
    checkpoint or the model is written (deferred()): a kill there would leave neither. A launcher
    kills soon after its one SIGTERM (torchrun, Slurm and Kubernetes 30 s later), so waiting longer
    loses the steps trained.

    Python runs a handler only in the main thread, between bytecodes: a main thread held in native code
    (a collective whose peer is stopped or gone silent) runs none. So the signal is also read from
    the wakeup fd by a thread, which starts the grace's timer; the give-up is the signal again, sent
    to the main thread; if the step has not unwound STUCK_S later (no handler ran, or the task's
    code swallowed the exception), the timer calls `stuck(why, code, where)`, which saves what it
    safely can and ends the process. Restores the previous handlers on exit."""

    STUCK_S = STUCK_S

    def __init__(self, info, grace: float, stuck):
        self.requested, self.info, self.previous, self.writing = False, info, {}, False
        self.grace, self.stuck, self.armed, self.lock = grace, stuck, False, threading.Lock()
        self.raised = False
        self.step_over, self.unwinding = threading.Event(), threading.Event()

    @contextlib.contextmanager
    def deferred(self):
        """Inside, every signal only asks the run to stop: the write finishes first."""
        self.writing = True
        try:
            yield
        finally:
            self.writing = False

    def _handle(self, signum, frame):
        self.signum = signum
        if self.requested and not self.writing:
            self.raised = True   # unwinding is set once it reaches the loop (__exit__), not here
            raise StoppedBySignal(signum)
        self._arm(signum)
        self.requested = True
        self.info(f"{signal.Signals(signum).name}: " + (
            "the save under way finishes first" if self.writing else
            f"finishing this step (given up after {self.grace:g} s), then saving a checkpoint (send it "
            "again to give the step up now and save the last finished one)"))

    def _arm(self, signum) -> None:
        with self.lock:
            if self.armed:
                return
            self.armed = True
        threading.Thread(target=self._give_up_later, args=(signum, self.step_over),
                         daemon=True).start()

    def _read_wakeups(self, fd: int) -> None:
        while data := os.read(fd, 64):   # the write end closed on exit: b""
            for signum in data:
                if signum in self.previous:
                    self._arm(signum)
        os.close(fd)

    def _give_up_later(self, signum, step_over) -> None:
        step_over.wait(self.grace)
        while not step_over.is_set():
            if not self.writing:   # a write is never cut short: the run stops after it
                signal.pthread_kill(threading.main_thread().ident, signum)   # a blocked call: EINTR
                if self.unwinding.wait(self.STUCK_S):
                    return
                if not self.writing:
                    self.stuck(signal.Signals(signum).name, 128 + signum,
                               "the task's code swallowed the stop" if self.raised
                               else "held in a collective")
                    return
            step_over.wait(0.1)

    def step_ended(self) -> None:
        """The step returned: a stop asked during it needs no give-up."""
        self.step_over.set()
        self.step_over = threading.Event()

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in stop_signals()}
        read, self.wakeup = os.pipe()
        os.set_blocking(self.wakeup, False)
        self.previous_wakeup = signal.set_wakeup_fd(self.wakeup, warn_on_full_buffer=False)
        threading.Thread(target=self._read_wakeups, args=(read,), daemon=True).start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.unwinding.set()
        self.step_over.set()
        signal.set_wakeup_fd(self.previous_wakeup)
        os.close(self.wakeup)
        for s, h in self.previous.items():
            signal.signal(s, h)
        if self.requested and distributed.failed_collective(exc):
            raise StoppedBySignal(self.signum) from exc   # a collective failed: a peer gave up first
