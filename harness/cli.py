"""The command line and the GRPO_<FLAG> environment: argv and environ into the Config and the task's options.

Every field of the Config (harness/config.py) is a flag --field-name and an override GRPO_FIELD_NAME, and so is
every field of the chosen task's options dataclass (harness/task.py), for that task only. A task may also declare
trainer settings it needs (its trainer_settings, harness/task.py). Precedence: command line > environment > the
task's declared value > default. A value is checked against its field's type and choices here (a declared one, and
its range, as soon as the task is found), its range and the batch arithmetic in config.batch_layout. A bad one
raises config.ConfigError: one line that names it. A variant flag's choices are its table's
(tables: flag -> grpo/variants.py Table, train_lean.py TABLES), read when the command line is.
"""
import argparse
import collections.abc
import copy
import dataclasses
import difflib
import math
import os
import sys
import types
import typing

import torch

from grpo import variants
from harness import task as tasks
from harness.config import FIELDS, OLD_NAMES, Config, ConfigError, env_name, fields_of, flag, range_error

BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


class Loaded(typing.NamedTuple):
    cfg: Config
    options: typing.Any       # an instance of the task's options dataclass, or None
    sources: dict             # field name -> "cli" | "env" | "task" | "default", the task's options included
    task: typing.Any          # the class or object --task names, imported, not yet built
    tables: dict              # each variant flag's choices (flag -> grpo/variants.py Table)


def variant_fields(tables: dict) -> dict:
    """FIELDS, each variant flag's with its table's choices (name -> what it does, the default
    first) as the command line takes and lists them."""
    fields = dict(FIELDS)
    for name, table in tables.items():
        f = fields[name] = copy.copy(FIELDS[name])
        f.metadata = types.MappingProxyType({**f.metadata, "choices": table.words()})
    return fields


def _base_type(f):
    args = typing.get_args(f.type)
    if args and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return f.type, False


