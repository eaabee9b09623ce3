"""Exports a trained policy from a run's checkpoint as a Hugging Face checkpoint.

    python -m spade_jax.export --workdir=runs/tiny --out=exported/tiny
    python -m spade_jax.export --workdir=gs://bucket/runs/spade_30b --step=best \
        --out=gs://bucket/exported/spade_30b --dtype=bfloat16

Writes ``config.json`` + safetensors shards (Hub tensor names and layout, the format
``transformers``, ``load_hf`` and ``python -m spade_jax.evaluate / steer / filter
--checkpoint=DIR`` read) and the run's tokenizer files. ``--workdir`` and ``--out`` may be
local or ``gs://``.

Streamed: the training checkpoint's arrays are read through TensorStore one parameter at
a time, and one layer at a time for the stacked parameters of ``scan_layers``, transposed
into the Hub layout and appended to the current shard; a shard is written once full. The
optimizer state is never read and no host ever holds the whole model.

--step: a step number, ``latest`` (default: the newest intact checkpoint) or ``best`` (the
step kept for the best held-out score, ``ExperimentConfig.best_checkpoint_metric``).
Exit status: 0 done, 2 bad arguments (missing run directory, no checkpoint, unknown step,
a non-empty --out), with a message naming the problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from spade_jax import storage
from spade_jax.checkpoint import manifest_problem, named_leaves
from spade_jax.models.config import ModelConfig, human_count
from spade_jax.models.hf_io import abstract_model, param_mappings, write_hf
from spade_jax.models.qwen3 import ModelOptions, Qwen3

MODEL_SPEC_FILE = "model.json"
CHECKPOINTS_DIR = "checkpoints"
_STATE_ITEM = "state"  # CheckpointManager's array item
_PARAMS = "params"  # TrainState's field of the model's variables
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json", "tokenizer.model")


class ExportError(ValueError):
    """A run directory, step or output directory that cannot be exported; names it."""


def write_model_spec(workdir: storage.PathLike, model: Qwen3) -> None:
    """``workdir/model.json``: the policy's architecture (Hugging Face config) and options,
    which fix the parameter tree a run checkpoint holds (a run writes it at its start)."""
    spec = {"hf_config": model.config.to_hf(), "options": dataclasses.asdict(model.options)}
    (storage.as_path(workdir) / MODEL_SPEC_FILE).write_text(json.dumps(spec, indent=2))


def read_model_spec(workdir: storage.PathLike) -> tuple[ModelConfig, ModelOptions]:
    """The policy's architecture and options as the run recorded them."""
    path = storage.as_path(workdir) / MODEL_SPEC_FILE
    if not path.exists():
        raise ExportError(f"{workdir} has no {MODEL_SPEC_FILE} (`python -m spade_jax.train` "
                          "writes it when a run starts); is this a run directory?")
    spec = json.loads(path.read_text())
    return ModelConfig.from_hf(spec["hf_config"]), ModelOptions(**spec["options"])


def intact_steps(workdir: storage.PathLike) -> list[int]:
    """Steps under ``workdir/checkpoints`` whose manifest matches their files, ascending."""
    directory = storage.as_path(workdir) / CHECKPOINTS_DIR
    if not directory.is_dir():
        return []
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    return [s for s in steps if manifest_problem(directory / str(s), s) is None]


def best_step(workdir: storage.PathLike, steps: Sequence[int]) -> int:
    """The step with the best ``best_checkpoint_metric`` among ``steps`` (Orbax stores each
    step's score in ``<step>/metrics/metrics``)."""
    workdir = storage.as_path(workdir)
    config = json.loads((workdir / "config.json").read_text())
    name, mode = config.get("best_checkpoint_metric"), config.get("best_checkpoint_mode", "max")
    scored = []
    for step in steps:
        metrics_file = workdir / CHECKPOINTS_DIR / str(step) / "metrics" / "metrics"
        if name and metrics_file.exists():
            value = json.loads(metrics_file.read_text()).get(name)
            if value is not None and np.isfinite(value):
                scored.append((value if mode == "max" else -value, step))
    if not scored:
        raise ExportError(f"no checkpoint in {workdir / CHECKPOINTS_DIR} has a {name!r} score "
                          "(was the held-out evaluation on?); give --step=N or latest")
    return max(scored)[1]


def choose_step(workdir: storage.PathLike, step: str) -> int:
    steps = intact_steps(workdir)
    if not steps:
        raise ExportError(f"no complete checkpoint in {storage.as_path(workdir) / CHECKPOINTS_DIR}")
    if step == "latest":
        return steps[-1]
    if step == "best":
        return best_step(workdir, steps)
    if not step.isdigit() or int(step) not in steps:
        raise ExportError(f"--step={step}: no complete checkpoint of that step; "
                          f"available: {steps}, latest, best")
    return int(step)


def param_keys(config: ModelConfig, options: ModelOptions) -> dict[tuple, str]:
    """nnx path of each model variable -> its key in a run checkpoint's ``state`` item.

    A run stores its ``TrainState`` through ``checkpoint.named_arrays``: each array under
    its tree path, the model's variables under ``params/`` (``params`` holds
    ``nnx.split(model)``'s state), e.g. ``params/layers/0/attn/q_dnh``."""
    _, state = nnx.split(abstract_model(config, options))
    named = named_leaves({_PARAMS: state})
    flat = [tuple(path) for path, _ in nnx.to_flat_state(state)]
    if len(flat) != len(named):
        raise AssertionError("nnx flat state and pytree leaves disagree")
    return dict(zip(flat, named, strict=True))


