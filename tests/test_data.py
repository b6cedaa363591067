"""Synthetic retrieval tasks and their word-level tokenizer (sparsejax.train.data / .tokenizer)."""
import numpy as np
import pytest

from sparsejax.train import data, tokenizer

CONTEXTS = [data.min_context("vt") + 1, 257, 1024]


@pytest.fixture(scope="module")
def vocab():
    return tokenizer.default_vocab()


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tokenizer.save_tokenizer(tmp_path_factory.mktemp("tok"), 4112)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def test_vocabulary_layout(vocab):
    words = tokenizer.vocabulary()
    assert len(words) == len(vocab) <= 1024 and len(set(words)) == len(words)
    assert words[:4] == ("<pad>", "<s>", "</s>", "<unk>")
    groups = [set(vocab.numbers), set(vocab.keys), set(vocab.variables), set(vocab.filler)]
    assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1:])
    assert vocab.decode(vocab.numbers[[0, 7, 99]]) == "0 7 99"


@pytest.mark.parametrize("task", data.TASKS)
def test_deterministic(task):
    a = data.make_sample(task, 300, seed=3, index=11)
    b = data.make_sample(task, 300, seed=3, index=11)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.answer_ids, b.answer_ids)
    assert a.needle_positions == b.needle_positions
    others = [data.make_sample(task, 300, seed=3, index=12), data.make_sample(task, 300, 4, 11)]
    for other in others:
        assert not np.array_equal(a.input_ids, other.input_ids)


@pytest.mark.parametrize("task", data.TASKS)
@pytest.mark.parametrize("context", CONTEXTS)
def test_prompt_layout(vocab, task, context):
    s = data.make_sample(task, context, seed=0, index=context)
    assert s.input_ids.shape == (context,) and s.input_ids.dtype == np.int32
    assert s.input_ids[0] == tokenizer.BOS_ID
    assert not np.isin(s.input_ids[1:], [tokenizer.BOS_ID, tokenizer.EOS_ID, tokenizer.PAD_ID,
                                          tokenizer.UNK_ID]).any()
    tail = vocab.decode(s.input_ids[-20:])
    assert "? answer :" in tail
    if task == "vt":
        assert tail.endswith("? answer :")
    else:   # the restated needle, up to the value
        key = vocab.decode(s.input_ids[-1:])
        assert tail.endswith(f"? answer : the special magic number for {key}")
    assert s.answer_ids[-1] == tokenizer.EOS_ID
    assert len(s.answer_ids) <= data.MAX_ANSWER_TOKENS
    assert tokenizer.EOS_ID not in s.answer_ids[:-1]


def _needle_text(vocab, s, position):
    end = position + int(np.flatnonzero(s.input_ids[position:] == vocab["."])[0]) + 1
    return vocab.decode(s.input_ids[position:end])


@pytest.mark.parametrize("context", CONTEXTS)
def test_answers_come_from_the_needles(vocab, context):
    """Each task's answer is readable from its needles (and only there)."""
    for index in range(5):
        s = data.make_sample("niah", context, 1, index)
        (p,) = s.needle_positions
        key = vocab.decode(s.input_ids[-1:])
        value = vocab.decode(s.answer_ids[:-1])
        assert _needle_text(vocab, s, p) == f"the special magic number for {key} {value} ."
        assert s.distractor_positions == ()

        s = data.make_sample("multikey", context, 1, index)
        assert len(s.needle_positions) == 1
        assert len(s.distractor_positions) == data.MULTIKEY_NEEDLES - 1
        key = vocab.decode(s.input_ids[-1:])
        want = f"the special magic number for {key} {vocab.decode(s.answer_ids[:-1])} ."
        assert _needle_text(vocab, s, s.needle_positions[0]) == want
        for p in s.distractor_positions:   # distractors: other keys
            assert f" for {key} " not in _needle_text(vocab, s, p)

        s = data.make_sample("multivalue", context, 1, index)
        key = vocab.decode(s.input_ids[-1:])
        values = [_needle_text(vocab, s, p).split(f" for {key} ")[1][:-2]
                  for p in s.needle_positions]
        assert len(values) == data.MULTIVALUE_NEEDLES
        assert vocab.decode(s.answer_ids[:-1]) == " , ".join(values)
        assert all(_needle_text(vocab, s, p).startswith(f"the special magic number for {key} ")
                   for p in s.needle_positions)

        s = data.make_sample("vt", context, 1, index)
        names = vocab.decode(s.answer_ids[:-1]).split()
        value = vocab.decode(s.input_ids[-3 - data.VALUE_TOKENS:-3])
        chain = [_needle_text(vocab, s, p) for p in s.needle_positions]
        assert chain[0] == f"var {names[0]} = {value} ."
        assert chain[1:] == [f"var {b} = {a} ." for a, b in zip(names, names[1:])]
        assert len(s.distractor_positions) == data.VT_VARIABLES
        for p in s.distractor_positions:
            assert not set(_needle_text(vocab, s, p).split()) & set(names)


