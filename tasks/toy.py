"""An offline toy task that a tiny random model can learn: repeat a letter.

Prompt: "Repeat c: " for a letter c. Reward: the fraction of the first `width` characters of the
completion that are c (a short completion scores its missing characters as misses). A random
model already hits c now and then, so rewards vary inside a group and GRPO has a signal.

Its evaluation asks each letter once: a completion is correct when its reward is 1 (all `width` characters
are the letter). Greedy accuracy and mean reward; with --eval-k, pass@K and mean@N of sampled completions; each given per letter,
so the trainer adds its interval.
"""
import random

from harness.task import SampledEvalOptions, sampled_metrics

LETTERS = "abcde"


class ToyTask:
    name = "toy"
    min_reward = 0.0
    options = SampledEvalOptions

    def __init__(self, width: int = 10, eval_k: int = 0, eval_n: int = 0, eval_temperature: float = 1.0):
        self.width = width
        self.eval_k, self.eval_n, self.eval_temperature = eval_k, eval_n, eval_temperature

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        return [f"Repeat {rng.choice(LETTERS)}: " for _ in range(n)]

    def reward(self, prompt: str, completion: str) -> float:
        target = prompt[len("Repeat ")]
        head = completion[: self.width]
        return sum(ch == target for ch in head) / self.width

    def correct(self, prompt: str, completion: str) -> bool:
        return self.reward(prompt, completion) == 1.0

    def evaluate(self, complete) -> dict:
        prompts = [f"Repeat {c}: " for c in LETTERS]
        texts = complete(prompts)
        # per letter: the trainer averages them and gives each its interval (harness/intervals.py)
        out = {"acc": list(map(self.correct, prompts, texts)), "reward": list(map(self.reward, prompts, texts))}
        if self.eval_k:
            out.update(sampled_metrics(complete, prompts, self.correct, self.eval_k, self.eval_n,
                                       self.eval_temperature))
        return out
