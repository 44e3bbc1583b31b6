"""Frozen engine configuration. Facts found at start-up live in `KVLayout`, never here."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.hardware import AUTO

DTYPES = (AUTO, "float32", "bfloat16", "float16")
LINEARS = (AUTO, "packed", "plain")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings.

    Args:
        block_size: tokens per KV block.
        memory_gib: memory budget for the KV pool; the number of blocks follows from it.
        enable_prefix_caching: reuse full blocks of earlier prompts keyed by their token hash chain.
    """

    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    memory_gib: float = field(default=1.0, metadata={"flag": "--kv-memory-gib",
                                                     "help": "memory budget of each worker's paged KV pool, GiB"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of earlier prompts' shared prefixes"})

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if not self.memory_gib > 0:
            raise ValueError(f"memory_gib must be > 0, got {self.memory_gib}")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine runs and how much work one step may take.

    Args:
        model: path of a Hugging Face causal-LM directory; None means the embedded default.
        dtype: weights and KV dtype: float32, bfloat16, float16 (CUDA only), or auto: the one that
            serves fastest on this machine, chosen at start-up (`engine.auto_dtype`).
        device: "cpu" or a CUDA device such as "cuda:0".
        max_num_seqs: most sequences in one batch.
        max_num_batched_tokens: most tokens one step computes: prompt chunks plus one per decoding sequence
            (those always run).
        prefill_chunk_tokens: most prompt tokens of one sequence in one step, and of all prompts in a
            step that also decodes: the longest a prompt holds up the running batch or other prompts
            (a prompt alone in its step goes whole, within `max_num_batched_tokens`).
        max_model_len: context limit; None means the model's own.
        num_threads: torch intra-op threads on CPU; None leaves torch's default.
        linear: how linear layers compute on CPU: "packed" (weights packed once for oneDNN,
            `engine.packed_linear`), "plain" (`F.linear`), or auto: per group of layers, whichever
            of those and pdserve's kernel (on the weight, or on a blocked copy) runs decode-sized
            products faster here, measured at start-up. CUDA always runs plain.
        seed: seed for requests that sample without a seed of their own.
        chat_template: the Jinja chat template chat prompts are rendered with instead of the model's
            own: a file's path, or the template itself (`engine.chat_template`); None: the model's.
        compile: run each decode step as one `torch.compile`d graph (with the paged decode kernel:
            a CPU build or Triton on CUDA; 15 s to 2 min of compilation at the first start, by CPU; cached on disk).
            Checked once against the eager model at start; a decoder it does not reproduce stays eager.
        cache: the KV cache settings.
    """

    model: str | None = field(default=None, metadata={
        "help": "local Hugging Face model directory (default: the embedded model)"})
    dtype: str = field(default=AUTO, metadata={
        "choices": DTYPES, "help": "weights and KV dtype; auto: the fastest on this machine, chosen at start-up from "
        "the CPU (or GPU) and, where that does not decide, a short measurement"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda[:N]"})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences a worker runs at once"})
    max_num_batched_tokens: int = field(default=8192, metadata={
        "help": "most tokens one step computes: prompt chunks plus one per decoding sequence"})
    prefill_chunk_tokens: int = field(default=256, metadata={
        "help": "most prompt tokens of one sequence per step, and of all prompts in a step that also decodes "
        "(longer prompts are prefilled in chunks next to the running batch or other prompts; alone, whole)"})
    max_model_len: int | None = field(default=None, metadata={"help": "context limit (default: the model's)"})
    num_threads: int | None = field(default=None, metadata={
        "flag": "--threads", "help": "torch threads per engine (default: torch's choice; serve: --cpus-per-worker)"})
    linear: str = field(default=AUTO, metadata={"choices": LINEARS, "help": (
        "linear layers on CPU: packed (weights packed once for oneDNN), plain (F.linear), or auto: per group of "
        "layers, the fastest for decode-sized batches here of plain, packed and pdserve's own kernel on the weight "
        "as it is or on a blocked copy (fp32: AVX2 + FMA; bf16: AVX-512 BF16 or AMX), measured at start-up")})
    seed: int = field(default=0, metadata={"help": "seed of sampled requests that give none of their own"})
    chat_template: str | None = field(default=None, metadata={
        "help": "Jinja chat template for chat prompts instead of the model's own: a file, or the template itself "
        "(default: the model's)"})
    compile: bool = field(default=False, metadata={
        "help": "run each decode step as one torch.compile'd graph (faster decode; 15 s to 2 min of compiling at the "
        "first start, by CPU; cached on disk after)"})
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.linear not in LINEARS:
            raise ValueError(f"linear must be one of {LINEARS}, got {self.linear!r}")
        if self.dtype == "float16" and not self.device.startswith("cuda"):
            raise ValueError("dtype float16 needs a CUDA device; on cpu use auto, bfloat16 or float32")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template.strip()):
            raise ValueError(f"chat_template must be a file path or a template, got {self.chat_template!r}")


@dataclass(frozen=True)
class KVLayout:
    """Shape of the paged KV pool, found at start-up from the model and the memory budget."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype_bytes: int

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_budget(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                    cache: CacheConfig) -> KVLayout:
        per_block = 2 * num_layers * cache.block_size * num_kv_heads * head_dim * dtype_bytes
        num_blocks = int(cache.memory_gib * (1 << 30)) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"cache memory_gib={cache.memory_gib} holds no KV block; one block of "
                f"{cache.block_size} tokens needs {per_block / (1 << 30):.6f} GiB")
        return cls(num_layers, num_kv_heads, head_dim, cache.block_size, num_blocks, dtype_bytes)
