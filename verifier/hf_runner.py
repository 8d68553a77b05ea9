"""The transformers fallback runner (verifier/runner.py's conventions): any causal LM that the
native runner does not cover, one DynamicCache per request and a 4-D mask for the tree."""

from __future__ import annotations

import torch

from spectandem.tree import tree_shape

FeatureSpec = None | str | tuple[int, ...]


class HFRunner:
    """Any transformers causal LM: one DynamicCache per request, a 4-D mask for the tree.
    `commit` crops the cache to the committed prefix and re-runs the accepted path (one extra
    forward per round: slower, same tokens)."""

    # What NativeRunner can do and this runner cannot (VerifierEngine.decode asks):
    chains_decode = False         # several greedy steps chained on the device (NativeRunner.decode_greedy)

    def __init__(self, model, feature_layers: FeatureSpec, max_len: int):
        self.model, self.feature_layers, self.max_len = model, feature_layers, max_len
        self.device = next(model.parameters()).device
        self.caches: dict[int, object] = {}
        self.last_tree: dict[int, torch.Tensor] = {}   # slot -> [N] tokens of its last verified tree
        self.num_layers = model.config.num_hidden_layers

    def _features(self, out):
        if self.feature_layers is None:
            return None
        hs = out.hidden_states
        if self.feature_layers == "final":
            return hs[-1]
        return torch.cat([hs[k] for k in self.feature_layers], dim=-1)

    @torch.no_grad()
    def prefill(self, slots, prompts):
        from transformers import DynamicCache

        logits, feats = [], []
        for slot, p in zip(slots, prompts):
            cache = DynamicCache()
            ids = torch.tensor([p], device=self.device)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                             output_hidden_states=self.feature_layers is not None)
            self.caches[slot] = out.past_key_values
            logits.append(out.logits[0, -1].float())
            f = self._features(out)
            feats.append(None if f is None else f[0])
        return torch.stack(logits), (None if self.feature_layers is None else feats)

    @torch.no_grad()
    def verify(self, slots, cache_lens, token_ids, parents, node_valid):
        depth, tree = tree_shape(parents.cpu(), node_valid.cpu())
        logits, feats = [], []
        for i, (slot, base) in enumerate(zip(slots, cache_lens)):
            n = token_ids.shape[1]
            mask = torch.zeros(1, 1, n, base + n, dtype=torch.bool, device=self.device)
            mask[0, 0, :, :base] = True
            mask[0, 0, :, base:] = tree[i]
            additive = torch.zeros(mask.shape, dtype=self.model.dtype, device=self.device)
            additive.masked_fill_(~mask, torch.finfo(self.model.dtype).min)
            out = self.model(input_ids=token_ids[i: i + 1].clamp(min=0).to(self.device),
                             position_ids=(base + depth[i: i + 1]).to(self.device),
                             attention_mask=additive, past_key_values=self.caches[slot], use_cache=True,
                             output_hidden_states=self.feature_layers is not None)
            # Drop the tree's entries. crop(-n) removes n entries in every transformers version;
            # a positive argument meant "keep that many" before 5.x and is refused since.
            extra = self.caches[slot].get_seq_length() - base
            if extra > 0:
                self.caches[slot].crop(-extra)
            self.last_tree[slot] = token_ids[i].clone()
            logits.append(out.logits[0].float())
            f = self._features(out)
            feats.append(None if f is None else f[0])
        return torch.stack(logits), (None if self.feature_layers is None else torch.stack(feats))

    def verify_and_prefill(self, slots, cache_lens, token_ids, parents, node_valid, prompt_slots, prompts):
        """`verify`; it carries none of the prompts (NativeRunner.verify_and_prefill's contract:
        the caller prefills them)."""
        return (*self.verify(slots, cache_lens, token_ids, parents, node_valid), 0, None, None)

    @torch.no_grad()
    def features(self, tokens: list[int]) -> torch.Tensor | None:
        if self.feature_layers is None:
            return None
        out = self.model(input_ids=torch.tensor([tokens], device=self.device), output_hidden_states=True)
        return self._features(out)[0]

    @torch.no_grad()
    def commit(self, slots, cache_lens, accepted_nodes):
        """Replays the accepted path into the slot's transformers cache."""
        for i, (slot, base) in enumerate(zip(slots, cache_lens)):
            nodes = [int(x) for x in accepted_nodes[i] if x >= 0]
            path = self.last_tree.pop(slot)[nodes][None].to(self.device)
            pos = torch.arange(base, base + len(nodes), device=self.device)[None]
            self.model(input_ids=path, position_ids=pos, past_key_values=self.caches[slot], use_cache=True)

    def warm_up(self, widths: list[int], progress=None) -> None:
        """Nothing to capture: this runner has no CUDA graphs."""

    def kv_stats(self) -> dict:
        return {}  # transformers' own caches: not paged, no pool to report

    def release(self, slot: int) -> None:
        self.caches.pop(slot, None)
        self.last_tree.pop(slot, None)
