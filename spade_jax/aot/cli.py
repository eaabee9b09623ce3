"""``python -m spade_jax.aot``: compile a plan and print it, or re-render stored plans.

    python -m spade_jax.aot --experiment=qwen3_30b_a3b --topology=v5p-64 --json_out=plan.json
    python -m spade_jax.aot --render=a.json,b.json

Exits 1 with "DOES NOT FIT" when a program's peak exceeds ``--hbm_fraction`` of HBM (or the
TPU compiler runs out of HBM), 2 on bad input.
"""

from __future__ import annotations

import os
import sys

from spade_jax.aot.planner import AotConfig, plan
from spade_jax.aot.report import (
    DECODE_HEADER,
    PREFILL_HEADER,
    RL_HEADER,
    TABLE_HEADER,
    decode_rows,
    format_plan,
    prefill_rows,
    read_plan,
    recost,
    rl_rows,
    table_row,
    write_plan,
)
from spade_jax.aot.rl_step import EpisodeShape
from spade_jax.aot.topology import GIB


def main(argv: list[str]) -> int:
    from absl import flags

    from spade_jax.overrides import OverrideError

    FLAGS = flags.FLAGS
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    if FLAGS.render:
        plans = []
        for path in FLAGS.render:
            try:
                plans.append(recost(read_plan(path), tuple(FLAGS.set)))
            except (OSError, ValueError, KeyError, TypeError) as e:  # missing / not a plan
                print(f"error: --render: {path} is not a readable --json_out plan: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)
                return 2
        print(tables(plans))
        return 0
    try:
        config = AotConfig(
            experiment=FLAGS.experiment, topology=FLAGS.topology, overrides=tuple(FLAGS.set),
            train_batch=FLAGS.train_batch, seq_len=FLAGS.seq_len,
            sample_batch=FLAGS.sample_batch, prompt_len=FLAGS.prompt_len,
            new_tokens=FLAGS.new_tokens, hbm_fraction=FLAGS.hbm_fraction,
            programs=tuple(FLAGS.programs), decode_layouts=tuple(FLAGS.decode_layouts),
            episodes=EpisodeShape(turns=FLAGS.turns, turn_tokens=FLAGS.turn_tokens,
                                  prompt_tokens=FLAGS.prompt_tokens,
                                  observation_tokens=FLAGS.observation_tokens))
        result = plan(config)
    except (ValueError, ImportError, FileNotFoundError, OverrideError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the TPU compiler refuses programs that exceed HBM outright
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"DOES NOT FIT: {config.experiment} on {config.topology}: the TPU compiler ran "
              f"out of HBM: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(format_plan(result))
    print(tables([result]))
    if FLAGS.json_out:
        write_plan(result, FLAGS.json_out)
    failed = [p.name for p in result.programs if not result.fits(p)]
    if failed:
        print(f"DOES NOT FIT: {', '.join(failed)} exceed {100 * config.hbm_fraction:.0f}% of "
              f"{result.topology.chip.hbm_bytes / GIB:.0f} GiB per chip on "
              f"{result.topology.name}", file=sys.stderr)
        return 1
    return 0


def tables(plans: list) -> str:
    """The markdown tables of ``plans``: programs, prefill and decode per layout, RL step
    estimates."""
    prefill = [row for p in plans for row in prefill_rows(p)]
    decode = [row for p in plans for row in decode_rows(p)]
    rl = [row for p in plans for row in rl_rows(p)]
    parts = ["\n".join([TABLE_HEADER, *(table_row(p) for p in plans)])]
    if prefill:
        parts.append("\n".join([PREFILL_HEADER, *prefill]))
    if decode:
        parts.append("\n".join([DECODE_HEADER, *decode]))
    if rl:
        parts.append("\n".join([RL_HEADER, *rl]))
    return "\n\n".join(parts)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("experiment", "qwen3_30b_a3b", "Experiment name or path.")
    flags.DEFINE_string("topology", "v5p-64", "TPU slice, e.g. v5p-64, v4-8, v5e-16, v6e-8.")
    flags.DEFINE_multi_string("set", [], "Config override section.field=value (repeatable).")
    flags.DEFINE_integer("train_batch", 0, "Global train rows (0 = microbatches x data ways).")
    flags.DEFINE_integer("seq_len", 0, "Train sequence length (0 = agent.max_episode_tokens).")
    flags.DEFINE_integer("sample_batch", 0, "Sampler rows (0 = agent episodes per round).")
    flags.DEFINE_integer("prompt_len", 0, "Prefill length (0 = the last turn's prompt bucket).")
    flags.DEFINE_integer("new_tokens", 0, "Decode buffer (0 = agent sampler max_new_tokens).")
    flags.DEFINE_float("hbm_fraction", 0.85, "Fit limit as a share of HBM.")
    flags.DEFINE_list("programs", ["train", "prefill", "decode"], "Programs to compile.")
    flags.DEFINE_list("decode_layouts", ["train", "auto"], "Sampler weight layouts to compile "
                      "the prefill and decode step for (mesh.decode_layout values).")
    shape = EpisodeShape()
    flags.DEFINE_integer("turns", shape.turns, "RL step estimate: policy turns per episode.")
    flags.DEFINE_integer("turn_tokens", shape.turn_tokens, "RL step estimate: tokens per turn.")
    flags.DEFINE_integer("prompt_tokens", shape.prompt_tokens,
                         "RL step estimate: first prompt tokens.")
    flags.DEFINE_integer("observation_tokens", shape.observation_tokens,
                         "RL step estimate: tokens added between turns.")
    flags.DEFINE_string("json_out", "", "Also write the plan's raw numbers to this JSON file.")
    flags.DEFINE_list("render", [], "Compile nothing: print the markdown table of these "
                      "--json_out files.")


def run() -> None:
    """The entry point: flags parsed by absl, exit status from :func:`main`."""
    # The TPU compiler runs on this host; the host's own backend stays CPU.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from absl import app

    define_flags()
    app.run(main)
