import pytest
import torch

from lmforge.model import GPT, KVCache, ModelConfig, SamplingError, SamplingParams, generate, stream
from lmforge.model.generate import sample

VOCAB = 97


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Decoding runs thousands of tiny ops: extra OpenMP threads only add synchronisation, and on
    a loaded 2-core machine they made this module ~40x slower (23 s vs 0.6 s for one test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(n_kv_head: int = 4, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=n_kv_head, d_model=64, max_seq_len=128)
    model = GPT(cfg)
    # Larger weights than the default init give peaked, input-dependent next-token choices, so a
    # wrong position or a leaked padding token changes the greedy sequence.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(std=0.3)
    return model


def greedy_reference(model: GPT, prompt: list[int], n: int) -> list[int]:
    """Full recompute through the plain training forward, one row at a time: no cache, no pad."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


PROMPTS = [[5, 17, 3, 9, 60, 2, 44], [11], [8, 8, 1, 90]]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0)


def sampled(n: int, **kw) -> SamplingParams:
    """Plain sampling: temperature 1, no filter, unless kw says otherwise."""
    return SamplingParams(max_new_tokens=n, **{"temperature": 1.0, "top_k": 0, **kw})


@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_cache_equals_full_recompute(n_kv_head):
    model = make_model(n_kv_head)
    n = 64
    with torch.no_grad():
        ref = [greedy_reference(model, p, n) for p in PROMPTS]
    assert len({tuple(r) for r in ref}) == len(PROMPTS)  # rows differ: the test can see a mix-up
    assert generate(model, PROMPTS, greedy(n)) == ref
    assert generate(model, PROMPTS, greedy(n), use_cache=False) == ref


def test_cache_quarter_memory_with_gqa():
    mha = ModelConfig(vocab_size=VOCAB, n_head=8, n_kv_head=8, d_model=64)
    gqa = ModelConfig(vocab_size=VOCAB, n_head=8, n_kv_head=2, d_model=64)
    a, b = KVCache(mha, batch_size=2, max_len=100), KVCache(gqa, batch_size=2, max_len=100)
    assert b.nbytes * 4 == a.nbytes
    assert a.nbytes == 2 * mha.n_layer * 2 * mha.n_kv_head * 100 * mha.head_dim * 4


def test_top_k_one_and_tiny_top_p_are_greedy():
    model = make_model(2)
    argmax = generate(model, PROMPTS, greedy(20))
    assert generate(model, PROMPTS, sampled(20, temperature=1.5, top_k=1, seed=1)) == argmax
    assert generate(model, PROMPTS, sampled(20, temperature=1.5, top_p=1e-6, seed=2)) == argmax


def test_sampling_filters():
    torch.manual_seed(0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample(logits, sampled(1, top_k=2), g).tolist()) == {0, 1}
    p = logits[0].softmax(-1)  # p0 ≈ .64, p0 + p1 ≈ .88: top_p = .8 keeps exactly two
    assert p[0] < 0.8 < p[:2].sum()
    assert set(sample(logits, sampled(1, top_p=0.8), g).tolist()) == {0, 1}
    assert len(set(sample(logits, sampled(1), g).tolist())) == 5


def test_seed_reproducible_and_different_seeds_differ():
    model = make_model(2)
    a = generate(model, PROMPTS, sampled(30, top_k=50, seed=123))
    assert generate(model, PROMPTS, sampled(30, top_k=50, seed=123)) == a
    assert generate(model, PROMPTS, sampled(30, top_k=50, seed=124)) != a
    assert all(0 <= t < VOCAB for row in a for t in row)


def test_padded_vocab_never_sampled():
    model = make_model(2)
    with torch.no_grad():  # padding rows of the tied head would win every draw if reachable
        model.tok_emb.weight[VOCAB:] = 100.0
    out = generate(model, PROMPTS, sampled(20, seed=0))
    assert all(0 <= t < VOCAB for row in out for t in row)


def test_stop_token_cuts_each_row():
    model = make_model(2)
    free = generate(model, PROMPTS, greedy(30))
    stop = free[0][5]
    out = generate(model, PROMPTS, greedy(30), stop_token=stop)
    for row_free, row in zip(free, out):
        cut = row_free.index(stop) if stop in row_free else len(row_free)
        assert row == row_free[:cut]
    steps = list(stream(model, PROMPTS, greedy(30), stop_token=stop))
    assert steps[5][0] is None and all(s[0] is None for s in steps[5:])
    assert [s[0] for s in steps[:5]] == free[0][:5]


def test_max_seq_len_and_argument_errors():
    model = make_model(2)
    with pytest.raises(ValueError, match="max_seq_len 128"):
        generate(model, [[1] * 100], greedy(29))
    assert len(generate(model, [[1] * 100], greedy(28))[0]) == 28
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[1], []], greedy(4))
    with pytest.raises(ValueError, match="token ids"):
        generate(model, [[VOCAB]], greedy(4))


def test_compiled_decode_equals_eager():
    """compile=True runs every one-token step through one torch.compile'd graph over a static,
    masked cache: it must pick the same greedy tokens as the eager path, padded batch included,
    and a one-token prompt (its prefill is already a decode step)."""
    model = make_model(2)
    for prompts in (PROMPTS, [[11]]):
        assert generate(model, prompts, greedy(40), compile=True) == generate(model, prompts, greedy(40))
    with pytest.raises(ValueError, match="use_cache"):
        generate(model, PROMPTS, greedy(4), compile=True, use_cache=False)


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", 0), ("max_new_tokens", -5), ("max_new_tokens", 2.5),
    ("temperature", -1.0), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_k", -1), ("top_k", 1.5),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
    ("seed", -1), ("seed", 2**64),
])
def test_sampling_params_refuse_out_of_range(field, value):
    with pytest.raises(SamplingError, match=f"^{field} must be .*, got ") as e:
        SamplingParams(**{"max_new_tokens": 1, field: value})
    assert e.value.field == field and "\n" not in str(e.value)


def test_sampling_params_edges_and_fit():
    ok = SamplingParams(max_new_tokens=1, temperature=0, top_k=0, top_p=1.0, seed=2**64 - 1)
    assert ok.top_p == 1.0
    assert SamplingParams(max_new_tokens=48).fit(100, 128).max_new_tokens == 28
    assert SamplingParams(max_new_tokens=8).fit(100, 128).max_new_tokens == 8
    assert SamplingParams(max_new_tokens=8).fit(127, 128).max_new_tokens == 1
    with pytest.raises(ValueError, match="130-token prompt leaves no room .* context is 128; shorten it by at least 3"):
        SamplingParams(max_new_tokens=8).fit(130, 128)
