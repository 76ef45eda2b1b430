"""Model and training settings; presets follow the HSTU paper's MovieLens-1M setup."""
from dataclasses import asdict, dataclass, replace

from kernels.dynamic_embedding import EmbeddingConfig, OptimizerConfig

GENRE_SEED_OFFSET = 1_000_003
GENRE_CAPACITY, GENRE_MAX_CAPACITY = 1 << 10, 1 << 16


@dataclass(frozen=True)
class HSTUConfig:
    num_blocks: int = 2
    num_heads: int = 1
    attention_dim: int = 50  # per head, for Q and K
    linear_dim: int = 50  # per head, for U and V
    embedding_dim: int = 50  # item embedding (the model width)
    max_seq_len: int = 200
    dropout: float = 0.2
    num_time_buckets: int = 128
    # training
    lr: float = 4e-3
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.0
    batch_size: int = 128  # sequences per step, over all processes
    # negatives shared by every position of a step: the whole catalog (the full softmax)
    # when it has no more items than this, else a uniform sample of this many
    num_negatives: int = 16384
    temperature: float = 0.1
    # a long sequence is trained on a window ending at a random place each epoch, not
    # always on its last max_seq_len items
    random_windows: bool = True
    # under several processes, every global batch is split over the ranks by the sequences'
    # FLOPs (balanced_sampler.py), not at random: a step lasts as long as its busiest rank
    balanced_batches: bool = True
    seed: int = 0
    # the item table: its own sparse optimizer (Adam, same rate as the dense weights)
    embedding_optimizer: str = "adam"
    embedding_capacity: int = 1 << 14
    embedding_max_capacity: int = 1 << 22
    # item side features: each item's genres (items.parquet, where the data has them),
    # their rows' mean added to the item's row, from a second table of the same collection
    item_features: bool = False
    # on one CUDA device, the model's training forward and backward replay CUDA graphs, one
    # per bucket of padded row counts (this many, evenly spaced; 0: no graphs)
    cuda_graph_buckets: int = 4
    # on a GPU, a step that runs the model without graphs pads its batch's rows up to a
    # multiple of this, with padding rows the loss leaves out (row_padding.py): a row count
    # cuBLAS has not seen costs the host milliseconds, and a jagged batch's total is new
    # nearly every step (0: no padding)
    row_multiple: int = 1024
    # each block's work around the attention (layer norms, SiLU, the split, the product
    # with U, dropout), the model's input, its output's normalization and the sampled
    # softmax's per-position work before its logits through torch.compile: fewer passes
    # over memory, a compilation at the first step (hstu.py, losses.py). Off by default:
    # faster on one GPU, measured slower under 4 processes on one host (benchmarks/scaling.md)
    compile_blocks: bool = False
    # the whole model's forward (every block, the attention and kernels.norm_mul_dropout as
    # custom ops within it) as one torch.compile graph, and so its backward as one: the host
    # runs one compiled function a step each way instead of one between every two attention
    # calls (hstu.py). The sampled softmax's compilation stays with compile_blocks
    compile_model: bool = False
    # the blocks' layer norms through kernels.layer_norm (Triton on CUDA, torch's elsewhere)
    # instead of torch's CUDA kernel, which takes a thread block per row at the paper
    # presets' width of 50 (timings: benchmarks/train_throughput.md). The same weights and
    # state keys either way
    layer_norm_kernel: bool = True
    # where the attention runs its Triton kernels, each block's Dropout(LayerNorm(A V) ⊙ U)
    # through kernels.norm_mul_dropout: one pass each way, the dropout's mask made again in
    # the backward from a seed instead of kept (elsewhere torch's ops and nn.Dropout, whose
    # masks differ). The same weights and state keys either way; timings in
    # benchmarks/train_throughput.md and benchmarks/norm_mul_dropout.py
    norm_mul_dropout_kernel: bool = True
    # under DDP over NCCL, the whole dense step in one CUDA graph per bucket as with one
    # process, the gradients' all-reduce captured in it (step_graph.py); off: the model's
    # graphs with DDP's hooks and all-reduce between them (benchmarks/scaling.md compares)
    ddp_step_graph: bool = True

    def embedding_config(self) -> EmbeddingConfig:
        return EmbeddingConfig(
            dim=self.embedding_dim,
            optimizer=OptimizerConfig(
                name=self.embedding_optimizer, lr=self.lr, beta1=self.betas[0], beta2=self.betas[1]
            ),
            seed=self.seed,
            capacity=min(self.embedding_capacity, self.embedding_max_capacity),  # (a small table starts whole)
            max_capacity=self.embedding_max_capacity,
        )

    def genre_embedding_config(self) -> EmbeddingConfig:
        """The genre table: the item table's layout and optimizer (so the two share launches),
        its own seed (genre k and item k start from different rows), a small capacity."""
        return replace(
            self.embedding_config(), seed=self.seed + GENRE_SEED_OFFSET, capacity=GENRE_CAPACITY, max_capacity=GENRE_MAX_CAPACITY
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "HSTUConfig":
        d = dict(d)
        d["betas"] = tuple(d["betas"])
        d.setdefault("item_features", False)  # configs saved before the fields existed
        d.setdefault("balanced_batches", True)
        d.setdefault("compile_blocks", False)
        d.setdefault("compile_model", False)
        d.setdefault("layer_norm_kernel", False)  # (what those configs computed with)
        d.setdefault("norm_mul_dropout_kernel", False)  # (nn.Dropout's masks, as those configs trained)
        return HSTUConfig(**d)

    def override(self, **changes) -> "HSTUConfig":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


PRESETS = {
    "hstu": HSTUConfig(),
    "hstu-large": HSTUConfig(num_blocks=8, num_heads=2, attention_dim=25, linear_dim=25),
    # the production shape: long histories, a wide model (GPU only)
    "hstu-long": HSTUConfig(
        num_blocks=8, num_heads=4, attention_dim=128, linear_dim=128, embedding_dim=512, max_seq_len=4096, batch_size=16,
        # no graphs: they take the host's share off the step but add more GPU work than that
        # (padding to a bucket) and double the memory (benchmarks/train_throughput.md)
        cuda_graph_buckets=0,
    ),
}


def preset(name: str) -> HSTUConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
