"""An offline toy task that a tiny random model can learn: repeat a letter.

Prompt: "Repeat c: " for a letter c. Reward: the fraction of the first `width` characters of the
completion that are c (a short completion scores its missing characters as misses). A random
model already hits c now and then, so rewards vary inside a group and GRPO has a signal.
"""
import random

LETTERS = "abcde"


class ToyTask:
    name = "toy"
    min_reward = 0.0

    def __init__(self, width: int = 10):
        self.width = width

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        return [f"Repeat {rng.choice(LETTERS)}: " for _ in range(n)]

    def reward(self, prompt: str, completion: str) -> float:
        target = prompt[len("Repeat ")]
        head = completion[: self.width]
        return sum(ch == target for ch in head) / self.width
