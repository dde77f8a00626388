"""Addition of two digits with partial credit, some sums held out: a task a tiny random model
learns in minutes (`make demo`), with an honest held-out evaluation.

Prompt: "a+b=" for digits a, b. Reward: 1 for a completion that starts with the sum, less the
further off (1 - |guess - sum| / 10, at least 0), 0 without a number. Partial credit gives a
random model a signal: inside a group a guess near the sum beats one far from it, where
right-or-wrong would score 0 everywhere.

Of the 100 sums, the 40 with (3a + b) % 5 < 2 are held out: training never draws them,
evaluate() asks only them (greedy), so a gain there is not a memory of the prompt. Each a and
each b is in 4 held-out sums and 6 trained ones. Metrics, per held-out sum: credit (the reward),
number (the completion starts with a number) and accuracy (the exact sum).
"""
import re

DIGITS = range(10)


def held_out(a: int, b: int) -> bool:
    return (3 * a + b) % 5 < 2


TRAIN = [(a, b) for a in DIGITS for b in DIGITS if not held_out(a, b)]
HELD_OUT = [(a, b) for a in DIGITS for b in DIGITS if held_out(a, b)]


class AddTask:
    name = "add"
    min_reward = 0.0
    # what the demo's tiny model needs: a high rate (it starts from random weights), room for a
    # number (3 tokens: with more it drifts into digits that spoil it), and steps enough for the
    # reward to rise and level off (make demo)
    trainer_settings = {"learning_rate": 3e-3, "max_new_tokens": 3, "steps": 100,
                        "eval_interval": 20}

    def prompts(self, n, rng):
        return ["{}+{}=".format(*rng.choice(TRAIN)) for _ in range(n)]

    def reward(self, prompt, completion):
        guess = re.match(r"\s*(\d+)", completion)   # the number the completion starts with
        a, b = prompt[:-1].split("+")
        return max(0.0, 1 - abs(int(guess[1]) - int(a) - int(b)) / 10) if guess else 0.0

    def evaluate(self, complete):
        prompts = [f"{a}+{b}=" for a, b in HELD_OUT]
        texts = complete(prompts)
        credit = list(map(self.reward, prompts, texts))
        return {"credit": credit, "number": [bool(re.match(r"\s*\d", t)) for t in texts],
                "accuracy": [c == 1 for c in credit]}
