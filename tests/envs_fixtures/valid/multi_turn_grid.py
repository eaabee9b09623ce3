"""Multi-turn text navigation on a 4x4 grid with a key and a door (two partial rewards)."""

import random
from dataclasses import dataclass

MOVES = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}


@dataclass
class State:
    x: int
    y: int
    has_key: bool = False


class Environment:
    def reset(self, seed=None):
        rng = random.Random(seed)
        cells = [(x, y) for x in range(4) for y in range(4)]
        rng.shuffle(cells)
        (sx, sy), self.key, self.door = cells[0], cells[1], cells[2]
        self.state = State(sx, sy)
        self.t = 0
        return self._describe("Find the key, then the door. Moves: up/down/left/right."), {}

    def _describe(self, prefix):
        s = self.state
        target = self.door if s.has_key else self.key
        return f"{prefix} You are at {(s.x, s.y)}; the {'door' if s.has_key else 'key'} is at {target}."

    def step(self, action):
        self.t += 1
        move = MOVES.get(action.strip().lower())
        reward = 0.0
        if move is not None:
            self.state.x = min(3, max(0, self.state.x + move[0]))
            self.state.y = min(3, max(0, self.state.y + move[1]))
        here = (self.state.x, self.state.y)
        if not self.state.has_key and here == self.key:
            self.state.has_key, reward = True, 0.4
        elif self.state.has_key and here == self.door:
            return "You escape!", 0.6, True, False, {"t": self.t}
        return self._describe("Ok." if move else "Unknown move."), reward, False, self.t >= 30, {}
