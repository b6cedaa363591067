"""The generation API users know: length buckets (one compile per bucket), SamplingParams,
RequestOutput, stop strings as transformers cuts them, logprobs, seeds, chat templates, the
mask transformers infers from the pad token, dtype="auto" and allocate(model)."""
import dataclasses
import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import SamplingParams
from sparsejax.generate import _generate
from sparsejax.models import ModelConfig, init_params, unstack_layers
from sparsejax.plan import dense_plan

CONFIG = ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                     max_position_embeddings=512, eos_token_id=96)


@pytest.fixture(scope="module")
def tiny():
    """A random model with peaked logits (std 0.3), so greedy choices have no near-ties."""
    params = unstack_layers(init_params(CONFIG, jax.random.key(0), jnp.float32, std=0.3))
    return sparsejax.Model(CONFIG, params)


def ragged(lengths, seed=0, low=1):
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), max(lengths)), np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(low, 90, n)
    return ids, np.asarray(lengths, np.int32)


DELTA = sparsejax.methods.DELTA(budget_pages=1, recent_pages=1, delta_layers=(1,),
                                dense_layers=(0,))


# ---- buckets ---------------------------------------------------------------------------------
def test_bucket_lengths():
    got = [sparsejax.bucket_length(n) for n in (1, 16, 17, 100, 2048, 2049, 4096, 4097, 8192,
                                                8193, 32768, 32769)]
    assert got == [16, 16, 32, 128, 2048, 4096, 4096, 8192, 8192, 12288, 32768, 36864]


@pytest.mark.parametrize("method", [None, DELTA], ids=["dense", "delta"])
def test_padding_to_the_bucket_changes_no_row_and_compiles_once(tiny, method):
    ids, lengths = ragged([5, 19, 11])
    kw = dict(lengths=lengths, max_new_tokens=6, method=method, eos_token_id=())
    exact = sparsejax.generate(tiny, ids, pad_to_bucket=False, **kw)
    before = _generate._cache_size()
    padded = sparsejax.generate(tiny, ids, **kw)                     # width 19 -> bucket 32
    np.testing.assert_array_equal(np.asarray(padded.tokens), np.asarray(exact.tokens))
    wider = np.pad(ids, ((0, 0), (0, 6)))                            # width 25: same bucket
    again = sparsejax.generate(tiny, wider, **kw)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(exact.tokens))
    assert _generate._cache_size() == before + 1
    # compile_generate's program serves every width of its bucket, and only those
    run = sparsejax.compile_generate(tiny, ids, **kw)
    np.testing.assert_array_equal(np.asarray(run(wider, lengths=lengths).tokens),
                                  np.asarray(exact.tokens))
    with pytest.raises(ValueError, match=r"compiled for \(3, 32\)"):
        run(np.pad(ids, ((0, 0), (0, 20))), lengths=lengths)


