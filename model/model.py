"""A Pre-LN decoder-only transformer in the Llama style: RMSNorm, RoPE, grouped-query attention,
SwiGLU (or GELU) MLP, no biases, token embedding tied to the LM head.

Dimension key, used in tensor names (x_BTD, q_BHTK, logits_BTV):
    B batch          T time (query positions)     S key positions (KV-cache length)
    D d_model        H n_head                     G n_kv_head
    K head_dim       V vocab (padded in the LM head, real in returned logits)
    F mlp hidden     L n_layer

Parallelism, compilation, checkpoint I/O and logging live outside this file (pipeline/).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_MULTIPLE = 64  # the LM-head matmul is faster when V is a multiple of 64
MLP_KINDS = ("swiglu", "gelu")
IGNORE_INDEX = -100  # a target the loss skips (eval padding rows); cross_entropy's default
LOSS_CHUNK_ELEMS = 2**23  # two reused 32 MB fp32 buffers; 83-2048 tokens timed within 20 %


@dataclass
class ModelConfig:
    vocab_size: int = 0
    """Real vocabulary size; 0 means "not set yet" (the pipeline fills it from the dataset)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Query heads; d_model / n_head is the head dimension (even, for RoPE)."""
    n_kv_head: int = 4
    """Key/value heads: n_head = MHA, fewer = GQA, 1 = MQA. Must divide n_head."""
    d_model: int = 256
    """Width of the residual stream (and of the tied token embedding)."""
    d_mlp: int | None = None
    """MLP hidden size; None = 8/3·d_model rounded up to a multiple of 64 (SwiGLU) or 4·d_model (GELU)."""
    mlp: str = "swiglu"
    """"swiglu" (Llama, exportable to Hugging Face) or "gelu" (GPT-2 style)."""
    rope_theta: float = 10000.0
    """RoPE base: larger stretches the rotary wavelengths for longer contexts."""
    max_seq_len: int = 1024
    """Longest sequence the RoPE tables and the KV cache are built for (training and sampling)."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    tie_embeddings: bool = True
    """The LM head reuses the token embedding matrix (GPT-2 / nanoGPT style, fewer parameters)."""
    init_std: float = 0.02
    """Std of every weight matrix; residual-output projections get init_std / sqrt(2·n_layer)."""

    def __post_init__(self) -> None:
        sizes = ("n_layer", "n_head", "n_kv_head", "d_model", "max_seq_len")
        for name in sizes:
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.vocab_size < 0:
            raise ValueError(f"model.vocab_size must be >= 0 (0 = set later), got {self.vocab_size}")
        if self.d_mlp is not None and self.d_mlp <= 0:
            raise ValueError(f"model.d_mlp must be positive or None, got {self.d_mlp}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"model.mlp must be one of {MLP_KINDS}, got {self.mlp!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}; "
                "pick sizes where d_model % n_head == 0"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"model.n_head={self.n_head} is not divisible by model.n_kv_head={self.n_kv_head}; "
                "n_kv_head must divide n_head (n_head for MHA, 1 for MQA)"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = d_model / n_head = {self.head_dim} is odd; RoPE rotates pairs, "
                "so choose d_model and n_head giving an even head_dim"
            )
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):  # NaN fails every comparison: test it
                raise ValueError(f"model.{name} must be a finite number > 0, got {value}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @property
    def mlp_hidden(self) -> int:
        if self.d_mlp is not None:
            return self.d_mlp
        if self.mlp == "gelu":
            return 4 * self.d_model
        return -(-8 * self.d_model // (3 * 64)) * 64  # Llama's 8/3·d, rounded up to 64

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"unknown model config key {key!r}; known keys: {sorted(known)}")
        return cls(**d)


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None):
    """RoPE tables (max_seq_len, K), fp32, laid out for apply_rope: with angle[t, i] =
    t / theta^(2i/K) for i < K/2, cos = [cos(angle), cos(angle)], sin = [-sin(angle), sin(angle)]."""
    K = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, K, 2, device=device, dtype=torch.float32) / K)
    angle = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    cos, sin = angle.cos(), angle.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x_BTNK: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + K/2]) by its angle: the half-split layout of Hugging Face
    Llama's rotate_half, so q/k weights export unpermuted. roll swaps the halves in one op
    (measured faster, forward + backward, than chunk + cat). cos/sin broadcast to (B, T, 1, K)."""
    cos, sin = cos.to(x_BTNK.dtype), sin.to(x_BTNK.dtype)
    return x_BTNK * cos + x_BTNK.roll(x_BTNK.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        # One fused GEMM for q, k and v: fewer, larger matmuls are faster than three small ones.
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x_BTD, cos, sin, kv_cache=None):
        B, T, _ = x_BTD.shape
        H, G, K = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv(x_BTD)
        # RoPE on the q and k heads together, (B, T, H+G, K): one rotation instead of two.
        qk_BTNK = apply_rope(qkv[..., : (H + G) * K].view(B, T, H + G, K), cos, sin)
        q_BHTK = qk_BTNK[:, :, :H].transpose(1, 2)
        k_BGTK = qk_BTNK[:, :, H:].transpose(1, 2)
        v_BGTK = qkv[..., (H + G) * K :].view(B, T, G, K).transpose(1, 2)
        if kv_cache is None:
            attn_mask, is_causal = None, True
            k_BGSK, v_BGSK = k_BGTK, v_BGTK
        else:
            attn_mask, is_causal = kv_cache.attn_mask, kv_cache.is_causal
            k_BGSK, v_BGSK = kv_cache.update(self.layer_idx, k_BGTK, v_BGTK)
        # enable_gqa lets SDPA read the G shared K/V heads directly instead of materialising
        # H/G copies with repeat_interleave. On CUDA the flash kernel (bf16/fp16) supports it
        # natively (torch documents flash + math only); on CPU the flash kernel measured faster
        # than repeat_interleave, forward + backward (bench/model_bench.py, "gqa" line).
        y_BHTK = F.scaled_dot_product_attention(
            q_BHTK, k_BGSK, v_BGSK, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=G != H
        )
        return self.proj(y_BHTK.transpose(1, 2).reshape(B, T, H * K))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        hidden = cfg.mlp_hidden
        # SwiGLU's gate and up projections fused into one GEMM (first half gate, second half up).
        self.up = nn.Linear(cfg.d_model, 2 * hidden if self.swiglu else hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x_BTD):
        h_BTF = self.up(x_BTD)
        if self.swiglu:
            gate_BTF, up_BTF = h_BTF.chunk(2, dim=-1)
            h_BTF = F.silu(gate_BTF) * up_BTF
        else:
            h_BTF = F.gelu(h_BTF)
        return self.down(h_BTF)


class Block(nn.Module):
    """Pre-LN block; self-contained so the pipeline can FSDP-wrap and checkpoint it alone."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x_BTD, cos, sin, kv_cache=None):
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos, sin, kv_cache)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))

    @torch.no_grad()
    def init_weights(self, std: float, resid_std: float) -> None:
        nn.init.normal_(self.attn.qkv.weight, std=std)
        nn.init.normal_(self.mlp.up.weight, std=std)
        # Outputs added to the residual stream: scaled by depth so its variance stays ~constant.
        nn.init.normal_(self.attn.proj.weight, std=resid_std)
        nn.init.normal_(self.mlp.down.weight, std=resid_std)
        self.attn_norm.reset_parameters()
        self.mlp_norm.reset_parameters()


