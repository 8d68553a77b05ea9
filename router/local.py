"""Both engines in this process: what `spectandem generate` uses without a server address, and
what the tests drive the pair through. It builds a drafter and a verifier engine and runs the
reference loop (spectandem/reference.py) over them, so it sits above both roles, with the
router's in-process backend (router/links_local.py); like the router it imports no torch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from spectandem.config import EngineConfig, GpuPaths, SamplingParams, SpecConfig
from spectandem.devices import DEFAULT_DTYPE
from spectandem.reference import LocalCompletion, generate
from verifier.fused import FusedStep


class LocalSpeculator:
    def __init__(self, target_dir: str | Path, draft_dir: str | Path | None, cfg: SpecConfig,
                 max_slots: int = 8, max_len: int | None = None, dtype=DEFAULT_DTYPE,
                 device: str = "cpu", force_hf_target: bool = False, kv_blocks: int | None = None,
                 draft_kv_blocks: int | None = None, block_size: int = 16, cuda_graphs: bool = False,
                 batch_invariant: bool = False, triton_attention: bool = False):
        """Both engines from the role factories (verifier/factory.py, drafter/factory.py), the
        drafter on the target's weights as loaded for the verifier. cuda_graphs, batch_invariant,
        triton_attention: spectandem.config.GpuPaths (the target's graphs are off with
        batch_invariant)."""
        self._build(EngineConfig(
            target_dir=str(target_dir), draft_dir=None if draft_dir is None else str(draft_dir), spec=cfg,
            max_slots=max_slots, max_len=max_len, dtype=str(dtype).removeprefix("torch."), device=device,
            kv_blocks=kv_blocks, draft_kv_blocks=draft_kv_blocks, block_size=block_size,
            force_hf_target=force_hf_target,
            gpu=GpuPaths(cuda_graphs=cuda_graphs, batch_invariant=batch_invariant, triton_attention=triton_attention)))

    @classmethod
    def from_config(cls, config: EngineConfig, drafter_device: str | None = None) -> "LocalSpeculator":
        """Both engines of `config` (built once from a command's flags: EngineConfig.from_args).
        `drafter_device`: the drafter's device when not `config.device` (None: the same)."""
        self = cls.__new__(cls)
        self._build(config, drafter_device)
        return self

    def _build(self, config: EngineConfig, drafter_device: str | None = None) -> None:
        from drafter.factory import build_engine as build_drafter
        from spectandem.checkpoint import eos_token_ids, load_tokenizer, read_config
        from spectandem.memory import shared_gpu_configs
        from verifier.factory import build_engine as build_verifier
        from verifier.factory import warm_up_engine

        cfg = self.cfg = config.spec
        target_dir = config.target_dir
        # One device: the drafter's share of its memory and the verifier's rest (spectandem/memory.py);
        # a drafter on a device of its own sizes its pool from that device alone.
        shared = drafter_device in (None, config.device)
        verifier_config, drafter_config = shared_gpu_configs(config) if shared else (config, config)
        # The head decides which features it reads, and takes weights from the target: build the
        # target first, then the drafter on the same weights, then tell the runner what to return.
        # A drafter on another device loads the target's weights there itself (as a drafter
        # process does); the engines move what crosses between them to their own device.
        self.verifier = build_verifier(verifier_config, warm_up=False)
        self.drafter = None
        if cfg.method != "none":
            runner = self.verifier.runner
            if shared:
                self.drafter, _ = build_drafter(drafter_config, target=runner.model, context=runner.max_len)
            else:
                self.drafter, _ = build_drafter(dataclasses.replace(drafter_config, device=drafter_device))
            runner.feature_layers = self.drafter.feature_layers
        warm_up_engine(self.verifier, verifier_config)   # its graphs, with the features the drafter reads
        target_cfg = read_config(target_dir)
        self.eos_token_ids = eos_token_ids(target_cfg)
        self.tokenizer = load_tokenizer(target_dir)
        self.vocab_size = int(target_cfg["vocab_size"])
        # Fused mode on the GPU with graphs: greedy rounds replay one graph (verifier/fused.py).
        self._fused_graph = None
        if cfg.fused and config.gpu.cuda_graphs and not config.gpu.batch_invariant:
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
