"""The first screen: what is running and where its results go, in a dozen lines (header), and the full settings
table (describe) in the run folder, OUT_DIR/settings.txt, and on the console with --log-level debug.

harness/run.py (Run) keeps the table at start-up, before anything heavy (with --overwrite once the
earlier run's records are set aside), and prints the header once the model is loaded (load_models):
the header names the decoder generation will use, which depends on the model's modules.
"""
import os
import textwrap

import torch

from grpo import decoders, packing, variants
from grpo import model as model_lib
from harness import checkpoint, config, log, rundir


def derived(cfg, layout) -> dict:
    """What an unset (None) setting comes to in this run, by field name: a size of the batch layout (config.Layout),
    the other clip range, the default metrics file. An unset setting not named here is off."""
    return {"mini_batch_size": layout.mini_batch,
            **({} if layout.micro_tokens or layout.micro_tokens_auto else   # else cut by tokens
               {"micro_batch_size": layout.micro_batch}),
            "generation_batch_size": layout.generation_batch, "clip_range_high": cfg.clip_range,
            "log_file": log.metrics_path(cfg)}


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()   # as the command line spells it
    # a value of several lines (a --system-prompt) as Python writes it: one row a setting; an empty
    # or blank one too, else it reads as no value
    quoted = isinstance(value, str) and not (value.isprintable() and value.strip())
    return repr(value) if quoted else str(value)


def _cut(value, width: int = 60) -> str:
    """A free text (--system-prompt) in the header: its start; settings.txt holds it whole."""
    text = _text(value)
    return text if len(text) <= width else f"{text[:width - 3]}... ({len(value)} characters)"


def _shown(value, unset: str) -> str:
    return unset if value is None else _text(value)


def describe(cfg, options, sources: dict, layout) -> str:
    """The settings table: every setting with its source (the task's options after the trainer's), then the batch
    sizes (layout: config.Layout). An unset trainer setting shows what it comes to in this run ("64 (derived)",
    derived) or "off"; an unset option of the task shows "none" (what it means is the task's to say)."""
    trainer = list(vars(cfg))   # a Config's fields, in order; the rest of sources are the task's options
    computed = {n: f"{v} (derived)" for n, v in derived(cfg, layout).items()}
    rows = [(config.flag(n), _shown(getattr(cfg, n), computed.get(n, "off")), sources[n]) for n in trainer]
    rows += [(config.flag(n), _shown(getattr(options, n), "none"), sources[n]) for n in sources if n not in trainer]
    w = max(len(r[0]) for r in rows)
    # a longer value (a --system-prompt) pushes its own row's source along, not every row's
    v = min(max(len(r[1]) for r in rows), 60)
    lines = ["settings (source: cli > env > task > default)"]
    lines += [f"  {a:<{w}}  {b:<{v}}  {c}" for a, b, c in rows[:len(trainer)]]
    if options is not None:
        lines.append(f"options of --task {cfg.task}")
        lines += [f"  {a:<{w}}  {b:<{v}}  {c}" for a, b, c in rows[len(trainer):]]
    lines.append("batch layout (per device | global)")
    d = layout
    auto = d.micro_batch_auto
    micro = (("auto", "auto") if auto else (d.micro_batch, d.micro_batch * d.devices))
    accum = ("auto", "auto") if auto else (d.grad_accum_steps, d.grad_accum_steps)
    if d.micro_tokens or d.micro_tokens_auto:   # --micro-batch-tokens: the lengths decide the rows
        micro = (f"{d.micro_tokens or 'auto'} tokens", "-")
        accum = ("lengths", "lengths")
    table = [
        ("devices", "", d.devices),
        ("prompts (groups) per step", d.prompts_per_device, d.prompts_per_step),
        ("completions per step", d.completions_per_device, d.completions_per_step),
        ("mini-batch (completions per update)", d.mini_batch_per_device, d.mini_batch),
        ("micro-batch (per forward/backward)", *micro),
        ("gradient-accumulation steps", *accum),
        ("optimizer updates per step", d.updates_per_step, d.updates_per_step),
        ("generation batch", d.generation_batch, d.generation_batch * d.devices),
    ]
    lines += [f"  {name:<37} {str(a):>6} | {b}" for name, a, b in table]
    return "\n".join(lines)


