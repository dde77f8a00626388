"""The command line and the environment: every field is a flag and a GRPO_ variable, CLI > environment >
default, and a bad flag or value is one line that names it."""
import dataclasses
import re

import pytest

import tasks
from harness import cli, config, screen
from harness.config import FIELDS, Config, ConfigError
from train_lean import TABLES


def load(argv, environ):
    """The trainer's settings (the default task's options aside) and their sources."""
    loaded = cli.load(argv, environ, tasks.BUILTIN, tasks.DEFAULT, tables=TABLES)
    return loaded.cfg, loaded.sources


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "lots"], "--batch-size 'lots' is not a valid int"),
    (["--advantage", "rank"], "--advantage 'rank' is not one of group, batch, none"),
    (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag 1"),
    (["--batch"], "unrecognized arguments: --batch"),  # no silent abbreviations
])
def test_bad_flags_and_values(argv, message):
    with pytest.raises(ConfigError) as e:
        load(argv, environ={})
    assert message in str(e.value)


def test_environment_overrides_default_and_cli_overrides_environment():
    env = {"GRPO_MICRO_BATCH_SIZE": "4", "GRPO_LEARNING_RATE": "3e-5", "GRPO_BATCH_SIZE": "32"}
    cfg, sources = load(["--batch-size", "16"], environ=env)
    assert cfg.micro_batch_size == 4 and sources["micro_batch_size"] == "env"
    assert cfg.learning_rate == 3e-5 and sources["learning_rate"] == "env"
    assert cfg.batch_size == 16 and sources["batch_size"] == "cli"
    assert cfg.group_size == 8 and sources["group_size"] == "default"


def test_bad_environment_values_name_the_variable():
    with pytest.raises(ConfigError, match="GRPO_GROUP_SIZE 'eight' is not a valid int"):
        load([], environ={"GRPO_GROUP_SIZE": "eight"})
    with pytest.raises(ConfigError, match="unknown environment variable GRPO_BACH_SIZE"):
        load([], environ={"GRPO_BACH_SIZE": "8"})


@pytest.mark.parametrize("name, right", [("GRPO_learning_rate", "GRPO_LEARNING_RATE"),
                                         ("GRPO_Batch_Size", "GRPO_BATCH_SIZE"),
                                         ("GRPO_stockfish_depth", "GRPO_STOCKFISH_DEPTH")])   # a task's option
def test_a_variable_in_another_case_is_refused_with_the_right_spelling(name, right):
    # it was taken as known (the check lower-cased it) and then never read: the run went on with the default
    with pytest.raises(ConfigError, match=f"environment variable {name} is not read: spell it {right} "):
        load([], environ={name: "3"})


def test_optional_sizes_accept_auto_as_derived():
    cfg, _ = load(["--mini-batch-size", "auto"], environ={"GRPO_GENERATION_BATCH_SIZE": "none"})
    assert cfg.mini_batch_size is None and cfg.generation_batch_size is None


def test_every_field_is_a_flag_and_an_env_variable():
    for f in dataclasses.fields(Config):
        cfg, sources = load([], environ={"GRPO_" + f.name.upper(): str(f.default) if f.default is not None else ""})
        assert sources[f.name] == "env"


def test_help_is_grouped_and_shows_allowed_values_and_defaults():
    text = cli.build_parser("toy", {}, tasks.DEFAULT, tables=TABLES).format_help()
    titles = [title for title, _ in cli.HELP_GROUPS]
    assert titles[:7] == ["batch", "sampling", "algorithm", "model and task", "evaluation",
                          "the work on this machine", "run"]   # the algorithm's settings first
    assert [t for t in re.findall(r"^(\S[^:\n]*):$", text, re.M) if t in titles] == titles   # in this order
    groups = cli.help_groups(FIELDS)
    assert [n for _, names in groups for n in names] == list(FIELDS)   # every field in one group, in order
    assert dict(groups)["batch"][0] == "batch_size" and "learning_rate" in dict(groups)["algorithm"]
    assert text.startswith("usage: train_lean.py [--task TASK] [--flag VALUE ...]\n")
    assert "--eval-only [BOOL]" in text and "EVAL_ONLY" not in text and "--resume [RESUME]" in text
    assert "--micro-batch-size INT|auto" in text and "--learning-rate FLOAT" in text and "--log-file PATH" in text
    for name, f in cli.variant_fields(TABLES).items():   # each flag shows its choices, and its default unless its help says it
        if f.metadata["choices"]:
            shown = f"{{{','.join(f.metadata['choices'])}}}"   # in brackets where the flag may be given bare
            assert f"{config.flag(name)} {f'[{shown}]' if f.metadata['const'] else shown}" in text, name
    flat = " ".join(text.split())
    assert "[default 64; at least 1]" in flat and "[default chess]" in flat and "[default false]" in flat
    assert "(default: batch) [at least 1]" in flat and "with every sampled completion [default off]" in flat
    assert "derived" not in flat


