"""The run around the algorithm: what train_lean.py calls by name so that its loop stays the algorithm.

    run = Run(argv, TABLES, builtin=tasks.BUILTIN, default_task=tasks.DEFAULT)
        every setting checked (a bad one exits 2 with one line; TABLES: the variant flags' choices,
        train_lean.py's), OUT_DIR locked, the devices joined, settings.txt written, the RNGs seeded
    with run:                                   every way out closes what the run opened; a failure after a
                                                completed step saves that step (harness/checkpoint.py Saver)
        task = run.open_task()                  the task, its answers checked (and --ptx-coef's)
        policy, reference, tokenizer = run.load_models()    and the start-up header
        guard = run.start_training(optimizer, kl)   --resume's state (the optimizer's, the KL controller's),
                                                the micro-batch, logs, checkpoints, step 0's eval;
                                                run.context, what the step reads of the run
        for step in run.steps():                the progress bar; after a step a checkpoint when due or asked
                                                for (a signal), after the last the trained model
            run.phase_done("gen")               a phase's time and memory
            rows = run.check_rewards(step, batch, rec)   failed rewards said (all failed: the run stops)
            run.end_step(rec, rows)             the record, the console line, the evaluation when due

The algorithm modules (grpo/) never import this package, nor read its objects: it imports them, and
hands them a Context.
"""
import contextlib
import functools
import inspect
import os
import random
import signal
import sys
import threading
import time

from tqdm import tqdm

from grpo import decoders, distributed, graphs, packing, ptx, variants
from grpo.model import (ModelLoadError, checkpoint_layers, context_length, declared_end_ids,
                        end_ids, frozen_copy, load_config, load_policy, load_tokenizer,
                        load_trainable, model_autocast)
from grpo.rollout import Sampler, encode_prompts, stream_seed, wants_bos
from grpo.settings import Context
from harness import checkpoint, cli, config, guards, log, memory, paths, progress, rundir, screen
from harness import task as task_lib


def usage_error(message: str, every_rank: bool = False):
    """One line, exit 2. Under torchrun every rank fails alike and rank 0 says so; every_rank:
    before the ranks meet, a rank's own mistake (a GRPO_ variable set on it alone) is said by that
    rank too, named."""
    rank = os.environ.get("RANK", "0")
    if every_rank and rank != "0":
        print(f"train_lean.py: rank {rank}: error: {message}", file=sys.stderr, flush=True)
    log.warn(f"error: {message}")
    sys.exit(2)