def keep_settings(cfg, table: str, main_rank: bool) -> None:
    """The settings table into OUT_DIR/settings.txt (rank 0; not --eval-only, which writes nothing there), and on
    the console with --log-level debug. A resumed run writes its own: the checkpoint records the earlier ones."""
    if main_rank and not cfg.eval_only:
        with open(os.path.join(cfg.out_dir, rundir.SETTINGS), "w", encoding="utf-8") as f:
            f.write(table + "\n")
    log.info(main_rank and cfg.log_level == "debug", table)


def batch_line(cfg, layout) -> str:
    """The batch layout in one line: prompts x completions per step, the devices, updates, accumulation, and the
    generation batch when it is not the device's whole share."""
    d, each = layout, " per device" if layout.devices > 1 else ""
    line = f"{d.prompts_per_step} prompts x {cfg.group_size} = {d.completions_per_step} completions per step"
    if d.devices > 1:
        line += f" over {d.devices} devices ({d.completions_per_device} each)"
    line += f"; {d.updates_per_step} update{'s' * (d.updates_per_step > 1)} of {d.mini_batch}" + (
        f" ({cfg.ppo_epochs} epochs)" if cfg.ppo_epochs > 1 else "")
    if d.micro_batch_auto:
        line += ", micro-batch auto (probed before training)"
    elif d.micro_tokens or d.micro_tokens_auto:
        line += (", micro-batches by real tokens, the budget from the free memory" if d.micro_tokens_auto
                 else f", micro-batches of at most {d.micro_tokens:,} real tokens{each}")
    else:
        accum = "no accumulation" if d.grad_accum_steps == 1 else f"{d.grad_accum_steps} accumulation steps"
        line += f", micro-batch {d.micro_batch}{each} ({accum})"
    if d.generation_batch < d.completions_per_device:   # by default a device samples its share at once
        line += f"; sampled {d.generation_batch} at a time{each}"
    return line


def _evaluation(cfg, task) -> str:
    if not hasattr(task, "evaluate"):
        return f"none (--task {cfg.task} has no evaluate())"
    if cfg.eval_only:
        return "the task's evaluate() on the model, then exit (--eval-only)"
    if cfg.eval_interval == 0:
        return "off (--eval-interval 0)"
    every = "every step" if cfg.eval_interval == 1 else f"every {cfg.eval_interval} steps"
    return f"the task's evaluate() before training, {every} and after the last"


def _kl(cfg, sources, places) -> str:
    """The KL penalty: its coefficient, estimator and place (places: --kl-in's table; a place may declare the
    estimator it takes by default)."""
    if cfg.kl_coef == 0:
        return "off (--kl-coef 0: no reference model)"
    chosen = f" (--kl-in {cfg.kl_in}'s default; --kl-estimator names another)" if (
        variants.declared(places[cfg.kl_in], "kl_estimator") and sources["kl_estimator"] == "default") else ""
    adaptive = f", steered toward KL {cfg.kl_target:g} (--kl-target)" if cfg.kl_target else ""
    return f"{cfg.kl_coef:g} x {cfg.kl_estimator}{chosen} {places.words()[cfg.kl_in]}{adaptive}"