def test_the_system_prompt_is_a_flag_and_a_variable_of_the_model_and_task():
    cfg, sources = load(["--task", "toy", "--system-prompt", "Be brief."], environ={})
    assert cfg.system_prompt == "Be brief." and sources["system_prompt"] == "cli"
    cfg, sources = load(["--task", "toy"], environ={"GRPO_SYSTEM_PROMPT": "Line one.\nLine two."})
    assert cfg.system_prompt == "Line one.\nLine two." and sources["system_prompt"] == "env"
    assert load(["--task", "toy"], environ={})[0].system_prompt is None   # the task's own messages
    assert "system_prompt" in dict(cli.help_groups(FIELDS))["model and task"]
    flat = " ".join(cli.build_parser("toy", {}, tasks.DEFAULT, tables=TABLES).format_help().split())
    assert ("it replaces the task's own system message (the command line over the task), else "
            "comes first; a task of str prompts is refused; any text is the message, none, auto "
            "and '' too [default off]") in flat
    assert not FIELDS["system_prompt"].metadata["resume_free"]   # it changes what is trained


def test_help_groups_follow_the_config(monkeypatch):
    monkeypatch.setattr(cli, "HELP_GROUPS", [("model and task", "model"), ("run", "steps"), ("batch", "batch_size")])
    with pytest.raises(KeyError, match="in their order"):
        cli.help_groups(FIELDS)
    monkeypatch.setattr(cli, "HELP_GROUPS", [("model and task", "model"), ("gone", "no_such_field")])
    with pytest.raises(KeyError, match="must name fields of the Config"):
        cli.help_groups(FIELDS)


@pytest.mark.parametrize("argv, environ, message", [
    (["--lr", "1e-5"], {}, "unrecognized arguments: --lr 1e-5: did you mean --learning-rate or --lora-rank?"),   # initials
    (["--lr=1e-5"], {}, "did you mean --learning-rate or --lora-rank?"),
    (["--learing-rate", "1e-5"], {}, "did you mean --learning-rate?"),   # a typo: the closest spelling
    (["--batch", "8"], {}, "did you mean --batch-size?"),   # a prefix: suggested, never taken
    (["--kl", "0.1"], {}, "did you mean --kl-coef, --kl-target, --kl-horizon, --kl-cov-coef, --kl-estimator or --kl-in?"),
    (["--task", "chess", "--stockfish-dept", "3"], {}, "did you mean --stockfish-depth?"),   # a task's option
    (["--task", "toy", "--bogus", "1"], {}, "--bogus is not a flag of train_lean.py nor of --task toy (see "
                                            "train_lean.py --task toy --help)"),
    ([], {"GRPO_BACH_SIZE": "8"}, "unknown environment variable GRPO_BACH_SIZE: did you mean GRPO_BATCH_SIZE?"),
])
def test_an_unknown_flag_gets_did_you_mean(argv, environ, message):
    with pytest.raises(ConfigError) as e:
        load(argv, environ)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_sampling_an_evaluation_that_never_runs_is_refused():
    toy = dict(builtin=tasks.BUILTIN, default_task=tasks.DEFAULT)
    with pytest.raises(ConfigError, match="--eval-k 4 samples in the held-out evaluation, and --eval-interval 0 runs"):
        cli.load(["--task", "toy", "--eval-k", "4", "--eval-interval", "0"], environ={}, **toy, tables=TABLES)
    for argv in (["--eval-interval", "5"], ["--eval-only"], []):   # an evaluation that runs: accepted
        assert cli.load(["--task", "toy", "--eval-k", "4", *argv], environ={}, **toy, tables=TABLES).options.eval_k == 4


