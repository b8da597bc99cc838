"""The minimal GPT as an mbtune workload: `mbtune probe --workload examples.nanogpt.workload:gpt`."""
import torch

from examples.nanogpt.model import GPT, GPTConfig
from mbtune.workloads import Workload


def gpt(n_layer: int = 4, n_embd: int = 128, n_head: int = 4, block_size: int = 64, vocab_size: int = 4096) -> Workload:
    config = GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)

    def make_batch(batch_size: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab_size, (batch_size, block_size + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return Workload.from_module(lambda: GPT(config), make_batch=make_batch, name="nanogpt")