def test_compilation_cache_writes_programs_to_disk(tmp_path):
    code = ("import jax, jax.numpy as jnp, sparsejax; "
            f"sparsejax.enable_compilation_cache({str(tmp_path)!r}); "
            "jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="min_compile_seconds=-1"):
        sparsejax.enable_compilation_cache(tmp_path, min_compile_seconds=-1)


# ---- logprobs, seeds, the pad token ---------------------------------------------------------
def test_logprobs_are_the_full_forwards_log_softmax(tiny):
    ids, lengths = ragged([7, 12], seed=1)
    kw = dict(lengths=lengths, max_new_tokens=5, eos_token_id=())
    plain = sparsejax.generate(tiny, ids, **kw)
    assert plain.logprobs is None and plain.top_logprobs is None
    out = sparsejax.generate(tiny, ids, logprobs=3, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    for i, n in enumerate(lengths):
        seq = np.concatenate([ids[i, :n], np.asarray(out.tokens[i])])[None]
        want = jax.nn.log_softmax(sparsejax.logits(tiny, seq)[0, n - 1:-1], axis=-1)
        chosen = np.take_along_axis(np.asarray(want), np.asarray(out.tokens[i])[:, None], 1)[:, 0]
        np.testing.assert_allclose(np.asarray(out.logprobs[i]), chosen, atol=2e-4)
        top_ids, top_values = (np.asarray(x[i]) for x in out.top_logprobs)
        np.testing.assert_array_equal(top_ids, np.argsort(-np.asarray(want), axis=-1)[:, :3])
        np.testing.assert_allclose(top_values, -np.sort(-np.asarray(want), axis=-1)[:, :3],
                                   atol=2e-4)
    with pytest.raises(ValueError, match="logprobs='all'"):
        sparsejax.generate(tiny, ids, logprobs="all", **kw)


def test_int_seeds_reproduce_and_bad_keys_are_refused(tiny):
    ids, lengths = ragged([6, 9], seed=2)
    kw = dict(lengths=lengths, max_new_tokens=8, temperature=1.5, eos_token_id=())
    a = np.asarray(sparsejax.generate(tiny, ids, seed=5, **kw).tokens)
    np.testing.assert_array_equal(np.asarray(sparsejax.generate(tiny, ids, rng=5, **kw).tokens), a)
    np.testing.assert_array_equal(
        np.asarray(sparsejax.generate(tiny, ids, rng=jax.random.key(5), **kw).tokens), a)
    np.testing.assert_array_equal(
        np.asarray(sparsejax.generate(tiny, ids, rng=jax.random.PRNGKey(5), **kw).tokens), a)
    assert not np.array_equal(np.asarray(sparsejax.generate(tiny, ids, seed=6, **kw).tokens), a)
    for bad, match in ((dict(rng=1.5), "rng=1.5"), (dict(rng="abc"), "rng='abc'"),
                       (dict(rng=jax.random.split(jax.random.key(0))), "one PRNG key"),
                       (dict(seed=1.0), "seed=1.0"), (dict(seed=1, rng=2), "give one")):
        with pytest.raises(ValueError, match=match):
            sparsejax.generate(tiny, ids, **kw, **bad)


def test_a_missing_mask_is_inferred_from_the_pad_token(tiny):
    ids, lengths = ragged([5, 9, 3], seed=3)
    T = ids.shape[1]
    left, mask = np.zeros_like(ids), np.zeros_like(ids)   # pad id 0: absent from the prompts
    for i, n in enumerate(lengths):
        left[i, T - n:], mask[i, T - n:] = ids[i, :n], 1
    kw = dict(max_new_tokens=6, eos_token_id=())
    want = np.asarray(sparsejax.generate(tiny, ids, lengths=lengths, **kw).tokens)
    padded = sparsejax.Model(dataclasses.replace(CONFIG, pad_token_id=0), tiny.params)
    for model, extra in ((padded, {}), (tiny, dict(pad_token_id=0))):
        np.testing.assert_array_equal(np.asarray(sparsejax.generate(model, left, **kw,
                                                                    **extra).tokens), want)
        np.testing.assert_array_equal(np.asarray(sparsejax.generate(model, ids, **kw,
                                                                    **extra).tokens), want)
    # without a known pad token the pads are prompt (the negative control), and a pad inside
    # a prompt (or a pad that is the EOS) is not inferred
    assert not np.array_equal(np.asarray(sparsejax.generate(tiny, left, **kw).tokens), want)
    holed = left.copy()
    holed[1, T - 3] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] hold the pad token 0 inside the prompt"):
        sparsejax.generate(padded, holed, **kw)
    as_eos = sparsejax.generate(padded, left, max_new_tokens=6, eos_token_id=0)
    assert not np.array_equal(np.asarray(as_eos.tokens), want)


# ---- dtype="auto", allocate(model) ----------------------------------------------------------
def test_dtype_auto_reads_the_checkpoint_and_allocate_takes_the_models(tmp_path, tiny):
    assert sparsejax.from_pretrained(sparsejax.embedded_model_path()).dtype == jnp.bfloat16
    sparsejax.save_pretrained(tiny, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert sparsejax.from_pretrained(tmp_path).dtype == jnp.float32           # float32 saved
    for written, want in ((None, jnp.float32), ("float16", jnp.float16),
                          ("torch.bfloat16", jnp.bfloat16)):
        (tmp_path / "config.json").write_text(json.dumps(
            {k: v for k, v in config.items() if k != "torch_dtype"}
            | ({} if written is None else {"torch_dtype": written})))
        assert sparsejax.from_pretrained(tmp_path).dtype == want
    (tmp_path / "config.json").write_text(json.dumps(config | {"torch_dtype": "int8"}))
    with pytest.raises(ValueError, match="torch_dtype='int8'"):
        sparsejax.from_pretrained(tmp_path)
    # the step API with an f32 model: the cache takes the model's dtype
    cache = sparsejax.allocate(tiny, 1, 32)
    assert cache.k.dtype == jnp.float32
    assert sparsejax.allocate(tiny.config, 1, 32).k.dtype == jnp.bfloat16   # as before
    assert sparsejax.allocate(tiny, 1, 32, dtype=jnp.bfloat16).k.dtype == jnp.bfloat16
    plan = dense_plan(tiny.config, 16)
    ids, lengths = ragged([7])
    logits, cache = jax.jit(sparsejax.prefill, static_argnames="plan")(tiny, cache, ids, lengths,
                                                                        plan=plan)
    logits, cache = jax.jit(sparsejax.decode_step, static_argnames="plan")(
        tiny, cache, jnp.argmax(logits, -1), plan=plan)
    assert logits.shape == (1, CONFIG.vocab_size)
    with pytest.raises(ValueError, match="expected a Model"):
        sparsejax.allocate({"vocab_size": 3}, 1, 32)


# ---- LLM ------------------------------------------------------------------------------------
ORCA = ("the special magic number for orca 39 20 34 . leave bird again soon now can high wonder "
        "snow listen game claim still eat . what is the special magic number for orca ? "
        "answer : the special magic number for orca")
TAPIR = ("the special magic number for orca 39 20 34 . leave bird again . the special magic number "
         "for tapir 5 61 17 . snow listen game . what is the special magic number for tapir ? "
         "answer : the special magic number for tapir")


@pytest.fixture(scope="module")
def llm():
    return sparsejax.LLM(sparsejax.embedded_model_path(), dtype=jnp.float32)


def test_llm_generate_returns_request_outputs(llm):
    eos = llm.model.config.eos_token_id
    before = _generate._cache_size()
    [one] = llm.generate(ORCA, SamplingParams(max_tokens=8))            # one prompt: a string
    assert one.prompt == ORCA and one.prompt_token_ids == llm.tokenizer(ORCA)["input_ids"]
    done = one.outputs[0]
    assert (done.text, done.finish_reason, done.stop_reason) == ("39 20 34", "stop", None)
    assert done.token_ids[-1] == eos and done.logprobs is None
    # another length in the same bucket (46 and 42 tokens -> 64) runs the same program
    [other] = llm.generate(TAPIR, SamplingParams(max_tokens=2))
    assert (other.outputs[0].text, other.outputs[0].finish_reason) == ("5 61", "length")
    assert _generate._cache_size() == before + 2     # max_tokens 8 and 2: two programs
    shorter = TAPIR.replace(" . snow listen game", "")
    assert len(llm.tokenizer(shorter)["input_ids"]) == 42
    assert llm.generate(shorter, SamplingParams(max_tokens=2))[0].outputs[0].text == "5 61"
    assert _generate._cache_size() == before + 2
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"prompts=\[\]"):
        llm.generate([])


def test_llm_stop_strings_stop_tokens_logprobs_and_seeds(llm):
    ids = llm.tokenizer(TAPIR)["input_ids"]
    stop_id = llm.tokenizer("61", add_special_tokens=False)["input_ids"][0]
    params = SamplingParams(max_tokens=8, stop=["20"], stop_token_ids=[stop_id], logprobs=2)
    orca, tapir = llm.generate([ORCA, {"prompt_token_ids": ids}], params)
    assert (orca.outputs[0].text, orca.outputs[0].finish_reason) == ("39 20", "stop")
    assert orca.outputs[0].stop_reason == "20"                 # a stop string, kept
    got = tapir.outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == ("5 61", "stop", stop_id)
    assert tapir.prompt_token_ids == ids and got.token_ids[-1] == stop_id
    # the chosen tokens' log-probabilities are the array API's, the top 2 ranked 1 and 2
    rows = np.zeros((2, len(ids)), np.int32)
    orca_ids = llm.tokenizer(ORCA)["input_ids"]
    rows[0, :len(orca_ids)], rows[1] = orca_ids, ids
    eos = (llm.model.config.eos_token_id, stop_id)
    out = sparsejax.generate(llm.model, rows, lengths=np.asarray([len(orca_ids), len(ids)]),
                             max_new_tokens=8, logprobs=2, eos_token_id=eos)
    want = np.asarray(out.logprobs[1, :len(got.token_ids)])
    np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)],
                               want, atol=1e-6)
    assert got.cumulative_logprob == pytest.approx(float(want.sum()), abs=1e-5)
    assert all(sorted(r.rank for r in lp.values() if r.rank) == [1, 2] for lp in got.logprobs)
    assert len(orca.outputs[0].logprobs) == len(orca.outputs[0].token_ids) == 2
    # an int seed reproduces a sampled completion, another seed samples another
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    a, b = (llm.generate("the", sampled)[0].outputs[0].token_ids for _ in range(2))
    other = llm.generate("the", dataclasses.replace(sampled, seed=4))[0].outputs[0].token_ids
    assert a == b != other


