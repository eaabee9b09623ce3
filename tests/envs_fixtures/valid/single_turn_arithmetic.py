"""Single-turn: answer one arithmetic question; exact answer 1.0, off by one 0.5."""

import random


class Environment:
    def reset(self, seed=None):
        rng = random.Random(seed)
        self.a, self.b = rng.randint(10, 99), rng.randint(10, 99)
        return f"What is {self.a} * {self.b}? Answer with the number only.", {}

    def step(self, action):
        try:
            guess = int(action.strip())
        except ValueError:
            return "Not a number.", 0.0, True, False, {"parsed": False}
        truth = self.a * self.b
        reward = 1.0 if guess == truth else 0.5 if abs(guess - truth) == 1 else 0.0
        return f"The answer was {truth}.", reward, True, False, {"parsed": True}
