"""Multi-turn: open a 3-digit lock; 1/3 reward per digit found, feedback each turn."""

import random


class Environment:
    def reset(self, seed=None):
        rng = random.Random(seed)
        self.code = [rng.randint(0, 9) for _ in range(3)]
        self.found = [False, False, False]
        self.turn = 0
        return "A 3-digit lock. Guess like '123'. You learn which positions are right.", {}

    def step(self, action):
        self.turn += 1
        digits = [c for c in action if c.isdigit() and c.isascii()][:3]
        reward = 0.0
        marks = []
        for i in range(3):
            hit = i < len(digits) and int(digits[i]) == self.code[i]
            if hit and not self.found[i]:
                self.found[i] = True
                reward += 1 / 3
            marks.append("x" if self.found[i] else "_")
        done = all(self.found)
        truncated = not done and self.turn >= 20
        obs = f"Positions found: {''.join(marks)} (turn {self.turn}/20)"
        return obs, reward, done, truncated, {"found": sum(self.found)}
