"""The prose tasks of sparsejax.tasks: each answer hidden in the document exactly where and as
often as it should be, deterministic per seed, the prompt fitted to the token budget of the
tokenizer it was built for (a tiny word-level one, the embedded model's, SmolLM2's when
installed), and RULER's scoring."""
import re
from pathlib import Path

import numpy as np
import pytest

import sparsejax
from sparsejax import tasks

CONTEXTS = (512, 1500)


def word_tokenizer():
    """A tiny word-level tokenizer with a chat template: every word and punctuation mark its
    own token, unknown words one <unk> each."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"] + sorted(
        set(re.findall(r"\w+|[^\w\s]+", tasks.load_prose()[:20000])))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<|user|> {{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %} <|assistant|> {% endif %}")
    return fast


def smollm2_tokenizer():
    try:
        path = sparsejax.real_model_path()
    except ValueError as e:
        pytest.skip(str(e))
    return sparsejax.load_tokenizer(path)


TOKENIZERS = {"word": word_tokenizer,
              "embedded": lambda: sparsejax.load_tokenizer(sparsejax.embedded_model_path()),
              "smollm2": smollm2_tokenizer}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def count(text: str, word: str) -> int:
    """Occurrences of `word` in `text` as a whole word."""
    return len(re.findall(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text))


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("task", tasks.TASKS)
def test_fits_budget_and_hides_answers(tokenizer, task, context):
    s = tasks.build(task, tokenizer, context, seed=7)
    assert s.task == task and s.context == context
    assert s.prompt_ids.dtype == np.int32
    # the prompt is its text's tokens (chat-templated: the template's own special tokens)
    chat = bool(tokenizer.chat_template)
    np.testing.assert_array_equal(
        s.prompt_ids, tokenizer(s.prompt, add_special_tokens=not chat)["input_ids"])
    assert s.prompt.endswith(("is", "are", "Answer:", "are:"))
    # fits the budget, and nearly fills it: short by less than one word's tokens at most
    # (cwe: than three list entries, the rare words' repeats)
    assert s.length <= context
    assert context - s.length <= (40 if task == "cwe" else 12), context - s.length
    assert s.document in s.prompt
    doc = s.document
    for needle in s.needles:
        assert doc.count(needle) == 1
    if task == "vt":
        # every variable assigned exactly once, the value once, in chain order
        for name in s.answers:
            assert count(doc, f"VAR {name} =") == 1
        positions = [doc.index(f"VAR {name} =") for name in s.answers]
        assert positions == sorted(positions)
        value = s.needles[0].split("= ")[1].rstrip(".")
        assert count(doc, value) == 1
    elif task == "cwe":
        listed = re.findall(r"^\d+\. (\w+)$", doc, re.M)
        counts = {w: listed.count(w) for w in set(listed)}
        frequent = sorted(counts, key=counts.get, reverse=True)[:len(s.answers)]
        assert sorted(frequent) == sorted(s.answers)
        assert min(counts[w] for w in s.answers) > max(
            c for w, c in counts.items() if w not in s.answers)
        assert [int(n) for n in re.findall(r"^(\d+)\.", doc, re.M)] == list(
            range(1, len(listed) + 1))
    else:
        for answer in s.answers:
            assert count(doc, answer) == 1, answer
            # in its needle, which the question's key picks out
            assert any(answer in n for n in s.needles)
        if task in ("niah", "multikey", "multivalue"):
            key = re.search(r"numbers? for (\S+) mentioned", s.prompt).group(1)
            hits = [n for n in s.needles if f" for {key} is:" in n]
            assert sorted(n.rsplit(" ", 1)[1].rstrip(".") for n in hits) == sorted(s.answers)
        if task == "qa":
            person = re.search(r"What is (.+)'s favourite", s.prompt).group(1)
            assert count(doc, person) == 1
            assert f"{person}'s favourite" in next(n for n in s.needles if s.answers[0] in n)
    # the haystack is the shipped prose (in order, from some sentence on)
    if task != "cwe":
        prose = tasks.load_prose()
        stripped = doc
        for needle in s.needles:
            stripped = stripped.replace(needle + " ", "")
        assert " ".join(stripped.split()[:12]) in " ".join(prose.split())


@pytest.mark.parametrize("task", tasks.TASKS)
def test_deterministic_per_seed(tokenizer, task):
    a = tasks.build(task, tokenizer, 700, seed=3)
    b = tasks.build(task, tokenizer, 700, seed=3)
    c = tasks.build(task, tokenizer, 700, seed=4)
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    assert a.answers == b.answers and a.prompt == b.prompt
    assert a.answers != c.answers and a.document != c.document


def test_plain_prompt_without_chat(tokenizer):
    s = tasks.build("passkey", tokenizer, 400, seed=1, chat=False)
    assert s.prompt.endswith("\nThe pass key is")
    np.testing.assert_array_equal(s.prompt_ids, tokenizer(s.prompt)["input_ids"])
    assert s.length <= 400


def test_score():
    assert tasks.score("The pass key is 12345.", ["12345"]) == 1.0
    assert tasks.score("they are: abcde, FGHIJ", ["ABCDE", "fghij", "KLMNO"]) == pytest.approx(2 / 3)
    assert tasks.score("", ["x"]) == 0.0
    with pytest.raises(ValueError, match="answers="):
        tasks.score("x", "x")


def test_bad_arguments():
    tok = word_tokenizer()
    with pytest.raises(ValueError, match="task_name='needle'.*'passkey'"):
        tasks.build("needle", tok, 100, 0)
    with pytest.raises(ValueError, match="context=-1"):
        tasks.build("niah", tok, -1, 0)
    with pytest.raises(ValueError, match="seed=1.5"):
        tasks.build("niah", tok, 100, 1.5)
    with pytest.raises(ValueError, match="context=20 is too short for task 'vt'"):
        tasks.build("vt", tok, 20, 0)


def test_prose_is_shipped_public_domain_text():
    text = tasks.PROSE_FILE.read_text(encoding="utf-8")
    header = text[:text.index("\n\n")]
    assert "Project Gutenberg" in header and "public domain" in header
    prose = tasks.load_prose()
    assert len(prose.encode()) >= 1_000_000
    assert "START OF THE PROJECT GUTENBERG" not in prose and "*** END OF" not in prose
    assert "It is a truth universally acknowledged" in prose
    assert not any(line.startswith("#") or line != " ".join(line.split())
                   for line in prose.splitlines())


def test_build_prose_script(tmp_path):
    """The build script strips a Gutenberg header and footer and normalizes whitespace."""
    import runpy

    book = tmp_path / "book.txt"
    book.write_text("The Project Gutenberg eBook of X\r\nTitle: A Book\r\nAuthor: Someone\r\n"
                    "*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\n\r\nCHAPTER I.\r\n\r\n"
                    "It  was a\r\n_dark_ night. [Illustration: a lamp]\r\n\r\n"
                    "*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nLicense text\r\n")
    script = Path(__file__).resolve().parents[1] / "scripts" / "build_prose.py"
    main = runpy.run_path(str(script))["main"]
    assert main([str(tmp_path / "out.txt"), f"{book}=somewhere"]) == 0
    out = (tmp_path / "out.txt").read_text()
    header, body = out.split("\n\n", 1)
    assert "A Book, by Someone (somewhere)" in header
    assert body == "It was a dark night.\n"


def test_eval_picks_the_task_set_by_tokenizer():
    from sparsejax import evaluation

    embedded = sparsejax.load_tokenizer(sparsejax.embedded_model_path())
    assert isinstance(evaluation.task_set(embedded, ["niah", "vt"], 256),
                      evaluation.SyntheticTasks)
    assert isinstance(evaluation.task_set(None, ["niah"], 256), evaluation.SyntheticTasks)
    with pytest.raises(ValueError, match="--task passkey,qa: .*synthetic.*--model smollm2"):
        evaluation.task_set(embedded, ["niah", "passkey", "qa"], 256)
    prose = evaluation.task_set(word_tokenizer(), ["passkey", "niah", "cwe"], 256)
    assert isinstance(prose, evaluation.ProseTasks)
    with pytest.raises(ValueError, match="--task copy: .*prose"):
        evaluation.task_set(word_tokenizer(), ["copy"], 256)


def test_evaluate_on_prose_scores_what_generate_decodes(monkeypatch):
    """`evaluate` with a non-synthetic tokenizer scores, per prompt, the completion a direct
    greedy `generate` decodes from the same prompt, and reports the mean score per task."""
    import jax
    import jax.numpy as jnp

    from sparsejax import evaluation
    from sparsejax.models import Model, ModelConfig, init_params

    tok = word_tokenizer()
    config = ModelConfig(model_type="llama", vocab_size=len(tok), hidden_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id)
    model = Model(config, init_params(config, jax.random.key(0), jnp.float32))
    context, names = 300, ("passkey", "vt")
    scored, score = [], tasks.score
    monkeypatch.setattr(tasks, "score", lambda text, answers: scored.append(text) or
                        score(text, answers))
    doc = evaluation.evaluate(model, tasks=names, context=context, samples=2, ratios=[0.5],
                              method_names=["dense"], timing=False, tokenizer=tok, seed=5)
    assert doc["task_set"] == "prose"
    samples = [tasks.build(t, tok, context, 5 + i) for i in range(2) for t in names]
    ids, lengths = tasks.prompt_batch(samples, 0, length=context)
    out = sparsejax.generate(model, ids, lengths=lengths,
                             max_new_tokens=max(s.max_new_tokens for s in samples))
    texts = [tok.decode(t[:n], skip_special_tokens=True)
             for t, n in zip(np.asarray(out.tokens), np.asarray(out.num_generated))]
    assert scored == texts and any(texts)
    scores = [score(text, s.answers) for text, s in zip(texts, samples)]
    for name in names:
        result = next(r for r in doc["results"] if r["task"] == name)
        want = np.mean([sc for sc, s in zip(scores, samples) if s.task == name])
        assert result["accuracy"] == pytest.approx(want)
        assert result["samples"] == 2
