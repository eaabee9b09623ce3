"""Multi-host agreement for the SPADE loop: every host trains on process 0's view.

Every host builds the same global batch, but each has its own sandbox (wall-clock
deadlines), its own corpus files and its own memory object. What the hosts could see
differently is made process 0's here, one broadcast per call (a no-op on one host):
prompt draws, validation and load verdicts, episode returns. An item process 0 accepted
but a host rejected is rechecked once there; if it fails again every host raises together
(a host that went on alone would wait forever in the next collective).
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
                   recheck: Callable[[int], Verdict]) -> list[Verdict]:
    """Process 0's per-item verdicts on every host (see the module docstring)."""
    if single_host():
        return list(local)
    agreed = [Verdict.from_json(v) for v in distributed.agree_json([v.to_json() for v in local])]
    problems = []
    if len(agreed) != len(local):
        problems.append(f"{len(local)} items here, {len(agreed)} on process 0")
    else:
        for i, (mine, primary) in enumerate(zip(local, agreed, strict=True)):
            if primary.ok and not mine.ok:
                again = recheck(i)
                if not again.ok:
                    problems.append(f"{names[i]} ({mine.reason!r}, then {again.reason!r} on a retry)")
                else:
                    log.warning("%s: %s failed here (%s) but passed on process 0 and on a "
                                "retry; kept", stage, names[i], mine.reason)
            elif mine.ok and not primary.ok:
                log.warning("%s: %s passed here but failed on process 0 (%s); dropped",
                            stage, names[i], primary.reason)
    failing = distributed.failing_hosts(bool(problems))
    if failing:
        here = (f"this host ({jax.process_index()}) rejects " + "; ".join(problems)
                if problems else f"this host ({jax.process_index()}) agrees with process 0")
        raise RuntimeError(
            f"multi-host {stage}: host(s) {failing} cannot reproduce process 0's outcome "
            f"(process 0 accepted what they reject, even after a retry), so the hosts "
            f"would train on different environments; {here}")
    return agreed


def agree_returns(returns: list[float]) -> list[float]:
    """Process 0's episode returns (rewards come from untrusted programs under deadlines,
    so an episode can time out on one host only). The tokens of such an episode still
    differ: the rollout would have to agree each turn's observation for those to match."""
    if single_host():
        return returns
    agreed = [float(x) for x in distributed.agree_json(list(returns))]
    failing = distributed.failing_hosts(len(agreed) != len(returns))
    if failing:
        raise RuntimeError(
            f"multi-host rollout: host(s) {failing} ran a different number of episodes than "
            f"process 0 (this host ({jax.process_index()}) {len(returns)}, process 0 "
            f"{len(agreed)}), so their training batches would differ")
    return agreed
