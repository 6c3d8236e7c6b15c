"""Autoregressive generation over a preallocated KV cache.

Batched prompts of different lengths are LEFT-padded: every row then writes its keys/values at
the same cache index each step (one static layout for the whole batch), while each row's RoPE
positions are shifted by its padding so its first real token sits at position 0, exactly as if it
ran alone. Padding keys are masked out of attention.

Dimension key as in model/model.py (L layers, B batch, G kv heads, S cache length, K head dim).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from lmforge.model.model import GPT, ModelConfig


class KVCache:
    """Keys and values of every layer for n_kv_head heads, allocated once: (L, B, G, S, K) each.

    With GQA (G = H/4) this is a quarter of the memory an MHA model of the same width needs."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int | None = None,
        *,
        pad_B: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        S = cfg.max_seq_len if max_len is None else max_len
        if S > cfg.max_seq_len:
            raise ValueError(f"KV cache length {S} exceeds model.max_seq_len={cfg.max_seq_len}")
        shape = (cfg.n_layer, batch_size, cfg.n_kv_head, S, cfg.head_dim)
        self.k_LBGSK = torch.zeros(shape, device=device, dtype=dtype)
        self.v_LBGSK = torch.zeros(shape, device=device, dtype=dtype)
        self.k_layers, self.v_layers = self.k_LBGSK.unbind(0), self.v_LBGSK.unbind(0)
        # pad_B[b] = number of left-padding slots of row b (its real tokens start there).
        pad_B = torch.zeros(batch_size, dtype=torch.long, device=device) if pad_B is None else pad_B
        self.padded = bool(pad_B.any())
        # Everything a step needs is precomputed here and sliced per step: the decode loop then
        # runs no index arithmetic of its own.
        slot_S = torch.arange(S, device=device)
        self.pos_BS = (slot_S[None, :] - pad_B[:, None]).clamp(min=0)  # RoPE position per slot
        self.real_B11S = (slot_S[None, :] >= pad_B[:, None])[:, None, None, :]  # not padding
        self.slot_S = slot_S
        self.pos = 0  # slots filled so far (same for every row)
        self.attn_mask: torch.Tensor | None = None
        self.is_causal = False

    @property
    def nbytes(self) -> int:
        return self.k_LBGSK.nbytes + self.v_LBGSK.nbytes

    def begin(self, T: int) -> torch.Tensor:
        """Prepare a forward over the next T slots: sets the attention mask shared by all layers
        and returns the RoPE positions pos_BT."""
        start, end = self.pos, self.pos + T
        if end > self.k_LBGSK.shape[3]:
            raise ValueError(f"KV cache full: {end} positions needed, {self.k_LBGSK.shape[3]} allocated")
        self.is_causal = not self.padded and start == 0 and T > 1  # a fresh prefill: plain causal
        if not self.padded and (T == 1 or start == 0):
            self.attn_mask = None  # one new token attends to everything cached
        elif T == 1:
            self.attn_mask = self.real_B11S[..., :end]
        else:
            k_S, q_T1 = self.slot_S[:end], self.slot_S[start:end, None]
            # A padding query sees only itself, so no row of the mask is empty (that gives NaN).
            self.attn_mask = (k_S <= q_T1) & (self.real_B11S[..., :end] | (k_S == q_T1))
        return self.pos_BS[:, start:end]

    def update(self, layer: int, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor):
        """Write this chunk's keys/values and return views of the filled part, (B, G, S, K)."""
        end = self.pos + k_BGTK.shape[2]
        k_BGSK, v_BGSK = self.k_layers[layer][:, :, :end], self.v_layers[layer][:, :, :end]
        k_BGSK[:, :, self.pos :] = k_BGTK
        v_BGSK[:, :, self.pos :] = v_BGTK
        return k_BGSK, v_BGSK

    def advance(self, T: int) -> None:
        self.pos += T


