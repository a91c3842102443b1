"""gpt_lightning.generation.generate with its KV cache: the same tokens as the uncached path and as transformers' greedy
generate, reproducible sampling, top-k, top-p, temperature 0, a padded vocabulary, past block_size, batched,
sharded, and a compiled decode step."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gpt_lightning.generation import Sampler, generate
from gpt_lightning.interop.pretrained import export_hf
from gpt_lightning.model import GPT, GPTConfig, KVCache
from gpt_lightning.scaling.sharding import shard_gpt

TINY = GPTConfig(block_size=32, vocab_size=4096, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(TINY).eval()


def prompt(batch=2, length=5, vocab=4096, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_tokens_equal_the_uncached_path_and_transformers(model, tmp_path):
    transformers = pytest.importorskip("transformers")
    idx = prompt()
    cached = generate(model, idx, 20, temperature=0)
    assert cached.shape == (2, 25) and torch.equal(cached[:, :5], idx)
    assert torch.equal(cached, generate(model, idx, 20, temperature=0, use_cache=False))
    export_hf(model, tmp_path / "hf")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    theirs.generation_config.eos_token_id = None  # all 20 tokens, as ours
    with torch.no_grad():
        expected = theirs.generate(
            idx,
            attention_mask=torch.ones_like(idx),
            max_new_tokens=20,
            do_sample=False,
            use_cache=True,
            pad_token_id=50256,
        )
    assert torch.equal(cached, expected)


def test_seeded_sampling_is_reproducible_and_draws_as_the_uncached_path(model):
    idx = prompt()

    def draw(seed, **kwargs):
        return generate(
            model, idx, 15, temperature=0.8, top_k=100, generator=torch.Generator().manual_seed(seed), **kwargs
        )

    first = draw(7)
    assert torch.equal(first, draw(7))
    assert not torch.equal(first, draw(8))
    assert torch.equal(first, draw(7, use_cache=False))  # same draws, same numbers: same tokens
    assert not torch.equal(first[0, 5:], first[1, 5:])  # batch rows draw independently


def test_top_k_one_and_temperature_zero_are_greedy(model):
    idx = prompt()
    greedy = generate(model, idx, 10, temperature=0)
    assert torch.equal(
        greedy, generate(model, idx, 10, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(3))
    )
    # Each greedy token is the argmax of a full forward pass over everything before it.
    with torch.no_grad():
        logits, _ = model(greedy[:, :-1])
    torch.testing.assert_close(logits[:, 4:].argmax(-1), greedy[:, 5:], rtol=0, atol=0)


def test_top_k_samples_only_among_the_k_likeliest(model):
    idx = prompt(batch=8, length=3)
    out = generate(model, idx, 1, temperature=5.0, top_k=3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        allowed = model(idx)[0][:, -1].topk(3).indices  # (8, 3)
    assert (allowed == out[:, -1:]).any(dim=1).all()


def test_top_p_draws_only_from_the_nucleus(model):
    """Nucleus sampling: top_p 1 is plain sampling, a tiny top_p is greedy, and only the fewest
    likeliest ids whose probabilities reach top_p are ever drawn (each of them is)."""
    idx = prompt()

    def seeded(**kwargs):
        return generate(model, idx, 10, temperature=1.0, generator=torch.Generator().manual_seed(3), **kwargs)

    assert torch.equal(seeded(top_p=1.0), seeded())
    assert torch.equal(seeded(top_p=1e-6), generate(model, idx, 10, temperature=0))
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    sample = Sampler(1.0, None, torch.Generator().manual_seed(0), None, top_p=0.7)
    drawn = torch.cat([sample(probs.log()) for _ in range(400)])  # (400, 1)
    assert set(drawn.flatten().tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.7; 0.5 alone does not
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(model, idx, 1, top_p=0.0)


def test_a_padded_vocabulary_is_never_sampled():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=128, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():  # the padding rows (100..127) dominate every logit
        model.transformer.wte.weight[100:] = 1.0
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
    idx = prompt(vocab=100)
    assert (generate(model, idx, 10, temperature=0)[:, 5:] >= 100).all()  # the trap is armed
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "top_k": 5}, {"temperature": 1.0}):
        out = generate(model, idx, 10, vocab_limit=100, generator=torch.Generator().manual_seed(0), **kwargs)
        assert (out < 100).all(), kwargs


def windowed_reference(model, idx, max_new_tokens):
    """Greedy tokens by full forward passes under the cache's window rule: at most block_size tokens
    of context; when a full window gets a new token it restarts from its last block_size // 2."""
    block, keep = model.config.block_size, model.config.block_size // 2
    out = idx
    start = max(0, idx.size(1) - block)
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits, _ = model(out[:, start:])
        out = torch.cat((out, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
        if out.size(1) - start > block:
            start = out.size(1) - keep
    return out


def test_past_block_size_the_window_slides_and_the_cache_refills():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=4096, n_layer=2, n_head=2, n_embd=32)).eval()
    for length in (3, 8, 13):  # shorter than, as long as and longer than block_size
        idx = prompt(length=length)
        out = generate(model, idx, 20, temperature=0)
        assert out.shape == (2, length + 20) and torch.equal(out[:, :length], idx)
        assert torch.equal(out, windowed_reference(model, idx, 20)), length
    # Within block_size the window rule is the uncached path's own: the first 8 - 3 tokens agree.
    short = generate(model, prompt(length=3), 5, temperature=0)
    assert torch.equal(short, generate(model, prompt(length=3), 5, temperature=0, use_cache=False))


