"""grpo/ptx.py and the pretraining-mix term (--ptx-coef): what is learned, the loss against Hugging Face's own
next-token loss, the text's sources, its stream as a function of (seed, step), and a run that resumes exactly.

Accumulation over micro-batches and the sum over two gloo ranks are in test_train_update.py (the "pretraining mix" knob),
bad settings in test_bad_input.py.
"""
import random

import pytest
import torch

from grpo import ptx
from grpo.ptx import ptx_loss
from grpo.model import completion_logprobs, load_policy, load_tokenizer
from harness.task import TaskError, checked_texts, mix_source
from helpers import records

TEXTS = ["Repeat a: aaaa", ("Repeat b: ", "bb"), ("", "x y z"), ("a much longer context than the rest: ", "q")]


class Demonstrating:
    name = "demonstrating"

    def demonstrations(self, n, rng):
        return [(f"Repeat {c}: ", c * 3) for c in rng.choices("abc", k=n)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir, "cpu")


def test_the_loss_is_the_mean_next_token_loss_of_the_targets(tiny):
    """Against Hugging Face's loss with labels, text by text without padding: the context is not learned, the
    target and the closing EOS are, positions are right under left padding; micro-batches sum to it."""
    tok, model = tiny
    batch = ptx.encode(TEXTS, tok, prepend_bos=True, context=None)
    nll, count = 0.0, 0
    for text in TEXTS:
        context, target = ("", text) if isinstance(text, str) else text
        head = [tok.eos_token_id] + tok(context, add_special_tokens=False)["input_ids"]
        ids = head + tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        labels = [-100] * len(head) + ids[len(head):]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
        learned = len(ids) - len(head)
        nll, count = nll + out.loss.item() * learned, count + learned
    assert batch.tokens == count
    with torch.no_grad():
        whole = completion_logprobs(model, batch.input_ids, batch.attention, batch.target.shape[1], 1.0, 4096,
                                    share_prompts=False)
        loss, summed = ptx_loss(whole, batch.target, batch.tokens, coef=0.5)
        parts = [ptx_loss(completion_logprobs(model, batch.input_ids[rows], batch.attention[rows],
                                              batch.target.shape[1], 1.0, 4096, share_prompts=False),
                          batch.target[rows], batch.tokens, coef=0.5)[0] for rows in torch.arange(4).split(3)]
    assert summed.item() == pytest.approx(nll, rel=1e-5)
    assert loss.item() == pytest.approx(0.5 * nll / count, rel=1e-5)
    assert sum(p.item() for p in parts) == pytest.approx(loss.item(), rel=1e-5)


def test_encode_learns_the_target_and_eos_never_the_bos_context_or_padding(tiny):
    tok, _ = tiny
    batch = ptx.encode([("Repeat b: ", "bb"), "a"], tok, prepend_bos=True, context=None)
    context = len(tok("Repeat b: ", add_special_tokens=False)["input_ids"])
    target = len(tok("bb", add_special_tokens=False)["input_ids"])
    width = 1 + context + target + 1
    assert batch.input_ids.shape == (2, width) and batch.target.shape == (2, width - 1)
    # row 0: BOS and context predict nothing learned until the context's last token predicts the target
    assert batch.target[0].tolist() == [0] * context + [1] * (target + 1)
    short = 1 + len(tok("a", add_special_tokens=False)["input_ids"]) + 1
    assert batch.attention[1].tolist() == [0] * (width - short) + [1] * short
    assert batch.target[1].tolist() == [0] * (width - short) + [1] * (short - 1)   # a string is learned whole
    assert batch.input_ids[1, -1] == tok.eos_token_id
    assert batch.tokens == target + 1 + short - 1


def test_a_text_longer_than_the_model_keeps_its_start_and_is_counted(tiny):
    tok, _ = tiny
    batch = ptx.encode(["x " * 50, "short"], tok, prepend_bos=False, context=16)
    assert batch.input_ids.shape == (2, 16) and batch.cut == 1   # counted: the run says it (harness/run.py)
    assert batch.input_ids[0].tolist() == tok("x " * 50, add_special_tokens=False)["input_ids"][:16]
    assert batch.target[0].sum() == 15 and batch.for_device(1, 2).cut == 1   # a device's share keeps the update's


def test_a_pair_whose_context_fills_the_model_is_named(tiny):
    # it failed at step 1 inside the loss, its target mask longer than its row
    tok, _ = tiny
    context = 1 + len(tok("x " * 8, add_special_tokens=False)["input_ids"])   # BOS and the pair's context
    with pytest.raises(ValueError, match=rf"a --ptx-coef text's context of {context} tokens \(with BOS\) \('x x x .*"
                                         rf"fills the model's {context} positions: no room is left for its target"):
        ptx.encode([("x " * 8, "y"), "short"], tok, prepend_bos=True, context=context)
    assert ptx.encode([("x " * 8, "y")], tok, prepend_bos=True, context=context + 1).tokens == 1   # one position left