def header(loaded, layout, device, model, resume_from, lora=None) -> str:
    """What runs (the model and its decoder, with --lora-rank its adapters, the task, device and dtype, the batch,
    the settings given) and where its results go (out dir, metrics, checkpoints, the trained model, the settings
    file). loaded: cli.Loaded; lora: the PeftModel around the model, or None."""
    cfg, sources = loaded.cfg, loaded.sources
    values = config.settings(cfg, loaded.options)
    decoder = decoders.decoder_name(model)
    if cfg.compile == "on":
        fast = decoders.decoder_class(model) is not decoders.HFDecoder
        decoder += ", compiled (--compile on)" if fast else "; --compile has no effect on it"
    elif decoders.decoder_class(model) is not decoders.HFDecoder:
        decoder += {"capture": ", each step a replayed CUDA graph", None: "",
                    "check": ", each step checked as a CUDA graph would replay it (--decode-graph check: slow)"
                    }[decoders.graph_mode(cfg.decode_graph, device, False)]
    where = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    # a flag and its value stay on one line when the header wraps (no-break spaces, made plain after wrapping)
    given = [f"{config.flag(n)}\xa0{_cut(values[n]) if n == 'system_prompt' else _text(values[n])}"
             + (f"\xa0({s})" if s in ("env", "task") else "")
             for n, s in sources.items() if s != "default"]
    start = checkpoint.step_of(resume_from) + 1 if resume_from else 1
    first = "evaluation only" if cfg.eval_only else f"GRPO, steps {start}-{cfg.steps}"
    rows = [("model", f"{cfg.model}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.3g}M "
                      f"parameters" + (f", the weights of {resume_from}" if resume_from else "")),
            ("decoder", decoder),
            *([] if cfg.eval_only else [("update", packing.describe(model))]),
            *([("lora", model_lib.lora_summary(lora, cfg.kl_coef > 0 and not cfg.eval_only))] if lora else []),
            ("task", cfg.task),
            ("device", f"{where}, {cfg.dtype}" + (" autocast over fp32 weights" if cfg.dtype == "bf16" else "") +
             (" (the default on a GPU; --dtype fp32 to change)" if cfg.dtype == "bf16" and sources.get("dtype")
              == "default" else "") +
             (f", {layout.devices} processes" if layout.devices > 1 else "")),
            *([] if cfg.eval_only else [("batch", batch_line(cfg, layout))]),
            *([("ptx", f"{cfg.ptx_coef} x next-token loss on {cfg.ptx_batch_size} texts per update from "
                            f"{cfg.ptx_file or 'the task (demonstrations)'}")] if cfg.ptx_coef and not cfg.eval_only
              else []),
            *([] if cfg.eval_only else [("kl", _kl(cfg, sources, loaded.tables["kl_in"]))]),
            ("evaluation", _evaluation(cfg, loaded.task)),
            ("given", ", ".join(given) or "nothing: every setting at its default")]
    if cfg.eval_only:
        rows.append(("writes", cfg.log_file or "nothing (the results are printed; --log-file keeps them)"))
    else:
        ckpt = os.path.join(cfg.out_dir, checkpoint.SUBDIR)
        rows += [("out dir", cfg.out_dir),
                 ("metrics", log.metrics_path(cfg))]
        rows += [("completions", cfg.log_completions)] if cfg.log_completions else []
        rows += [("reports", os.path.join(cfg.out_dir, cfg.report_to))] if cfg.report_to != "none" else []
        every = "every step" if cfg.save_interval == 1 else f"every {cfg.save_interval} steps"
        rows += [("checkpoints", f"{ckpt} {every} and at the end (the last {cfg.keep_checkpoints} kept)"
                  if cfg.save_interval else f"{ckpt} at the end and when stopped or aborted "
                  f"(--save-interval N: every N steps)"),
                 ("final model", f"{os.path.join(cfg.out_dir, 'model')} at the end" if cfg.save_final
                  else "not saved (--save-final false)"),
                 ("settings", f"{os.path.join(cfg.out_dir, rundir.SETTINGS)} (every setting; --log-level debug "
                              f"shows them)")]
    width = max(len(name) for name, _ in rows)
    return "\n".join([f"train_lean.py: {first}", *(textwrap.fill(text, 120, initial_indent=f"  {name:<{width}}  ",
                                                                 subsequent_indent=" " * (width + 4),
                                                                 break_on_hyphens=False, break_long_words=False)
                                                   for name, text in rows)]).replace("\xa0", " ")
