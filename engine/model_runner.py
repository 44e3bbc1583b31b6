"""Owns the model and the paged KV pool; turns a batch of sequences into next-token logits."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from engine import kernels
from engine.attention import ATTN_NAME, AttnMetadata, PrefillSlice
from engine.config import KVLayout
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

log = logging.getLogger(__name__)


def kv_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder-only model's attention."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


class ModelRunner:
    """Runs transformers' own model classes with attention over the paged KV pool.

    Args:
        model: a loaded causal LM (its attention implementation is switched to paged).
        layout: the KV pool's shape.
        compile: compile the decoder layers for decode steps (needs the CPU kernel).
    """

    def __init__(self, model: PreTrainedModel, layout: KVLayout, compile: bool = False) -> None:
        self.model = model.eval()
        self.model.set_attn_implementation(ATTN_NAME)
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.layout = layout
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kv = torch.zeros(layout.num_layers, 2, layout.num_kv_heads, layout.num_blocks, layout.block_size,
                              layout.head_dim, dtype=self.dtype, device=self.device)
        group = model.config.get_text_config().num_attention_heads // layout.num_kv_heads
        self.use_kernel = kernels.supports(self.dtype, self.device, group)
        self._compiled: list | None = None
        self._graphs_ready = False  # compiled graphs warmed: only their distinguishing guards are checked
        self._layer_hook: Callable[[int], None] | None = None
        self._hooked = False
        self._prefilling = False
        if compile and self.use_kernel:
            self._compiled = self._compile_layers()
            self._warm_compiled()
        elif compile:
            log.warning("compile needs the CPU paged kernel (cpu, float32/bfloat16, a C compiler); running eager")

    def set_layer_hook(self, hook: Callable[[int], None]) -> None:
        """Call `hook(layer)` after each decoder layer of a prefill, once that layer's K/V sit in
        the pool: the prefill worker ships layer i while layer i + 1 computes."""
        self._layer_hook = hook
        if not self._hooked:
            for i, layer in enumerate(self.decoder.layers):
                layer.register_forward_hook(lambda *_, i=i: self._prefilling and self._layer_hook(i))
            self._hooked = True

    def _compile_layers(self) -> list:
        """Regional compilation: every decoder layer shares one compiled graph (two: batch 1 and
        batch > 1). Prefill stays eager; decode switches the layers to their compiled calls."""
        torch._dynamo.config.allow_unspec_int_on_nn_module = True  # layer_idx: one graph for all layers
        torch.fx.experimental._config.use_duck_shape = False  # sizes equal by chance stay independent
        torch._dynamo.mark_static(self.kv)
        compiled = []
        for layer in self.decoder.layers:
            layer.compile(dynamic=True)
            compiled.append(layer._compiled_call_impl)
            layer._compiled_call_impl = None
        return compiled

    def _warm_compiled(self) -> None:
        """Compile now rather than on a user's first requests: the batch-1 and batch > 1 graphs.
        Dummy tokens go to the first free blocks, which nothing reads before they are rewritten."""
        bs = self.layout.block_size
        if self.layout.num_blocks < 6:
            return
        for batch in (1, 2):  # contexts over one block, so no dimension is specialised to 1
            seqs = [Sequence(f"warmup-{i}", [0] * (2 * bs + 1 + i), SamplingParams(max_tokens=1))
                    for i in range(batch)]
            for i, seq in enumerate(seqs):
                seq.block_table = [3 * i, 3 * i + 1, 3 * i + 2]
            self.decode(seqs)
        self._graphs_ready = True

    def _use_compiled(self, on: bool) -> None:
        if self._compiled is not None:
            for layer, impl in zip(self.decoder.layers, self._compiled):
                layer._compiled_call_impl = impl if on else None

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.layout.block_size
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Compute each sequence's uncached tokens; return logits of each last token [B, V]."""
        ids: list[int] = []
        positions, slots, slices, last = [], [], [], []
        n = 0
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_tokens
            ids.extend(seq.token_ids[start:])
            positions.append(torch.arange(start, end))
            slots.append(self._slots(seq.block_table, start, end))
            blocks = mask = None
            if start > 0:
                blocks = torch.tensor([seq.block_table], dtype=torch.long, device=self.device)
                mask = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]).to(self.device)
            slices.append(PrefillSlice(n, n + end - start, start, blocks, mask))
            n += end - start
            last.append(n - 1)
        meta = AttnMetadata(slot_mapping=torch.cat(slots).to(self.device), prefill=slices)
        self._use_compiled(False)
        self._prefilling = self._layer_hook is not None
        try:
            return self._forward(ids, torch.cat(positions), meta, last)
        finally:
            self._prefilling = False

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Compute one token per sequence (its last); return next-token logits [B, V]."""
        bs = self.layout.block_size
        ctx = torch.tensor([s.num_tokens for s in seqs])
        max_ctx = int(ctx.max())
        max_blocks = (max_ctx + bs - 1) // bs
        # at least 2 columns: a size-1 dimension would need a graph of its own (padding is never read)
        table = torch.zeros(len(seqs), max(max_blocks, 2), dtype=torch.long)
        for i, seq in enumerate(seqs):
            table[i, :len(seq.block_table)] = torch.tensor(seq.block_table[:max_blocks])
        last = ctx - 1
        slot_mapping = table[torch.arange(len(seqs)), last // bs] * bs + last % bs
        mask = None
        if not self.use_kernel and int(ctx.min()) != max_ctx:
            mask = (torch.arange(max_ctx)[None, :] < ctx[:, None])[:, None, None, :].to(self.device)
        meta = AttnMetadata(slot_mapping=slot_mapping.to(self.device), decode_blocks=table.to(self.device),
                            ctx_lens=ctx.to(self.device), max_ctx=max_ctx, decode_mask=mask,
                            use_kernel=self.use_kernel)
        self._use_compiled(True)
        if not self._graphs_ready:
            return self._forward([s.last_token_id for s in seqs], ctx - 1, meta, list(range(len(seqs))))
        # Both graphs exist after warm-up; check only the guards that tell them apart. Should an input
        # still need a new graph, run again with full guards (the step rewrites the same KV slots).
        try:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self._forward([s.last_token_id for s in seqs], ctx - 1, meta, list(range(len(seqs))))
        except RuntimeError as e:
            if "Recompilation" not in str(e):
                raise
            log.warning("decode step needed a new compiled graph: %s", e)
            return self._forward([s.last_token_id for s in seqs], ctx - 1, meta, list(range(len(seqs))))

    def _forward(self, ids: list[int], positions: torch.Tensor, meta: AttnMetadata,
                 last: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.decoder(input_ids=input_ids, position_ids=positions[None].to(self.device), use_cache=False,
                           attn_meta=meta, kv_cache=self.kv)
        hidden = out.last_hidden_state[0]
        if len(last) != hidden.shape[0]:
            hidden = hidden[torch.tensor(last, device=self.device)]
        return self.lm_head(hidden)
