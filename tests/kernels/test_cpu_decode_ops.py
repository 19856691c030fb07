"""The CPU decode step's own forms of shared ops: RMSNorm, a one-token KV write and a one-row
KV gather equal the general (reference) forms exactly."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.norm import rms_norm, rms_norm_ref
from specserve.model.layers import ForwardContext


@pytest.mark.parametrize("with_residual", [False, True])
def test_cpu_rms_norm_is_the_reference_bit_for_bit(with_residual):
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(2, 3, 576, generator=g), torch.randn(2, 3, 576, generator=g)
    w = torch.randn(576, generator=g)
    if with_residual:
        y, total = rms_norm(x, w, 1e-5, res)
        assert torch.equal(total, x + res)
        assert torch.equal(y, rms_norm_ref(x + res, w, 1e-5))
    else:
        assert torch.equal(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))


def _paged(block_size=4):
    """A pool of 9 blocks [block, heads=2, block_size, dim=8] and a table whose rows hold scattered blocks."""
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(9, 2, block_size, 8, generator=g)
    table = torch.tensor([[5, 2, 7, 0], [3, 8, 1, 0]])
    return cache, table


def _ctx(row_start, write_idx, kv_len, table, block_size=4):
    w = torch.tensor(write_idx)
    return ForwardContext(row_start, w, w, kv_len, block_table=table, block_size=block_size)


def test_one_token_store_writes_the_slot_the_table_names():
    cache, table = _paged()
    expected = cache.clone()
    values = torch.randn(1, 1, 2, 8)
    ctx = _ctx(1, [[6]], 7, table)
    ctx.store(cache, values)  # row 1, index 6: block table[1, 1] = 8, offset 2
    assert torch.equal(cache[8, :, 2], values[0, 0])
    block, offset = ctx.write_at()  # the tensor form every other forward writes through
    expected[block, :, offset] = values
    assert torch.equal(cache, expected)


def test_one_row_gather_equals_that_row_of_the_batched_gather():
    cache, table = _paged()
    both = _ctx(0, [[9], [9]], 10, table).cached(cache)  # [2, heads, 10, dim]
    one = _ctx(1, [[9]], 10, table).cached(cache)
    assert one.shape == (1, 2, 10, 8)
    assert torch.equal(one, both[1:2])
    # index 5 of row 1 lives in block table[1, 1] = 8 at offset 1
    assert torch.equal(one[0, :, 5], cache[8, :, 1])
