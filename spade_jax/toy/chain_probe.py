"""What a chain run's policy answers: per start, the second digit it writes, and the
lengths of its answers (docs/toy_world.md, "chain games").

    python -m spade_jax.export --workdir=$PWD/runs/chain_check --out=$PWD/runs/chain_check_hf
    python -m spade_jax.toy.chain_probe --workdir=runs/chain_check --model=runs/chain_check_hf

Samples ``--samples`` first turns per start and level at the agent's temperature, laid
out as the agent loop lays out a first turn (its ``ChatTurns``), and prints the copy rate,
the answer lengths, and for each start the distribution of the second digit (whether the
first successor lookup is known, start by start).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path


def probe(workdir: str, model_dir: str, levels: tuple[int, ...], samples: int) -> list[str]:
    from spade_jax.experiment import load_experiment
    from spade_jax.models import load_hf
    from spade_jax.rollout import generate
    from spade_jax.rollout.agent_loop import ChatTurns
    from spade_jax.tokenizers import load_tokenizer
    from spade_jax.toy import chain

    saved = json.loads((Path(workdir) / "config.json").read_text())
    base = int(saved["toy"]["chain_base"])
    agent = load_experiment("chain:check").agent
    model, _ = load_hf(Path(model_dir).resolve())
    tokenizer = load_tokenizer(Path(workdir) / "tokenizer" / "spm.model")
    turns = ChatTurns(tokenizer, agent.system_prompt, agent.enable_thinking,
                      agent.first_turn_template, agent.observation_role)
    lines = []
    for level in levels:
        rows, starts = [], []
        for start in range(base):
            rows += [turns.first_prompt(chain.observation(start, level))] * samples
            starts += [start] * samples
        result = generate(model, rows, agent.max_turn_tokens,
                          temperature=agent.sampler.temperature, seed=level,
                          stop_tokens=sorted(tokenizer.eos_ids))
        second = collections.defaultdict(collections.Counter)
        lengths, copied = collections.Counter(), 0
        for start, tokens in zip(starts, result.tokens, strict=True):
            found = re.search(r"\\boxed\{([0-9 ]*)\}",
                              tokenizer.decode(tokens, skip_special_tokens=True))
            digits = list(found.group(1).replace(" ", "")) if found else []
            lengths[len(digits)] += 1
            copied += bool(digits) and digits[0] == str(start)
            if len(digits) >= 2:
                second[start][digits[1]] += 1
        lines.append(f"level {level}: copy {copied / len(rows):.2f}, answer lengths "
                     f"{dict(sorted(lengths.items()))}")
        for start in range(base):
            counts, total = second[start], max(1, sum(second[start].values()))
            successor = str((start + 1) % base)
            shown = " ".join(f"{d}:{n / total:.2f}" for d, n in sorted(counts.items()))
            lines.append(f"  start {start}: second digit {shown}  "
                         f"(successor {successor}: {counts[successor] / total:.2f})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="the chain run (config, tokenizer)")
    parser.add_argument("--model", required=True, help="its exported model (spade_jax.export)")
    parser.add_argument("--levels", default="2,3")
    parser.add_argument("--samples", type=int, default=40)
    args = parser.parse_args()
    levels = tuple(int(x) for x in args.levels.split(","))
    print("\n".join(probe(args.workdir, args.model, levels, args.samples)))


if __name__ == "__main__":
    main()