def test_stop_strings_end_where_transformers_stop_string_criteria_does():
    """On a byte-level BPE vocabulary, whose tokens overhang the stop strings on either end."""
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, StopStringCriteria

    from sparsejax.llm import stop_string_end

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([ORCA, TAPIR] * 4, trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)   # noqa: E731
    words = tok(ORCA + " " + TAPIR)["input_ids"]
    assert max(len(tok.convert_ids_to_tokens(i)) for i in words) > 4    # merged tokens
    rng = np.random.default_rng(0)
    ends = []
    for stop in (["20 34"], ["61"], ["ber fo", "r tap"], ["c n"], ["zebra"]):
        criteria = StopStringCriteria(tok, stop)
        for _ in range(6):
            start = int(rng.integers(0, len(words) - 16))    # a window of the text
            row = words[start:start + 16]
            hf_end = next((k for k in range(1, len(row) + 1)
                           if criteria(torch.tensor([row[:k]]), None)[0]), None)
            got = stop_string_end(decode, row, stop)
            assert (None if got is None else got[0]) == hf_end, (stop, row)
            assert got is None or got[1] in decode(row[:got[0]])
            ends.append(hf_end)
    assert sum(e is not None for e in ends) >= 10    # the stop strings do occur


def test_llm_chat_applies_the_template_once(llm, monkeypatch):
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}answer : the special magic number for orca"
                "{% endif %}")
    monkeypatch.setattr(llm.tokenizer, "chat_template", template, raising=False)
    question = ORCA[:ORCA.index(" answer")]
    conversation = [{"role": "user", "content": question}]
    [out] = llm.chat(conversation, SamplingParams(max_tokens=8))
    want = llm.tokenizer.apply_chat_template(conversation, tokenize=True,
                                             add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert out.prompt_token_ids == want
    assert want.count(llm.tokenizer.bos_token_id) == 1
    assert out.outputs[0].text == "39 20 34"
    assert len(llm.chat([conversation, conversation], SamplingParams(max_tokens=8))) == 2
    monkeypatch.setattr(llm.tokenizer, "chat_template", None, raising=False)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat(conversation)


def test_default_sampling_params_come_from_generation_config(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(sparsejax.embedded_model_path(), path,
                    ignore=shutil.ignore_patterns("*.png", "calibration", "gates"))
    (path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 5}))
    llm = sparsejax.LLM(path, dtype=jnp.float32)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (
        0.6, 0.9, 50, 5)                       # top_k: transformers' default when unset
    assert SamplingParams(temperature=0).over(defaults).temperature == 0
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": None}))
    unset = sparsejax.LLM(path, dtype=jnp.float32).get_default_sampling_params()
    assert (unset.temperature, unset.top_p, unset.top_k) == (1.0, 1.0, 0)   # null: no top-k
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    greedy = sparsejax.LLM(path, dtype=jnp.float32).get_default_sampling_params()
    assert (greedy.temperature, greedy.max_tokens) == (0.0, 16)   # no do_sample: greedy
