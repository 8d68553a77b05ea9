"""EAGLE draft heads: EAGLE-1/2 and EAGLE-3, parameter names as in their public checkpoints
(the loader, drafter/loader.py, maps `midlayer.` / `layers.0.` prefixes).

A head consumes pairs (feature at position p, token at position p + 1) at RoPE position p and
predicts the token at p + 2. Its output hidden is fed back as the feature of the next draft
step. `run` is the one entry point: K/V are written for every input row, while attention
output, o-proj, MLP and norms are computed only for the rows in `query_rows`, the rows whose
logits are needed (all rows during tree steps; the last live row per request in catch-up).
Its kernels are the `ModelOps` it is built with (spectandem/modeling/ops.py): the torch
reference, or the fused ops of the GPU fast path (`with_ops(FUSED_OPS)`, EagleProposer with
CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spectandem.kv_cache import CacheBatch
from spectandem.modeling.layers import GatedMLP, PackedProjections, RMSNorm, RopeSpec, Rotary
from spectandem.modeling.ops import TORCH_OPS, ModelOps, gather_rows, twin_under


@dataclass(frozen=True)
class HeadSpec:
    kind: str                        # "eagle" (EAGLE-1/2) or "eagle3"
    hidden_size: int                 # H, the head's width
    target_hidden_size: int          # Ht
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    vocab_size: int                  # target vocabulary V
    draft_vocab_size: int            # Vd (EAGLE-3: own lm_head rows; EAGLE-1: V)
    fc_bias: bool
    qkv_bias: bool
    aux_layers: tuple[int, ...]      # EAGLE-3: HF hidden-state indices, ascending; EAGLE-1: ()
    norm_before_residual: bool = False  # EAGLE-3: the layer's residual is hidden_norm(u), not u
    hidden_act: str = "silu"         # the MLP's activation, a key of layers.ACTIVATIONS
    final_norm: bool = True          # EAGLE-3: logits = lm_head(norm(h)); False: lm_head(h)
    normed_feedback: bool = False    # EAGLE-3: the next step reads norm(h) instead of h

    def __post_init__(self):
        assert not (self.normed_feedback and not self.final_norm), "normed feedback needs the final norm"
        assert self.kind == "eagle3" or (self.final_norm and not self.normed_feedback
                                         and not self.norm_before_residual), "EAGLE-3 options on an EAGLE-1 head"

    @property
    def feature_size(self) -> int:
        """Width of the target feature one position contributes."""
        return self.target_hidden_size * (len(self.aux_layers) if self.kind == "eagle3" else 1)


class _HeadAttention(PackedProjections):
    packed_names = ("q_proj", "k_proj", "v_proj")  # packed: [.., (nh + 2 nkv) * hd]

    def __init__(self, spec: HeadSpec, in_dim: int):
        super().__init__()
        hd = spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, hd
        self.q_proj = nn.Linear(in_dim, spec.num_heads * hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(in_dim, spec.num_kv_heads * hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(in_dim, spec.num_kv_heads * hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * hd, spec.hidden_size, bias=False)

    def forward(self, x, cos, sin, rows, cache: CacheBatch, mask, ops: ModelOps):
        """x [B, T, D] (every input row: K/V for each); rows [B, Tq] the query rows, or None for
        all T in order; cos/sin [B, T, hd]; mask [B, Tq, span] -> [B, Tq, D]."""
        return ops.query_rows_attention(self, x, cos, sin, rows, cache, mask, self.head_dim ** -0.5)


class _Layer(nn.Module):
    def __init__(self, spec: HeadSpec, in_dim: int, input_norms: bool):
        super().__init__()
        self.self_attn = _HeadAttention(spec, in_dim)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, act=spec.hidden_act)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if input_norms:  # EAGLE-3: one norm for the embedding, one for the hidden
            self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
            self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class DraftHead(nn.Module):
    """Common driver; subclasses define how a (token, feature) pair becomes the layer input.
    `ops`: its kernels (the torch reference unless built `with_ops`)."""

    spec: HeadSpec
    ops: ModelOps = TORCH_OPS

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., feature_size] -> head input hidden [..., H]."""
        raise NotImplementedError

    def with_ops(self, ops: ModelOps) -> "DraftHead":
        """This head's weights (the same modules, nothing copied) under `ops`; this head is
        unchanged. The fused ops (the GPU fast path of EagleProposer with CUDA graphs): the norms,
        the rotary embedding and the SiLU product through the fused kernels, the attention's
        q/k/v and the MLP's gate/up as one GEMM each over weights packed here, and every
        projection (fc, q/k/v, o, the MLP, the LM head) through `fast_linear`: the skinny GEMM
        where it was measured faster than cuBLAS at a few rows (spectandem/kernels/skinny.py). A
        draft step is a few dozen small launches besides its GEMMs; these take about a third of
        them away. The drafts may differ in the last bits (another GEMM): exactness does not
        depend on them."""
        return twin_under(self, ops)

    def _linear(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(linear, x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> draft logits [..., draft_vocab_size] (float32)."""
        raise NotImplementedError

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary indices -> target token ids (same shape)."""
        return draft_ids

    def run(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
            cache: CacheBatch, mask: torch.Tensor, query_rows: torch.Tensor) -> torch.Tensor:
        """One head layer over pairs.

        token_ids [B, T] int64 (target ids of the token after each feature's position);
        hidden [B, T, H] (projected target features, or the head's own previous outputs);
        positions [B, T]; mask [B, Tq, cache.span] bool for the query rows;
        query_rows [B, Tq] int64, indices into T; with Tq == T they must be 0..T-1 in order
        (every row a query row, as in tree and chain steps), and are not read.
        Returns the head's output hidden for the query rows, [B, Tq, H]: pre-norm, or after
        the final norm where `spec.normed_feedback`; it is what `logits` and the next step read.
        """
        assert token_ids.shape == positions.shape == hidden.shape[:2], (token_ids.shape, hidden.shape)
        assert query_rows.shape[0] == token_ids.shape[0] and mask.shape[:2] == query_rows.shape
        layer, ops = self.layer, self.ops
        emb = self.embed_tokens(token_ids).to(hidden.dtype)
        x, residual = self._layer_input(emb, hidden)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if query_rows.shape[1] == token_ids.shape[1]:   # every row (see above): no gathers
            rows, res_q = None, residual
        else:
            rows, res_q = query_rows, gather_rows(residual, query_rows)
        a = res_q + layer.self_attn(x, cos, sin, rows, cache, mask, ops)
        out = a + ops.mlp(layer.mlp, ops.norm(layer.post_attention_layernorm, a))
        assert out.shape == (token_ids.shape[0], query_rows.shape[1], self.spec.hidden_size)
        return self._output(out)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """The layer output as the head hands it on (to `logits` and the next step)."""
        return out

    def _layer_input(self, emb, hidden):
        raise NotImplementedError


class Eagle1Head(DraftHead):
    """EAGLE-1/2: z = fc([embed(token), feature]); one decoder layer without input norm; the
    target's lm_head on the un-normalised output. Embedding and lm_head come from the target."""

    def __init__(self, spec: HeadSpec):
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=spec.fc_bias)
        self.layer = _Layer(spec, h, input_norms=False)
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        self.lm_head = nn.Linear(h, spec.vocab_size, bias=False)
        self.rotary = Rotary(spec.rope)

    def project(self, features):
        return features

    def _layer_input(self, emb, hidden):
        z = self._linear(self.fc, torch.cat([emb, hidden], dim=-1))
        return z, z

    def logits(self, hidden):
        return self.ops.logits(self.lm_head, hidden)


class Eagle3Head(DraftHead):
    """EAGLE-3: u = fc(concat(low, mid, high target layers)); the layer's q/k/v read
    [input_layernorm(embed), hidden_norm(u)] (2H wide), its residual is u (hidden_norm(u) with
    `norm_before_residual`); final norm and the head's own lm_head over a reduced vocabulary
    mapped to target ids by `d2t` (target id = i + d2t[i]). Variants: no final norm
    (`final_norm` False: lm_head on the layer output); the normed output fed back to the next
    step (`normed_feedback`: `run` returns norm(h), `logits` applies lm_head to it)."""

    def __init__(self, spec: HeadSpec):
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.fc = nn.Linear(spec.feature_size, h, bias=spec.fc_bias)
        self.layer = _Layer(spec, 2 * h, input_norms=True)
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
        self.rotary = Rotary(spec.rope)

    def project(self, features):
        return self._linear(self.fc, features)

    def _layer_input(self, emb, hidden):
        normed = self.ops.norm(self.layer.hidden_norm, hidden)
        residual = normed if self.spec.norm_before_residual else hidden
        return torch.cat([self.ops.norm(self.layer.input_layernorm, emb), normed], dim=-1), residual

    def _output(self, out):
        return self.ops.norm(self.norm, out) if self.spec.normed_feedback else out

    def logits(self, hidden):
        if self.spec.final_norm and not self.spec.normed_feedback:
            hidden = self.ops.norm(self.norm, hidden)
        return self.ops.logits(self.lm_head, hidden)

    def draft_to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


HEAD_CLASSES = {"eagle": Eagle1Head, "eagle3": Eagle3Head}