def test_zero_new_tokens_and_bad_arguments(model):
    idx = prompt()
    assert torch.equal(generate(model, idx, 0), idx)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        generate(model, idx, -1)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        generate(model, idx, 1, top_k=0)
    with pytest.raises(ValueError, match=r"shape \(B, T\) with T >= 1"):
        generate(model, idx[:, :0], 1)


def test_generation_under_bf16_autocast_keeps_a_bf16_cache(model, monkeypatch):
    stored = []
    store = KVCache.store
    monkeypatch.setattr(KVCache, "store", lambda self, k, v, pos: (stored.append(self), store(self, k, v, pos))[1])
    idx = prompt()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, idx, 5, temperature=0)
    assert out.shape == (2, 10) and out.dtype == torch.long
    assert {(cache.k.dtype, cache.v.dtype) for cache in stored} == {(torch.bfloat16, torch.bfloat16)}  # half the bytes
    assert model.lm_head.weight.dtype == torch.float32  # autocast casts per op: the weights stay float32


def test_a_sharded_model_generates_what_the_unsharded_one_does(model, tmp_path, in_process_group):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    sharded = GPT(TINY).eval()
    sharded.load_state_dict(model.state_dict())
    shard_gpt(sharded, init_device_mesh("cpu", (1,)))
    idx = prompt()
    assert torch.equal(generate(sharded, idx, 6, temperature=0), generate(model, idx, 6, temperature=0))


def test_the_compiled_decode_step_gives_the_eager_tokens(monkeypatch):
    """And it keeps its KV caches per model, batch and length (a power of two, at most block_size): on
    CUDA they are static inputs of a CUDA graph, so fresh caches at each call would record a new graph
    each time. A second prompt decodes from the same caches and still gives its own eager tokens; so
    do twenty prompt lengths after it, with neither a new cache set nor a new graph (a long-lived
    model serving prompts of many lengths)."""
    from torch._dynamo.utils import counters

    import gpt_lightning.generation as generation

    made = []

    class Counted(KVCache):
        def __init__(self, max_len):
            super().__init__(max_len)
            made.append(self)

    monkeypatch.setattr(generation, "KVCache", Counted)
    torch.manual_seed(0)
    # Block 0 attends to 2 positions back (sliding-window attention, block_size 8 / 4): the step masks its window too.
    model = GPT(GPTConfig(block_size=8, vocab_size=256, n_layer=2, n_head=2, n_embd=16, window_pattern="SL")).eval()
    idx = prompt(length=3, vocab=256)
    eager = generate(model, idx, 12, temperature=0)  # past block_size: slides once
    made.clear()
    assert torch.equal(generate(model, idx, 12, temperature=0, compile=True), eager)
    other = (idx * 7 + 1) % 256
    assert torch.equal(
        generate(model, other, 12, temperature=0, compile=True), generate(model, other, 12, temperature=0)
    )
    assert len(made) == 2 * model.config.n_layer  # compiled: one set for both calls; and the eager call's
    prompts = [prompt(length=length, vocab=256, seed=length) for length in range(1, 21)]  # 9 to 20 past block_size
    eager = [generate(model, idx, 4, temperature=0) for idx in prompts]
    made.clear()
    counters.clear()
    for idx, expected in zip(prompts, eager):
        assert torch.equal(generate(model, idx, 4, temperature=0, compile=True), expected), idx.shape
    assert made == [] and counters["stats"]["unique_graphs"] == 0  # memory flat, no recompilation