def _convert(f, text: str, where: str):
    try:   # a byte that is not UTF-8 reaches Python as a surrogate, which no record (settings.txt, JSON) can hold
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{where} {ascii(os.fsencode(text))[2:-1]} has a byte that is not UTF-8: the run records "
                          f"its settings as UTF-8 text; rename it or pass another") from None
    base, optional = _base_type(f)
    if f.metadata.get("text"):   # prose, "" included: "none" is what the user wants said, not unset
        return text
    if f.metadata.get("auto") and text.lower() == "auto":
        return "auto"
    if optional and text.lower() in ("", "none", "auto"):
        return None
    if base is bool:   # bool("false") is True: spell the values out
        if text.lower() not in BOOLS:
            raise ConfigError(f"{where} {text!r} is not a valid bool (true/false, 1/0, yes/no, on/off)")
        return BOOLS[text.lower()]
    try:
        value = base(text)
    except ValueError:
        raise ConfigError(f"{where} {text!r} is not a valid {base.__name__}") from None
    if base is float and not math.isfinite(value):
        raise ConfigError(f"{where} {text!r} is not a finite number")
    choices, aliases = f.metadata.get("choices"), f.metadata.get("aliases", {})
    if choices and isinstance(value, str) and value not in choices and value.lower() in {*choices, *aliases}:
        value = value.lower()   # --log-level INFO means info
    value = aliases.get(value, value)   # --loss-agg dapo (TRL's name) means token-mean
    if choices and value not in choices:
        raise ConfigError(f"{where} {text!r} is not one of {', '.join([*choices, *aliases])}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump: ConfigError is printed by the caller
        raise ConfigError(message)


# --help in sections: each starts at the named field of the Config and runs to the next one's (harness/config.py
# and grpo/settings.py keep their fields in this order, the algorithm's first); a new field joins its section
HELP_GROUPS = [("batch", "batch_size"), ("sampling", "max_new_tokens"), ("algorithm", "learning_rate"),
               ("model and task", "model"), ("evaluation", "eval_interval"),
               ("the work on this machine", "micro_batch_size"), ("run", "device"),
               ("output and logging", "out_dir"), ("checkpoints and resume", "save_final"),
               ("memory tracing", "trace_memory")]


def help_groups(fields: dict) -> list:
    """(title, [field names]) of each HELP_GROUPS section, in the fields' order. Raises KeyError naming a first
    field that is not a field, or one out of order: the table must follow harness/config.py."""
    names = list(fields)
    starts = [names.index(first) if first in fields else None for _, first in HELP_GROUPS]
    if None in starts or starts != sorted(starts) or starts[0] != 0:
        raise KeyError(f"cli.HELP_GROUPS {[first for _, first in HELP_GROUPS]} must name fields of the Config in "
                       f"their order, the first field first")
    return [(title, names[a:b]) for (title, _), a, b in zip(HELP_GROUPS, starts, [*starts[1:], len(names)])]


def _metavar(name: str, f) -> str:
    """What a flag takes, as --help shows it: its choices, BOOL, INT, FLOAT (INT|auto), PATH, else its name."""
    base, _ = _base_type(f)
    if f.metadata.get("choices"):
        return "{" + ",".join(f.metadata["choices"]) + "}"
    if base in (bool, int, float):
        return base.__name__.upper() + ("|auto" if f.metadata.get("auto") else "")
    return "PATH" if f.metadata.get("path") else name.upper()


def _help(f, default_task: str, declared: dict = None, task_name: str = "") -> str:
    """A flag's help with its default and its range: "[default 64; at least 1]". An unset default is "off",
    unless the help says what it comes to ("(default: batch)"); a value the task declares is shown as its default
    ("[default 1.0 (--task chess); >= 0]")."""
    text, choices = f.metadata.get("help", ""), f.metadata.get("choices")
    if isinstance(choices, collections.abc.Mapping):   # a variant's table: each choice's words
        text = f"{text}: " + "; ".join(f"{k}: {v}" for k, v in choices.items())
    if f.metadata.get("aliases"):
        text += " (also " + ", ".join(f"{k} = {v}" for k, v in f.metadata["aliases"].items()) + ")"
    if f.name in (declared or {}):
        default = f"{_spelt(declared[f.name])} (--task {task_name})"
    elif f.name == "task":
        default = default_task
    elif f.default is not dataclasses.MISSING:
        default = "off" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        default = "required"
    shown = [] if f.default is None and "default" in text and f.name not in (declared or {}) else [f"default {default}"]
    shown += [f.metadata["must"]] if f.metadata.get("must") else []
    shown += [f"also {flag(old)}" for old in f.metadata.get("old_names", ())]
    return f"{text} [{'; '.join(shown)}]" if shown else text


def build_parser(task_name: str = "", task_fields: dict = None, default_task: str = None,
                 declared: dict = None, *, tables: dict) -> argparse.ArgumentParser:
    """The parser of the trainer's flags and the task's options (tables: the variant flags')."""
    every = variant_fields(tables)
    p = _Parser(prog="train_lean.py", allow_abbrev=False, usage="train_lean.py [--task TASK] [--flag VALUE ...]",
                description="GRPO on a small causal LM. Every flag also reads GRPO_<FLAG> from the environment "
                "(--batch-size: GRPO_BATCH_SIZE; command line > environment > the task's declared value > default). "
                "A flag shown [BOOL] may "
                "be given bare (true); true/false, 1/0, yes/no, on/off.")
    groups = [(p.add_argument_group(title), {n: every[n] for n in names})
              for title, names in help_groups(every)]
    if task_fields:
        groups.append((p.add_argument_group(f"options of --task {task_name}"), task_fields))
    for group, fields in groups:
        for name, f in fields.items():
            # a bool may be given bare (true), the task's options' as the trainer's; another field with const too
            const = "true" if _base_type(f)[0] is bool else f.metadata.get("const")
            bare = {"nargs": "?", "const": const} if const is not None else {}
            group.add_argument(flag(name), dest=name, default=argparse.SUPPRESS, metavar=_metavar(name, f), **bare,
                               help=_help(f, default_task, declared, task_name))
            for old in f.metadata.get("old_names", ()):   # its help names them (_help)
                group.add_argument(flag(old), dest=old, default=argparse.SUPPRESS, **bare, help=argparse.SUPPRESS)
    return p


def did_you_mean(given: str, names) -> list:
    """The names (fields) that a misspelt or shortened flag most likely meant: those whose words' initials it is
    (--lr: learning_rate), else those it begins (--batch: batch_size), else the closest spelling (difflib)."""
    word = given.split("=", 1)[0].lstrip("-").replace("-", "_").lower()
    names = list(names)
    initials = [n for n in names if "".join(w[:1] for w in n.split("_")) == word]
    prefixed = [n for n in names if n.startswith(word)]
    return initials or prefixed or difflib.get_close_matches(word, names, n=1, cutoff=0.6)


def _either(names: list) -> str:
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _spelt(value) -> str:
    """A declared value as a command line spells it: a bool true/false, None none, a number as Python writes it."""
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_option_types(task_name: str, fields: dict) -> None:
    """A task's options become flags that each read one value, as the trainer's do: a str, int,
    float or bool, or Optional of one (a Literal or list was a traceback, or a str split into
    characters), and none named help (argparse's --help)."""
    where = f"--task {task_name}: its option"
    for name, f in fields.items():
        if name == "help":
            raise tasks.TaskError(f"{where} 'help' would be the flag --help, which lists the "
                                  f"flags: rename it")
        if _base_type(f)[0] not in (str, int, float, bool):
            spelt = (f.type.__name__ if isinstance(f.type, type) else
                     str(f.type).replace("typing.", ""))
            raise tasks.TaskError(f"{where} {name!r} is typed {spelt}: a task option is a str, "
                                  f"int, float or bool (or Optional of one), read from one flag; "
                                  f"take a str and check it in __post_init__")


def declared_settings(target, task_name: str, fields: dict) -> dict:
    """The trainer settings the task declares (its optional trainer_settings: {field name: value}), each checked as
    the same value given as a flag would be, its type, choices (fields: variant_fields') and range
    included: a bad one is a ConfigError that names the task and the setting. The values are the
    trainer's defaults for this task (_read)."""
    declared = getattr(target, "trainer_settings", None)
    if declared is None:
        return {}
    where = f"--task {task_name}'s trainer_settings"
    if not isinstance(declared, dict):
        raise ConfigError(f"{where} must be a dict of trainer setting names to values, not {declared!r:.60}")
    options = tasks.options_type(target)
    out, spellings = {}, {}
    for key, value in declared.items():
        name = OLD_NAMES.get(key, key)
        # deleting an earlier run's records is the user's call alone, and so is where: a task's path
        # would aim --overwrite at a file of the task's choosing
        if name == "overwrite" or name in FIELDS and FIELDS[name].metadata["path"] == "out":
            what = "delete an earlier run's records" if name == "overwrite" else \
                "place what the run writes (and --overwrite deletes)"
            raise ConfigError(f"{where} names {name!r}: only your own {flag(name)} (or "
                              f"{env_name(name)}) may {what}")
        if not isinstance(name, str) or name not in FIELDS or name == "task":   # the task cannot choose itself
            near = did_you_mean(name, FIELDS) if isinstance(name, str) else []
            own = isinstance(name, str) and options is not None and name in fields_of(options)
            raise ConfigError(f"{where} names {name!r}, which is not a trainer setting" + (
                " (it is the task's own option: set its default in the options dataclass)" if own else
                f" (did you mean {_either(near)}?)" if near and name != "task" else
                " (the names are the fields of harness/config.py Config, as --help lists them)"))
        if not (isinstance(value, (str, bool, int, float)) or value is None):   # what flags say
            raise ConfigError(f"{where}: {flag(name)} {value!r:.60} is not a value a flag takes "
                              f"(a str, number, bool or None)")
        if value is not None or not _base_type(FIELDS[name])[1]:   # None if optional: default
            text = value if isinstance(value, str) else _spelt(value)
            value = _convert(fields[name], text, f"{where}: {flag(name)}")
        problem = range_error(name, value)
        if problem:
            raise ConfigError(f"{where}: {problem}")
        spellings.setdefault(name, {})[repr(key)] = value   # its earlier name too, as flags are
        _agreed(spellings[name], repr(name), f"{where}: ")
        out[name] = value
    return out


def _agreed(found: dict, alone: str, where: str = "") -> None:
    """found: one setting's values under each of its names given; two that disagree: ConfigError."""
    if len(set(map(repr, found.values()))) > 1:
        raise ConfigError(where + " and ".join(f"{k} {v}" for k, v in found.items()) +
                          f": one setting under two names that disagree: give {alone} alone")


def _given(name: str, f, given: dict, spell) -> dict:
    """A field's values in given (flag or GRPO_ variable -> text), spelt by spell (flag, env_name) from its name
    and its earlier names (opt's old_names), each converted; two that disagree are a ConfigError."""
    found = {spell(n): _convert(f, given[spell(n)], spell(n)) for n in (name, *f.metadata.get("old_names", ()))
             if spell(n) in given}
    _agreed(found, spell(name))
    return found


def _read(fields: dict, given: dict, environ, declared: dict = None) -> tuple[dict, dict]:
    """Each field's value and its source: the command line, else the environment, else the task's declared value
    (declared: checked already), else the default."""
    values, sources = {}, {}
    declared = declared or {}
    flags = {flag(k): v for k, v in given.items()}
    for name, f in fields.items():
        cli = _given(name, f, flags, flag)
        env = {} if cli else _given(name, f, environ, env_name)   # the command line's value wins unread
        if cli:
            values[name], sources[name] = next(iter(cli.values())), "cli"
        elif env:
            values[name], sources[name] = next(iter(env.values())), "env"
        elif name in declared:
            values[name], sources[name] = declared[name], "task"
        elif f.default is not dataclasses.MISSING:
            values[name], sources[name] = f.default, "default"
        elif f.default_factory is not dataclasses.MISSING:
            values[name], sources[name] = f.default_factory(), "default"
        else:
            raise ConfigError(f"{flag(name)} is required by the task")
    return values, sources


def _find_task(argv, environ, builtin: dict, default_task: str) -> tuple:
    """(its name, the class or object --task names, its options' fields): --task, else GRPO_TASK, else
    default_task, whose options must not take a trainer setting's name."""
    first = _Parser(add_help=False, allow_abbrev=False)
    first.add_argument("--task")
    task_name = first.parse_known_args(argv)[0].task or environ.get(env_name("task")) or default_task
    if not task_name:
        raise ConfigError("no --task given: pass --task NAME, path/to/file.py:Name or module:Name")
    target = tasks.resolve(task_name, builtin or {})
    options_cls = tasks.options_type(target)
    task_fields = fields_of(options_cls) if options_cls else {}
    check_option_types(task_name, task_fields)
    clash = sorted((FIELDS.keys() | OLD_NAMES.keys()) & task_fields.keys())
    if clash:
        raise tasks.TaskError(f"--task {task_name}: its option {clash[0]!r} has the name of a trainer setting "
                              f"({flag(OLD_NAMES.get(clash[0], clash[0]))}): rename it")
    return task_name, target, task_fields


def _check_environment(environ, known, task_name: str) -> None:
    """Every GRPO_ variable names a setting in `known` (field names), spelt upper-case."""
    # a setting's variable is read by its upper-case name alone: another spelling would be ignored in silence
    # (the environment is case-sensitive, and two spellings of one setting would have to be ranked)
    misspelt = sorted(k for k in environ if k.startswith("GRPO_") and k[5:].lower() in known and
                      k != env_name(k[5:].lower()))
    if misspelt:
        raise ConfigError(f"environment variable {misspelt[0]} is not read: spell it "
                          f"{env_name(misspelt[0][5:].lower())} (GRPO_ variables are upper-case)")
    unknown = sorted(k for k in environ if k.startswith("GRPO_") and k[5:].lower() not in known)
    if unknown:
        near = did_you_mean(unknown[0][5:], known)
        raise ConfigError(f"unknown environment variable {unknown[0]}: " + (
            f"did you mean {_either([env_name(n) for n in near])}?" if near else
            f"not a setting of train_lean.py nor of --task {task_name}") +
            f" (see train_lean.py --task {task_name} --help)")


def _resolve_defaults(values: dict, sources: dict, tables: dict) -> None:
    """The values that follow from others, set in place: auto's dtype, the estimator that
    --kl-in's place declares."""
    cuda = values["device"].startswith("cuda") or (values["device"] == "auto" and torch.cuda.is_available())
    if values["dtype"] == "auto":   # fast where researchers train; on a CPU the bits of runs before auto
        values["dtype"] = "bf16" if cuda else "fp32"
    # the estimator that belongs in the reward, k1 (docs/algorithm.md); another where named
    estimator = variants.declared(tables["kl_in"][values["kl_in"]], "kl_estimator")
    if estimator and sources["kl_estimator"] == "default":
        values["kl_estimator"] = estimator


def load(argv=None, environ=None, builtin: dict = None, default_task: str = None, *,
         tables: dict) -> Loaded:
    """Parse argv and environ into the Config, the chosen task's options and each value's source.

    The task is found first (--task, else GRPO_TASK, else default_task; builtin maps short names to
    "module:Attribute"), because its options add flags. tables: each variant flag's choices
    (train_lean.py TABLES). Raises ConfigError (or task.TaskError)."""
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    task_name, target, task_fields = _find_task(argv, environ, builtin, default_task)
    options_cls = tasks.options_type(target)
    fields = variant_fields(tables)
    declared = declared_settings(target, task_name, fields)
    given, extra = build_parser(task_name, task_fields, default_task, declared,
                                tables=tables).parse_known_args(argv)
    if extra:
        bad = next((a for a in extra if a.startswith("-")), extra[0])
        near = did_you_mean(bad, [*FIELDS, *task_fields]) if bad.startswith("--") else []
        raise ConfigError(f"unrecognized arguments: {' '.join(extra)}: " + (
            f"did you mean {_either([flag(n) for n in near])}?" if near else
            f"{bad} is not a flag of train_lean.py nor of --task {task_name}") +
            f" (see train_lean.py --task {task_name} --help)")
    given = vars(given)
    values, sources = _read(fields, given, environ, declared)
    option_values, option_sources = _read(task_fields, given, environ)
    _check_environment(environ, FIELDS.keys() | OLD_NAMES.keys() | task_fields.keys(), task_name)
    values["task"] = task_name
    _resolve_defaults(values, sources, tables)
    asked = values["eval_only"] or (values["eval_interval"] > 0 and sources["eval_interval"] != "default")
    if asked and not hasattr(target, "evaluate"):
        raise ConfigError(f"{'--eval-only' if values['eval_only'] else '--eval-interval'}: --task {task_name} "
                          f"has no evaluate(complete) method (harness/task.py says how to add one)")
    try:
        options = options_cls(**option_values) if options_cls else None
    except (TypeError, ValueError) as e:   # the options' own checks (__post_init__) say what is wrong
        raise ConfigError(str(e).splitlines()[0] if str(e) else f"bad options for --task {task_name}") from None
    if getattr(options, "eval_k", 0) and not values["eval_only"] and not values["eval_interval"]:
        raise ConfigError(f"--eval-k {options.eval_k} samples in the held-out evaluation, and --eval-interval 0 runs "
                          f"none: pass --eval-interval N, or --eval-only")
    return Loaded(Config(**values), options, {**sources, **option_sources}, target, tables)