def test_the_text_comes_from_a_file_of_lines_or_the_task(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("first line\n\n   \nsecond line\n")
    draw = mix_source(None, str(path))
    assert set(draw(50, random.Random(0))) == {"first line", "second line"}
    task = Demonstrating()
    assert mix_source(task, None)(5, random.Random(1)) == task.demonstrations(5, random.Random(1))
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(TaskError, match="empty.txt has no text"):
        mix_source(None, str(tmp_path / "empty.txt"))
    from tasks.toy import ToyTask
    with pytest.raises(TaskError, match=r"--ptx-file PATH.*demonstrations\(n, rng\) \(toy has none\)"):
        mix_source(ToyTask(), None)


def test_a_steps_texts_are_a_function_of_seed_and_step(tiny):
    tok, _ = tiny
    draw = Demonstrating().demonstrations

    def ids(step_seed):
        return [b.input_ids.tolist() for b in ptx.step_batches(draw, step_seed, 2, 8, tok, True, None)]

    assert ids(7) == ids(7) and ids(7) != ids(8)
    first, second = ptx.step_batches(draw, 7, 2, 8, tok, True, None)
    assert first.input_ids.tolist() != second.input_ids.tolist()   # each update learns its own texts
    # apart from the prompts: the same step's prompt rng draws another stream
    assert draw(16, random.Random(7)) != draw(16, random.Random("ptx 7"))


def test_a_task_that_returns_the_wrong_texts_is_named():
    with pytest.raises(TaskError, match=r"demonstrations\(8, rng\) returned 3 texts, not 8"):
        checked_texts(lambda n, rng: ["a"] * 3, 8, random.Random(0))
    with pytest.raises(TaskError, match=r"returned a generator, not a list of 8 texts"):
        checked_texts(lambda n, rng: ("a" for _ in range(n)), 8, random.Random(0))
    with pytest.raises(TaskError, match="a string or a .context, target. pair of strings, not 3"):
        checked_texts(lambda n, rng: ["a", 3], 2, random.Random(0))
    # learned, an empty text or target is BOS -> EOS: the model would learn to stop at once
    for empty in ("", ("Repeat a: ", ""), ("Repeat a: ", "  ")):
        with pytest.raises(TaskError, match=r"demonstrations\(2, rng\) returned .*: an empty (text|target) teaches "
                                            r"the model to end at once \(EOS\): leave such texts out"):
            checked_texts(lambda n, rng: ["a", empty], 2, random.Random(0))


def test_a_devices_share_keeps_the_whole_updates_token_count(tiny):
    tok, _ = tiny
    batch = ptx.encode(TEXTS + ["b"], tok, True, None)
    shares = [batch.for_device(rank, 2) for rank in range(2)]
    assert [s.input_ids.shape[0] for s in shares] == [3, 2] and all(s.tokens == batch.tokens for s in shares)
    assert sum(s.target.sum().item() for s in shares) == batch.tokens
    assert ptx.encode(["a"], tok, True, None).for_device(1, 2).input_ids.shape[0] == 0   # a device may get none


def ptx_run(model, text_file, out, *extra):
    return ["--model", model, "--task", "toy", "--batch-size", "8", "--group-size", "4", "--mini-batch-size", "4",
            "--micro-batch-size", "2", "--max-new-tokens", "8", "--learning-rate", "1e-2", "--ptx-coef", "1",
            "--ptx-file", str(text_file), "--ptx-batch-size", "3", "--eval-interval", "0", "--log-level", "warning",
            "--save-final", "false", "--out-dir", str(out), *extra]


def test_a_run_learns_the_text_and_resumes_exactly(tiny_model_dir, tmp_path, clean_env,
                                                   user_threads):
    import train_lean
    text = tmp_path / "text.txt"
    text.write_text("the same sentence again\nthe same sentence again, and more\n")
    train_lean.main(ptx_run(tiny_model_dir, text, tmp_path / "straight", "--steps", "6"))
    train_lean.main(ptx_run(tiny_model_dir, text, tmp_path / "resumed", "--steps", "3", "--save-interval", "3"))
    train_lean.main(ptx_run(tiny_model_dir, text, tmp_path / "resumed", "--steps", "6", "--resume"))
    straight, resumed = records(tmp_path / "straight" / "metrics.jsonl"), records(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 7)) and resumed == straight
    losses = [r["ptx_loss"] for r in straight]
    assert losses[-1] < 0.5 * losses[0]   # two updates a step on these two lines: it learns them


def test_a_run_says_once_that_a_text_was_cut_and_counts_it_in_every_record(tiny_model_dir, tmp_path, clean_env,
                                                                            capsys):
    import train_lean
    text = tmp_path / "text.txt"
    text.write_text("x " * 600 + "\n")   # longer than the tiny model's 512 positions: every draw is it
    train_lean.main(ptx_run(tiny_model_dir, text, tmp_path / "run", "--steps", "2"))
    said = [line for line in capsys.readouterr().err.splitlines() if "longer than the model's" in line]
    assert said == ["train_lean.py: step 1: 6 --ptx-coef text(s) longer than the model's 512 positions: each is "
                    "learned cut to its first 512 tokens, without its end and EOS (said once; ptx_cut in each "
                    "record counts them)"]
    assert [r["ptx_cut"] for r in records(tmp_path / "run" / "metrics.jsonl")] == [6, 6]   # 2 updates x 3 texts