def test_depths_spread(vocab):
    """Needles land at all depths of the haystack, not only near the start or the end."""
    depths = [data.make_sample("niah", 2000, 0, i).needle_positions[0] / 2000 for i in range(200)]
    assert min(depths) < 0.1 and max(depths) > 0.9
    assert 0.35 < np.mean(depths) < 0.65


def test_check_answer():
    s = data.make_sample("multivalue", 400, 0, 0)
    right = np.concatenate([s.answer_ids, [tokenizer.EOS_ID] * 3])
    assert data.check_answer(right, s)
    assert data.check_answer(s.answer_ids, s)
    wrong = right.copy()
    wrong[1] = s.answer_ids[1] + 1
    assert not data.check_answer(wrong, s)
    no_eos = np.concatenate([s.answer_ids[:-1], s.answer_ids[:1]])
    assert not data.check_answer(no_eos, s)
    assert not data.check_answer(s.answer_ids[:-1], s)   # cut short


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="task='nope'"):
        data.make_sample("nope", 100, 0, 0)
    with pytest.raises(ValueError, match="context=20 is too short"):
        data.make_sample("vt", 20, 0, 0)
    with pytest.raises(ValueError, match="index=-1"):
        data.make_sample("niah", 100, 0, -1)


def test_batches():
    samples = [data.make_sample(t, c, 0, i)
               for i, (t, c) in enumerate(zip(data.TASKS, [100, 130, 90, 120]))]
    ids, lengths = data.prompt_batch(samples)
    assert ids.shape == (4, 130) and lengths.tolist() == [100, 130, 90, 120]
    assert (ids[0, 100:] == tokenizer.PAD_ID).all()
    b = data.train_batch(samples, 130 + data.MAX_ANSWER_TOKENS)
    for row, s in enumerate(samples):
        n = len(s.answer_ids)
        assert b.lengths[row] == s.context + n - 1
        np.testing.assert_array_equal(b.tokens[row, :s.context], s.input_ids)
        # every target is the token after its position in prompt + answer
        full = np.concatenate([s.input_ids, s.answer_ids])
        pos = b.target_positions[row, :n]
        np.testing.assert_array_equal(full[pos + 1], b.targets[row, :n])
        assert b.target_mask[row].sum() == n
    with pytest.raises(ValueError, match="seq_len=131"):
        data.train_batch(samples, 131)


@pytest.mark.parametrize("task", data.TASKS)
def test_tokenizer_round_trip(vocab, hf_tokenizer, task):
    s = data.make_sample(task, 512, 2, 5)
    text = vocab.decode(s.input_ids[1:])
    assert hf_tokenizer(text)["input_ids"] == s.input_ids.tolist()
    assert hf_tokenizer(vocab.decode(s.answer_ids[:-1]), add_special_tokens=False)[
        "input_ids"] == s.answer_ids[:-1].tolist()
    assert hf_tokenizer.decode(s.answer_ids, skip_special_tokens=True) == \
        vocab.decode(s.answer_ids[:-1])


def test_hf_tokenizer_settings(hf_tokenizer):
    assert hf_tokenizer.is_fast
    assert (hf_tokenizer.pad_token_id, hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id,
            hf_tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert len(hf_tokenizer) == len(tokenizer.vocabulary())
    # the Whitespace pre-tokenizer splits punctuation off words typed without spaces
    ids = hf_tokenizer("which variables have the value 12 3 4? answer:")["input_ids"]
    assert ids == [tokenizer.BOS_ID] + tokenizer.default_vocab().encode(
        "which variables have the value 12 3 4 ? answer :").tolist()


def test_generator_uses_a_loaded_tokenizers_ids(hf_tokenizer):
    """`tokenizer_vocab` may be a loaded tokenizer's vocabulary."""
    a = data.make_sample("vt", 300, 0, 9, hf_tokenizer.get_vocab())
    b = data.make_sample("vt", 300, 0, 9)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    with pytest.raises(ValueError, match="lacks"):
        data.make_sample("vt", 300, 0, 9, {"<pad>": 0})


@pytest.mark.parametrize("context", CONTEXTS)
def test_copy_task_continues_a_sequence_of_the_haystack(vocab, context):
    """The training-only copy task: the question ends with the first tokens of a random sequence
    in the haystack, and the answer is the rest of that sequence."""
    for index in range(5):
        s = data.make_sample("copy", context, 2, index)
        (p,) = s.needle_positions
        sequence = s.input_ids[p:p + data.COPY_TOKENS]
        np.testing.assert_array_equal(s.input_ids[-data.COPY_PROMPT_TOKENS:],
                                      sequence[:data.COPY_PROMPT_TOKENS])
        np.testing.assert_array_equal(s.answer_ids[:-1], sequence[data.COPY_PROMPT_TOKENS:])
        assert np.isin(sequence, np.r_[vocab.numbers, vocab.keys]).all()
    with pytest.raises(ValueError, match="task='copy2'"):
        data.make_sample("copy2", 256, 0, 0)
