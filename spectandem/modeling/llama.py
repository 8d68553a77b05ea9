"""Native Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over an explicit KV cache.

The model has no mode flags: prefill, one-token decode and tree verification are the same
forward over a different number of positions with a mask built by the caller. Parameter
names equal HuggingFace's, so checkpoints load with `load_state_dict`. Its kernels are the
`ModelOps` it is built with (spectandem/modeling/ops.py): the torch reference, the fused GPU
path (NativeRunner's `triton_attention`) or the batch-invariant kernels (NativeRunner's
`batch_invariant`); `with_ops` gives the same weights under another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spectandem.checkpoint import eos_token_ids
from spectandem.kv_cache import CacheBatch, PagedKVCache
from spectandem.modeling.layers import GatedMLP, PackedProjections, RMSNorm, RopeSpec, Rotary
from spectandem.modeling.ops import TORCH_OPS, ModelOps, twin_under

NATIVE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class LlamaSpec:
    """Shapes and options of a Llama-family model, read from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # attention span limit; the runner caps the context at it

    @staticmethod
    def from_config(cfg: dict, source: str = "config.json") -> "LlamaSpec":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in NATIVE_ARCHITECTURES:
            raise ValueError(f"{source}: architecture {arch!r} has no native implementation "
                             f"(native: {', '.join(NATIVE_ARCHITECTURES)})")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            act = cfg.get("hidden_act", "silu")
            if act != "silu":
                raise ValueError(f"{source}: hidden_act {act!r} is not supported natively (only 'silu')")
            window = cfg.get("sliding_window")
            if arch != "MistralForCausalLM" and not cfg.get("use_sliding_window", False):
                window = None
            eos_ids = eos_token_ids(cfg)
            return LlamaSpec(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=RopeSpec.from_config(cfg, head_dim, source),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases (never o); in the others attention_bias puts a bias
                # on all four projections.
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
                o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                eos_token_ids=eos_ids,
                sliding_window=int(window) if window else None,
            )
        except KeyError as exc:
            raise ValueError(f"{source}: missing field {exc.args[0]!r}") from None


class Attention(PackedProjections):
    packed_names = ("q_proj", "k_proj", "v_proj")  # packed: [.., (nh + 2 nkv) * hd]

    def __init__(self, spec: LlamaSpec):
        super().__init__()
        hd = spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, hd
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_heads * hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * hd, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, cache: CacheBatch, layer: int, mask, ops: ModelOps):
        b, t, _ = x.shape
        q, k, v = ops.project(self, x)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = ops.head_norm(self.q_norm, q), ops.head_norm(self.k_norm, k)
        out = ops.attend(cache, layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cos, sin, mask,
                         self.head_dim ** -0.5)
        return ops.linear(self.o_proj, out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, h, cos, sin, cache, layer, mask, ops: ModelOps):
        """x [B, T, H]: the residual stream entering the layer; h: input_layernorm(x), which the
        caller computes together with the previous layer's last residual add.

        Returns (x + attention, the MLP's output): the caller adds the latter to the former in
        the next norm (`ops.add_norm`, one launch on the fused path)."""
        x, h = ops.add_norm(self.post_attention_layernorm, x, self.self_attn(h, cos, sin, cache, layer, mask, ops))
        return x, ops.mlp(self.mlp, h)