class StaticKVCache(KVCache):
    """A KVCache whose one-token decode steps have constant shapes, for torch.compile.

    Each step attends over all S slots with the unfilled ones masked, and the slot it writes is a
    tensor: a Python int position would be baked into the compiled graph and recompile it every
    step. The prompt's prefill (T > 1) runs through KVCache unchanged, before any decode step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slot_1 = torch.zeros(1, dtype=torch.long, device=self.slot_S.device)

    def begin(self, T: int) -> torch.Tensor:
        if T > 1:
            return super().begin(T)
        self.is_causal = False
        self.attn_mask = self.real_B11S & (self.slot_S <= self.slot_1)
        return self.pos_BS[:, self.slot_1]

    def update(self, layer: int, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor):
        if k_BGTK.shape[2] > 1:
            return super().update(layer, k_BGTK, v_BGTK)
        self.k_layers[layer].index_copy_(2, self.slot_1, k_BGTK)
        self.v_layers[layer].index_copy_(2, self.slot_1, v_BGTK)
        return self.k_layers[layer], self.v_layers[layer]

    def advance(self, T: int) -> None:
        if T > 1:  # the prefill: the Python int is read by KVCache.begin, never by a decode step
            super().advance(T)
            self.slot_1.fill_(self.pos)
        else:
            self.slot_1 += 1


def _decode_step(model: GPT, idx_B1: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
    return model(idx_B1, kv_cache=cache)[:, -1]


COMPILE_BUCKET = 64


@functools.cache
def _compiled_decode_step():
    """Compiled on first use (importing torch._dynamo is slow): one graph per model, batch size
    and cache length; dynamic=False keeps every shape static."""
    return torch.compile(_decode_step, fullgraph=True, dynamic=False)


class SamplingError(ValueError):
    """A sampling parameter out of range. It carries the field and what the field accepts, so the
    config and the CLI each report it under their own name (sample.top_p, --top-p)."""

    def __init__(self, field: str, value: object, expected: str):
        super().__init__(f"{field} must be {expected}, got {value!r}")
        self.field, self.value, self.expected = field, value, expected


class NonFiniteLogits(ValueError):
    """The model's logits hold NaN or inf: nothing can be sampled from them (weights damaged, or
    from a run that diverged)."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


MIN_TEMPERATURE = torch.finfo(torch.float32).tiny
"""The smallest temperature sampled from (fp32's smallest normal number): below it the logits
would be divided by a subnormal fp32 or by 0; sampling that cold is greedy anyway."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How new tokens are drawn: the one definition of the sampling defaults and ranges, used by
    generate/stream, the trainer's samples (the [sample] config section) and `lmforge sample`.

    The filters apply in the transformers order: logits / temperature, then top_k, then top_p on
    the renormalised top-k distribution."""

    max_new_tokens: int = 200
    """At most this many new tokens (what `lmforge sample` and the demo draw; the trainer's
    periodic samples are shorter: sample.max_new_tokens). `fit` cuts it to the context."""
    temperature: float = 0.8
    """0 = greedy (the filters and the seed then do not matter), as is any temperature below
    MIN_TEMPERATURE: greedy is the limit sampling approaches as the temperature falls."""
    top_k: int = 50
    """Sample among the k most likely tokens; 0 = no top-k filter."""
    top_p: float | None = None
    """Keep the smallest set of tokens whose probability reaches top_p; None or 1 = off."""
    seed: int | None = None
    """Seed of this call's own generator; None = torch's global random state."""

    def __post_init__(self):
        rules = [
            ("max_new_tokens", _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
             "an integer >= 1"),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0,
             "a finite number >= 0 (0 = greedy)"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", self.top_p is None or _is_number(self.top_p) and 0 < self.top_p <= 1,
             "in (0, 1] (1 or unset = off)"),
            ("seed", self.seed is None or _is_int(self.seed) and 0 <= self.seed < 2**64,
             "an integer in [0, 2**64)"),
        ]
        for name, ok, expected in rules:
            if not ok:
                raise SamplingError(name, getattr(self, name), expected)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def fit(self, prompt_len: int, max_seq_len: int) -> SamplingParams:
        """These params with max_new_tokens cut to the room a prompt of prompt_len tokens leaves
        in the model's context; ValueError (naming the fix) when it leaves none."""
        room = max_seq_len - prompt_len
        if room < 1:
            raise ValueError(
                f"a {prompt_len}-token prompt leaves no room for new tokens: the model's context "
                f"is {max_seq_len}; shorten it by at least {1 - room} token(s)"
            )
        return replace(self, max_new_tokens=min(self.max_new_tokens, room))