# oneDNN's linear computes a chunk's logits (a ~100-200-token chunk of h against the V x D
# embedding) at ~1.7x MKL's mm on CPU in fp32: 100-105 vs 51-60 GFLOP/s at 128-166 tokens x
# 50,304 (AVX2). The head's two backward products stay on MKL, faster there (104 vs 48).
_ONEDNN_LINEAR = (getattr(torch.ops.mkldnn, "_linear_pointwise", None)
                  if torch.backends.mkldnn.is_available() else None)


def _chunk_logits(h_CD, w_VD, buf_CV):
    """h_CD @ w_VDᵀ in fp32, written into buf_CV; oneDNN's fresh output when buf_CV is None."""
    if buf_CV is None:
        return _ONEDNN_LINEAR(h_CD.contiguous(), w_VD, None, "none", [], "")
    if h_CD.dtype == torch.float32:
        return torch.mm(h_CD, w_VD.T, out=buf_CV)
    return buf_CV.copy_(h_CD @ w_VD.T)


def _head_loss_chunks(h_ND, w_VD, targets_N, vocab_size, ignore_index, chunk, grad_scale_N=None):
    """Loss of N tokens (fp32) by chunks of `chunk` tokens and, when grad_scale_N is given, the
    gradients of sum(grad_scale_N * loss_N) w.r.t. h_ND (its dtype) and w_VD (fp32):
    (loss_N, grad_h_ND, grad_w_VD).

    The logits are upcast before the log-softmax, so the loss is fp32 whatever the matmul dtype.
    Padded vocabulary columns get -inf: no probability mass, hence no gradient. Every chunk reuses
    two fp32 buffers, one for its logits and one for its log-probabilities, then (in place) its
    gradient: a fresh C×V tensor per chunk costs a page fault per 4 KiB on CPU (the allocator
    hands such sizes back to the OS), and each extra pass over it is memory traffic. (In fp32 on
    CPU the logits are oneDNN's fresh output instead: its faster product outweighs the faults.) The
    per-token scale is applied to the D-wide factors, never to the C×V gradient."""
    N, V = len(targets_N), w_VD.shape[0]
    f32 = dict(dtype=torch.float32, device=h_ND.device)
    valid_N = targets_N != ignore_index
    safe_N = torch.where(valid_N, targets_N, 0)
    loss_N = torch.empty(N, **f32)
    C = min(chunk, N)
    onednn = _ONEDNN_LINEAR is not None and h_ND.device.type == "cpu" and h_ND.dtype == torch.float32
    buf_CV = None if onednn else torch.empty(C, V, **f32)
    logp_CV = torch.empty(C, V, **f32)
    rows_C = torch.arange(C, device=h_ND.device)
    if grad_scale_N is not None:
        scale_N1 = torch.where(valid_N, grad_scale_N, 0.0)[:, None].to(h_ND.dtype)
        grad_h_ND, grad_w_VD = torch.empty_like(h_ND), torch.zeros(w_VD.shape, **f32)
    for start in range(0, N, chunk):
        part = slice(start, start + chunk)
        h_CD, safe_C = h_ND[part], safe_N[part]
        lp_CV = logp_CV[: len(h_CD)]
        logits_CV = _chunk_logits(h_CD, w_VD, None if onednn else buf_CV[: len(h_CD)])
        logits_CV[:, vocab_size:] = float("-inf")
        torch.log_softmax(logits_CV, dim=-1, out=lp_CV)
        del logits_CV  # oneDNN's fresh logits: freed before the next chunk's, not after
        loss_N[part] = -lp_CV.gather(1, safe_C[:, None]).squeeze(1)
        if grad_scale_N is None:
            continue
        # d loss / d logits = softmax - one_hot(target); ignored rows get scale 0 below.
        grad_CV = lp_CV.exp_()
        grad_CV[rows_C[: len(safe_C)], safe_C] -= 1.0
        grad_CV = grad_CV.to(h_CD.dtype)
        grad_h_ND[part] = (grad_CV @ w_VD) * scale_N1[part]
        hs_CD = h_CD * scale_N1[part]
        if grad_CV.dtype == torch.float32:
            grad_w_VD.addmm_(grad_CV.T, hs_CD)
        else:
            grad_w_VD += grad_CV.T @ hs_CD
    loss_N = torch.where(valid_N, loss_N, 0.0)
    if grad_scale_N is None:
        return loss_N, None, None
    return loss_N, grad_h_ND, grad_w_VD


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Cross-entropy of softmax(h @ wᵀ) without the full logits. Summed over tokens
    (`per_token=False`), the gradients are computed chunk by chunk in the forward pass, where
    the logits are at hand (no recompute), and only scaled in backward. Per token, the upstream
    gradient differs by token, so backward recomputes each chunk's logits instead."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, vocab_size, ignore_index, chunk, per_token):
        ctx.args = (vocab_size, ignore_index, chunk)
        ctx.per_token = per_token
        if per_token:
            ctx.save_for_backward(h_ND, w_VD, targets_N)
            loss_N, _, _ = _head_loss_chunks(h_ND, w_VD, targets_N, *ctx.args)
            return loss_N
        ones_N = torch.ones(len(targets_N), device=h_ND.device)
        loss_N, grad_h_ND, grad_w_VD = _head_loss_chunks(h_ND, w_VD, targets_N, *ctx.args, ones_N)
        ctx.save_for_backward(grad_h_ND, grad_w_VD.to(w_VD.dtype))
        return loss_N.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.per_token:
            h_ND, w_VD, targets_N = ctx.saved_tensors
            _, grad_h_ND, grad_w_VD = _head_loss_chunks(
                h_ND, w_VD, targets_N, *ctx.args, grad_loss.float()
            )
            return grad_h_ND, grad_w_VD.to(w_VD.dtype), None, None, None, None, None
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        return grad_h_ND * grad_loss, grad_w_VD * grad_loss, None, None, None, None, None


