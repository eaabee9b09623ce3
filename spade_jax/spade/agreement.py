"""Multi-host agreement for the SPADE loop: every host trains on process 0's view.

Every host builds the same global batch, but each has its own sandbox (wall-clock
deadlines), its own corpus files and its own memory object. What the hosts could see
differently is made process 0's here, one broadcast per call (a no-op on one host):
prompt draws, validation verdicts, episode returns; load verdicts are those of the host
that opens an environment's first copy (:mod:`spade_jax.spade.env_copies`). An item the
deciding host accepted but a host rejected is rechecked once there; if it fails again
every host raises together (a host that went on alone would wait forever in the next
collective).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from spade_jax import distributed
from spade_jax.spade.corpus import Document
from spade_jax.spade.memory import EnvironmentRecord
from spade_jax.spade.window import Verdict

log = logging.getLogger(__name__)


def single_host() -> bool:
    return jax.process_count() == 1


def agree_prompt_draws(docs: list[list[Document]], examples: list[list[dict[str, Any]]]
                       ) -> tuple[list[list[Document]], list[list[dict[str, Any]]]]:
    """Process 0's corpus documents and memory examples for every designer prompt."""
    if single_host():
        return docs, examples
    agreed = distributed.agree_json(
        {"docs": [[dataclasses.astuple(d) for d in slot] for slot in docs], "examples": examples})
    return [[Document(*d) for d in slot] for slot in agreed["docs"]], agreed["examples"]


def agree_records(picks: list[EnvironmentRecord]) -> list[EnvironmentRecord]:
    """Process 0's memory picks (replayed environments)."""
    if single_host():
        return picks
    return [EnvironmentRecord.from_json(r) for r in distributed.agree_json([r.to_json() for r in picks])]


def agree_verdicts(stage: str, names: Sequence[str], local: Sequence[Verdict],
                   recheck: Callable[[int], Verdict],
                   primaries: Sequence[int] | None = None) -> list[Verdict]:
    """Process 0's per-item verdicts on every host (see the module docstring); with
    ``primaries``, item i's verdict is that of host ``primaries[i]`` instead (e.g. the host
    that opened the item's first environment copy, when each host opens only the copies it
    steps), gathered from every host in one all-gather."""
    if single_host():
        return list(local)
    mine_json = [v.to_json() for v in local]
    if primaries is None:
        agreed = [Verdict.from_json(v) for v in distributed.agree_json(mine_json)]
    else:
        hosts = distributed.all_gather_json(mine_json)
        agreed = ([Verdict.from_json(hosts[p][i]) for i, p in enumerate(primaries)]
                  if all(len(h) == len(local) for h in hosts) else [])
    problems = []
    if len(agreed) != len(local):
        problems.append(f"{len(local)} items here, {len(agreed)} on the deciding host(s)")
    else:
        for i, (mine, primary) in enumerate(zip(local, agreed, strict=True)):
            decider = "process 0" if primaries is None else f"process {primaries[i]}"
            if primary.ok and not mine.ok:
                again = recheck(i)
                if not again.ok:
                    problems.append(f"{names[i]} ({mine.reason!r}, then {again.reason!r} on a retry)")
                else:
                    log.warning("%s: %s failed here (%s) but passed on %s and on a retry; "
                                "kept", stage, names[i], mine.reason, decider)
            elif mine.ok and not primary.ok:
                log.warning("%s: %s passed here but failed on %s (%s); dropped",
                            stage, names[i], decider, primary.reason)
    failing = distributed.failing_hosts(bool(problems))
    if failing:
        here = (f"this host ({jax.process_index()}) rejects " + "; ".join(problems)
                if problems else f"this host ({jax.process_index()}) agrees with the deciding host")
        raise RuntimeError(
            f"multi-host {stage}: host(s) {failing} cannot reproduce the deciding host's "
            f"outcome (process 0, or the host opening an environment's first copy, accepted "
            f"what they reject, even after a retry), so the hosts would train on different "
            f"environments; {here}")
    return agreed


def agree_returns(returns: list[float]) -> list[float]:
    """Process 0's episode returns (rewards come from untrusted programs under deadlines,
    so an episode can time out on one host only). The tokens of such an episode still
    differ: the rollout would have to agree each turn's observation for those to match."""
    return _per_episode(returns, float)


def agree_drops(reasons: list[str]) -> list[str]:
    """Process 0's verdict on which plays are dropped (a play's environment time and its
    sandbox limits are measured per host)."""
    return _per_episode(reasons, str)


def agree_tools(tools: list[Any]) -> list[Any]:
    """Each episode's tool schemas (None: a text environment, or a copy another host
    steps) as known on the host that opened its copy, on every host: every host renders
    every episode's first prompt, so each needs the tools of copies it never opens."""
    if single_host():
        return tools
    known: list[Any] = [None] * len(tools)
    for host_tools in distributed.all_gather_json([None if t is None else list(t)
                                                  for t in tools]):
        if len(host_tools) != len(tools):
            raise RuntimeError(f"multi-host rollout: a host has {len(host_tools)} episodes "
                               f"where this one ({jax.process_index()}) has {len(tools)}")
        known = [k if k is not None or t is None else tuple(t)
                 for k, t in zip(known, host_tools, strict=True)]
    return known


def _per_episode(values: list[Any], cast: Callable[[Any], Any]) -> list[Any]:
    """Process 0's value for each episode of the batch; every host raises together when
    one ran a different number of episodes."""
    if single_host():
        return values
    agreed = [cast(x) for x in distributed.agree_json(list(values))]
    failing = distributed.failing_hosts(len(agreed) != len(values))
    if failing:
        raise RuntimeError(
            f"multi-host rollout: host(s) {failing} ran a different number of episodes than "
            f"process 0 (this host ({jax.process_index()}) {len(values)}, process 0 "
            f"{len(agreed)}), so their training batches would differ")
    return agreed