class CheckpointArrays:
    """Reads single arrays, or one index of a stacked array, from a run checkpoint's
    ``state`` item through TensorStore (the store Orbax wrote it with), without restoring
    the rest: never more than the slice asked for is in host memory."""

    def __init__(self, state_dir: storage.PathLike) -> None:
        import tensorstore as ts

        self.state_dir = storage.as_path(state_dir)
        metadata = json.loads((self.state_dir / "_METADATA").read_text())
        self._use_ocdbt = bool(metadata.get("use_ocdbt", True))
        self._use_zarr3 = bool(metadata.get("use_zarr3", False))
        self._context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 0}})

    def open(self, key: str, shape: tuple[int, ...], what: tuple):
        """The TensorStore of array ``key``, checked to have ``shape``."""
        import tensorstore as ts

        info = ocp.type_handlers.ParamInfo(
            name=key, parent_dir=self.state_dir, path=self.state_dir / key,
            is_ocdbt_checkpoint=self._use_ocdbt, use_zarr3=self._use_zarr3,
            ts_context=self._context)
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._use_ocdbt)
        array = ts.open(spec, context=self._context, open=True).result()
        if tuple(array.shape) != tuple(shape):
            raise ExportError(f"checkpoint array {key} has shape {tuple(array.shape)} but the "
                              f"model's {'/'.join(map(str, what))} needs {tuple(shape)}: the "
                              f"checkpoint does not match {MODEL_SPEC_FILE}")
        return array


def checkpoint_tensors(workdir: storage.PathLike, step: int, config: ModelConfig,
                       options: ModelOptions, dtype: str) -> Iterator[tuple[str, np.ndarray]]:
    """The step's parameters as (HF name, array in ``dtype``), one parameter (one layer of a
    stacked one) read at a time."""
    arrays = CheckpointArrays(storage.as_path(workdir) / CHECKPOINTS_DIR / str(step) / _STATE_ITEM)
    keys = param_keys(config, options)
    target = jnp.dtype(dtype)
    for mapping in param_mappings(config, options.scan_layers):
        array = arrays.open(keys[mapping.path], mapping.shape, mapping.path)
        if not mapping.layers:
            yield from mapping.export(np.asarray(array.read().result()).astype(target))
            continue
        for index, layer_mapping in enumerate(mapping.layers):  # one layer at a time
            yield from layer_mapping.export(np.asarray(array[index].read().result()).astype(target))


def copy_tokenizer(workdir: storage.PathLike, out: storage.PathLike) -> list[str]:
    """The run's tokenizer files into ``out``: the sentencepiece model trained in
    ``workdir/tokenizer``, else the files of the configured ``tokenizer.path``."""
    workdir, out = storage.as_path(workdir), storage.as_path(out)
    trained = workdir / "tokenizer" / "spm.model"
    if trained.exists():
        sources = [trained]
    else:
        config = json.loads((workdir / "config.json").read_text()) if (
            workdir / "config.json").exists() else {}
        path = (config.get("tokenizer") or {}).get("path")
        if not path:
            return []
        source = storage.as_path(path)
        sources = ([source] if not source.is_dir() else
                   [source / n for n in _TOKENIZER_FILES if (source / n).exists()])
    for source in sources:
        (out / source.name).write_bytes(source.read_bytes())
    return [s.name for s in sources]


def export(workdir: storage.PathLike, out: storage.PathLike, *, step: str = "latest",
           dtype: str = "float32", max_shard_bytes: int = 5 * 1024**3) -> tuple[int, list[str]]:
    """Writes step ``step`` of the run in ``workdir`` to ``out``; returns (step, files)."""
    workdir, out = storage.as_path(workdir), storage.as_path(out)
    if not workdir.is_dir():
        raise ExportError(f"run directory {workdir} does not exist")
    if out.exists() and any(True for _ in out.iterdir()):
        raise ExportError(f"--out {out} exists and is not empty; choose a new directory")
    config, options = read_model_spec(workdir)
    chosen = choose_step(workdir, step)
    if jax.process_index() != 0:  # the files are process 0's to write
        return chosen, []
    files = write_hf(checkpoint_tensors(workdir, chosen, config, options, dtype), config, out,
                     dtype=dtype, max_shard_bytes=max_shard_bytes)
    return chosen, files + copy_tokenizer(workdir, out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spade_jax.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="run directory (local or gs://)")
    p.add_argument("--out", required=True, help="new output directory (local or gs://)")
    p.add_argument("--step", default="latest", help="N, latest or best")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--max_shard_gb", type=float, default=5.0, help="safetensors shard size")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.time()
    try:
        step, files = export(args.workdir, args.out, step=args.step, dtype=args.dtype,
                             max_shard_bytes=int(args.max_shard_gb * 1024**3))
    except (ExportError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    config, _ = read_model_spec(args.workdir)
    print(f"exported step {step} of {args.workdir} ({config.architecture}, "
          f"{human_count(config.param_count())} params) to {args.out} in "
          f"{time.time() - start:.1f}s: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
