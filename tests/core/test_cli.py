"""The command line and the environment: every field is a flag and a GRPO_ variable, CLI > environment >
default, and a bad flag or value is one line that names it."""
import dataclasses

import pytest

import tasks
from grpo import cli
from grpo.config import Config, ConfigError


def load(argv, environ):
    """The trainer's settings (the default task's options aside) and their sources."""
    loaded = cli.load(argv, environ, tasks.BUILTIN, tasks.DEFAULT)
    return loaded.cfg, loaded.sources


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "lots"], "--batch-size 'lots' is not a valid int"),
    (["--scale-rewards", "rank"], "--scale-rewards 'rank' is not one of group, batch, none"),
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


def test_optional_sizes_accept_auto_as_derived():
    cfg, _ = load(["--mini-batch-size", "auto"], environ={"GRPO_GENERATION_BATCH_SIZE": "none"})
    assert cfg.mini_batch_size is None and cfg.generation_batch_size is None


def test_every_field_is_a_flag_and_an_env_variable():
    for f in dataclasses.fields(Config):
        cfg, sources = load([], environ={"GRPO_" + f.name.upper(): str(f.default) if f.default is not None else ""})
        assert sources[f.name] == "env"
