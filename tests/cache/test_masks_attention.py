"""Masks and the XLA reference attention against NumPy loop references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specjax.attention import live_attention, live_block_bounds, masked_attention, reference_attention
from specjax.masks import MASK_VALUE, make_left_padded_causal_mask

from refs import ref_attention, ref_visible

B, T, D = 4, 24, 8


@st.composite
def ragged(draw, t_q_max=8):
    t_q = draw(st.integers(1, t_q_max))
    q_start = np.array([draw(st.integers(0, T - t_q)) for _ in range(B)], np.int32)
    lead = np.array([draw(st.integers(0, int(qs) + t_q)) for qs in q_start], np.int32)  # may exceed: empty
    window = draw(st.sampled_from([None, 3, 7]))
    return t_q, q_start, lead, window


@given(ragged())
def test_mask_matches_loop_reference(case):
    t_q, q_start, lead, window = case
    m = np.asarray(make_left_padded_causal_mask(lead, q_start, t_q, T, window))
    assert m.shape == (B, 1, t_q, T) and m.dtype == np.float32
    q_pos = q_start[:, None] + np.arange(t_q)[None]
    key_pos = np.broadcast_to(np.arange(T), (B, T))
    vis = ref_visible(q_pos, key_pos, lead, window)
    np.testing.assert_array_equal(m[:, 0] == 0.0, vis)
    assert np.isfinite(m).all() and (m[~vis[:, None]] <= -1e9).all()


_attn = jax.jit(reference_attention, static_argnames=("window",))


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1), (8, 2)])
@given(case=ragged(), seed=st.integers(0, 2**16))
def test_attention_matches_loop_reference(hq, hkv, case, seed):
    t_q, q_start, lead, window = case
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t_q, hq, D)).astype(np.float32)
    k = rng.standard_normal((B, hkv, T, D)).astype(np.float32)
    v = rng.standard_normal((B, hkv, T, D)).astype(np.float32)
    out = np.asarray(_attn(q, k, v, lead, q_start, window=window))
    q_pos = q_start[:, None] + np.arange(t_q)[None]
    ref = ref_attention(q, k, v, q_pos, np.broadcast_to(np.arange(T), (B, T)), lead, window)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


def test_query_with_no_visible_key_returns_zeros():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 2, D)).astype(np.float32)
    k = rng.standard_normal((2, 2, T, D)).astype(np.float32)
    lead = np.array([0, 20], np.int32)  # row 1: lead pad past every query position
    out = np.asarray(reference_attention(q, k, k, lead, np.array([4, 4], np.int32)))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], 0.0)
    assert np.abs(out[0]).sum() > 0


def test_bfloat16_inputs_softmax_in_float32():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, 4, 4, D)).astype(np.float32)
    k = rng.standard_normal((B, 2, T, D)).astype(np.float32)
    lead, qs = np.zeros(B, np.int32), np.array([0, 5, 10, 20], np.int32)
    ref = np.asarray(reference_attention(q, k, k, lead, qs))
    bf = reference_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, k)), lead, qs)
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf, np.float32), ref, atol=5e-2)


def test_zero_filled_prefix_is_not_a_masked_prefix():
    """Why dead slots are masked, not zeroed: a zero K row scores logit 0 and takes weight."""
    rng = np.random.default_rng(2)
    lead = 6
    q = rng.standard_normal((1, 1, 1, D)).astype(np.float32) * 0.5
    k = rng.standard_normal((1, 1, T, D)).astype(np.float32)
    v = rng.standard_normal((1, 1, T, D)).astype(np.float32) + 2.0
    q_start = np.array([12], np.int32)
    masked = np.asarray(reference_attention(q, k, v, np.array([lead], np.int32), q_start))
    kz, vz = k.copy(), v.copy()
    kz[:, :, :lead] = 0.0
    vz[:, :, :lead] = 0.0
    zeroed = np.asarray(reference_attention(q, kz, vz, np.array([0], np.int32), q_start))
    # zero keys score exp(0) each: 6 dead slots take real softmax weight
    s = (q[0, 0, 0] @ k[0, 0, lead:13].T) * D**-0.5
    dead_weight = lead / (lead + np.exp(s - 0).sum())
    assert dead_weight > 0.05
    assert np.abs(masked - zeroed).max() > 1e-2
    # while the masked run equals attention over the live slots alone
    live = np.asarray(reference_attention(q, k[:, :, lead:], v[:, :, lead:], np.array([0], np.int32), q_start - lead))
    np.testing.assert_allclose(masked, live, atol=1e-6)


def test_masked_attention_ignores_values_behind_the_mask():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 2, D)).astype(np.float32)
    k = rng.standard_normal((1, 2, T, D)).astype(np.float32)
    mask = make_left_padded_causal_mask(np.array([3]), np.array([8]), 2, T)
    a = masked_attention(q, k, k, mask)
    k2 = k.copy()
    k2[:, :, :3] = 1e4  # garbage in dead slots
    k2[:, :, 10:] = -1e4
    np.testing.assert_array_equal(np.asarray(a), np.asarray(masked_attention(q, k2, k2, mask)))
    assert MASK_VALUE <= -1e9


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(k=np.zeros((B, 3, T, D), np.float32)), r"query heads 4 must be a multiple of kv heads 3"),
        (dict(q=np.zeros((B, 4, D), np.float32)), r"rank 4"),
    ],
)
def test_attention_bad_input(kwargs, match):
    args = dict(q=np.zeros((B, 2, 4, D), np.float32), k=np.zeros((B, 2, T, D), np.float32))
    args |= kwargs
    with pytest.raises(ValueError, match=match):
        reference_attention(args["q"], args["k"], args["k"], np.zeros(B, np.int32), np.zeros(B, np.int32))


# ----------------------------------------------------------------------------- live range


def _blocked_reader(k, v, block, touched):
    def read(j):
        touched.append(j)
        kb = jax.lax.dynamic_slice_in_dim(k, j * block, block, axis=2)
        vb = jax.lax.dynamic_slice_in_dim(v, j * block, block, axis=2)
        return kb, vb, (j * block + jnp.arange(block, dtype=jnp.int32))[None]

    return read


def _random_case(t_q, q_start, seed):
    """Random ``q [B, t_q, 4, D]``, ``k, v [B, 2, T, D]`` and the queries' positions from ``q_start``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, t_q, 4, D)).astype(np.float32)
    k = rng.standard_normal((B, 2, T, D)).astype(np.float32)
    v = rng.standard_normal((B, 2, T, D)).astype(np.float32)
    return q, k, v, (q_start[:, None] + np.arange(t_q)[None]).astype(np.int32)


