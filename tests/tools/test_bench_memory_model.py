"""bench/memory_model.py: its parts add up to its phases, and the saved tensors it counts on a
micro-batch scale with whole groups as its prediction assumes (real tiny models)."""
import argparse
import sys

import pytest

from helpers import REPO

sys.path.insert(0, REPO)
from bench import memory_model  # noqa: E402


def predicted(model_dir, **flags):
    a = memory_model.parser().parse_args(["--model", model_dir, "--guard", "none"])
    a = argparse.Namespace(**{**vars(a), **flags})
    a.config = memory_model.config_of(model_dir)
    return memory_model.sizes(a.config), memory_model.predict(memory_model.sizes(a.config), a)


@pytest.mark.parametrize("micro", [None, 8])
def test_the_phases_are_the_resident_parts_plus_their_own(tiny_model_dir, micro):
    s, out = predicted(tiny_model_dir, batch_size=16, micro_batch_size=micro, max_new_tokens=8,
                       prompt_tokens=12)
    base = sum(out["resident"].values())
    assert out["resident"]["weights"] == 4 * s["P"] == out["resident"]["gradients"]
    assert out["resident"]["optimizer state"] == 8 * s["P"]
    assert out["peaks"]["sampler"] == base + sum(out["sampler"].values())
    assert out["peaks"]["optimizer"] == base + sum(out["optimizer"].values())
    assert out["peak"] == max(out["peaks"].values())
    no_kl = predicted(tiny_model_dir, batch_size=16, max_new_tokens=8, prompt_tokens=12,
                      kl_coef=0.0)[1]
    assert no_kl["resident"]["reference"] == 0 and no_kl["reference"] == {}


def test_the_counted_saved_tensors_scale_with_whole_groups(any_model_dir):
    config = memory_model.config_of(any_model_dir)
    one, two = (memory_model.saved_bytes(config, 2, rows, 4, 10, 6, "fp32", False)
                for rows in (4, 8))
    assert two == 2 * one > 0
    deeper = memory_model.saved_bytes(config, 3, 4, 4, 10, 6, "fp32", False)
    assert deeper > one   # a layer more saves more


def test_it_prints_a_prediction_of_a_bench_shape_without_building_its_weights(capsys):
    memory_model.main(["--model", "gpt2-124m", "--batch-size", "8", "--max-new-tokens", "4",
                       "--prompt-tokens", "8", "--guard", "none"])
    text = capsys.readouterr().out
    assert "124.4M parameters" in text and "predicted peak:" in text