class Run:
    def __init__(self, argv, tables: dict, builtin: dict = None, default_task: str = None):
        """argv: the command line (None: sys.argv); tables: each variant flag's choices
        (train_lean.py TABLES: flag -> grpo/variants.py Table); builtin and default_task: the task
        registry (tasks/)."""
        try:
            self.loaded = cli.load(argv, builtin=builtin, default_task=default_task, tables=tables)
            cfg = self.cfg = self.loaded.cfg
            self.layout = config.batch_layout(cfg, world=config.launched_world())
            config.check_variants(cfg, tables)
            self.tables = tables
            outs = paths.check(cfg, self.loaded.options)   # none on what it reads or another writes
            rundir.check_paths(cfg)
            paths.check_made(cfg, outs)   # nothing in the way of what it makes steps later
            if not cfg.resume:   # a resumed run reads --model only for a KL reference or LoRA base
                rundir.check_model(cfg.model)
            rundir.check_paths(self.loaded.options)
            rundir.absolute(cfg)   # before the task is built: its code may change the working folder
            rundir.absolute(self.loaded.options)
            self.evaluating = hasattr(self.loaded.task, "evaluate") and (
                cfg.eval_only or cfg.eval_interval > 0)
            # OUT_DIR and every path the run writes locked, no other run's records
            lock, self.resume_from, self.doomed = rundir.prepare(cfg, self.loaded.options, outs,
                                                                 self.evaluating)
        except (config.ConfigError, checkpoint.CheckpointError, task_lib.TaskError) as e:
            usage_error(str(e), every_rank=True)
        self.rank, self.world, self.device = distributed.init(cfg.device)  # every rank
        # the same settings on all ranks, or none starts (a GRPO_ variable set on one rank only)
        ranks = distributed.gather_objects(  # every rank
            (config.settings(cfg, self.loaded.options), self.loaded.sources))
        differ = rundir.ranks_differ(ranks)
        if differ:
            usage_error(differ)
        self.main = distributed.is_main()   # only rank 0 prints, logs, saves and evaluates
        self.info = functools.partial(log.info, self.main and cfg.log_level != "warning")
        self.table = screen.describe(cfg, self.loaded.options, self.loaded.sources, self.layout)
        if not self.doomed:   # else once the earlier run's are set aside (_set_aside_doomed)
            screen.keep_settings(cfg, self.table, self.main)
        self.autocast = model_autocast(self.device, cfg.dtype)   # bf16 matmuls over fp32 weights and AdamW state
        checkpoint.seed_all(cfg.seed)
        self.start_step = checkpoint.step_of(self.resume_from) if self.resume_from else 0
        # resumed at its last step: what a failure or a kill after its checkpoint left out
        self.owed = rundir.owed(cfg, self.resume_from, self.evaluating) \
            if self.start_step == cfg.steps and not cfg.eval_only else []
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(lock)          # the lock on OUT_DIR, released last
        self.lock = lock.file   # open while the run lives (rank 0): where OUT_DIR is now (rundir.where_now)
        # a stop unwinds and says so (by default SIGTERM and SIGHUP end the process where it stands,
        # unsaid, and SIGINT is a traceback)
        for signum in guards.stop_signals():
            self.stack.callback(signal.signal, signum, signal.signal(signum, self._terminated))
        self.stack.push(distributed.close)   # every rank, on the way out (told of an exception)
        self.exit_code, self.cut_said, self.no_tokens_said, self.overwritten = 0, False, False, None
        self.skips_said = False
        self.progress, self.started = None, time.perf_counter()   # the console's (start_training)
        self.task_changed = None   # "old -> new" fingerprints of an edited task's file (_task_code)
        self.ending = None   # _terminated's timer

    def __enter__(self):
        return self

    def _terminated(self, signum, frame):
        """A stop outside the steps (the task's build, the model's load, the step-0 evaluation;
        during them guards.StopOnSignal finishes the step and saves it): an exit that runs every
        way out's clean-up, said (exit status 128 + the signal's number, as by default)."""
        name = signal.Signals(signum).name
        if self.progress is None or self.progress.first is None:
            log.warn(f"stopped ({name}) before the first step: nothing was trained, nothing to save")
        else:
            log.warn(f"stopped ({name}): the run's checkpoints keep what it trained (--resume)")
        if self.ending is None:   # a task that swallows the exit (a bare except) holds it no more
            swallowed = (name, 128 + signum, "the task's code swallowed the stop")
            self.ending = threading.Timer(self.cfg.stop_grace + guards.STUCK_S, self._stuck,
                                          swallowed)
            self.ending.daemon = True
            self.ending.start()
        raise guards.Exiting(128 + signum)

    def __exit__(self, *exc):
        stop = getattr(self, "stop", None)
        if stop is not None:
            stop.unwinding.set()   # the step given up has reached the run: no need to end it
        if stop is not None and stop.requested and distributed.failed_collective(exc[1]):
            # a peer asked to stop too left the collective first: this rank stops, not fails
            exc = (guards.StoppedBySignal, guards.StoppedBySignal(stop.signum), exc[2])
        try:
            self.stack.__exit__(*exc)
        finally:
            if self.ending is not None:   # the exit got out: nothing to end
                self.ending.cancel()
        if exc[0] is None and self.exit_code:
            sys.exit(self.exit_code)
        if exc[0] is not None and issubclass(exc[0], guards.StoppedBySignal):   # said by the saver
            sys.exit(exc[1].code)
        if exc[0] is not None and issubclass(exc[0], task_lib.WeightError):   # a flag's typo
            usage_error(str(exc[1]))
        return False

    def _stuck(self, why: str, code: int, where: str) -> None:
        """From guards.StopOnSignal's timer or the reward timeout's: the step was given up, but it
        does not end (where: the main thread stays in native code, a collective whose peer is
        stopped or silent, or the task's code swallowed the exception). Rank 0 saves the last
        finished step as the saver would (the weights stay still: in a reward or that collective,
        nothing updates them); every rank then ends at once, said."""
        try:   # a save that fails still ends the process (this thread is its last way out)
            if self.main and hasattr(self, "saver"):   # else before the first step: nothing to save
                log.warn(self.saver.stopped(why) + f" ({where})")
            else:
                log.warn_here(f"stopped ({why}) while {where}")
        finally:
            os._exit(code)

    def open_task(self):
        """The task, its prompts checked where they enter (run.mix_source: --ptx-coef's texts, or
        None). The first step's prompts are drawn now, to be checked with the tokenizer and the
        model's config before the weights load."""
        cfg = self.cfg
        try:
            here = os.getcwd()
            built = task_lib.build(self.loaded.task, self.loaded.options, cfg.task)
            if os.getcwd() != here:   # the run's paths were made absolute before: nothing moves
                self.info(f"the task changed the working folder to {os.getcwd()}; the run's paths "
                          f"are those given at start-up ({cfg.out_dir})")
            # --system-prompt given to its conversations
            task = task_lib.CheckedTask(built, cfg.system_prompt, cfg.task)
            self.stack.callback(task_lib.close, task)
            # --eval-only learns nothing: a task's declared --ptx-coef needs no texts there
            mix_source = task_lib.mix_source(task, cfg.ptx_file) if cfg.ptx_coef and not cfg.eval_only else None
            if cfg.reward_weights and not callable(getattr(task, "reward_breakdown", None)):
                raise task_lib.TaskError(f"--reward-weights {cfg.reward_weights} weighs the parts of the task's "
                                         f"reward_breakdown, and {cfg.task} has none")
            declared = getattr(task, "reward_parts", None)
            unknown = [k for k in config.reward_weights(cfg) if declared is not None and k not in (*declared, "reward")]
            if unknown:
                raise task_lib.TaskError(f"--reward-weights names {', '.join(unknown)}: {cfg.task}'s reward has no "
                                         f"such part (its reward_parts: {', '.join(declared)})")
            self.first_prompts = [] if cfg.eval_only else task.prompts(
                self.layout.prompts_per_step, random.Random(stream_seed(cfg.seed, self.start_step + 1)))
        except task_lib.TaskError as e:
            usage_error(str(e))
        self.task, self.mix_source = task, mix_source
        return task

    def load_models(self):
        """(the policy, the KL reference or None, the tokenizer), once the first step's prompts and --ptx-coef texts
        are measured against the model's context (a bad one exits 2). The reference is a frozen copy of the starting
        policy on the same device, only when used (with LoRA the policy with its adapters off); a resumed run
        anchors its KL to the starting model too (unless --ref-sync-steps moved it: start_training loads it)."""
        cfg, device, source = self.cfg, self.device, self.resume_from or self.cfg.model
        try:
            self.tokenizer = load_tokenizer(source)   # checked against the model's vocab_size
            self.prepend_bos = wants_bos(cfg.prompt_bos, self.tokenizer)
            self.context_length = context_length(load_config(source))
            try:
                self.first_ids = encode_prompts(self.tokenizer, self.first_prompts, self.prepend_bos,
                                                cfg.max_new_tokens, self.context_length)
                if self.mix_source is not None and not cfg.eval_only:   # the first step's --ptx-coef texts too
                    ptx.step_batches(self.mix_source, stream_seed(cfg.seed, self.start_step + 1),
                                     self.layout.updates_per_step, cfg.ptx_batch_size, self.tokenizer,
                                     self.prepend_bos, self.context_length)
            except ValueError as e:   # a prompt too long for the model or of no tokens; a text whose context fills it
                raise task_lib.TaskError(str(e)) from None
            self.policy, self.lora = load_trainable(cfg, device, self.resume_from)
            self.reference = None if cfg.kl_coef == 0 or cfg.eval_only else (
                self.lora or frozen_copy(load_policy(cfg.model, device) if self.resume_from else self.policy))
        except (task_lib.TaskError, ModelLoadError) as e:
            usage_error(str(e))
        if not cfg.eval_only:
            self.start_model = self._start_model()
        self.info(screen.header(self.loaded, self.layout, device, self.policy, self.resume_from, self.lora))
        undeclared = [i for i in end_ids(self.policy, self.tokenizer)
                      if i not in declared_end_ids(self.policy, self.tokenizer)]
        if undeclared:   # said: a completion then ends where the model's own generate() would not
            log.warn(f"the chat template ends a turn with {self.tokenizer.convert_ids_to_tokens(undeclared[0])} "
                     f"(id {undeclared[0]}), which neither the tokenizer's EOS nor the model's "
                     f"generation_config.json eos_token_id declares: completions end there too")
        # whether the reference's forwards take packed rows: probed now (the policy's, which LoRA's
        if self.reference is not None and self.lora is None:   # reference is, for the header)
            packing.packs(self.reference)
        if cfg.gradient_checkpointing:  # layers recompute their activations in backward (grpo/model.py)
            checkpoint_layers(self.policy)
        # the task's held-out evaluate(complete): greedy decoding, or seeded samples; rank 0 alone evaluates
        self.complete = functools.partial(
            task_lib.eval_completions, self.policy, self.tokenizer, prepend_bos=self.prepend_bos, device=device,
            max_new_tokens=cfg.max_new_tokens, batch=self.layout.generation_batch, autocast=self.autocast, seed=cfg.seed)
        if cfg.system_prompt is not None:   # the held-out conversations get it as training's do
            self.complete = functools.partial(task_lib.complete_with_system, self.complete,
                                              cfg.system_prompt, cfg.task)
        return self.policy, self.reference, self.tokenizer

    def _start_model(self):
        """The fingerprint of what --model holds, kept with the run's checkpoints. A resumed run loads --model again
        for the KL reference and the LoRA base: other weights there than the run started from are refused (exit 2)
        unless --resume-allow-change model; where it loads nothing of --model (no KL, no LoRA), the saved one goes on."""
        cfg = self.cfg
        if not self.resume_from:
            return checkpoint.fingerprint(self.policy)   # before any update
        saved = checkpoint.saved_start_model(self.resume_from)
        loaded = self.policy if self.lora is not None else self.reference   # what was read from --model now
        if loaded is None:
            return saved
        now = checkpoint.fingerprint(loaded)
        if now != saved and "model" not in rundir.allowed_changes(cfg.resume_allow_change):
            usage_error(f"--resume: --model {cfg.model} holds other weights than the run started from (fingerprint "
                        f"{saved or '(not recorded)'}, now {now}); the run's "
                        f"{'LoRA base and ' if self.lora is not None else ''}KL reference would change under it: "
                        f"restore it, or pass --resume-allow-change model to go on from these weights on purpose")
        if now != saved:
            log.warn(f"--model {cfg.model} holds other weights than the run started from (fingerprint "
                     f"{saved or '(not recorded)'}, now {now}): going on from them (--resume-allow-change model)")
        return now

    def _task_code(self):
        """The fingerprint of the task's source file, kept with the checkpoints. On --resume an edited
        file is said in one line and marked in the first record after it (task_changed: old -> new):
        not refused, since resuming after a fix to a reward is what one does; the records after it
        come from the new code, and say so."""
        now = task_lib.code_fingerprint(self.task)
        saved = checkpoint.saved_task_code(self.resume_from) if self.resume_from else None
        if saved and now and saved != now:
            self.task_changed = f"{saved} -> {now}"
            log.warn(f"--resume: the task's code changed since step {self.start_step} was saved "
                     f"({inspect.getsourcefile(type(getattr(self.task, 'task', self.task)))}: "
                     f"fingerprint {self.task_changed}); the records from step {self.start_step + 1} "
                     f"come from the new code (task_changed in that step's record)")
        return now

    def evaluate_only(self) -> None:
        """--eval-only: the task's evaluation of --model; a log file only when asked for (an earlier run's metrics
        are not overwritten)."""
        if self.main:
            log_file = self.cfg.log_file
            self._set_aside_doomed()
            self._first_evaluation(self.stack.enter_context(log.open_jsonl(log_file)) if log_file else None,
                                   items_path=log.items_path(log_file) if log_file else None)
            self._drop_overwritten()

    def _set_aside_doomed(self) -> None:
        """--overwrite, now that every check has passed and the model has loaded: the earlier
        run's records aside until this run's first step is written (rundir.Overwritten)."""
        if self.doomed:   # SIGTERM unwinds (Run._terminated): the records come back
            self.overwritten = rundir.Overwritten(self.doomed)
            self.stack.callback(self.overwritten.restore)   # a no-op once dropped
            self.overwritten.set_aside()
            screen.keep_settings(self.cfg, self.table, self.main)

    def _drop_overwritten(self) -> None:
        if self.overwritten:
            self.overwritten.drop()

    def _first_evaluation(self, metrics_file, reporter=None, items_path=None) -> None:
        """The evaluation before any training (step 0, or --eval-only). A TaskError there (a
        held-out prompt too long for the model, a metric that is no number) loses nothing yet: one
        line, exit 2, as at start-up. Nor does a stop (_terminated)."""
        try:
            record, entry = task_lib.evaluate(self.task, self.complete, self.start_step, metrics_file,
                                              reporter, items_path)
            if self.progress:
                self.progress.evaluated(self.start_step, record["eval_time_s"], full=True)
                self.progress.compare(self.start_step, entry)
        except task_lib.TaskError as e:
            usage_error(f"the task's evaluation at step {self.start_step}: {e}")

    def start_training(self, optimizer, kl) -> guards.Guard:
        """Before the first step: --resume's optimizer, reference and RNG states; the guard of the update (its
        micro-batch probed with --micro-batch-size auto); the logs, reporter and checkpoints; the step-0 evaluation.
        Then self.context: what the step reads of the run (grpo/settings.py Context)."""
        cfg = self.cfg
        self.compiles_before = decoders.compile_counts()   # a step's record counts its own (--compile)
        self.graphs_before = dict(graphs.COUNTS)   # and its decode graphs made and replayed
        self.kl = kl   # --kl-target steers it (grpo/variants.py AdaptiveKL); a checkpoint holds where it was
        streak = self._resume_states(optimizer, kl) if self.resume_from else 0
        self.guard = self._guard(optimizer, streak)  # every rank
        settings = config.settings(cfg, self.loaded.options)
        rundir.branch_off(cfg, self.resume_from)   # a resume from an older checkpoint: the later ones aside, kept
        self._set_aside_doomed()
        self.metrics_file, self.completions_file = log.open_run_logs(
            log.metrics_path(cfg), cfg.log_completions, self.start_step if self.resume_from else None,
            self.stack) if self.main else (None, None)
        try:  # TensorBoard or W&B as well, on rank 0 (--report-to)
            self.reporter = log.open_reporter(cfg.report_to if self.main else "none", cfg.out_dir, settings)
        except log.ReportError as e:
            usage_error(str(e))
        self.stack.callback(self.reporter.close)
        # checkpoints; and on a failure after a completed step, that step's (harness/checkpoint.py)
        self.saver = self.stack.enter_context(checkpoint.Saver(
            cfg.out_dir, self.lora or self.policy, self.tokenizer, optimizer, settings, cfg.keep_checkpoints,
            self.start_step, streak, self.reference if cfg.ref_sync_steps else None, self.start_model,
            self._task_code()))
        # each evaluation's per-item scores, beside the records (written only when the task gives some)
        self.items_path = log.items_path(log.metrics_path(cfg))
        if self.resume_from and self.main:   # like the records: those of steps after the checkpoint are redone
            log.keep_until(self.items_path, self.start_step)
        # the console's "is it learning?" and time left (rank 0)
        self.progress = progress.Progress(cfg, self.start_step, self.evaluating, log.metrics_path(cfg),
                                          self.items_path) if self.main else None
        if self.progress:
            self.info(self.progress.legend())
        if self.evaluating and self.start_step == 0 and self.main:  # where the run starts from
            self._first_evaluation(self.metrics_file, self.reporter, self.items_path)
        self.scorer = task_lib.Scorer(self.task, cfg.reward_errors == "tolerate",
                                      config.reward_weights(cfg), cfg.group_size,
                                      cfg.reward_timeout, self._stuck)
        self.phases = self.stack.enter_context(memory.Phases(self.device, self.rank, cfg, self.info))
        self.context = Context(
            cfg=cfg, layout=self.layout, rank=self.rank, world=self.world, device=self.device,
            autocast=self.autocast, tokenizer=self.tokenizer, prepend_bos=self.prepend_bos,
            context_length=self.context_length, score=self.scorer,
            reward_weights=tuple(self.scorer.weights.values()), mix_source=self.mix_source,
            on=variants.on(cfg, self.tables))
        return self.guard

    def sampler(self, policy) -> Sampler:
        """The policy's completions of prompts with the run's settings (grpo/rollout.py Sampler)."""
        cfg, compiled = self.cfg, self.cfg.compile == "on"
        return Sampler(policy, self.tokenizer, group_size=cfg.group_size, prepend_bos=self.prepend_bos,
                       generation_batch=self.layout.generation_batch, max_new_tokens=cfg.max_new_tokens,
                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                       min_new_tokens=cfg.min_new_tokens, autocast=self.autocast, device=self.device,
                       compile=compiled, graph=decoders.graph_mode(cfg.decode_graph, self.device, compiled))

    def _resume_states(self, optimizer, kl) -> int:
        """--resume: the optimizer's, the adaptive KL's, the moved reference's and this rank's RNG states as
        saved; returns the non-finite streak the checkpoint had."""
        cfg, state = self.cfg, checkpoint.load_state(self.resume_from)
        # the moments and step counts as saved, the hyperparameters (--weight-decay, ...) as set now: a change
        # --resume-allow-change let through is then the one the run trains with
        settings_now = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(state["optimizer"])
        for group, now in zip(optimizer.param_groups, settings_now):
            group.update(now)
        if cfg.kl_target and "kl_coef" in state:   # where --kl-target had steered it; a new --kl-coef starts over
            if state["config"].get("kl_coef") == cfg.kl_coef:
                kl.load_state_dict({"kl_coef": state["kl_coef"]})
            else:
                log.warn(f"--kl-target: the coefficient starts again from --kl-coef {cfg.kl_coef} (it had reached "
                         f"{state['kl_coef']:.4g})")
        if "reference" in state and self.reference is None:   # --kl-coef 0 now (allowed): no KL, no reference
            log.warn(f"{self.resume_from} holds the reference --ref-sync-steps moved; --kl-coef 0 has no KL term, "
                     f"so it is not used")
        elif "reference" in state:  # --ref-sync-steps moved it: the checkpoint holds where it was
            self.reference.load_state_dict(state["reference"])
        # each rank continues its own RNG streams
        checkpoint.set_rng_states(state["rng"][self.rank])   # the same device count (rundir.prepare)
        self.info(f"resumed from {self.resume_from} after step {self.start_step}")
        return state["nonfinite_streak"]

    def _guard(self, optimizer, streak: int) -> guards.Guard:
        """The update's guard, its micro-batch or token budget probed where the layout says auto (every rank)."""
        cfg, layout = self.cfg, self.layout
        guard = guards.Guard(layout.micro_batch, layout.mini_batch_per_device, self.info, streak,
                             cfg.update_threads if self.device.type == "cpu" else 0, tokens=layout.micro_tokens)
        longest = max(map(len, self.first_ids)) + cfg.max_new_tokens
        probe = (guard, self.policy, optimizer, longest, self.tokenizer.eos_token_id, cfg, self.autocast)
        if layout.micro_batch_auto:
            micro = guards.probe_micro_batch(*probe)  # every rank
            self.info(f"micro-batch auto: {micro} per device ({micro * self.world} global) fits at {longest} tokens, "
                      f"{layout.mini_batch_per_device // micro} gradient-accumulation steps")
        if layout.micro_tokens_auto:
            tokens, per_token, free = guards.probe_token_budget(*probe)  # every rank
            self.info(f"micro-batch tokens auto: {tokens:,} real tokens per forward/backward on this device "
                      f"({free / 2 ** 30:.1f} GiB free, {per_token / 1024:.0f} KiB saved for backward a token; "
                      f"a row of the longest sequence is {longest} tokens)")
        return guard

    def steps(self):
        """The steps to train, one at a time. After each: a checkpoint when due, when a signal asked the run to stop
        (Ctrl-C or SIGTERM: the step finishes, is saved, and the run exits 0) or when too many updates in a row were
        not finite (saved, exit 1). After the last: its checkpoint (--resume extends the run from
        it, optimizer included, or finishes what a failure left out), then the trained model in
        OUT_DIR/model, both with signals deferred; and a line when most steps learned nothing."""
        cfg = self.cfg
        bar = tqdm(range(self.start_step + 1, cfg.steps + 1), desc="steps", initial=self.start_step, total=cfg.steps,
                   disable=not (self.main and sys.stderr.isatty()), file=sys.stderr)
        self.print_line = tqdm.write if not bar.disable else print
        with guards.StopOnSignal(self.info, cfg.stop_grace, self._stuck) as stop:
            self.stop = stop   # end_step asks for a stop too: OUT_DIR gone from where it was
            for step in bar:
                self.phases.start(step)
                self.guard.notes.clear()
                yield step
                stop.step_ended()
                stopping = distributed.any_rank(stop.requested)  # every rank
                aborting = self.guard.nonfinite_streak >= cfg.max_nonfinite
                due = step == cfg.steps or (cfg.save_interval and step % cfg.save_interval == 0)
                if stopping or aborting or due:
                    with stop.deferred():
                        rngs = distributed.gather_objects(checkpoint.rng_states())  # every rank
                        path = self.saver.save(rngs)
                    self.info(f"saved {path}")
                if aborting:
                    log.warn(guards.nonfinite_abort(step, self.guard.nonfinite_streak, path))
                    self.exit_code = 1
                    return
                if stopping and step < cfg.steps:   # after the last, the model is written still
                    self.info(f"stopped after step {step}: continue with --resume")
                    return
            if self.owed:
                self.info(f"step {cfg.steps} is the last: writing what the run left out "
                          f"({', '.join(self.owed)})")
            if "eval" in self.owed and self.main:
                self._evaluate(cfg.steps)
            if cfg.save_final and self.main:  # the run reached its last step: keep what it made
                with stop.deferred():
                    folder = checkpoint.save_model(os.path.join(cfg.out_dir, "model"), self.lora
                                                   or self.policy, self.tokenizer, cfg.steps)
                self.info(f"saved the trained model to {folder} (from_pretrained loads it)")
        summary = self.scorer.flat_summary()   # the same on every rank: each has the gathered frac_zero_std
        if summary:
            log.warn(summary)

    def phase_done(self, name: str) -> None:
        """The step's phase `name` ended: its time and the memory at its end (harness/memory.py)."""
        self.phases.end(name)

    def check_rewards(self, step: int, batch, rec: dict) -> dict:
        """Every rank's rows of the step gathered once (every rank), returned for end_step's record; the first
        failure of each kind of reward is shown, a step in which every reward failed stops the run
        (--reward-errors), and the first step whose groups were all flat is named (harness/task.py Scorer)."""
        parts = distributed.gather_objects(  # every rank
            log.device_part(batch, self.scorer, self.cfg.log_completions))
        rows = log.whole_step(parts)
        self.scorer.after_step(step, rows, rec["frac_zero_std"])
        return rows

    def end_step(self, rec: dict, rows: dict) -> None:
        """The step's update has returned: it is what a failure from here on saves; its record (rows: the step's,
        from check_rewards), console line and, when due, the held-out evaluation."""
        cfg, step = self.cfg, rec["step"]
        self.saver.completed(step, self.guard.nonfinite_streak,   # every rank
                             self.kl.coef if cfg.kl_target else None)
        self.phases.end("train")
        rec.update(log.batch_stats(rows, cfg.group_size))
        if self.task_changed:   # the first record of a resume after the task's file was edited
            rec["task_changed"], self.task_changed = self.task_changed, None
        if self.guard.notes:
            cut = self.guard.cut   # what the update ended with
            rec.update(oom_retries=len(self.guard.notes),
                       **({"micro_batch_tokens": cut.tokens} if cut.tokens else {"micro_batch": cut.rows}))
        rec.update(log.throughput(self.phases.times(), rows), **self.phases.record())
        if cfg.compile == "on":   # a compilation is seconds to minutes of the step's generation time
            now, before = decoders.compile_counts(), self.compiles_before
            rec["decode_compiles"], self.compiles_before = now["decode_compiles"] - before["decode_compiles"], now
            skips = now["decode_graph_skips"] - before["decode_graph_skips"]
            if self.device.type == "cuda":   # a CPU runs no CUDA graphs: nothing to skip
                rec["decode_graph_skips"] = skips
            if skips and not self.skips_said and self.main:
                self.skips_said = True
                log.warn(f"step {step}: torch.compile ran the decode step without CUDA graphs ({skips} "
                         f"skip(s); TORCH_LOGS=cudagraphs says why): each token launches its kernels one by "
                         f"one, the cost --compile is there to remove (said once; decode_graph_skips in each "
                         f"record)")
        if decoders.graph_mode(cfg.decode_graph, self.device, cfg.compile == "on"):
            rec.update({k: v - self.graphs_before[k] for k, v in graphs.COUNTS.items()})
            self.graphs_before = dict(graphs.COUNTS)
        if not self.main:
            return
        if rec.get("ptx_cut") and not self.cut_said:   # learned, but not whole: said once, counted in every record
            self.cut_said = True
            n = self.context_length
            log.warn(f"step {step}: {rec['ptx_cut']} --ptx-coef text(s) longer than the model's {n} "
                     f"positions: each is learned cut to its first {n} tokens, without its end and EOS "
                     f"(said once; ptx_cut in each record counts them)")
        # the loss and its gradient are then 0 in silence: the flat-groups note does not cover it
        all_cut = bool(rows["truncated"].all())
        if cfg.mask_truncated and all_cut and not self.no_tokens_said:
            self.no_tokens_said = True
            log.warn(f"step {step}: the policy loss saw no tokens: every completion reached "
                     f"--max-new-tokens {cfg.max_new_tokens} without ending, and --mask-truncated "
                     f"leaves such completions out of the loss, so the step learned nothing from "
                     f"its rewards (said once; truncated_frac 1.0 in a record says it again). "
                     f"Raise --max-new-tokens, or leave --mask-truncated out")
        if cfg.log_completions:
            log.write_completions(self.completions_file, step, rows)
        self._watch_out_dir(step)
        log.write(self.metrics_file, rec)
        self._drop_overwritten()   # its first step on record: --overwrite's earlier run goes
        self.reporter.log(rec, step)
        pace = self.progress.pace(step)
        if cfg.log_level != "warning":
            self.print_line(log.step_line(rec, cfg.steps, self.progress.eta(step, pace),
                                          self.progress.reward(rec)))
        job = self.progress.job(step, pace)
        if job:
            self.info(job)
        if self.evaluating and (step % cfg.eval_interval == 0 or step == cfg.steps):  # the last: "after"
            self._evaluate(step)

    def _watch_out_dir(self, step: int) -> None:
        """OUT_DIR deleted or moved while the run trains (rank 0): the run stops after this step with
        one line, its checkpoint saved where the user finds it (the moved folder, or OUT_DIR made
        again), exit 1. Every rank stops with it (steps: a stop asked for is agreed on)."""
        where = rundir.where_now(self.lock, self.cfg.out_dir)
        if where is None:
            return
        before, self.exit_code = self.cfg.out_dir, 1
        if where:   # moved: the run's records went with it, and so do its checkpoints and model
            self.cfg.out_dir = self.saver.out_dir = where
            log.warn(f"--out-dir {before} moved to {where} while the run trained: stopping after step "
                     f"{step}, its checkpoint saved in {where}; go on with --out-dir {where} --resume")
        else:
            os.makedirs(before, exist_ok=True)
            log.warn(f"--out-dir {before} was deleted while the run trained (its records with it): "
                     f"stopping after step {step}, its checkpoint saved in {before} again; go on "
                     f"with --resume")
        self.stop.requested = True

    def _evaluate(self, step: int) -> None:
        full = step == self.cfg.steps   # whole: before vs after
        record, entry = task_lib.evaluate(self.task, self.complete, step, self.metrics_file,
                                          self.reporter, self.items_path, full=full)
        self.progress.evaluated(step, record["eval_time_s"], full)
        for line in self.progress.compare(step, entry):
            self.print_line(line)
        share = self.progress.share(record["eval_time_s"], time.perf_counter() - self.started)
        if share:
            self.info(share)
