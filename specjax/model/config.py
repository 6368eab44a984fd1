"""Model configuration: a frozen dataclass, hashable, usable as a jit static argument."""

from __future__ import annotations

import dataclasses
import functools

from specjax.model.rope import RopeScaling

__all__ = ["ModelConfig", "RopeScaling"]

MLP_ACTS = ("silu", "gelu_tanh")
MTP_LAYOUTS = ("specjax", "native", "eagle3")
# the settings a block drafter's layers may hold apart from the target's (``block_overrides``)
BLOCK_OVERRIDES = ("n_heads", "n_kv_heads", "head_dim", "d_ff", "qk_norm", "qkv_bias", "rope_theta", "rope_scaling",
                   "norm_eps", "norm_offset", "sandwich_norm", "mlp_act", "query_pre_attn_scalar")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder.

    ``sliding_window``: if set, layers are local (sliding window) except, with
    ``global_every = k > 0``, every k-th layer (``i % k == k - 1``), which is global.
    ``mtp_depth``: how many tokens the MTP module may draft per step (chained).
    ``mtp_draft_vocab = N > 0``: the MTP module drafts over ``N`` of the target's tokens (EAGLE-3's
    draft vocabulary): its own head ``mtp.draft_head [d, N]`` after the target's final norm, and
    ``mtp.draft_ids [N]`` (int32) mapping each draft index to its target token. A token outside
    is never drafted (its draft probability is 0: verification stays lossless); the head costs
    ``N / vocab_size`` of the target's. 0: the target's own head over the whole vocabulary.
    ``mtp_layout``: how the MTP module reads and writes hidden states (``MTP_LAYOUTS``):
    ``"specjax"`` (its own: the target's pre-norm hidden in, ``proj`` over [hidden ‖ embedding],
    one block, the target's final norm before the head, its pre-norm output fed back);
    ``"native"`` (the MTP layers shipped inside MiMo and DeepSeek-V3 checkpoints: the target's
    final-normed hidden in, a final norm of its own, ``mtp.final_norm``, whose output is the
    head's input and what a chain feeds back); ``"eagle3"`` (an EAGLE-3 head: the target's
    hidden states after the layers ``mtp_taps`` projected by ``mtp.fc``; the layer's attention
    reads [embedding ‖ hidden] (``2 d`` wide) and its residual is the hidden; its own final norm
    before the head; its pre-norm output fed back). ``mtp_overrides``: ``(name, value)`` pairs
    (``BLOCK_OVERRIDES``' names) where the MTP layer differs from the model's (``mtp_config``).
    ``compressed_layers``: layers with compressed memory (``specjax.cache.compressed``): each
    attends to the raw K/V of its last ``compress_window`` tokens (back to the start of the
    oldest block not yet compressed) and to one mean-pooled K/V slot per full block of
    ``compress_block`` older tokens. They take precedence over ``sliding_window``.

    RoPE: global layers rotate with ``rope_theta`` and ``rope_scaling``; local layers too,
    unless ``local_rope_theta`` is set (then with it and ``local_rope_scaling``: Gemma 3).
    Checkpoint families (``specjax.hf``): ``qk_norm`` (per-head RMSNorm of q and k before
    RoPE: Qwen3, Gemma 3); ``norm_offset`` (RMSNorm weight applied as ``offset + w``:
    Gemma's ``1 + w``); ``sandwich_norm`` (RMSNorm after attention and after the MLP, before
    each residual add: Gemma 3); ``mlp_act`` (``"silu"`` SwiGLU or ``"gelu_tanh"`` GeGLU);
    ``embed_scale`` (embeddings multiplied by it, in their dtype); ``query_pre_attn_scalar``
    (attention scale ``s ** -0.5`` instead of ``head_dim ** -0.5``).

    ``block_size = k > 0``: the model carries a block drafter (``specjax.model.block``, DFlash
    style): ``block_layers`` decoder layers shaped like the model's that draft ``k - 1`` tokens in
    one pass over a block of the row's last token and ``k - 1`` copies of ``block_mask_id``,
    conditioned on the model's hidden states after the layers ``block_taps``. 0: none.
    ``block_overrides``: ``(name, value)`` pairs (names in ``BLOCK_OVERRIDES``) where the
    drafter's layers differ from the model's: a loaded DFlash drafter's heads, ``head_dim``,
    ``d_ff``, q/k norms, RoPE and norm settings (``block_config`` is the config its layers run
    with). Its width is always ``d_model``: it reads the model's embedding and LM head.

    ``shard_groups = G``: the fused ``wqkv`` holds ``G`` column groups ``[q_g | k_g | v_g]`` (each
    group ``1/G`` of the heads) and ``w_gate_up`` ``G`` groups ``[gate_g | up_g]``, so a column
    split over ``G`` devices keeps each device's q, k, v (gate, up) together. ``1``: the plain
    ``[q | k | v]`` layout. Set by ``specjax.sharding.shard_model``, never by checkpoints.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    sliding_window: int | None = None
    global_every: int = 0
    mtp_depth: int = 1
    mtp_draft_vocab: int = 0
    mtp_layout: str = "specjax"
    mtp_taps: tuple[int, ...] = ()
    mtp_overrides: tuple[tuple[str, object], ...] = ()
    head_dim: int | None = None  # None: d_model // n_heads (always an int after construction)
    tie_embeddings: bool = True
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    compressed_layers: tuple[int, ...] = ()
    compress_window: int | None = None
    compress_block: int | None = None
    rope_scaling: RopeScaling | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norm: bool = False
    mlp_act: str = "silu"
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    block_size: int = 0
    block_layers: int = 0
    block_taps: tuple[int, ...] = ()
    block_mask_id: int = 0
    block_overrides: tuple[tuple[str, object], ...] = ()
    shard_groups: int = 1  # column groups of the fused wqkv / w_gate_up (tensor parallelism: specjax.sharding)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig.{name} must be an int >= 1, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads} (or set head_dim)")
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise ValueError(f"head_dim must be an even int >= 2, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.global_every < 0:
            raise ValueError(f"global_every must be >= 0, got {self.global_every}")
        if self.mtp_depth < 0:
            raise ValueError(f"mtp_depth must be >= 0, got {self.mtp_depth}")
        if not isinstance(self.mtp_draft_vocab, int) or not 0 <= self.mtp_draft_vocab <= self.vocab_size:
            raise ValueError(f"mtp_draft_vocab={self.mtp_draft_vocab!r} is invalid: an int in [0, vocab_size="
                             f"{self.vocab_size}] (0: the target's head over the whole vocabulary)")
        self._check_mtp()
        layers = tuple(int(i) for i in self.compressed_layers)  # a JSON list becomes a (hashable) tuple
        object.__setattr__(self, "compressed_layers", layers)
        if layers:
            if len(set(layers)) != len(layers) or not all(0 <= i < self.n_layers for i in layers):
                raise ValueError(f"compressed_layers={layers} must be distinct layer indices in [0, {self.n_layers})")
            for name in ("compress_window", "compress_block"):
                v = getattr(self, name)
                if not isinstance(v, int) or v < 1:
                    raise ValueError(f"ModelConfig.{name} must be an int >= 1 with compressed_layers, got {v!r}")
        elif self.compress_window is not None or self.compress_block is not None:
            raise ValueError("compress_window/compress_block are set but compressed_layers is empty")
        for name in ("rope_scaling", "local_rope_scaling"):  # a JSON dict becomes the (hashable) dataclass
            v = getattr(self, name)
            if isinstance(v, dict):
                object.__setattr__(self, name, RopeScaling(**v))
            elif v is not None and not isinstance(v, RopeScaling):
                raise ValueError(f"ModelConfig.{name} must be a RopeScaling, a dict or None, got {v!r}")
        if self.local_rope_scaling is not None and self.local_rope_theta is None:
            raise ValueError("local_rope_scaling is set but local_rope_theta is None")
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"ModelConfig.mlp_act must be one of {list(MLP_ACTS)}, got {self.mlp_act!r}")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar must be > 0 or None, got {self.query_pre_attn_scalar!r}")
        self._check_block()
        g = self.shard_groups
        if not isinstance(g, int) or g < 1 or self.n_heads % g or self.n_kv_heads % g or self.d_ff % g:
            raise ValueError(f"shard_groups={g!r} must be an int >= 1 dividing n_heads={self.n_heads}, "
                             f"n_kv_heads={self.n_kv_heads} and d_ff={self.d_ff}")
        if self.head_dim is None:  # one field, always concrete: no second name for the head size
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        for name, make in (("block_overrides", _make_block_config), ("mtp_overrides", _make_mtp_config)):
            if getattr(self, name):
                try:
                    make(self)
                except ValueError as e:
                    raise ValueError(f"{name}={dict(getattr(self, name))} are invalid: {e}") from None

    def _check_block(self) -> None:
        taps = tuple(int(i) for i in self.block_taps)  # a JSON list becomes a (hashable) tuple
        object.__setattr__(self, "block_taps", taps)
        pairs = self._overrides("block_overrides")
        if not self.block_size:
            if self.block_layers or taps or pairs:
                raise ValueError("block_layers/block_taps/block_overrides are set but block_size is 0 (no block "
                                 "drafter)")
            return
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size={self.block_size!r} is invalid: an int >= 2 (the block's last token and "
                             "at least one draft), or 0 for no block drafter")
        if not isinstance(self.block_layers, int) or self.block_layers < 1:
            raise ValueError(f"block_layers={self.block_layers!r} is invalid: an int >= 1 with block_size")
        if not taps or len(set(taps)) != len(taps) or not all(0 <= i < self.n_layers for i in taps):
            raise ValueError(f"block_taps={taps} is invalid: distinct target layer indices in [0, {self.n_layers})")
        if not 0 <= self.block_mask_id < self.vocab_size:
            raise ValueError(f"block_mask_id={self.block_mask_id} is invalid: a token id in [0, {self.vocab_size})")

    def _overrides(self, name: str) -> tuple:
        """``block_overrides`` / ``mtp_overrides`` as sorted hashable pairs (from a dict or JSON's lists)."""
        v = getattr(self, name)
        pairs = v.items() if isinstance(v, dict) else v
        pairs = tuple(sorted((str(k), RopeScaling(**x) if k == "rope_scaling" and isinstance(x, dict) else x)
                             for k, x in pairs))
        object.__setattr__(self, name, pairs)
        unknown = sorted({k for k, _ in pairs} - set(BLOCK_OVERRIDES))
        if unknown:
            raise ValueError(f"{name} has {unknown[0]!r}, which a drafter layer cannot override: one of "
                             f"{list(BLOCK_OVERRIDES)}")
        return pairs

    def _check_mtp(self) -> None:
        taps = tuple(int(i) for i in self.mtp_taps)
        object.__setattr__(self, "mtp_taps", taps)
        self._overrides("mtp_overrides")
        if self.mtp_layout not in MTP_LAYOUTS:
            raise ValueError(f"mtp_layout={self.mtp_layout!r} is invalid: one of {list(MTP_LAYOUTS)}")
        if (self.mtp_layout == "eagle3") != bool(taps):
            raise ValueError(f"mtp_taps={taps} is invalid with mtp_layout={self.mtp_layout!r}: an EAGLE-3 head "
                             "reads tapped layers, the other layouts none")
        if not all(0 <= i < self.n_layers for i in taps):
            raise ValueError(f"mtp_taps={taps} is invalid: target layer indices in [0, {self.n_layers})")

    @property
    def mtp_config(self) -> ModelConfig:
        """The config the MTP module's layer runs with: this one with ``mtp_overrides`` applied."""
        return _mtp_config(self)

    @property
    def block_config(self) -> ModelConfig:
        """The config the block drafter's layers run with: this one with ``block_overrides``
        applied, every layer global (the drafter's layers use the global RoPE)."""
        return _block_config(self)

    def is_compressed(self, layer: int) -> bool:
        """Does ``layer`` use compressed memory (and the compressed cache)?"""
        return layer in self.compressed_layers

    def is_local(self, layer: int) -> bool:
        """Does ``layer`` use the sliding window (and the rolling cache)?"""
        if self.sliding_window is None or self.is_compressed(layer):
            return False
        return not (self.global_every > 0 and layer % self.global_every == self.global_every - 1)

    def layer_kind(self, layer: int) -> str:
        """``"compressed"``, ``"local"`` or ``"global"``: which cache (and attention) ``layer`` uses."""
        return "compressed" if self.is_compressed(layer) else "local" if self.is_local(layer) else "global"

    def rope_for(self, layer: int | None) -> tuple[float, RopeScaling | None]:
        """``(theta, scaling)`` of ``layer`` (``None``: the MTP block, rotated like a global layer)."""
        if layer is not None and self.local_rope_theta is not None and self.is_local(layer):
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def local_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if self.is_local(i))

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if not (self.is_local(i) or self.is_compressed(i)))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _layer_config(cfg: ModelConfig, overrides: tuple) -> ModelConfig:
    """A drafter layer's config: ``cfg``'s, with ``overrides``, as a global layer of a plain model."""
    over = dict(overrides)
    over["head_dim"] = over.get("head_dim", cfg.head_dim)
    return dataclasses.replace(
        cfg, **over, block_size=0, block_layers=0, block_taps=(), block_mask_id=0, block_overrides=(), mtp_depth=0,
        mtp_draft_vocab=0, mtp_layout="specjax", mtp_taps=(), mtp_overrides=(), sliding_window=None, global_every=0,
        compressed_layers=(), compress_window=None, compress_block=None, local_rope_theta=None,
        local_rope_scaling=None, shard_groups=1 if overrides else cfg.shard_groups)


def _make_block_config(cfg: ModelConfig) -> ModelConfig:
    return _layer_config(cfg, cfg.block_overrides)


def _make_mtp_config(cfg: ModelConfig) -> ModelConfig:
    return _layer_config(cfg, cfg.mtp_overrides) if cfg.mtp_overrides else cfg


_block_config = functools.lru_cache(maxsize=64)(_make_block_config)
_mtp_config = functools.lru_cache(maxsize=64)(_make_mtp_config)
