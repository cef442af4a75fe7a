"""An ArraykvCache given the model leaves it as it found it: on detach(), when it is garbage
collected, and for every call no live cache owns (skipped without torch or transformers).

The model's own forward is compared to the last bit (``torch.equal``) with its forward before
any cache was made: after caches of several methods were used and dropped (``del cache;
gc.collect()``), while a cache is attached but not passed to the call (its fused attention
function must then be exactly the model's own, mask form included: a left-padded batch), and
with two caches on one model (each serves the calls it is passed to). Tiny random models here
(a Llama, a hybrid Gemma 3 with sliding-window layers); SmolLM2 and Gemma-3-270M in the slow test.
"""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from arraykv.integrations.transformers import ArraykvCache  # noqa: E402

from tiny_models import HF_MODELS, hf_gemma3_text_config, hf_ids, hf_llama  # noqa: E402


def _padded(seed: int = 2):
    """A batch of two whose second row is left-padded by 5 tokens, and its attention mask."""
    ids = hf_ids(2, 20, seed, low=1)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    return ids, mask


def implementations(model) -> list:
    """``_attn_implementation_internal`` of every config of the model (its own, sub-configs, modules')."""
    seen, out = set(), []
    stack = [model.config] + [getattr(m, "config", None) for m in model.modules()]
    while stack:
        cfg = stack.pop()
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation_internal"):
            continue
        seen.add(id(cfg))
        out.append((type(cfg).__name__, cfg._attn_implementation_internal))
        stack += [getattr(cfg, k, None) for k in getattr(cfg, "sub_configs", {})]
    return sorted(out)


def hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def own_outputs(model):
    """The model's forward logits (a plain batch and a left-padded one) and a greedy generate with a DynamicCache."""
    ids, (padded, mask) = hf_ids(2, 24, low=1), _padded()
    with torch.no_grad():
        plain = model(ids).logits
        masked = model(padded, attention_mask=mask).logits
        tokens = model.generate(
            padded,
            attention_mask=mask,
            cache=transformers.DynamicCache(config=model.config),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )
    return plain, masked, tokens


def assert_own(model, want, implementations_before, hooks_before):
    assert implementations(model) == implementations_before
    assert hooks(model) == hooks_before
    for got, exp in zip(own_outputs(model), want):
        assert torch.equal(got, exp)


def _use(model, cache, n: int = 5):
    with torch.no_grad():
        return model.generate(
            hf_ids(1, 30, seed=3, low=1),
            cache=cache,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )


@pytest.mark.parametrize("name", HF_MODELS)
@pytest.mark.parametrize("method", ["pqo4", "int4", "dense"])
def test_a_dropped_cache_gives_the_model_its_own_attention_back(name, method):
    model = HF_MODELS[name]()
    impl, n_hooks, want = implementations(model), hooks(model), own_outputs(model)
    cache = ArraykvCache(method, config=model.config, model=model)
    assert cache.fused and implementations(model) != impl and hooks(model) > n_hooks
    _use(model, cache)
    alive = weakref.ref(cache)
    del cache
    gc.collect()
    assert alive() is None  # nothing (a finalizer, a hook) keeps the cache alive
    assert_own(model, want, impl, n_hooks)


@pytest.mark.parametrize("name", HF_MODELS)
def test_detach_gives_it_back_once(name):
    model = HF_MODELS[name]()
    impl, n_hooks, want = implementations(model), hooks(model), own_outputs(model)
    cache = ArraykvCache("pqo4", config=model.config, model=model)
    _use(model, cache)
    cache.detach()
    assert not cache.fused and cache.hooked_layers == 0
    assert_own(model, want, impl, n_hooks)
    cache.detach()  # a second detach, and the collection later, change nothing
    del cache
    gc.collect()
    assert_own(model, want, impl, n_hooks)


@pytest.mark.parametrize("name", HF_MODELS)
def test_calls_no_cache_owns_are_the_models_own_while_a_cache_is_attached(name):
    """A live fused cache on the model: forwards without it (no cache, a DynamicCache, a padded
    batch) are the model's own to the last bit, before and after the cache served calls."""
    model = HF_MODELS[name]()
    want = own_outputs(model)
    cache = ArraykvCache("pqo4", config=model.config, model=model)
    for got, exp in zip(own_outputs(model), want):
        assert torch.equal(got, exp)
    _use(model, cache)
    for got, exp in zip(own_outputs(model), want):
        assert torch.equal(got, exp)
    cache.detach()


def test_the_eager_implementation_comes_back_as_it_was():
    model = hf_llama(0)
    model.set_attn_implementation("eager")
    impl, n_hooks, want = implementations(model), hooks(model), own_outputs(model)
    cache = ArraykvCache("int4", config=model.config, model=model)
    for got, exp in zip(own_outputs(model), want):  # served by the model's eager attention and eager mask
        assert torch.equal(got, exp)
    _use(model, cache)
    del cache
    gc.collect()
    assert model.config._attn_implementation == "eager"
    assert_own(model, want, impl, n_hooks)