class LlamaBody(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary_emb = Rotary(spec.rope)


class LlamaModel(nn.Module):
    """`forward` returns the final-normed hidden states and, when asked, the residual
    stream at the requested HuggingFace hidden-state indices (k = 0: embeddings, k = i + 1:
    after decoder layer i), concatenated in the order given. `ops`: its kernels."""

    def __init__(self, spec: LlamaSpec, ops: ModelOps = TORCH_OPS):
        super().__init__()
        self.spec = spec
        self.ops = ops
        self.model = LlamaBody(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: CacheBatch,
                mask: torch.Tensor | None, capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions [B, T] int64; mask [B, T, span] bool over the cache view's span, or
        None when the view carries its own (PagedTreeBatch; InvariantBatch with the invariant ops).

        Returns (hidden [B, T, H] after the final norm, aux [B, T, len(capture) * H] or None).
        """
        ops = self.ops
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb.cos_sin(positions, x.dtype)
        captured: dict[int, torch.Tensor] = {0: x} if 0 in capture else {}
        layers = self.model.layers
        # Layer i's MLP output is added to the stream by the norm after it (layer i + 1's input
        # norm, the final norm after the last layer), which also yields hidden state i + 1.
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        h = ops.norm(layers[0].input_layernorm if len(layers) else self.model.norm, x)
        for i, (layer, next_norm) in enumerate(zip(layers, next_norms)):
            x, mlp_out = layer(x, h, cos, sin, cache, i, mask, ops)
            x, h = ops.add_norm(next_norm, x, mlp_out)
            if i + 1 in capture:
                captured[i + 1] = x
        aux = torch.cat([captured[k] for k in capture], dim=-1) if capture else None
        return h, aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] (float32)."""
        return self.ops.logits(self.lm_head, hidden)

    def with_ops(self, ops: ModelOps) -> "LlamaModel":
        """This model's weights (the same modules and tensors, nothing copied) under `ops`; this
        model is unchanged. Fused ops read the q/k/v and gate/up projections packed into one
        weight each (`pack_projections`), which it packs first: parameter names, shapes and
        memory stay as they are, so this model reads the same weights after."""
        return twin_under(self, ops)

    def pack_projections(self) -> None:
        """Each layer's q/k/v projections share one weight [(nh + 2 nkv) * hd, H] and its gate/up
        projections one [2 * I, H] (PackedProjections); parameter names, shapes and memory as
        before. Idempotent."""
        for layer in self.model.layers:
            layer.self_attn.pack()
            layer.mlp.pack()


def load_llama(directory, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LlamaModel:
    """Loads a Llama-family checkpoint directory into the native model."""
    from spectandem.checkpoint import CheckpointError, load_weights, read_config

    spec = LlamaSpec.from_config(read_config(directory), f"{directory}/config.json")
    state = load_weights(directory)
    state = {k: v for k, v in state.items() if "rotary_emb" not in k}
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = LlamaModel(spec)
    model = model.to_empty(device=device)
    expected = {k for k in model.state_dict() if not (spec.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(f"{directory}: weights do not match {spec.architecture} "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    for name, tensor in state.items():
        shape = tuple(model.state_dict()[name].shape)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{directory}: tensor {name} has shape {tuple(tensor.shape)}, "
                                  f"config.json implies {shape}")
    model.load_state_dict(state, strict=False, assign=False)
    model.model.rotary_emb.inv_freq = spec.rope.inv_freq().to(device)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(dtype).eval()


@dataclass
class InvariantBatch:
    """The cache view of a forward through the invariant ops (spectandem/modeling/ops.py): where
    each token's K/V are written and which keys each query row reads, the logical key sequence of
    spectandem/kernels/batch_invariant.py (cache entries 0..prefix_lens-1 through the block
    table, then the row's tree path, root first)."""

    cache: PagedKVCache
    write_rows: torch.Tensor    # [B, T] physical rows the tokens' K/V are written to
    block_tables: torch.Tensor  # [B, max_blocks] physical block ids of each request, -1 where none
    prefix_lens: torch.Tensor   # [B, T] cache entries row t reads through the table
    path_rows: torch.Tensor     # [B, T, D] physical rows of row t's path (its own last), -1 padded
    path_lens: torch.Tensor     # [B, T] entries of path_rows[b, t] in use

    def __post_init__(self):
        # The kernel reads int32 rows; converting once here saves four copies per layer.
        for name in ("block_tables", "prefix_lens", "path_rows", "path_lens"):
            setattr(self, name, getattr(self, name).to(torch.int32).contiguous())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: None,
               scale: float) -> torch.Tensor:
        """Writes `k, v [B, nkv, T, hd]`, then attends `q [B, nh, T, hd]` -> [B, T, nh * hd].
        `mask` must be None: the view says which keys each row reads."""
        from spectandem.kernels.batch_invariant import bi_attention

        assert mask is None, "an InvariantBatch carries its own keys; the forward's mask must be None"

        k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]
        k_pool[self.write_rows] = k.transpose(1, 2).to(k_pool.dtype)
        v_pool[self.write_rows] = v.transpose(1, 2).to(v_pool.dtype)
        return bi_attention(q, k_pool, v_pool, self.block_tables, self.prefix_lens, self.path_rows, self.path_lens,
                            scale, self.cache.block_size)
