"""How a hint is shown to the agent: the one presentation the SPADE loop, evaluation and
the hint filter share (re-exported as ``spade_jax.spade.prompts.agent_first_observation``)."""

from __future__ import annotations


def agent_first_observation(observation: str, hint: str | None) -> str:
    """The agent's first user turn: the observation, with "\\n\\nHINT: <hint>" appended when
    the episode is in the hint arm (`hint` is not None), as the recipe shows it. Later
    turns never carry the hint, and the environment program never receives it."""
    if hint is None:
        return observation
    if not isinstance(hint, str) or not hint.strip():
        raise ValueError("hint arm needs a non-empty hint (pass None for the no-hint arm)")
    return f"{observation}\n\nHINT: {hint.strip()}"
