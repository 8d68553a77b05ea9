"""Both engines in this process: what `spectandem generate` uses without a server address, and
what the tests drive the pair through. It builds a drafter and a verifier engine and runs the
reference loop (spectandem/reference.py) over them, so it sits above both roles, with the
router's in-process backend (router/links_local.py); like the router it imports no torch."""

from __future__ import annotations

from pathlib import Path

from drafter.engine import DrafterEngine, build_proposer
from spectandem.config import SamplingParams, SpecConfig
from spectandem.devices import DEFAULT_DTYPE
from spectandem.reference import LocalCompletion, generate
from verifier.engine import VerifierEngine
from verifier.fused import FusedStep
from verifier.runner import load_runner


class LocalSpeculator:
    def __init__(self, target_dir: str | Path, draft_dir: str | Path | None, cfg: SpecConfig,
                 max_slots: int = 8, max_len: int | None = None, dtype=DEFAULT_DTYPE,
                 device: str = "cpu", force_hf_target: bool = False, kv_blocks: int | None = None,
                 draft_kv_blocks: int | None = None, block_size: int = 16, cuda_graphs: bool = False,
                 batch_invariant: bool = False, triton_attention: bool = False):
        """cuda_graphs: the target's verify steps, EAGLE catch-ups and argmax chains run as CUDA graphs.
        batch_invariant: the target's prefill and verify run the batch-invariant kernels (greedy
        speculation equals plain decoding bit for bit in bf16; CUDA and Triton only).
        triton_attention: the target's verify attends through the Triton paged tree attention
        (CUDA and Triton only; with or without cuda_graphs)."""
        from spectandem.checkpoint import load_tokenizer, read_config

        self.cfg = cfg
        # The head decides which features it reads, and takes weights from the target: build the
        # target first, then the proposer, then tell the runner what to return.
        runner, model = load_runner(target_dir, None, max_slots, max_len, dtype, device, force_hf_target,
                                    kv_blocks, block_size, cuda_graphs, batch_invariant, triton_attention)
        proposer = None
        if cfg.method != "none":
            proposer = build_proposer(cfg, model, draft_dir, max_slots, runner.max_len, dtype, device,
                                      draft_kv_blocks, block_size, cuda_graphs)
            runner.feature_layers = proposer.feature_layers
        self.verifier = VerifierEngine(runner, max_slots, int(read_config(target_dir)["vocab_size"]))
        self.drafter = DrafterEngine(proposer, cfg) if proposer is not None else None
        target_cfg = read_config(target_dir)
        eos = target_cfg.get("eos_token_id")
        self.eos_token_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        self.tokenizer = load_tokenizer(target_dir)
        self.vocab_size = int(target_cfg["vocab_size"])
        # Fused mode on the GPU with graphs: greedy rounds replay one graph (verifier/fused.py).
        self._fused_graph = None
        if cfg.fused and cuda_graphs and not batch_invariant:
            from verifier.fused import FusedGraphStep

            self._fused_graph = FusedGraphStep(self.verifier, self.drafter, graph=True)

    @property
    def lookahead(self) -> int:
        """Cache entries past the committed prefix one round may write (tree nodes, draft scratch)."""
        if self.drafter is None:
            return 1
        c = self.cfg
        return max(c.max_draft_nodes + 1, (c.num_steps - 1) * c.topk + 1)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 request_ids: list[str] | None = None, ahead: bool = False) -> list[LocalCompletion]:
        for i, p in enumerate(prompts):
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i}: token ids {bad[:5]} are outside the vocabulary 0..{self.vocab_size - 1}")
        fused = FusedStep(self.verifier, self.drafter, self._fused_graph) if self.cfg.fused else None
        return generate(self.verifier, self.drafter, prompts, params, self.eos_token_ids, self.lookahead,
                        request_ids, fused, ahead)
