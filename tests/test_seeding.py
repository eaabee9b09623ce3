import numpy as np
import pytest

from spade_jax.seeding import Phase, derive_seed, rng


def test_distinct_tuples_give_distinct_seeds():
    seeds = {derive_seed(7, step, phase, i) for step in range(20) for phase in Phase
             for i in range(5)}
    assert len(seeds) == 20 * len(Phase) * 5
    # base + index would collide here: (step 1, call 0) vs (step 0, call 1)
    assert derive_seed(0, 1, Phase.AGENT, 0) != derive_seed(0, 0, Phase.AGENT, 1)


def test_same_tuple_same_stream():
    assert derive_seed(3, 4, Phase.DESIGN) == derive_seed(3, 4, Phase.DESIGN)
    a, b = rng(3, 4, Phase.DESIGN).random(8), rng(3, 4, Phase.DESIGN).random(8)
    np.testing.assert_array_equal(a, b)
    assert 0 <= derive_seed(2**40, 1) < 2**31


def test_negative_part_is_refused():
    with pytest.raises(ValueError, match="seed parts"):
        derive_seed(1, -1)


def test_trailing_zero_parts_name_another_stream():
    """SeedSequence zero-pads its entropy: the tuple's length must be part of the key."""
    assert derive_seed(1, 2) != derive_seed(1, 2, 0) != derive_seed(1, 2, 0, 0)
    assert derive_seed(5, 0, Phase.AGENT) != derive_seed(5, 0, Phase.AGENT, 0)
    assert not np.array_equal(rng(1, 2).random(4), rng(1, 2, 0).random(4))
