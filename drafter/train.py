"""`spectandem train-draft`: trains an EAGLE-3 (or EAGLE-1) head for a target by distillation.

Recipe (the EAGLE-3 one, simplified where noted):
- data: the target's tokenizer over a corpus (drafter.data: the last 5% of documents are held
  out), random windows of `seq_len` tokens;
- teacher: the target, frozen. Per window it gives the features the head reads (EAGLE-3: the
  residual stream at the auxiliary layers; EAGLE-1: the last hidden state after the final norm)
  and its next-token distribution, the soft label (restricted to the draft vocabulary and
  renormalised for EAGLE-3);
- draft vocabulary (EAGLE-3): the `draft_vocab_size` most frequent training tokens, sorted;
  `d2t[i] = used[i] - i`;
- training-time test: step 0 reads the target's features; step j > 0 reads the head's own
  output of step j - 1 at the previous position, and attends to the real prefix up to p - j
  plus the diagonal of each earlier step, exactly what a query sees at draft step j during
  inference. Step j's loss is weighted 0.8**j;
- embeddings (and the EAGLE-1 lm_head) are the target's, frozen. EAGLE-1's feature-regression
  loss is left out: the head is trained on the soft labels alone.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from drafter.data import encode_documents, split_documents
from drafter.heads import HEAD_CLASSES, DraftHead, HeadSpec
from drafter.loader import save_head
from spectandem.checkpoint import load_tokenizer
from spectandem.modeling.layers import apply_rotary
from spectandem.modeling.llama import LlamaModel, load_llama


@dataclass(frozen=True)
class TrainConfig:
    arch: str = "eagle3"
    steps: int = 2000
    batch: int = 32
    seq_len: int = 256
    lr: float = 2e-3
    ttt_steps: int = 3
    draft_vocab_size: int = 2048
    seed: int = 0
    draft_length: int | None = None   # stated in the head's config (save_head): serve's default depth

    def __post_init__(self):
        if self.arch not in HEAD_CLASSES:
            raise ValueError(f"arch must be one of {sorted(HEAD_CLASSES)}, got {self.arch!r}")
        for name in ("steps", "batch", "ttt_steps", "draft_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_length is not None and self.draft_length < 1:
            raise ValueError(f"draft_length must be >= 1, got {self.draft_length}")
        if self.seq_len < self.ttt_steps + 2:
            raise ValueError(f"seq_len must be >= ttt_steps + 2 = {self.ttt_steps + 2}, got {self.seq_len}")


def build_head(target: LlamaModel, cfg: TrainConfig, used_ids: torch.Tensor | None) -> DraftHead:
    t = target.spec
    n = t.num_layers
    spec = HeadSpec(
        kind=cfg.arch, hidden_size=t.hidden_size, target_hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps, rope=t.rope, vocab_size=t.vocab_size,
        draft_vocab_size=used_ids.numel() if used_ids is not None else t.vocab_size,
        fc_bias=cfg.arch == "eagle", qkv_bias=False,
        aux_layers=tuple(sorted((2, n // 2, n - 3))) if cfg.arch == "eagle3" else (),
    )
    head = HEAD_CLASSES[cfg.arch](spec)
    for name, p in head.named_parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
    head.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    head.embed_tokens.weight.requires_grad_(False)
    if cfg.arch == "eagle":
        head.lm_head.weight.data.copy_(target.lm_head.weight.data)
        head.lm_head.weight.requires_grad_(False)
    else:
        head.d2t.copy_(used_ids - torch.arange(used_ids.numel()))
    return head


def _ttt_forward(head: DraftHead, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test over pairs (feature p, token p + 1), p = 0..P-1.

    tokens [B, P] (token after each pair's position); feats [B, P, F] target features.
    Returns per step j the head outputs [B, P, H]; row p of step j is valid for p >= j.
    """
    layer = head.layer
    attn = layer.self_attn
    b, p_len = tokens.shape
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    positions = torch.arange(p_len, device=tokens.device)[None].expand(b, -1)
    emb = head.embed_tokens(tokens)
    hidden = head.project(feats)
    cos, sin = head.rotary.cos_sin(positions, hidden.dtype)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    idx = torch.arange(p_len, device=tokens.device)
    for j in range(steps):
        x, residual = head._layer_input(emb, hidden)
        q = apply_rotary(attn.q_proj(x).view(b, p_len, nh, hd).transpose(1, 2), cos, sin)
        k = apply_rotary(attn.k_proj(x).view(b, p_len, nkv, hd).transpose(1, 2), cos, sin)
        v = attn.v_proj(x).view(b, p_len, nkv, hd).transpose(1, 2)
        keys.append(k.repeat_interleave(nh // nkv, dim=1))
        values.append(v.repeat_interleave(nh // nkv, dim=1))
        scale = hd ** -0.5
        # The real prefix: step 0's keys at columns <= p - j.
        s0 = torch.matmul(q, keys[0].transpose(2, 3)) * scale            # [B, nh, P, P]
        s0 = s0.masked_fill(idx[None, :] > (idx[:, None] - j), torch.finfo(s0.dtype).min)
        scores = [s0]
        vals = []
        for i in range(1, j + 1):
            shift = j - i  # query p reads step i's entry at p - (j - i)
            ki = F.pad(keys[i], (0, 0, shift, 0))[:, :, :p_len]
            vals.append(F.pad(values[i], (0, 0, shift, 0))[:, :, :p_len])
            scores.append((q * ki).sum(-1, keepdim=True) * scale)         # [B, nh, P, 1]
        probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs[..., :p_len], values[0])
        for i, vi in enumerate(vals):
            out = out + probs[..., p_len + i: p_len + i + 1] * vi
        out = out.transpose(1, 2).reshape(b, p_len, nh * hd)
        a = residual + attn.o_proj(out)
        h = a + head.ops.mlp(layer.mlp, layer.post_attention_layernorm(a))
        outs.append(h)
        hidden = F.pad(h, (0, 0, 1, 0))[:, :p_len]  # the next step reads p - 1's output at p
    return outs


def _teacher(target: LlamaModel, head: DraftHead, x: torch.Tensor):
    """Target features [B, T, F] and next-token log-probs [B, T, Vd] in the draft vocabulary."""
    from spectandem.kv_cache import KVCache

    b, t = x.shape
    spec = target.spec
    cache = KVCache(spec.num_layers, b, spec.num_kv_heads, t, spec.head_dim,
                    next(target.parameters()).dtype, x.device)
    pos = torch.arange(t, device=x.device)[None].expand(b, -1)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))[None].expand(b, -1, -1)
    capture = head.spec.aux_layers
    hidden, aux = target(x, pos, cache.batch(torch.arange(b, device=x.device), pos, t), mask, capture)
    logits = target.logits(hidden)
    if head.spec.kind == "eagle3":
        logits = logits[..., head.d2t + torch.arange(head.d2t.numel(), device=x.device)]
    return (aux if capture else hidden), torch.log_softmax(logits.float(), dim=-1)


def train_draft(target_dir: str, corpus: str, out_dir: str, cfg: TrainConfig,
                device: str | None = None, log=print) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.seed)
    target = load_llama(target_dir, torch.float32, device)
    for p in target.parameters():
        p.requires_grad_(False)
    tok = load_tokenizer(target_dir)
    eos = (target.spec.eos_token_ids or (0,))[0]
    train_docs, held_docs = split_documents(corpus)
    train_ids = torch.tensor(encode_documents(tok, train_docs, eos), dtype=torch.long)
    held_ids = torch.tensor(encode_documents(tok, held_docs, eos), dtype=torch.long)
    if train_ids.numel() < cfg.seq_len + 1:
        raise ValueError(f"{corpus}: {train_ids.numel()} training tokens, fewer than seq_len {cfg.seq_len}")
    used = None
    if cfg.arch == "eagle3":
        counts = torch.bincount(train_ids, minlength=target.spec.vocab_size)
        vd = min(cfg.draft_vocab_size, target.spec.vocab_size)
        used = torch.sort(torch.topk(counts, vd).indices).values
    head = build_head(target, cfg, used).to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, cfg.steps // 20)
    gen = torch.Generator().manual_seed(cfg.seed)
    use_amp = device.startswith("cuda")

    def batch_from(ids: torch.Tensor, starts: list[int]) -> torch.Tensor:
        return torch.stack([ids[s: s + cfg.seq_len] for s in starts]).to(device)

    def loss_and_acc(x: torch.Tensor):
        with torch.no_grad(), torch.autocast(device, torch.bfloat16, enabled=use_amp):
            feats, teacher = _teacher(target, head, x)
        teacher = teacher.float()
        with torch.autocast(device, torch.bfloat16, enabled=use_amp):
            outs = _ttt_forward(head, x[:, 1:], feats[:, :-1], cfg.ttt_steps)
        total, accs = 0.0, []
        for j, h in enumerate(outs):
            logp = torch.log_softmax(head.logits(h[:, j:-1].float()), dim=-1)  # pairs p = j..P-2
            tgt = teacher[:, j + 1: -1]                                       # target at p + 1
            total = total + (0.8 ** j) * -(tgt.exp() * logp).sum(-1).mean()
            accs.append((logp.argmax(-1) == tgt.argmax(-1)).float().mean().item())
        return total, accs

    t0 = time.time()
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - cfg.seq_len, (cfg.batch,), generator=gen).tolist()
        loss, accs = loss_and_acc(batch_from(train_ids, starts))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 200 == 0 or step == cfg.steps - 1:
            log(f"train-draft step {step} loss {loss.item():.3f} top-1 agreement per TTT step "
                f"{[round(a, 3) for a in accs]} ({time.time() - t0:.0f}s)")
    head.eval()
    with torch.no_grad():
        n = max(1, min(32, (held_ids.numel() - 1) // cfg.seq_len))
        starts = [i * cfg.seq_len for i in range(n) if (i + 1) * cfg.seq_len <= held_ids.numel()]
        _, held_accs = loss_and_acc(batch_from(held_ids, starts)) if starts else (None, [])
    log(f"held-out top-1 agreement with the target per TTT step: {[round(a, 3) for a in held_accs]}")
    save_head(head.float().cpu(), out_dir, cfg.draft_length)
    report = {"config": cfg.__dict__, "held_out_top1_per_step": held_accs,
              "train_tokens": train_ids.numel(), "seconds": round(time.time() - t0, 1)}
    (Path(out_dir) / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"head -> {out_dir}")
    return report