def chunked_cross_entropy(
    h_BTD, w_VD, targets_BT, vocab_size, reduction="mean", ignore_index=-100, chunk=1024
):
    """F.cross_entropy(h_BTD @ w_VDᵀ, targets) over the first `vocab_size` columns, computed
    `chunk` tokens at a time: memory O(chunk·V) instead of O(B·T·V), for the loss and for its
    gradient. reduction "mean" (over tokens whose target != ignore_index), "sum" or "none"."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    h_ND, targets_N = h_BTD.flatten(0, 1), targets_BT.flatten()
    if torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad):
        loss = _ChunkedCrossEntropy.apply(
            h_ND, w_VD, targets_N, vocab_size, ignore_index, chunk, reduction == "none"
        )
    else:  # evaluation: the loss alone (the Function would also build the gradients)
        loss_N, _, _ = _head_loss_chunks(h_ND, w_VD, targets_N, vocab_size, ignore_index, chunk)
        loss = loss_N if reduction == "none" else loss_N.sum()
    if reduction == "none":
        return loss.view(targets_BT.shape)
    if reduction == "mean":
        return loss / (targets_N != ignore_index).sum()
    return loss


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size is not set (0); set it to the tokenizer's vocabulary size")
        self.cfg = cfg
        V, D = cfg.padded_vocab_size, cfg.d_model
        self.tok_emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = nn.RMSNorm(D, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(D, V, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # Derived from the config, so not saved (persistent=False); init_weights() fills them.
        empty = torch.empty(cfg.max_seq_len, cfg.head_dim)
        self.register_buffer("rope_cos", empty, persistent=False)
        self.register_buffer("rope_sin", empty.clone(), persistent=False)
        if self.tok_emb.weight.device.type != "meta":
            self.init_weights()
        # Tokens per chunk of the LM-head loss: bounds its fp32 chunk of logits to ~LOSS_CHUNK_ELEMS.
        # Attributes, not config fields: they change memory and speed, never the model.
        self.loss_chunk_tokens = max(1, LOSS_CHUNK_ELEMS // V)
        # Up to this many tokens the loss builds the logits whole, with plain ops (0: always by
        # chunks). Eagerly the chunked path is faster (whole measured 0.93x at V 4k); traced by
        # torch.compile the plain ops fuse into the model's graph, so the pipeline raises it.
        self.loss_whole_tokens = 0

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE tables in place.

        Works after `to_empty(device=...)` of a meta-built model, and on FSDP2-sharded parameters."""
        cfg = self.cfg
        if cfg.tie_embeddings and self.lm_head.weight is not self.tok_emb.weight:
            self.lm_head.weight = self.tok_emb.weight  # a module.to_empty() may have split the tie
        nn.init.normal_(self.tok_emb.weight, std=cfg.init_std)
        if not cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=cfg.init_std)
        resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        for block in self.blocks:
            block.init_weights(cfg.init_std, resid_std)
        self.norm_f.reset_parameters()
        cos, sin = rope_tables(cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(
        self,
        idx_BT: torch.Tensor,
        targets_BT: torch.Tensor | None = None,
        *,
        reduction: str = "mean",
        ignore_index: int = IGNORE_INDEX,
        kv_cache=None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab_size) without targets; with targets only the loss: "mean" over
        tokens whose target != ignore_index, "sum", or "none" → (B, T).

        kv_cache (model.generate.KVCache) appends this chunk's keys/values and attends over the
        cache, using its per-row positions and padding mask."""
        B, T = idx_BT.shape
        if kv_cache is None:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
            cos, sin = self.rope_cos[:T, None], self.rope_sin[:T, None]  # (T, 1, K)
        else:
            pos_BT = kv_cache.begin(T)
            cos, sin = self.rope_cos[pos_BT, None], self.rope_sin[pos_BT, None]  # (B, T, 1, K)
        x_BTD = self.tok_emb(idx_BT)
        for block in self.blocks:
            x_BTD = block(x_BTD, cos, sin, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        if targets_BT is None:
            return self.lm_head(self.norm_f(x_BTD))[..., : self.cfg.vocab_size]  # V padded
        return self.head_loss(x_BTD, targets_BT, reduction, ignore_index)

    def head_loss(self, x_BTD, targets_BT, reduction="mean", ignore_index=-100):
        """Final norm, LM head and cross-entropy: by chunks of tokens (`chunked_loss`), the
        B×T×V logits never whole, unless there are at most `loss_whole_tokens` tokens; then with
        plain ops, which torch.compile fuses into the model's graph. The head matmul runs in the
        compute dtype (bf16 under autocast or FSDP's bf16 parameters); the log-softmax and the
        loss always in fp32."""
        h_BTD = self.norm_f(x_BTD)
        device = h_BTD.device.type
        if torch.is_autocast_enabled(device):
            h_BTD = h_BTD.to(torch.get_autocast_dtype(device))
        w_VD = self.lm_head.weight.to(h_BTD.dtype)
        if targets_BT.numel() > self.loss_whole_tokens:
            return self.chunked_loss(h_BTD, w_VD, targets_BT, reduction, ignore_index)
        logits_NV = (h_BTD.flatten(0, 1) @ w_VD.T)[:, : self.cfg.vocab_size]
        logits_NV = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))
        loss = F.cross_entropy(logits_NV, targets_BT.flatten(), ignore_index=ignore_index,
                               reduction=reduction)
        return loss.view(targets_BT.shape) if reduction == "none" else loss

    def chunked_loss(self, h_BTD, w_VD, targets_BT, reduction, ignore_index):
        """`chunked_cross_entropy` at this model's chunk size (a method of its own, so that the
        pipeline can keep it out of torch.compile)."""
        return chunked_cross_entropy(
            h_BTD, w_VD, targets_BT, self.cfg.vocab_size, reduction, ignore_index,
            self.loss_chunk_tokens,
        )

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied matrix counts once). exclude_embeddings drops the vocabulary
        matrices (token embedding and LM head, tied or not), leaving blocks + final norm."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at sequence length T = seq_len:

            6·N + 12·L·H·K·T

        N = weights used in a matmul for every token: all block parameters (+ the final norm,
        negligible) plus the LM head (D × padded V, the matmul actually run). The token embedding
        is a lookup and costs no FLOPs; when tied, the shared matrix is counted once, as the LM
        head. 6 = 2 (multiply-add) × 3 (forward + two backward matmuls).
        Attention: per layer and token, QKᵀ and AV each take 2·H·K·T FLOPs forward, ×3 for
        forward + backward → 12·L·H·K·T. The full T×T square is counted although causal masking
        skips half of it, as PaLM and nanoGPT do, so MFU figures stay comparable."""
        cfg = self.cfg
        n = self.num_params(exclude_embeddings=True) + self.lm_head.weight.numel()
        return 6 * n + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len

    def summary(self) -> str:
        cfg = self.cfg
        mha = {cfg.n_head: "MHA", 1: "MQA"}.get(cfg.n_kv_head, "GQA")
        return (
            f"GPT {self.num_params() / 1e6:.2f}M params ({self.num_params(True) / 1e6:.2f}M non-embedding): "
            f"L={cfg.n_layer} D={cfg.d_model} H={cfg.n_head} G={cfg.n_kv_head} ({mha}) K={cfg.head_dim} "
            f"{cfg.mlp} F={cfg.mlp_hidden} V={cfg.vocab_size} (padded {cfg.padded_vocab_size}) "
            f"ctx={cfg.max_seq_len} tied={cfg.tie_embeddings}"
        )