def sample(
    logits_BV: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row, drawn as `sampling` says (greedy when its temperature is 0)."""
    if sampling.greedy:
        return logits_BV.argmax(dim=-1)
    # Shifted so the largest logit is 0 before dividing: a tiny temperature then sends the
    # others to -inf (probability 0), never the largest to inf (inf - inf = NaN in softmax).
    logits_BV = logits_BV.float()
    logits_BV = (logits_BV - logits_BV.amax(dim=-1, keepdim=True)) / sampling.temperature
    if sampling.top_k:
        k = min(sampling.top_k, logits_BV.shape[-1])
        kth_B1 = torch.topk(logits_BV, k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1.0:
        # After top-k, so top_p is a share of the renormalised top-k mass (the transformers order).
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        drop_BV = probs_BV.cumsum(dim=-1) - probs_BV >= sampling.top_p
        logits_BV = logits_BV.scatter(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    probs_BV = logits_BV.softmax(dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


def _check_prompts(cfg: ModelConfig, prompts: list[list[int]], sampling: SamplingParams) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if any(t < 0 or t >= cfg.vocab_size for p in prompts for t in p):
        raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size})")
    longest = max(len(p) for p in prompts)
    if sampling.fit(longest, cfg.max_seq_len) != sampling:  # the one room rule: SamplingParams.fit
        raise ValueError(
            f"prompt length {longest} + max_new_tokens {sampling.max_new_tokens} exceeds the "
            f"model's max_seq_len {cfg.max_seq_len}; shorten the prompt or ask for fewer tokens"
        )


@torch.inference_mode()
def stream(
    model: GPT,
    prompts: list[list[int]],
    sampling: SamplingParams,
    *,
    stop_token: int | None = None,
    use_cache: bool = True,
    compile: bool = False,
) -> Iterator[list[int | None]]:
    """Yield, per step, each row's new token id, or None once the row has produced stop_token
    (the stop token itself is not yielded). Stops after sampling.max_new_tokens or when all rows
    stopped.

    compile=True runs each one-token step as a torch.compile'd graph over a StaticKVCache: the
    first call for a new model, batch size or length pays the compilation (tens of seconds on
    CPU), later calls reuse it."""
    cfg, max_new_tokens = model.cfg, sampling.max_new_tokens
    _check_prompts(cfg, prompts, sampling)
    weight = model.tok_emb.weight
    device, dtype = weight.device, weight.dtype
    B, P = len(prompts), max(len(p) for p in prompts)
    pad_B = torch.tensor([P - len(p) for p in prompts], device=device)
    idx_BT = torch.tensor([[0] * (P - len(p)) + list(p) for p in prompts], device=device)
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)

    def new_cache(length: int, cache_class: type[KVCache] = KVCache) -> KVCache:
        return cache_class(cfg, B, length, pad_B=pad_B, device=device, dtype=dtype)

    if compile and not use_cache:
        raise ValueError("compile=True needs use_cache=True (it compiles the cached decode step)")
    if compile:
        # Lengths rounded up to a multiple of COMPILE_BUCKET share one graph, so prompts of other
        # lengths do not each recompile; the extra slots stay masked.
        length = min(cfg.max_seq_len, -(-(P + max_new_tokens) // COMPILE_BUCKET) * COMPILE_BUCKET)
        step_fn, cache = _compiled_decode_step(), new_cache(length, StaticKVCache)
    else:
        step_fn, cache = _decode_step, new_cache(P + max_new_tokens) if use_cache else None
    # Without a cache every step recomputes the whole (padded) sequence through a throwaway one.
    # The head on the last position alone: the prompt's B x P x V logits are never built.
    logits_BV = model.logits(model.hidden(idx_BT, cache if cache is not None else new_cache(P))[:, -1])
    if not bool(torch.isfinite(logits_BV).all()):  # once: such weights fail on the first token
        raise NonFiniteLogits("the model's logits are NaN or inf on the prompt")
    finished = [False] * B
    for step in range(max_new_tokens):
        next_B = sample(logits_BV, sampling, generator)
        out: list[int | None] = []
        for b, tok in enumerate(next_B.tolist()):
            finished[b] = finished[b] or tok == stop_token
            out.append(None if finished[b] else tok)
        yield out
        if all(finished) or step == max_new_tokens - 1:
            return
        if cache is not None:
            logits_BV = step_fn(model, next_B[:, None], cache)
        else:
            idx_BT = torch.cat((idx_BT, next_B[:, None]), dim=1)
            logits_BV = model(idx_BT, kv_cache=new_cache(idx_BT.shape[1]))[:, -1]


def generate(
    model: GPT, prompts: list[list[int]], sampling: SamplingParams, **options
) -> list[list[int]]:
    """New tokens for each prompt (prompt not included), each cut before its stop token.
    `options` are stream's: stop_token, use_cache, compile."""
    rows: list[list[int]] = [[] for _ in prompts]
    for step in stream(model, prompts, sampling, **options):
        for row, tok in zip(rows, step):
            if tok is not None:
                row.append(tok)
    return rows
