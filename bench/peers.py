"""The peers bench/train_bench.py measures lmforge against, each built as (model, step, optimizer)
from a train_bench.Run at the same shape: a nanoGPT-style GPT-2 and transformers' LlamaForCausalLM,
each compiled whole (model + loss) when the run is compiled, with AdamW (lr 3e-4, betas 0.9 /
0.95, weight decay 0.1)."""

from __future__ import annotations


def build_gpt2(r, device):
    """nanoGPT-style GPT-2: LayerNorm, GELU MLP 4d, learned positions, SDPA, tied head."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    V, D, H = -(-r.vocab // 64) * 64, r.d_model, r.n_head

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x_BTD):
            B, T, _ = x_BTD.shape
            q, k, v = self.qkv(self.ln1(x_BTD)).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x_BTD = x_BTD + self.proj(y.transpose(1, 2).reshape(B, T, D))
            return x_BTD + self.out(F.gelu(self.fc(self.ln2(x_BTD))))

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(r.seq_len, D)
            self.blocks = nn.ModuleList(Block() for _ in range(r.n_layer))
            self.ln_f = nn.LayerNorm(D)
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, idx_BT, targets_BT):
            x_BTD = self.wte(idx_BT) + self.wpe(torch.arange(idx_BT.shape[1], device=idx_BT.device))
            for block in self.blocks:
                x_BTD = block(x_BTD)
            logits_BTV = self.head(self.ln_f(x_BTD))
            return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())

    model = GPT2().to(device)
    step = torch.compile(model) if r.compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return model, step, opt


def build_hf(r, device):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=r.vocab, hidden_size=r.d_model, intermediate_size=r.d_mlp,
        num_hidden_layers=r.n_layer, num_attention_heads=r.n_head, num_key_value_heads=r.n_head,
        max_position_embeddings=r.seq_len, tie_word_embeddings=True, attn_implementation="sdpa",
    )).to(device)

    def loss_fn(x_BT, y_BT):
        logits_BTV = hf(input_ids=x_BT).logits
        return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())

    step = torch.compile(loss_fn) if r.compiled else loss_fn
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return hf, step, opt