def test_an_eval_temperature_without_eval_k_is_refused():
    # the greedy evaluation has no temperature: it was ignored in silence
    toy = dict(builtin=tasks.BUILTIN, default_task=tasks.DEFAULT)
    with pytest.raises(ConfigError, match=r"--eval-temperature 0.7 is the temperature of --eval-k's samples, and "
                                          r"--eval-k 0 samples none: give --eval-k too"):
        cli.load(["--task", "toy", "--eval-temperature", "0.7"], environ={}, **toy, tables=TABLES)
    with pytest.raises(ConfigError, match="--eval-temperature 0.7 is the temperature"):
        cli.load(["--task", "toy"], environ={"GRPO_EVAL_TEMPERATURE": "0.7"}, **toy, tables=TABLES)
    assert cli.load(["--task", "toy", "--eval-temperature", "0.7", "--eval-k", "2"], environ={},
                    **toy, tables=TABLES).options.eval_temperature == 0.7


BOOL_OPTION_TASK = """
import dataclasses
from tasks.toy import ToyTask

@dataclasses.dataclass
class Options:
    exact_only: bool = False   # a plain dataclass field, as a user writes one

class Strict(ToyTask):
    options = Options
"""


def test_a_tasks_bool_option_may_be_given_bare_like_the_trainers(tmp_path):
    # a task's bool was a flag that took one argument: `--exact-only` alone was "expected one argument"
    (tmp_path / "strict.py").write_text(BOOL_OPTION_TASK)
    task = f"{tmp_path / 'strict.py'}:Strict"
    given = {(): False, ("--exact-only",): True, ("--exact-only", "false"): False, ("--exact-only", "yes"): True}
    for argv, value in given.items():
        loaded = cli.load(["--task", task, *argv, "--overwrite"], environ={}, tables=TABLES)
        assert loaded.options.exact_only is value and loaded.cfg.overwrite is True, argv
    assert "--exact-only [BOOL]" in cli.build_parser(task, config.fields_of(
        cli.tasks.options_type(cli.tasks.resolve(task, {}))), tables=TABLES).format_help()


@pytest.mark.parametrize("declared, message", [
    ("mode: typing.Literal['a', 'b'] = 'a'",
     "its option 'mode' is typed Literal['a', 'b']: a task option is a str, int, float or bool "
     "(or Optional of one)"),
    ("mode: typing.List[int] = None", "its option 'mode' is typed List[int]"),
    ("mode: list = None", "its option 'mode' is typed list"),
    ("help: str = 'x'",
     "its option 'help' would be the flag --help, which lists the flags: rename it"),
    ("learning_rate: float = 1.0", "its option 'learning_rate' has the name of a trainer setting "
     "(--learning-rate): rename it"),
    ("scale_rewards: str = 'x'", "its option 'scale_rewards' has the name of a trainer setting (--advantage)"),
])
def test_a_task_option_no_flag_can_read_is_refused(tmp_path, declared, message):
    """Tracebacks before (Literal, List), a str split into a list of characters (list), argparse's
    conflict (help)."""
    (tmp_path / "typed.py").write_text(
        f"import dataclasses, typing\nfrom tasks.toy import ToyTask\n\n@dataclasses.dataclass\n"
        f"class Options:\n    {declared}\n\nclass Typed(ToyTask):\n    options = Options\n")
    task = f"{tmp_path / 'typed.py'}:Typed"
    with pytest.raises(cli.tasks.TaskError, match=re.escape(f"--task {task}: {message}")):
        cli.load(["--task", task], environ={}, tables=TABLES)


def test_trl_loss_type_names_are_our_aggregations():
    # resolved where the value enters: the loss (grpo/algorithm.py) knows only its own names
    for trl, ours in {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean", "dr_grpo": "dr-grpo",
                      "token-mean": "token-mean"}.items():
        assert load(["--task", "toy", "--loss-agg", trl], {})[0].loss_agg == ours
    with pytest.raises(ConfigError, match="'sum' is not one of token-mean, seq-mean, dr-grpo, dapo, bnpo, grpo, dr_grpo"):
        load(["--task", "toy", "--loss-agg", "sum"], {})


