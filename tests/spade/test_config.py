"""`SpadeConfig`'s mode fields: each is an enum, a string from an experiment file or an
override is converted once, an unknown value is refused naming the choices, and what a run
writes (config.json, the config hash) is the same plain string as before the enums."""

from __future__ import annotations

import dataclasses
import enum
import json

import pytest

from spade_jax.envs.contract import LOOP_CONTRACTS
from spade_jax.experiment import config_hash, json_value, load_experiment
from spade_jax.overrides import OverrideError, apply_overrides
from spade_jax.spade import config as spade_config
from spade_jax.spade.config import (
    Contract,
    CorpusDraws,
    GameSourceKind,
    HintMode,
    MemorySelection,
    ProgramExtraction,
    SpadeConfig,
)
from spade_jax.spade.corpus import CORPUS_DRAWS
from spade_jax.spade.extraction import PROGRAM_EXTRACTIONS
from spade_jax.spade.memory import SELECTIONS

MODE_FIELDS = [f for f in dataclasses.fields(SpadeConfig) if isinstance(f.default, enum.Enum)]


def test_every_mode_field_is_an_enum_and_takes_each_of_its_values_as_a_string():
    assert {f.name for f in MODE_FIELDS} >= {
        "hint_mode", "designer_mode", "baseline", "designer_groups", "memory_at", "contract",
        "prompt_style", "corpus_draws", "memory_selection", "program_extraction"}
    for field in MODE_FIELDS:
        kind = type(field.default)
        for member in kind:
            extra = {"contract": "paper"} if field.name == "hint_mode" else {}
            config = SpadeConfig(**{field.name: member.value, **extra})
            value = getattr(config, field.name)
            assert type(value) is kind and value is member, (field.name, member)


@pytest.mark.parametrize("field", [f.name for f in MODE_FIELDS])
def test_an_unknown_mode_is_refused_naming_the_field_and_its_choices(field):
    kind = type(SpadeConfig.__dataclass_fields__[field].default)
    with pytest.raises(ValueError) as info:
        SpadeConfig(**{field: "no_such_mode"})
    message = str(info.value)
    assert f"spade.{field}" in message and "no_such_mode" in message
    assert all(repr(m.value) in message for m in kind)


def test_overrides_convert_to_the_enum_and_refuse_unknown_values():
    config = load_experiment("tiny")
    changed = apply_overrides(config, ["spade.hint_mode=none", "spade.memory_at='regeneration'"])
    assert changed.spade.hint_mode is HintMode.NONE
    assert changed.spade.memory_at is spade_config.MemoryTiming.REGENERATION
    with pytest.raises(OverrideError, match=r"spade.corpus_draws.*'uniform'.*got 'sometimes'"):
        apply_overrides(config, ["spade.corpus_draws=sometimes"])


def test_the_enums_list_exactly_the_choices_of_the_modules_that_use_them():
    assert {m.value for m in CorpusDraws} == set(CORPUS_DRAWS)
    assert {m.value for m in MemorySelection} == set(SELECTIONS)
    assert {m.value for m in ProgramExtraction} == set(PROGRAM_EXTRACTIONS)
    assert {m.value for m in Contract} == set(LOOP_CONTRACTS)
    # An enum member looks a mode up in a module's table keyed by the plain string.
    assert PROGRAM_EXTRACTIONS[ProgramExtraction.RECIPE] is PROGRAM_EXTRACTIONS["recipe"]


def test_a_run_writes_the_same_plain_strings_and_hash_as_before():
    config = load_experiment("tiny")
    as_strings = dataclasses.replace(config, spade=dataclasses.replace(
        config.spade, hint_mode="none", designer_mode="fixed_pool"))
    as_enums = dataclasses.replace(config, spade=dataclasses.replace(
        config.spade, hint_mode=HintMode.NONE, designer_mode=spade_config.DesignerMode.FIXED_POOL))
    assert config_hash(as_strings) == config_hash(as_enums)
    written = json.loads(json.dumps(dataclasses.asdict(as_enums), default=json_value))
    assert written["spade"]["hint_mode"] == "none"
    assert written["spade"]["designer_mode"] == "fixed_pool"
    assert as_enums.spade.game_source is GameSourceKind.FIXED_POOL


def test_game_source_and_hint_properties():
    assert SpadeConfig().game_source is GameSourceKind.SELF_DESIGN
    assert SpadeConfig(baseline="fixed_env_grpo").game_source is GameSourceKind.FIXED_ENV
    assert SpadeConfig().policy_writes_hints and not SpadeConfig().designer_writes_hints
    paper = SpadeConfig(hint_mode="designer", contract="paper")
    assert paper.designer_writes_hints and not paper.policy_writes_hints
    with pytest.raises(ValueError, match="hint_mode='designer' needs spade.contract='paper'"):
        SpadeConfig(hint_mode="designer")
    with pytest.raises(ValueError, match="the tool contract's designer prompt"):
        SpadeConfig(hint_mode="designer", contract="tool")
