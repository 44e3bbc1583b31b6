"""Owns the model and the paged KV pool; turns a batch of sequences into next-token logits."""
from __future__ import annotations

import itertools
import logging
import time
import types
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from engine import hardware, host_memory, kernels, triton_attention
from engine.attention import ATTN_NAME, AttnMetadata, PrefillSlice
from engine.config import KVLayout
from engine.packed_linear import BATCH_HINT
from engine.sampling_params import SamplingParams
from engine.scheduler import Chunk
from engine.sequence import Sequence

log = logging.getLogger(__name__)


# The compiled CPU decode step's wrapper, the code that calls its several hundred kernels and operators in turn,
# in C++: 2 ms less per step at batch 1 (22.0 vs 23.9 ms) and 3.6 ms at batch 8 (35.6 vs 39.3 ms) on a 2-core
# AVX2 EPYC, SmolLM2-135M fp32, the two ways alternating in one process. Built apart from the kernels
# (`..._build_separate`, the wrapper at -O1): a cold compile then takes what the Python wrapper's does (139 s for
# the batch-1 and batch > 1 graphs it compiled then); built together with them it took 390 s.
CPU_WRAPPER = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
# The compiled decode step checks no guards on the model's modules (~7,000 of them, their attributes, parameters
# and types) before it runs: a runner never changes its modules once it compiled, and the thread count, which it
# does change (`prepare_threads`), is global state, still checked. 0.3 ms less per step at batch 1 (8.30 vs 8.61 ms)
# on a 2-core AVX-512 BF16 EPYC (family 26), bf16, the two ways alternating in one process.
STEP_GUARDS = torch.compiler.skip_guard_on_all_nn_modules_unsafe
_STEPS = itertools.count()  # decode steps compiled in this process: each its own code object (`_compile_decode`)
# The compiled decode step is one graph for every batch size, batch 1 included: its batch dimension is unbacked
# (Dynamo would otherwise specialise a batch of 1 into a graph of its own, and compile twice at start-up), and
# inductor tunes its code for a typical decode batch (`packed_linear.BATCH_HINT` rows). Cold, on a 2-core AVX-512
# EPYC at 1 thread, the engine starts in 46-50 s instead of 79-80 s (fp32, bf16), and the loan's graph compiles in
# 6-7 s instead of 12. Without the hint inductor assumes a huge batch and the steps ran 3-4% slower at batch 32;
# with it they time as the two graphs did, within 2% at batch 1-32 (fp32 and bf16, 1 and 2 threads, the two ways
# alternating in one process).


def kv_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder-only model's attention."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


# How far the compiled decode step's logits may lie from the eager model's (relative L2 norm) on the
# start-up check's prompts. The step fuses and reorders arithmetic, so in 16-bit dtypes the two round
# differently by a few percent (bfloat16, AMX, 30 layers: up to 0.02 measured); a decoder the step does
# not reproduce (e.g. scaled embeddings) is off by far more.
EAGER_TOLERANCE = {torch.float32: 0.05, torch.bfloat16: 0.1, torch.float16: 0.1}

CHECK_BLOCKS = 6  # KV blocks of the check's prompts: the batch-2 check's two, three blocks each


def matches_eager(compiled: torch.Tensor, eager: torch.Tensor) -> tuple[bool, float]:
    """Whether the compiled step's logits are the eager model's, within its dtype's rounding; and the
    relative error."""
    err = float((compiled.float() - eager.float()).norm() / eager.float().norm().clamp_min(1e-6))
    return err < EAGER_TOLERANCE[eager.dtype], err