def test_the_advantage_is_also_read_under_its_earlier_name_scale_rewards(tmp_path, monkeypatch):
    # --scale-rewards (TRL's name, and this trainer's before --advantage): scripts and runs that use it go on
    for argv, environ in ((["--scale-rewards", "rloo"], {}), ([], {"GRPO_SCALE_REWARDS": "rloo"}),
                          (["--scale-rewards", "rloo", "--advantage", "rloo"], {}),
                          ([], {"GRPO_SCALE_REWARDS": "rloo", "GRPO_ADVANTAGE": "rloo"})):
        assert load(["--task", "toy", *argv], environ)[0].advantage == "rloo"
    cfg, sources = load(["--task", "toy", "--advantage", "maxrl"], {"GRPO_SCALE_REWARDS": "rloo"})
    assert (cfg.advantage, sources["advantage"]) == ("maxrl", "cli")
    for argv, environ, said in (
            (["--scale-rewards", "no-such"], {}, "--scale-rewards 'no-such' is not one of group, batch"),
            (["--advantage", "batch", "--scale-rewards", "rloo"], {},
             "--advantage batch and --scale-rewards rloo: one setting under two names that disagree: "
             "give --advantage alone"),
            ([], {"GRPO_ADVANTAGE": "batch", "GRPO_SCALE_REWARDS": "rloo"}, "give GRPO_ADVANTAGE alone")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            load(["--task", "toy", *argv], environ)
    (tmp_path / "old.py").write_text("from tasks.toy import ToyTask\n\n"
                                     "class Old(ToyTask):\n    trainer_settings = {'scale_rewards': 'rloo'}\n")
    assert load(["--task", f"{tmp_path / 'old.py'}:Old"], {})[0].advantage == "rloo"
    assert cli._help(FIELDS["advantage"], "toy").endswith("[default group; also --scale-rewards]")
    monkeypatch.setenv("COLUMNS", "1000")   # no wrapping: each flag's help on one line
    listed = cli.build_parser(tables=TABLES).format_help()
    assert listed.count("--scale-rewards") == 1 and "; also --scale-rewards]" in listed   # in --advantage's help


DECLARING_TASK = """
from tasks.toy import ToyTask

class Declares(ToyTask):
    trainer_settings = {"learning_rate": 3e-4, "temperature": 0.5}

class Bad(ToyTask):
    trainer_settings = BAD
"""


def declaring(tmp_path, bad=None) -> str:
    (tmp_path / "declares.py").write_text(DECLARING_TASK.replace("BAD", repr(bad)))
    return f"{tmp_path / 'declares.py'}:{'Bad' if bad is not None else 'Declares'}"


def test_a_tasks_declared_settings_rank_below_the_environment_and_the_command_line(tmp_path):
    task = declaring(tmp_path)
    cfg, sources = load(["--task", task], environ={})
    assert (cfg.learning_rate, sources["learning_rate"]) == (3e-4, "task") and sources["temperature"] == "task"
    assert (cfg.group_size, sources["group_size"]) == (8, "default")   # what it does not declare
    cfg, sources = load(["--task", task], environ={"GRPO_LEARNING_RATE": "2e-4"})
    assert (cfg.learning_rate, sources["learning_rate"]) == (2e-4, "env") and cfg.temperature == 0.5
    cfg, sources = load(["--task", task, "--learning-rate", "1e-4"], environ={"GRPO_LEARNING_RATE": "2e-4"})
    assert (cfg.learning_rate, sources["learning_rate"]) == (1e-4, "cli")
    help_text = " ".join(cli.build_parser("add.py:Add", {}, declared={"learning_rate": 3e-4}, tables=TABLES).format_help().split())
    assert "[default 0.0003 (--task add.py:Add); in (0, 1)]" in help_text   # --help shows the value the run gets


def test_the_chess_main_job_gets_its_pretraining_mix_with_no_flag():
    # `python train_lean.py --batch-size 64` is `make train`: --task chess declares --ptx-coef 1
    cfg, sources = load(["--batch-size", "64"], environ={})
    assert cfg.task == "chess" and (cfg.ptx_coef, sources["ptx_coef"]) == (1.0, "task")
    cfg, sources = load(["--ptx-coef", "0"], environ={})   # GRPO alone, on purpose
    assert (cfg.ptx_coef, sources["ptx_coef"]) == (0.0, "cli")
    cfg, sources = load(["--task", "chess-env"], environ={})   # the one-kind tasks declare nothing
    assert (cfg.ptx_coef, sources["ptx_coef"]) == (0.0, "default")


@pytest.mark.parametrize("bad, message", [
    ({"ptx_coef": -1}, "trainer_settings: --ptx-coef -1.0 must be >= 0"),                # its range, as a flag's
    ({"batch_size": 1.5}, "trainer_settings: --batch-size '1.5' is not a valid int"),   # its type
    ({"loss_agg": "mean"}, "trainer_settings: --loss-agg 'mean' is not one of"),         # its choices
    ({"temperature": "inf"}, "trainer_settings: --temperature 'inf' is not a finite number"),   # a str as GRPO_'s
    ({"ptx_coeff": 1}, "names 'ptx_coeff', which is not a trainer setting (did you mean ptx_coef?)"),
    ({"letter": "b"}, "names 'letter', which is not a trainer setting"),
    ({"eval_k": 2}, "names 'eval_k', which is not a trainer setting (it is the task's own option"),
    ({"task": "toy"}, "names 'task', which is not a trainer setting"),
    # issue 46 case 6: a task deleted earlier runs without the user asking
    ({"overwrite": True}, "names 'overwrite': only your own --overwrite (or GRPO_OVERWRITE) may"),
    ({"seed": [1]}, "trainer_settings: --seed [1] is not a value a flag takes"),
    ({"seed": -3}, "trainer_settings: --seed -3 must be in [0, 2**32)"),   # issue 54 case 9
    # issue 54 case 2: refused naming --out-dir, then --overwrite deleted the task's choice
    ({"log_completions": "victim/metrics.jsonl"}, "names 'log_completions': only your own "
     "--log-completions (or GRPO_LOG_COMPLETIONS) may place what the run writes (and --overwrite"),
    ({"out_dir": "victim"}, "names 'out_dir': only your own --out-dir (or GRPO_OUT_DIR) may place"),
    # issue 54 case 8: the later name won in silence, where two flags or variables are refused
    ({"scale_rewards": "batch", "advantage": "rloo"}, "trainer_settings: 'scale_rewards' batch and "
     "'advantage' rloo: one setting under two names that disagree: give 'advantage' alone"),
    (["ptx_coef"], "trainer_settings must be a dict"),
])
def test_a_bad_declaration_is_refused_naming_the_task_and_the_setting(tmp_path, bad, message):
    task = declaring(tmp_path, bad)
    with pytest.raises(ConfigError) as e:
        load(["--task", task], environ={})
    assert str(e.value).startswith(f"--task {task}'s trainer_settings") and message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, dtype, compile", [
    (["--device", "cpu"], "fp32", "off"),              # a CPU: the bits of the runs before auto
    (["--device", "cuda:1"], "bf16", "off"),           # a GPU: bf16; compiling measured no faster there
    (["--device", "cuda", "--compile", "on", "--dtype", "fp32"], "fp32", "on"),
    (["--device", "cpu", "--compile"], "fp32", "on"),  # bare: on
    (["--device", "cpu", "--compile", "true"], "fp32", "on"),   # the bool it was before
])
def test_dtype_auto_means_bf16_on_a_gpu_only(argv, dtype, compile):
    cfg = cli.load(["--task", "toy", *argv], {}, tasks.BUILTIN, tables=TABLES).cfg
    assert (cfg.dtype, cfg.compile) == (dtype, compile)


