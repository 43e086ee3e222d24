"""A plain Hugging Face Trainer script (nothing of ddp_hpc in it): a tiny GPT-2 built from a
config (no download) learns a repeating token pattern.  Under ``ddp-hpc submit`` ddp_hpc's
Trainer callback (docs/scripts.md, "Lightning and Hugging Face") reports its steps, total, loss
and samples/s to ``ddp-hpc status`` with no change here.

    ddp-hpc submit -N 2 -G 2 --wait examples/hf_trainer.py -- --max-steps 20
    torchrun --nproc-per-node 2 examples/hf_trainer.py
"""
import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Patterns(Dataset):
    """Sequences of a repeating pattern of tokens: next-token prediction any model can learn."""

    def __init__(self, n: int, length: int = 16, vocab: int = 32) -> None:
        self.n, self.length, self.vocab = n, length, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = (torch.arange(self.length) * (1 + i % 3) + i) % self.vocab
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--output-dir", default="hf-out")
    args = ap.parse_args()
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    training = TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps,
                                 per_device_train_batch_size=args.batch_size, learning_rate=1e-3,
                                 logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                 eval_strategy="steps", eval_steps=args.max_steps,
                                 disable_tqdm=True)
    trainer = Trainer(model=GPT2LMHeadModel(config), args=training, train_dataset=Patterns(256),
                      eval_dataset=Patterns(32))
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"hf_trainer: {training.world_size} ranks, {result.global_step} steps, "
              f"train_loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