@pytest.mark.parametrize("block", [4, 8, 24])
@given(case=ragged(), seed=st.integers(0, 2**16))
def test_live_attention_matches_loop_reference(block, case, seed):
    """The XLA live-range path (online softmax over live blocks) equals the NumPy reference."""
    t_q, q_start, lead, window = case
    q, k, v, q_pos = _random_case(t_q, q_start, seed)
    out = live_attention(jnp.asarray(q), _blocked_reader(jnp.asarray(k), jnp.asarray(v), block, []),
                         jnp.asarray(q_pos), jnp.asarray(lead), block=block, num_blocks=T // block, window=window)
    ref = ref_attention(q, k, v, q_pos, np.broadcast_to(np.arange(T), (B, T)), lead, window)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=2e-5)


@given(case=ragged())
def test_live_block_bounds_cover_exactly_the_visible_blocks(case):
    """[first, stop) holds every block with a key visible to some query, and no block past
    the batch's last query (the cost follows the longest live row, not the capacity)."""
    t_q, q_start, lead, window = case
    block, nb = 4, T // 4
    q_pos = q_start[:, None] + np.arange(t_q)[None]
    vis = ref_visible(q_pos, np.broadcast_to(np.arange(T), (B, T)), lead, window).any(axis=(0, 1))
    first, stop = (int(x) for x in live_block_bounds(jnp.asarray(q_pos), jnp.asarray(lead), window, block, nb))
    used = np.nonzero(vis)[0] // block
    if len(used):
        assert first <= used.min() and stop >= used.max() + 1
    assert stop <= int(q_pos.max()) // block + 1


def test_live_attention_never_reads_blocks_past_the_longest_row():
    """NaN in every block past the batch's last query: the output stays finite and exact (which
    blocks are visited: ``test_live_block_bounds_cover_exactly_the_visible_blocks``)."""
    rng = np.random.default_rng(5)
    cap, block = 64, 8
    q = rng.standard_normal((2, 2, 2, D)).astype(np.float32)
    k = rng.standard_normal((2, 1, cap, D)).astype(np.float32)
    v = rng.standard_normal((2, 1, cap, D)).astype(np.float32)
    q_start = np.array([9, 20], np.int32)  # last query at 21: blocks 0..2 are live
    k[:, :, 24:] = np.nan
    v[:, :, 24:] = np.nan
    q_pos = q_start[:, None] + np.arange(2)[None]
    lead = np.zeros(2, np.int32)
    out = np.asarray(live_attention(jnp.asarray(q), _blocked_reader(jnp.asarray(k), jnp.asarray(v), block, []),
                                    jnp.asarray(q_pos), jnp.asarray(lead), block=block, num_blocks=cap // block))
    assert np.isfinite(out).all()
    ref = ref_attention(q, np.nan_to_num(k), np.nan_to_num(v), q_pos, np.broadcast_to(np.arange(cap), (2, cap)), lead)
    np.testing.assert_allclose(out, ref, atol=2e-5)


def _poison_unseen(k, v, q_pos, key_pos, lead, window, value):
    """``k, v`` with ``value`` (NaN or Inf) in every slot no query of its row sees."""
    seen = ref_visible(q_pos, key_pos, lead, window).any(axis=1)  # [B, T]
    k, v = k.copy(), v.copy()
    k[~seen[:, None].repeat(k.shape[1], 1)] = value
    v[~seen[:, None].repeat(v.shape[1], 1)] = value
    return k, v, seen


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@given(case=ragged(), seed=st.integers(0, 2**16), block=st.sampled_from([4, 8, 24]))
def test_non_finite_values_in_unseen_slots_never_reach_a_row(value, case, seed, block):
    """A masked slot may hold anything (a model's NaN at a padding position): the reference and
    the live-range path give what they give with zeros there (``0 * NaN`` is NaN, so the zero
    weight alone would not hide it)."""
    t_q, q_start, lead, window = case
    q, k0, v0, q_pos = _random_case(t_q, q_start, seed)
    key_pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    k, v, seen = _poison_unseen(k0, v0, q_pos, key_pos, lead, window, value)
    ref = ref_attention(q, np.where(np.isfinite(k), k, 0), np.where(np.isfinite(v), v, 0), q_pos, key_pos, lead,
                        window)
    dense = np.asarray(_attn(q, k, v, lead, q_start, window=window))
    live = np.asarray(live_attention(jnp.asarray(q), _blocked_reader(jnp.asarray(k), jnp.asarray(v), block, []),
                                     jnp.asarray(q_pos), jnp.asarray(lead), block=block, num_blocks=T // block,
                                     window=window))
    for out in (dense, live):
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
