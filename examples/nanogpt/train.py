"""A plain training loop for the minimal GPT, as its users write one: the script `mbtune confirm` holds to
a probe's budget.

    mbtune confirm --memory-budget 512MiB -- python -m examples.nanogpt.train --batch-size 170
"""
import argparse

import torch

from examples.nanogpt.model import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()
    config = GPTConfig(block_size=args.block_size, vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=4,
                       n_embd=args.n_embd)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch_size, config.block_size + 1))
        _, loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
