"""Converts checkpoints between Hugging Face safetensors and Orbax.

    # Hugging Face directory -> Orbax checkpoint (what training runs start from)
    python -m spade_jax.convert --hf_dir=/ckpt/Qwen3-30B-A3B --out_dir=/ckpt/qwen3_30b_orbax

    # Orbax checkpoint -> Hugging Face directory that transformers loads
    python -m spade_jax.convert --to_hf --orbax_dir=/ckpt/qwen3_30b_orbax --out_dir=/ckpt/hf_export
"""

from __future__ import annotations

import sys
import time

import jax.numpy as jnp
from absl import app, flags

from spade_jax.models.config import ConfigError, human_count
from spade_jax.models.hf_io import load_hf, save_hf
from spade_jax.models.orbax_io import load_orbax, save_orbax
from spade_jax.models.safetensors_io import CheckpointError

FLAGS = flags.FLAGS
flags.DEFINE_string("hf_dir", None, "Hugging Face checkpoint directory (config.json + *.safetensors).")
flags.DEFINE_string("orbax_dir", None, "Orbax checkpoint directory (with --to_hf).")
flags.DEFINE_string("out_dir", None, "Where to write the converted checkpoint.")
flags.DEFINE_bool("to_hf", False, "Convert an Orbax checkpoint (--orbax_dir) back to Hugging Face.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter dtype.")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.out_dir:
        raise app.UsageError("--out_dir is required")
    dtype = jnp.dtype(FLAGS.dtype)
    start = time.time()
    try:
        if FLAGS.to_hf:
            if not FLAGS.orbax_dir:
                raise app.UsageError("--to_hf needs --orbax_dir")
            model, config = load_orbax(FLAGS.orbax_dir, dtype)
            save_hf(model, config, FLAGS.out_dir)
        else:
            if not FLAGS.hf_dir:
                raise app.UsageError("--hf_dir is required (or --to_hf with --orbax_dir)")
            model, config = load_hf(FLAGS.hf_dir, dtype)
            save_orbax(model, config, FLAGS.out_dir)
    except (CheckpointError, ConfigError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"converted {config.architecture} ({human_count(config.param_count())} params) "
          f"to {FLAGS.out_dir} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    app.run(main)
