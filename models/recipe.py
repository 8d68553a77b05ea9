"""The exact recipe of the embedded demo pair (tokenizer, target, draft LM).

The pair is trained on a fixed corpus, `--corpus CORPUS`: the Python 3.11 standard library's
sources as one file (drafter/data.py's format). Files whose path sorts into the last 5% are held
out: neither the tokenizer, the target, the draft LM nor the draft heads ever see them, and
acceptance is measured on them.

Steps (each writes under --out, default models/demo):

    python models/recipe.py tokenizer --corpus CORPUS.txt.xz
    python models/recipe.py lm --corpus CORPUS.txt.xz --which target    # GPU: ~3 min on one H200
    python models/recipe.py lm --corpus CORPUS.txt.xz --which draft-lm
    spectandem train-draft --target models/demo/target --corpus CORPUS.txt.xz \
        --out models/demo/eagle3 --arch eagle3 --draft-length 5
    spectandem train-draft --target models/demo/target --corpus CORPUS.txt.xz \
        --out models/demo/eagle --arch eagle

Weights are stored in bfloat16 (upcast to float32 exactly on load), to keep the committed
pair under 20 MB.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

EOS = "<|endoftext|>"
VOCAB_SIZE = 4096

# Model shapes of the demo pair. The target has 8 layers so that the EAGLE-3 default
# auxiliary layers (HF indices 2, L//2, L-3) = (2, 4, 5) are distinct.
TARGET_CONFIG = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64,
)
DRAFT_LM_CONFIG = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64,
)


def split_corpus(corpus):
    """(train files, held-out files), the split every step of the recipe uses."""
    from drafter.data import split_documents

    return split_documents(corpus)


def train_tokenizer(corpus, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train, _ = split_corpus(corpus)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator((body for _, body in train), trainer=trainer)
    assert tok.token_to_id(EOS) == 0, "the end-of-text token must be id 0"
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS,
         "model_max_length": 2048}, indent=2) + "\n")
    print(f"tokenizer: {tok.get_vocab_size()} tokens -> {out_dir}")


def encode_files(tokenizer_path: Path, files) -> list[int]:
    """All files' token ids, each followed by the end-of-text id 0."""
    from tokenizers import Tokenizer

    from drafter.data import encode_documents

    return encode_documents(Tokenizer.from_file(str(tokenizer_path)), files, eos_id=0)


def train_lm(corpus, out_dir: Path, which: str, steps: int, batch: int, seq_len: int,
             lr: float, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shapes = TARGET_CONFIG if which == "target" else DRAFT_LM_CONFIG
    tok_dir = out_dir / "target"
    train, held = split_corpus(corpus)
    train_ids = torch.tensor(encode_files(tok_dir / "tokenizer.json", train), dtype=torch.long)
    held_ids = torch.tensor(encode_files(tok_dir / "tokenizer.json", held), dtype=torch.long)
    print(f"{which}: {train_ids.numel()} train tokens, {held_ids.numel()} held-out tokens")

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, attention_bias=False, mlp_bias=False, **shapes,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    gen = torch.Generator().manual_seed(seed)
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda")
    t0 = time.time()
    model.train()
    for step in range(steps):
        starts = torch.randint(0, train_ids.numel() - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([train_ids[s:s + seq_len] for s in starts.tolist()]).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with amp:
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"{which} step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)

    model.eval()
    with torch.no_grad(), amp:
        n = (held_ids.numel() - 1) // seq_len
        chunks = held_ids[: n * seq_len].view(n, seq_len).to(device)
        held_loss = sum(model(input_ids=c[None], labels=c[None]).loss.item() for c in chunks) / n
    print(f"{which}: held-out loss {held_loss:.3f} nats/token")

    dest = out_dir / which
    dest.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if dest != tok_dir:
            shutil.copy(tok_dir / name, dest / name)
    (dest / "recipe.json").write_text(json.dumps(
        {"which": which, "steps": steps, "batch": batch, "seq_len": seq_len, "lr": lr,
         "seed": seed, "held_out_loss": round(held_loss, 4), "train_tokens": train_ids.numel()},
        indent=2) + "\n")
    print(f"{which} -> {dest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["tokenizer", "lm"])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", default=str(Path(__file__).parent / "demo"))
    ap.add_argument("--which", choices=["target", "draft-lm"], default="target")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    if args.step == "tokenizer":
        train_tokenizer(args.corpus, out / "target")
    else:
        train_lm(args.corpus, out, args.which, args.steps, args.batch, args.seq_len, args.lr, args.seed)


if __name__ == "__main__":
    main()