def _greedy_steps(model, cache, ids, steps: int) -> list:
    """Greedy tokens of ``steps`` forwards through ``cache``, one call at a time (a generator)."""
    with torch.no_grad():
        logits = model(ids, cache=cache).logits
        for _ in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            yield int(nxt[0, 0])
            logits = model(nxt, cache=cache).logits


@pytest.mark.parametrize("name", HF_MODELS)
def test_two_caches_on_one_model_serve_each_their_own_calls(name):
    """Two fused caches of different methods on one model, used alternately step by step, give
    the tokens each gives alone; the model's own attention comes back when the last one goes."""
    model = HF_MODELS[name]()
    impl, n_hooks, want = implementations(model), hooks(model), own_outputs(model)
    a_ids, b_ids = hf_ids(1, 25, seed=5, low=1), hf_ids(1, 28, seed=6, low=1)
    alone = []
    for method, ids in (("pqo4", a_ids), ("int4", b_ids)):
        cache = ArraykvCache(method, config=model.config, model=model)
        alone.append(list(_greedy_steps(model, cache, ids, 8)))
        cache.detach()
    a = ArraykvCache("pqo4", config=model.config, model=model)
    b = ArraykvCache("int4", config=model.config, model=model)
    steps = [_greedy_steps(model, a, a_ids, 8), _greedy_steps(model, b, b_ids, 8)]
    together = [[], []]
    for _ in range(8):
        for j in (0, 1):
            together[j].append(next(steps[j]))
    assert together == alone
    # a model call without either cache is still the model's own
    for got, exp in zip(own_outputs(model), want):
        assert torch.equal(got, exp)
    del a, steps
    gc.collect()
    assert b.fused and implementations(model) != impl  # b still serves
    cont = ArraykvCache("int4", config=model.config, model=model)
    assert list(_greedy_steps(model, cont, b_ids, 8)) == alone[1]
    del b, cont
    gc.collect()
    assert_own(model, want, impl, n_hooks)


# -- the real models ----------------------------------------------------------------------------
def _real(name: str):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    if name == "smollm2":
        from arraykv.integrations.common.downloads import find_model

        from smollm import smollm_or_skip

        smollm_or_skip()
        path = find_model(download=False)
    else:
        from gemma import gemma_path_or_skip

        path = gemma_path_or_skip()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_a_real_model_is_its_own_after_caches_were_used_and_dropped(name):
    model = _real(name)
    impl, n_hooks, want = implementations(model), hooks(model), own_outputs(model)
    for method in ("pqo4", "int4", "dense"):
        cache = ArraykvCache(method, config=model.config, model=model)
        _use(model, cache, n=4)
        del cache
        gc.collect()
        assert_own(model, want, impl, n_hooks)


def test_keys_changed_between_update_and_attention_are_refused():
    """The fused function serves the call whose key tensor its cache's update returned; keys
    changed in between (here: copied) are refused rather than attended as the new token alone."""
    model = hf_llama(0)
    cache = ArraykvCache("pqo4", config=model.config, model=model)
    ids = hf_ids(1, 12, low=1)
    with torch.no_grad():
        model(ids, cache=cache)
        layer = cache.layers[1]
        real = layer.update
        layer.update = lambda k, v, *a, **kw: tuple(t.clone() for t in real(k, v, *a, **kw))
        with pytest.raises(RuntimeError, match="other keys than the ArraykvCache's update returned"):
            model(ids[:, :1], cache=cache)
        del layer.update
    want = own_outputs(hf_llama(0))
    for got, exp in zip(own_outputs(model), want):  # a held token is no one's afterwards
        assert torch.equal(got, exp)
    cache.detach()


def test_a_model_of_sub_models_gets_each_configs_implementation_back():
    """Gemma 3 with a vision tower: only the text model's attention modules are switched (the vision
    config and the top config keep theirs), and each config's value comes back exactly."""
    if not hasattr(transformers, "Gemma3ForConditionalGeneration"):
        pytest.skip("this transformers has no Gemma 3")
    torch.manual_seed(0)
    text = hf_gemma3_text_config()
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    model.config.vision_config._attn_implementation_internal = "eager"  # sub-models of different kinds
    impl, n_hooks = implementations(model), hooks(model)
    ids = hf_ids(1, 20, low=1)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        cache = ArraykvCache("pqo4", config=model.config, model=model)
        switched = dict(implementations(model))
        assert switched["Gemma3TextConfig"] == "arraykv_fused_sdpa"
        assert switched["SiglipVisionConfig"] == "eager" and switched["Gemma3Config"] == "sdpa"
        model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model(input_ids=ids).logits, want)
        del cache
        gc.collect()
        assert implementations(model) == impl and hooks(model) == n_hooks
        assert torch.equal(model(input_ids=ids).logits, want)
