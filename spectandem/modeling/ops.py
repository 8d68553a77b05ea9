"""The kernels a model's forward runs, chosen once when the model is built: a model (the target's
`LlamaModel`, a `DraftHead`) holds one `ModelOps` and its single forward calls it for every step
that has more than one implementation. Three backends:

- `TORCH_OPS`, the torch reference: every step as HuggingFace's Llama computes it.
- `FUSED_OPS`, the GPU fast path: RMSNorm (with the residual add before it), the rotary embedding
  and the SiLU product through the fused Triton kernels of spectandem/kernels/fused.py and
  rotary.py (the same bits as the torch code; the torch code off CUDA), the q/k/v and gate/up
  projections as one GEMM each over packed weights, and the projections through `fast_linear`
  (the skinny GEMM at a few rows); the draft head's attention writes its rotated K/V and reads
  them in place on the paged cache. The packed GEMM may differ from separate ones in the last bits.
- `HOST_OPS`, a draft head's CPU path (EagleProposer on the CPU): the q/k/v and gate/up
  projections as one GEMM each over packed weights, fp32 RMSNorm as `F.rms_norm` and the
  attention as one `F.scaled_dot_product_attention`. On the CPU a draft step's ops are small
  enough that each one's dispatch is much of its time; these take about half of the head's ops
  away. The drafts may differ in the last bits: exactness does not depend on them.
- `INVARIANT_OPS`: the batch-invariant kernels of spectandem/kernels/batch_invariant.py, where a
  row's result depends on its own token, position and keys only (the verifier's
  `--batch-invariant`); its cache view is a `spectandem.modeling.llama.InvariantBatch`.

`model.with_ops(ops)` gives the same weights under another backend; nothing else changes a
model's kernels.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from spectandem.modeling.layers import GatedMLP, PackedProjections, RMSNorm, apply_rotary, fast_linear, masked_attention


class ModelOps:
    """The torch reference. Tensors in the shapes the model code uses: x [..., in]; q, k, v
    [B, heads, T, head_dim]; cos, sin [B, T, head_dim]."""

    name = "torch"
    # The backend reads `PackedProjections.packed_weight` (`with_ops` packs before handing it on)
    # and the cache's fused rotary write (`write_rotary`, `attend_rotary`).
    packed = False

    def linear(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x)

    def project(self, module: PackedProjections, x: torch.Tensor) -> list[torch.Tensor]:
        """The module's input projections (`packed_names`, in order) of x."""
        return [self.linear(getattr(module, name), x) for name in module.packed_names]

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """A per-head norm over rows of head_dim (Qwen3's q/k norm)."""
        return norm(x)

    def add_norm(self, norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add and the norm after it."""
        total = x + delta
        return total, self.norm(norm, total)

    def mlp(self, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x))."""
        gate, up = self.project(mlp, x)
        return self.linear(mlp.down_proj, mlp.act(gate) * up)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def attend(self, cache, layer: int, q, k, v, cos, sin, mask, scale: float) -> torch.Tensor:
        """Rotates q and k, writes k and v to the cache view and attends q over it under `mask`
        (None where the view carries its own) -> [B, T, nh * hd]."""
        q, k = self.rotary(q, k, cos, sin)
        return cache.attend(layer, q, k, v, mask, scale)

    def query_rows_attention(self, attn, x, cos, sin, rows, cache, mask, scale: float) -> torch.Tensor:
        """The attention of a draft head (drafter/heads.py, whose `attn` has q/k/v/o_proj,
        num_heads, num_kv_heads, head_dim): every row of x [B, T, D] written to the cache view,
        queries at `rows` [B, Tq] (None: all T in order), mask [B, Tq, span] -> [B, Tq, D].
        Here q of the query rows only, K/V of every row."""
        b, t, _ = x.shape
        cos_q, sin_q = (cos, sin) if rows is None else (gather_rows(cos, rows), gather_rows(sin, rows))
        q, k, v = self.head_qkv(attn, x, rows)
        tq, hd = q.shape[1], attn.head_dim
        q = q.view(b, tq, attn.num_heads, hd).transpose(1, 2)
        k = k.view(b, t, attn.num_kv_heads, hd).transpose(1, 2)
        v = v.view(b, t, attn.num_kv_heads, hd).transpose(1, 2)
        q, k = apply_rotary(q, cos_q, sin_q), apply_rotary(k, cos, sin)
        k_all, v_all = cache.update(0, k, v)
        return self.linear(attn.o_proj, self.rows_attention(q, k_all, v_all, mask, scale))

    def head_qkv(self, attn, x: torch.Tensor, rows: torch.Tensor | None):
        """A draft head's q of the query rows `rows` [B, Tq] (None: every row) and k, v of every
        row of x [B, T, D], unrotated: here q from the query rows' inputs only."""
        x_q = x if rows is None else gather_rows(x, rows)
        return self.linear(attn.q_proj, x_q), self.linear(attn.k_proj, x), self.linear(attn.v_proj, x)

    def rows_attention(self, q, k, v, mask, scale: float) -> torch.Tensor:
        """q [B, nh, Tq, hd] over k, v [B, nkv, S, hd] under mask [B, Tq, S] -> [B, Tq, nh * hd]."""
        return masked_attention(q, k, v, mask, scale)

    def logits(self, lm_head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(lm_head, hidden).float()

    def __repr__(self) -> str:
        return f"<{self.name} ops>"


class FusedOps(ModelOps):
    name = "fused"
    packed = True

    def linear(self, linear, x):
        return fast_linear(x, linear.weight, linear.bias)

    def project(self, module, x):
        assert module.packed_weight is not None, f"{type(module).__name__}: fused ops need packed projections"
        # One GEMM; the parts are views of its columns (rows of sum(sizes), not contiguous).
        return list(fast_linear(x, module.packed_weight, module.packed_bias).split(module.packed_sizes, dim=-1))

    def norm(self, norm, x):
        return _fused().rmsnorm(x, norm.weight, norm.eps)

    # head_norm stays the torch code: over rows of head_dim ATen's reduction order varies with the
    # row count in a way the kernel did not replay on the H200 (bf16 q, B 4, T 5: 2 of 81920
    # elements a bit apart), and one implementation serves every step alike.

    def add_norm(self, norm, x, delta):
        return _fused().add_rmsnorm(x, delta, norm.weight, norm.eps)

    def mlp(self, mlp, x):
        if mlp.act is not F.silu:   # no fused kernel for other activations
            return super().mlp(mlp, x)
        # One GEMM for gate and up; the product reads both halves of its output in place.
        gate_up = fast_linear(x, mlp.packed_weight, mlp.packed_bias)     # [..., 2 * intermediate]
        return self.linear(mlp.down_proj, _fused().silu_mul_packed(gate_up))

    def rotary(self, q, k, cos, sin):
        from spectandem.kernels.rotary import rotary

        return rotary(q, k, cos, sin)

    def attend(self, cache, layer, q, k, v, cos, sin, mask, scale):
        # Every cache view has attend_rotary: the rotation and the K/V write in one launch where
        # its kernel does both (the paged tree batch), the rotary kernel then `attend` elsewhere.
        return cache.attend_rotary(layer, q, k, v, cos, sin, mask, scale)

    def query_rows_attention(self, attn, x, cos, sin, rows, cache, mask, scale):
        # One GEMM over every row (q of the rows that are no query rows is computed and dropped:
        # at a few rows the GEMM's time is its weight read, the same for 1 row as for 16); the
        # rotated K/V written and the attention read in place on the paged cache.
        b, t, _ = x.shape
        nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q, k, v = self.project(attn, x)
        q = cache.write_rotary(0, q.view(b, t, nh, hd).transpose(1, 2), k.view(b, t, nkv, hd).transpose(1, 2),
                               v.view(b, t, nkv, hd).transpose(1, 2), cos, sin)
        if rows is not None:
            q = q.gather(2, rows[:, None, :, None].expand(-1, nh, -1, hd))
        return self.linear(attn.o_proj, cache.attend_rows(0, q, mask, scale))


class HostOps(ModelOps):
    name = "host"
    packed = True

    def project(self, module, x):
        return list(F.linear(x, module.packed_weight, module.packed_bias).split(module.packed_sizes, dim=-1))

    def norm(self, norm, x):
        if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:   # the reference's statistics are fp32 too
            return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
        return norm(x)

    def head_qkv(self, attn, x, rows):
        # One GEMM over every row; the query rows' q picked from it.
        q, k, v = self.project(attn, x)
        return (q if rows is None else gather_rows(q, rows)), k, v

    def rows_attention(self, q, k, v, mask, scale):
        b, nh, tq, hd = q.shape
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=k.shape[1] != nh)
        return out.transpose(1, 2).reshape(b, tq, nh * hd)


class InvariantOps(ModelOps):
    name = "invariant"

    def linear(self, linear, x):
        from spectandem.kernels.batch_invariant import bi_linear

        return bi_linear(x, linear.weight, linear.bias)

    def norm(self, norm, x):
        from spectandem.kernels.batch_invariant import bi_rmsnorm

        return bi_rmsnorm(x, norm.weight, norm.eps)

    def head_norm(self, norm, x):
        return self.norm(norm, x)


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, T, D], rows [B, Tq] -> [B, Tq, D]."""
    return x.gather(1, rows[..., None].expand(-1, -1, x.shape[-1]))


def twin_under(model: nn.Module, ops: ModelOps) -> nn.Module:
    """`model`'s weights (the same modules and tensors, nothing copied) as a new model object whose
    `ops` are `ops`; `model` is unchanged. Ops that read packed projections get them packed first
    (every PackedProjections in it: parameter names, shapes and memory stay, so `model` reads the
    same weights after)."""
    if ops.packed:
        for module in model.modules():
            if isinstance(module, PackedProjections):
                module.pack()
    twin = copy.copy(model)   # a new Module whose parameters, buffers and children are `model`'s
    twin.ops = ops
    return twin


def _fused():
    """spectandem/kernels/fused.py (imported late: spectandem.kernels imports the model layers)."""
    from spectandem.kernels import fused

    return fused


TORCH_OPS = ModelOps()
FUSED_OPS = FusedOps()
HOST_OPS = HostOps()
INVARIANT_OPS = InvariantOps()