class ModelRunner:
    """Runs transformers' own model classes with attention over the paged KV pool.

    Args:
        model: a loaded causal LM (its attention implementation is switched to paged).
        layout: the KV pool's shape.
        compile: run each decode step as one compiled graph (needs the paged decode kernel: CPU or Triton).
    """

    def __init__(self, model: PreTrainedModel, layout: KVLayout, compile: bool = False) -> None:
        self.model = model.eval()
        self.model.set_attn_implementation(ATTN_NAME)
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.layout = layout
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # the pool's blocks, then CHECK_BLOCKS of the runner's own for the compiled step's checks (which may
        # run while the pool's blocks hold live sequences: `prepare_threads`)
        self.kv, self.kv_pages = host_memory.zeros(
            (layout.num_layers, 2, layout.num_kv_heads, layout.num_blocks + CHECK_BLOCKS, layout.block_size,
             layout.head_dim), self.dtype, self.device)
        log.info("KV pool: %.2f GiB on %s", self.kv.numel() * self.kv.element_size() / 2**30, self.kv_pages)
        group = model.config.get_text_config().num_attention_heads // layout.num_kv_heads
        if self.device.type == "cuda":
            self.use_kernel = triton_attention.available()
        else:
            self.use_kernel = kernels.supports(self.dtype, self.device, group)
        # prompt chunks over a cached context on the CPU prefill kernel (bf16, or fp32 with AVX-512), else gather +
        # SDPA; and prompts with none (first chunks) too where the kernel beats causal SDPA, else causal SDPA
        self.prefill_kernel = kernels.supports_prefill(self.dtype, self.device, layout.head_dim)
        self.prefill_kernel_whole = self.prefill_kernel and kernels.prefill_whole(self.dtype)
        self._step: Callable[..., torch.Tensor] | None = None  # the compiled decode step
        self._step_ready = False  # its graphs (one per thread count) are warm: only guards telling them apart run
        self._layer_hook: Callable[[int], None] | None = None
        self._hooked = False
        self._prefilling = False
        if compile and self.use_kernel:
            t0 = time.perf_counter()
            log.info("compiling the decode step (15 s to 2 min the first time, by CPU; cached on disk after) ...")
            self._step = self._compile_decode()
            self._warm_compiled()
            log.info("decode step %s in %.1f s", "compiled" if self.compiled else "left eager",
                     time.perf_counter() - t0)
        elif compile:
            log.warning("compile needs the paged decode kernel (CPU: float32/bfloat16 and a C compiler; CUDA: "
                        "triton); running eager")

    @property
    def attention_kernel(self) -> str:
        """The decode attention in use: a CPU kernel build's name, "triton" (CUDA), or "torch" (gather + SDPA)."""
        if not self.use_kernel:
            return hardware.TORCH_KERNEL
        return "triton" if self.device.type == "cuda" else kernels.active().name

    @property
    def compiled(self) -> bool:
        """Whether decode steps run as one compiled graph."""
        return self._step is not None

    def set_layer_hook(self, hook: Callable[[int], None]) -> None:
        """Call `hook(layer)` after each decoder layer of a step that computes prompt chunks, once that
        layer's K/V sit in the pool: the prefill worker ships layer i while layer i + 1 computes."""
        self._layer_hook = hook
        if not self._hooked:
            for i, layer in enumerate(self.decoder.layers):
                layer.register_forward_hook(self._after_layer(i))
            self._hooked = True

    def _after_layer(self, i: int) -> Callable[..., None]:
        def after(*_: object) -> None:  # returns None: a forward hook's value would replace the layer's output
            if self._prefilling:
                self._layer_hook(i)
        return after

    def _compile_decode(self) -> Callable[..., torch.Tensor]:
        """The whole decode step as one compiled graph: embedding, rotary tables, every decoder layer,
        final norm and LM head. The layers are one nested region: compiled once, stamped out for each
        layer (a fast compile), and one guard check per step instead of one per layer. Its C++ kernels read
        the thread count when they run (`cpp.dynamic_threads`): the graph for another thread count (a
        loan's, `prepare_threads`) then reuses them from inductor's cache instead of compiling its own (on a
        2-core AVX2 EPYC, cold: 28 s instead of 99 s, when it was two graphs; decode steps within the run-to-run
        noise of kernels fixed to one count). On the CPU the step's calls run from inductor's C++ wrapper
        rather than its Python one (`CPU_WRAPPER`)."""
        torch.fx.experimental._config.use_duck_shape = False  # sizes equal by chance stay independent
        dec, kv, lm_head = self.decoder, self.kv, self.lm_head

        def step(input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 ctx: torch.Tensor) -> torch.Tensor:
            hidden = dec.embed_tokens(input_ids)
            cos, sin = dec.rotary_emb(hidden, position_ids=positions)
            for i, layer in enumerate(dec.layers):
                hidden = _decode_layer(layer, hidden, cos, sin, slots, tables, ctx, kv[i])
            return lm_head(dec.norm(hidden)[0])
        # Its guards leave the model's modules out (`STEP_GUARDS`); Dynamo keeps graphs per code object, so each
        # runner's step gets a code object of its own: a graph compiled for one model never runs another's.
        own = step.__code__.replace(co_name=f"decode_step_{next(_STEPS)}")
        step = types.FunctionType(own, step.__globals__, own.co_name, step.__defaults__, step.__closure__)
        options = {"cpp.dynamic_threads": True, "guard_filter_fn": STEP_GUARDS,
                   **(CPU_WRAPPER if self.device.type == "cpu" else {})}
        return torch.compile(step, dynamic=False, options=options)

    def _warm_compiled(self) -> None:
        """Compile now rather than on a user's first requests: the one graph, at a batch of 2, then checked
        at a batch of 1 as well (no new graph: the batch dimension is unbacked, `BATCH_HINT`). Each batch
        is checked once against the eager model (`matches_eager`); a model whose decoder does more than
        the standard embed → layers → norm (e.g. scaled embeddings) keeps the eager path.
        The check's prompts are distinct tokens whose KV an eager prefill writes first, so both ways
        attend over real keys: repeated tokens over an empty cache make 16-bit rounding alone look like
        a different model. Their KV goes to the runner's own blocks past the pool's, never a sequence's."""
        bs, first = self.layout.block_size, self.layout.num_blocks
        vocab = self.lm_head.out_features  # nn.Linear, PackedLinear and KernelLinear alike
        for batch in (2, 1):  # contexts over one block, so no dimension is specialised to 1
            t0 = time.perf_counter()
            seqs = [Sequence(f"warmup-{i}", [(7919 * (j + 1) + 104729 * i) % vocab for j in range(2 * bs + 1 + i)],
                             SamplingParams(max_tokens=1)) for i in range(batch)]
            for i, seq in enumerate(seqs):
                seq.block_table = [first + 3 * i + k for k in range(3)]
                self._write_kv(seq)
            compiled = self.decode(seqs)
            step, self._step = self._step, None
            eager = self.decode(seqs)
            self._step = step
            ok, err = matches_eager(compiled, eager)
            if not ok:
                log.warning("compiled decode step differs from the eager model (relative error %.3g, at most %.3g "
                            "in %s); running eager", err, EAGER_TOLERANCE[eager.dtype], eager.dtype)
                self._step = None
                return
            log.info("decode step graph (any batch, %d threads) %s at batch %d in %.1f s (relative error %.2g)",
                     torch.get_num_threads(), "compiled and checked" if batch > 1 else "checked", batch,
                     time.perf_counter() - t0, err)
        self._step_ready = True

    def _write_kv(self, seq: Sequence) -> None:
        """The KV of all but `seq`'s newest token, by the eager model, with no layer hook (a check is no
        prompt of the engine's)."""
        hook, self._layer_hook = self._layer_hook, None
        try:
            self.run([], [Chunk(seq, 0, seq.num_tokens - 1, final=False)])
        finally:
            self._layer_hook = hook

    def prepare_threads(self, threads: int) -> None:
        """Compile the decode step for `threads` torch threads too (Dynamo guards on the thread count: a
        graph of its own, though its kernels come from inductor's cache), so that switching to it later
        costs no compilation mid-serving."""
        if self._step is None:
            return
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        self._step_ready = False  # with full guard checks: a graph of its own for this thread count
        try:
            self._warm_compiled()
        finally:
            torch.set_num_threads(before)

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.layout.block_size
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    @torch.inference_mode()
    def run(self, decode: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        """One step in one forward pass: the newest token of each decoding sequence, then each
        prompt chunk. Returns next-token logits [B, V] of the decoding sequences and the chunks
        that finish a prompt, in that order (`Batch.sampled`)."""
        if not chunks:
            return self.decode(decode)
        nd = len(decode)
        ids = [s.last_token_id for s in decode]
        positions, slots, slices = [], [], []
        meta = AttnMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode=nd,
                            prefill_kernel=self.prefill_kernel, prefill_kernel_whole=self.prefill_kernel_whole)
        if decode:
            table, ctx, decode_slots, mask = self._decode_inputs(decode)
            positions.append(ctx - 1)
            slots.append(decode_slots)
            meta.decode_blocks, meta.ctx_lens, meta.max_ctx = table.to(self.device), ctx.to(self.device), int(ctx.max())
            meta.decode_mask, meta.use_kernel = mask, self.use_kernel
        last = list(range(nd))
        n = nd
        for c in chunks:
            ids.extend(c.seq.token_ids[c.start:c.end])
            positions.append(torch.arange(c.start, c.end))
            slots.append(self._slots(c.seq.block_table, c.start, c.end))
            blocks = mask = None
            if c.start > 0 or self.prefill_kernel_whole:
                needed = -(-c.end // self.layout.block_size)  # the blocks up to the chunk's end
                blocks = torch.tensor([c.seq.block_table[:needed]], dtype=torch.long, device=self.device)
            if c.start > 0:
                mask = _chunk_mask(c.start, c.end, self.kv.dtype).to(self.device)
            slices.append(PrefillSlice(n, n + c.end - c.start, c.start, blocks, mask))
            n += c.end - c.start
            if c.final:
                last.append(n - 1)
        meta.slot_mapping, meta.prefill = torch.cat(slots).to(self.device), slices
        self._prefilling = self._layer_hook is not None
        try:
            return self._forward(ids, torch.cat(positions), meta, last)
        finally:
            self._prefilling = False

    def _decode_inputs(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                            torch.Tensor | None]:
        """Block tables [B, max_blocks] (at least 2 columns), context lengths [B], the newest tokens'
        slots [B], and the padding mask of gather + SDPA (None with the kernel or equal lengths); on the CPU."""
        bs = self.layout.block_size
        ctx = torch.tensor([s.num_tokens for s in seqs])
        max_ctx = int(ctx.max())
        max_blocks = (max_ctx + bs - 1) // bs
        # at least 2 columns: a size-1 dimension would need a graph of its own (padding is never read)
        table = torch.zeros(len(seqs), max(max_blocks, 2), dtype=torch.long)
        for i, seq in enumerate(seqs):
            table[i, :len(seq.block_table)] = torch.tensor(seq.block_table[:max_blocks])
        last = ctx - 1
        slots = table[torch.arange(len(seqs)), last // bs] * bs + last % bs
        mask = None
        if not self.use_kernel and int(ctx.min()) != max_ctx:
            mask = (torch.arange(max_ctx)[None, :] < ctx[:, None])[:, None, None, :].to(self.device)
        return table, ctx, slots, mask

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Compute one token per sequence (its last); return next-token logits [B, V]."""
        table, ctx, slot_mapping, mask = self._decode_inputs(seqs)
        last = ctx - 1
        ids = [s.last_token_id for s in seqs]
        if self._step is not None:
            inputs = (torch.tensor([ids]), last[None], slot_mapping, table, ctx)
            if self.device.type != "cpu":
                inputs = tuple(t.to(self.device, non_blocking=True) for t in inputs)
            return self._decode_compiled(*inputs)
        meta = AttnMetadata(slot_mapping=slot_mapping.to(self.device), decode_blocks=table.to(self.device),
                            ctx_lens=ctx.to(self.device), max_ctx=int(ctx.max()), decode_mask=mask,
                            use_kernel=self.use_kernel)
        return self._forward(ids, last, meta, list(range(len(seqs))))

    def _decode_compiled(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Run the compiled step (inputs on the model's device). Batch and block-table sizes are
        dynamic. Once its graphs are warm (one per thread count), only the guards that tell them apart are
        checked; should an input still need a new graph, it runs again with full guards (rewriting the same
        KV slots)."""
        ids, positions, slots, tables, ctx = inputs
        for t, d in ((ids, 1), (positions, 1), (slots, 0), (tables, 0), (ctx, 0)):  # the batch: any size
            torch._dynamo.decorators.mark_unbacked(t, d, hint_override=BATCH_HINT)
        torch._dynamo.mark_dynamic(tables, 1)  # the blocks of the longest context
        assert self._step is not None
        if not self._step_ready:
            return self._step(*inputs)
        try:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self._step(*inputs)
        except RuntimeError as e:  # torch raises a plain RuntimeError when a new graph is needed here
            log.warning("decode step failed without guard checks (%s); running it again with them", e)
            return self._step(*inputs)  # a real error raises again

    def _forward(self, ids: list[int], positions: torch.Tensor, meta: AttnMetadata,
                 last: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.decoder(input_ids=input_ids, position_ids=positions[None].to(self.device), use_cache=False,
                           attn_meta=meta, kv_cache=self.kv)
        hidden = out.last_hidden_state[0]
        if len(last) != hidden.shape[0]:
            hidden = hidden[torch.tensor(last, dtype=torch.long, device=self.device)]
        return self.lm_head(hidden)


def _chunk_mask(start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [end - start, end] of a prompt chunk's queries (positions [start, end)) over
    its context: 0 up to each query's own position, -inf past it. Built once per step in the model's
    dtype: SDPA would otherwise turn a boolean mask into this in every layer (5–7% of a step of chunks
    over a 1,440-token prefix, bf16 on a 2-core AMX Xeon)."""
    future = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
    return torch.zeros(end - start, end, dtype=dtype).masked_fill_(future, float("-inf"))


@torch.compiler.nested_compile_region
def _decode_layer(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
    """One decoder layer of a compiled decode step, over its own part of the pool (no layer index
    in the graph, so every layer reuses one compiled region). `forward`, not the module call:
    the prefill worker's per-layer hooks are not part of a decode step."""
    meta = AttnMetadata(slot_mapping=slots, decode_blocks=tables, ctx_lens=ctx, use_kernel=True, layer_kv=True)
    return layer.forward(hidden, position_embeddings=(cos, sin), attn_meta=meta, kv_cache=kv_layer)