@pytest.mark.parametrize("argv, environ", [(["--seed", "-1"], {}), (["--seed", str(2**32)], {}),
                                           ([], {"GRPO_SEED": "-5"})])
def test_a_seed_outside_the_stated_range_is_refused_in_one_line(argv, environ):
    # issue 54 case 9: numpy's own message, exit 1 (the range is --help's: [0, 2**32))
    cfg, _ = load(argv, environ)
    with pytest.raises(ConfigError, match=r"^--seed -?\d+ must be in \[0, 2\*\*32\)$"):
        config.batch_layout(cfg)


@pytest.mark.parametrize("text", ["None", "none", "auto", "off", ""])
def test_a_system_prompt_is_the_text_given(text):
    # issue 54 case 6: these meant "no --system-prompt" (the task's own message kept), unsaid;
    # "" is an empty system message in place of the task's
    for argv, environ in (["--system-prompt", text], {}), ([], {"GRPO_SYSTEM_PROMPT": text}):
        assert load(argv, environ)[0].system_prompt == text
    given = cli.load(["--task", "toy", "--system-prompt", text], environ={}, builtin=tasks.BUILTIN, tables=TABLES)
    table = screen.describe(given.cfg, given.options, given.sources,
                            config.batch_layout(given.cfg))   # settings.txt's
    assert re.search(rf"--system-prompt +{re.escape(text or repr(text))} +cli\n", table)
