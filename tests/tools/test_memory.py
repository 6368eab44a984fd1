"""``specjax memory``'s sizing of what it attaches itself (abstract shapes only: no compile)."""

import dataclasses

import pytest

from specjax.memory import memory_plan
from specjax.model import ModelConfig

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=256)


def test_a_block_drafter_is_sized_with_its_layers_context_and_whole_block():
    """``drafter="block"`` on a shape without one: a DFlash-style drafter of ``block``
    positions whose layers weigh like the target's, whose context K/V is the drafter's state,
    and which verifies the whole block by default (a wider window)."""
    plain = memory_plan(CFG, batch=4, context=128, drafter=None)
    block = memory_plan(CFG, batch=4, context=128, drafter="block", block=8, block_layers=2, depth=None)
    three = memory_plan(CFG, batch=4, context=128, drafter="block", block=8, block_layers=2, depth=3)
    layer = plain.params - memory_plan(dataclasses.replace(CFG, n_layers=3), batch=4, context=128,
                                       drafter=None).params
    assert block.params - plain.params >= 2 * layer  # two layers (and their fc over the taps)
    assert block.drafter > 0 and plain.drafter == 0
    assert block.step_activation > three.step_activation  # a window of 8 tokens a row, not 4
    assert block.capacity >= three.capacity >= plain.capacity
    with pytest.raises(ValueError, match="block_layers=5 is invalid"):
        memory_plan(CFG, batch=4, context=128, drafter="block", block_layers=5)
