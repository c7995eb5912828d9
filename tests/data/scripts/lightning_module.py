"""A LightningModule on a tiny Llama, trained by lightning.Trainer on a synthetic token dataset."""
import argparse

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq-len", type=int, default=64)
args = parser.parse_args()


class LitLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=512, max_position_embeddings=512,
                             tie_word_embeddings=False)
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


torch.manual_seed(0)
data = torch.randint(0, 512, (16, args.seq_len))
loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size)
trainer = L.Trainer(max_steps=8, accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(LitLlama(), loader)
