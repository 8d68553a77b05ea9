"""Building blocks shared by the target model and the draft heads: RMSNorm, rotary
embeddings, gated MLP and masked attention over an explicit KV cache; PackedProjections, the
q/k/v and gate/up projections as one weight each for the fused ops. The modules hold weights;
the kernels run over them are a `ModelOps`' (spectandem/modeling/ops.py), whose torch reference
is the code here.

Numerics follow HuggingFace's Llama implementation (fp32 RMSNorm statistics, fp32 rotary
tables, softmax in fp32), so that greedy tokens match transformers' own `generate`. A float64
model keeps those steps in float64 (`compute_dtype`): dropping to fp32 there would bring back
the fp32 rounding noise that float64 runs exist to remove (tests/router/test_preemption.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the fp32 steps (norm statistics, rotary tables, attention softmax) for a
    model in `dtype`: float32 for float32, bfloat16 and float16 models, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(compute_dtype(dtype))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class PackedProjections(nn.Module):
    """Base of a module whose input projections, the nn.Linear children named in `packed_names`
    (one input width, concatenated in that order), can share one weight: one GEMM instead of one
    per child under the fused ops.

    `pack()` concatenates the children's weights (and biases) into `packed_weight [sum(out), in]`
    (`packed_bias [sum(out)]`) and makes each child's parameters views of its rows, so
    `state_dict()` keeps the children's names and shapes, `load_state_dict` copies into the shared
    storage and the weights take no extra memory. Example (q, k, v of 4, 2, 2 rows):
    packed_weight rows 0-3 are q_proj.weight, rows 4-5 k_proj.weight, rows 6-7 v_proj.weight.
    A conversion (`.to`, `.cuda`, `.half`), `load_state_dict(assign=True)` and a copy
    (`copy.deepcopy`, pickling) give each child its own storage again; all re-pack after
    (`_apply`, the load hook, `__setstate__`). Assigning a new Parameter to a child directly, or
    writing into one that is no longer a view, does not: call `pack()` after. Inference only: the
    packed tensors are not parameters, so gradients do not reach the children through the packed
    GEMM."""

    packed_names: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.packed_weight: torch.Tensor | None = None  # [sum(out), in], None until pack()
        self.packed_bias: torch.Tensor | None = None    # [sum(out)] where the children have biases
        self.packed_sizes: tuple[int, ...] = ()          # each child's out_features, in order
        self.register_load_state_dict_post_hook(_repack_after_load)

    def pack(self) -> None:
        """Idempotent: a no-op while every child is still a view of its rows."""
        if self._packed_intact():
            return
        linears = [getattr(self, name) for name in self.packed_names]
        has_bias = {linear.bias is not None for linear in linears}
        assert len(has_bias) == 1, f"{type(self).__name__}: {self.packed_names} mix biases and none"
        weight = torch.cat([linear.weight.detach() for linear in linears])
        bias = torch.cat([linear.bias.detach() for linear in linears]) if has_bias == {True} else None
        row = 0
        for linear in linears:
            n = linear.out_features
            # `.data =` keeps each Parameter object (and whoever holds it) and frees its old storage.
            linear.weight.data = weight[row: row + n]
            if bias is not None:
                linear.bias.data = bias[row: row + n]
            row += n
        self.packed_weight, self.packed_bias = weight, bias
        self.packed_sizes = tuple(linear.out_features for linear in linears)

    def _packed_intact(self) -> bool:
        if self.packed_weight is None:
            return False
        row = 0
        for name in self.packed_names:
            linear = getattr(self, name)
            n = linear.out_features
            if not _is_view(linear.weight, self.packed_weight[row: row + n]):
                return False
            if self.packed_bias is not None and not _is_view(linear.bias, self.packed_bias[row: row + n]):
                return False
            row += n
        return True

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.packed_weight is not None:
            self.pack()
        return self

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.packed_weight is not None:
            self.pack()


def _is_view(param: torch.Tensor | None, rows: torch.Tensor) -> bool:
    return (param is not None and param.device == rows.device and param.dtype == rows.dtype
            and param.shape == rows.shape and param.data_ptr() == rows.data_ptr())


def _repack_after_load(module: PackedProjections, incompatible_keys) -> None:
    """load_state_dict's hook: copying into views keeps them packed; assign=True replaces them."""
    if module.packed_weight is not None:
        module.pack()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation."""
    return F.gelu(x, approximate="tanh")


# HuggingFace `hidden_act` names -> the activation they denote (transformers' ACT2FN): "gelu" is
# the exact (erf) GELU; "gelu_new" and "gelu_pytorch_tanh" are the tanh approximation.
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_new": gelu_tanh,
               "gelu_pytorch_tanh": gelu_tanh, "relu": F.relu}


class GatedMLP(PackedProjections):
    """down(act(gate(x)) * up(x)), computed by `ModelOps.mlp`."""

    packed_names = ("gate_proj", "up_proj")  # packed: gate then up, [.., 2 * intermediate]

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear on the fast path: the skinny GEMM (spectandem/kernels/skinny.py) for CUDA bf16/fp16
    inputs of at most 16 rows and a weight shape it was measured faster on, cuBLAS otherwise."""
    from spectandem.kernels.skinny import skinny_linear

    return skinny_linear(x, weight, bias)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters as read from a HuggingFace config."""

    head_dim: int
    theta: float = 10000.0
    kind: str = "default"            # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0      # llama3 only
    high_freq_factor: float = 4.0     # llama3 only
    original_max_position: int = 8192  # llama3 only

    @staticmethod
    def from_config(cfg: dict, head_dim: int, source: str = "config.json") -> "RopeSpec":
        # transformers >= 5 writes `rope_parameters`; older files `rope_theta` + `rope_scaling`.
        params = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        merged = {**scaling, **params}
        kind = merged.get("rope_type", merged.get("type", "default")) or "default"
        if kind == "default":
            return RopeSpec(head_dim=head_dim, theta=theta)
        if kind == "linear":
            return RopeSpec(head_dim=head_dim, theta=theta, kind="linear", factor=float(merged["factor"]))
        if kind == "llama3":
            return RopeSpec(
                head_dim=head_dim, theta=theta, kind="llama3", factor=float(merged["factor"]),
                low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
                high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
                original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
            )
        raise ValueError(f"{source}: rope scaling type {kind!r} is not supported "
                         "(supported: default, linear, llama3)")

    def inv_freq(self) -> torch.Tensor:
        """[head_dim // 2] float32 inverse frequencies, as transformers computes them."""
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


class Rotary(nn.Module):
    def __init__(self, spec: RopeSpec):
        super().__init__()
        self.register_buffer("inv_freq", spec.inv_freq(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] int64 -> cos, sin [B, T, head_dim]."""
        ct = compute_dtype(dtype)
        freqs = positions[..., None].to(ct) * self.inv_freq.to(ct)  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, T, hd]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Grouped-query attention with an explicit boolean mask.

    q [B, nh, T, hd]; k, v [B, nkv, S, hd]; mask [B, T, S] bool (True = may attend).
    Returns [B, T, nh * hd]. A row whose mask is all False yields finite garbage (callers
    only do that for padding rows, whose outputs they never read).
    """
    nh, nkv = q.shape[1], k.shape[1]
    if nh != nkv:
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, nh, T, S]
    scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=compute_dtype(q.dtype)).to(q.dtype)
    out = torch.matmul(probs, v)  # [B, nh, T, hd]
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