def test_a_windowed_model_decodes_from_its_cache_what_its_forward_gives():
    """Windows of 4 positions back (block_size 16 / 4) in blocks 0 and 1, a prompt of 9 longer than them:
    the prefill through the band, each decode step over the cache's last 5 positions, eager (a slice) and
    compiled (the whole static cache, masked: the compiled-decode test's model is windowed too), the greedy
    tokens of the uncached forward up to block_size."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=3, n_head=2, n_embd=16, window_pattern="SSL")).eval()
    assert [block.attn.window for block in model.transformer.h] == [4, 4, None]
    idx = prompt(length=9, vocab=256)
    uncached = generate(model, idx, 7, temperature=0, use_cache=False)
    assert torch.equal(generate(model, idx, 7, temperature=0), uncached)
    full = GPT(dataclasses.replace(model.config, window_pattern="L")).eval()
    full.load_state_dict(model.state_dict())
    assert not torch.allclose(full(uncached)[0][:, 5:], model(uncached)[0][:, 5:])  # the windows cut something


def test_on_a_cpu_the_decode_step_is_frozen_and_compiled_again_after_training(monkeypatch, capfd, tmp_path):
    """Inductor's freezing packs the weights for the CPU's matmul (torch.compile's options={"freezing":
    True} did not freeze: the step multiplied the plain weights), and at batch 1 max_autotune may pick
    inductor's own C++ GEMM template over the libraries' kernels. Frozen weights are copies: once
    training changes the weights, the next generation compiles a new step instead of sampling
    from the old ones."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=256, n_layer=1, n_head=2, n_embd=16)).eval()
    idx = prompt(batch=1, length=3, vocab=256)  # batch 1: the static, autotuned graph
    # max_autotune hands each matmul's choices to inductor's selector (which times them, or reads its cache's pick)
    from torch._inductor.select_algorithm import AlgorithmSelectorCache

    selections, select = [], AlgorithmSelectorCache.__call__
    monkeypatch.setattr(
        AlgorithmSelectorCache,
        "__call__",
        lambda self, name, *a, **k: selections.append(name) or select(self, name, *a, **k),
    )
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # empty, as on a new machine: the timing runs
    counters.clear()
    first = generate(model, idx, 4, temperature=0, compile=True)
    if torch.backends.mkldnn.is_available() and torch._C.has_mkl:
        assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] > 0
        assert counters["inductor"]["select_algorithm_autotune"] > 0
        assert selections, "the batch-1 step compiled without max_autotune"
        err = capfd.readouterr().err  # the timing ran (an empty cache, below): its tables stayed off stderr
        assert "AUTOTUNE" not in err and "Autotune Choices" not in err, err[-2000:]
    with torch.no_grad():  # an optimizer step, in place
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    eager = generate(model, idx, 4, temperature=0)
    assert not torch.equal(eager, first)  # the step changed what greedy decoding picks
    assert torch.equal(generate(model, idx, 4, temperature=0, compile=True), eager)
    # another prompt of the same shape: the step reads this call's key/value caches, not the last one's
    other = (prompt(batch=1, length=3, vocab=256) + 1) % 256
    assert torch.equal(generate(model, other, 4, temperature=0, compile=True), generate(model, other, 4, temperature=0))
    # the step is held beside the model, not on it: a copy (an EMA, say) samples from its own weights
    copy = __import__("copy").deepcopy(model)
    with torch.no_grad():
        copy.lm_head.weight.mul_(-1)
    assert torch.equal(generate(copy, idx, 4, temperature=0, compile=True), generate(copy, idx, 4, temperature=0))


def test_seeded_samples_are_those_of_torch_multinomial_as_before(model):
    """The sampler skips torch.multinomial's host-reading check but draws the same numbers: a
    seed gives the samples it gave before the cache."""
    idx = prompt()
    generator = torch.Generator().manual_seed(5)
    before = idx
    for _ in range(10):
        with torch.no_grad():
            logits = model(before)[0][:, -1] / 0.8
        kth = torch.topk(logits, 20).values[:, [-1]]
        probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        before = torch.cat((before, torch.multinomial(probs, 1, generator=generator)), dim=1)
    assert torch.equal(
        generate(model, idx, 10, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(5)), before
    )


def linear_ops(model, idx, **kwargs):
    """The matmul ops ``generate`` ran, and the Linear layers left with a forward of their own."""
    with torch.profiler.profile() as profile:
        generate(model, idx, 4, temperature=0, **kwargs)
    ran = {event.key for event in profile.key_averages()} & {"mkldnn::_linear_pointwise", "aten::addmm", "aten::mm"}
    return ran, [name for name, layer in model.named_modules() if "forward" in vars(layer)]


def test_eager_decoding_leaves_every_layer_as_it_is(model):
    """No layer's forward is reassigned while sampling and no private oneDNN op is called (FSDP2's
    DTensors have no rule for them): the layers' own matmuls, in float32, bfloat16 and under autocast."""
    for batch in (1, 2):
        ran, left = linear_ops(model, prompt(batch=batch))
        assert "mkldnn::_linear_pointwise" not in ran and ran & {"aten::addmm", "aten::mm"} and left == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ran, left = linear_ops(model, prompt(batch=2))
    assert "mkldnn::_linear_pointwise" not in ran and left == []
    bf16 = GPT(TINY).eval()
    bf16.load_state_dict(model.state_dict())
    ran, left = linear_ops(bf16.to(torch.bfloat16), prompt(batch=1))
    assert "mkldnn::_linear_pointwise" not in ran and left == []
