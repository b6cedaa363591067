"""Long-context tasks on real English prose, in the manner of RULER, for any tokenizer.

    sample = tasks.build("niah", tokenizer, context=4096, seed=3)
    completion = tokenizer.decode(generated_ids)      # the model's answer to sample.prompt_ids
    tasks.score(completion, sample.answers)           # 1.0 when every answer is in it

Tasks (`TASKS`):
  passkey     one pass key (a number) hidden in the prose; asked for it
  niah        one needle "One of the special magic numbers for <key> is: <value>."; asked for
              the key's number
  multikey    four such needles with different keys; asked for one key's number
  multivalue  four needles with one key and four numbers; asked for all four
  vt          variable tracking: "VAR ABCDE = 12345." then four hops "VAR FGHIJ = VAR ABCDE.";
              asked for every variable holding the value
  cwe         common-word extraction: a numbered list of prose words, ten of them frequent;
              asked for the ten (no prose haystack: the list fills the budget)
  qa          a fact question: three sentences "<Name>'s favourite <thing> is <value>." about
              three invented people in the prose; asked for one person's

The haystack is `load_prose()`: three public-domain Project Gutenberg books (data/prose.txt
says which), read from a seed-chosen sentence on. Every needle's answer is drawn so that it
appears nowhere in the prose, and so exactly once (vt: each variable once as the target of an
assignment) in the document. The prompt is the instruction, the document and the question as
one user message through the tokenizer's chat template when it has one (`chat=True`), followed
by an answer prefix ("The pass key is"), as RULER prompts; without a template it is plain text
behind the tokenizer's special tokens. Its length in that tokenizer is `context` or just under:
whole sentences, then the words of one more, as many as fit.
Scoring is RULER's: the share of the expected answers contained in the completion, ignoring
case.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

TASKS = ("passkey", "niah", "multikey", "multivalue", "vt", "cwe", "qa")
PROSE_FILE = Path(__file__).resolve().parent / "data" / "prose.txt"

NEEDLES = 4                 # multikey: one asked for, three distractors; multivalue: values
VT_VARIABLES = 5            # one assignment of the value, then four hops
CWE_COMMON = 10             # the frequent words asked for
CWE_RARE_REPEATS = 3        # how often each other word appears
QA_PEOPLE = 3               # one asked about, two distractors
ANSWER_MARGIN_TOKENS = 8    # max_new_tokens past the answers' own length


@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    """One prompt of a task, its tokens measured in the tokenizer it was built for."""
    task: str
    prompt_ids: np.ndarray     # [n] int32, n <= context: the whole prompt, templated
    answers: list[str]         # every one must be in the completion (`score`)
    prompt: str                # prompt_ids' text
    document: str              # the haystack with the needles: the part that fills the budget
    needles: tuple[str, ...]   # the sentences hidden in the document, in order
    context: int               # the budget the prompt was fitted to
    seed: int
    max_new_tokens: int        # enough to say the answers, plus a margin

    @property
    def length(self) -> int:
        return int(self.prompt_ids.shape[0])


def score(completion_text: str, answers: Sequence[str]) -> float:
    """RULER's string_match_all: the share of `answers` contained in `completion_text`,
    ignoring case."""
    if isinstance(answers, str) or not answers:
        raise ValueError(f"answers={answers!r}: expected a non-empty list of strings")
    text = completion_text.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


# ---- the prose ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def load_prose() -> str:
    """The shipped English prose (data/prose.txt without its '#' header): one paragraph a
    line."""
    text = PROSE_FILE.read_text(encoding="utf-8")
    header_end = text.find("\n\n")
    if not text.startswith("#") or header_end < 0:
        raise ValueError(f"{PROSE_FILE} lacks its '#' header and the blank line after it: "
                         "rebuild it with scripts/build_prose.py")
    return text[header_end + 2:]


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)|(?<=[.!?][”’\"')])\s+(?=\S)")


@functools.lru_cache(maxsize=None)
def _sentences() -> tuple[str, ...]:
    """The prose as sentences, each with the space (or line break) that follows it."""
    out = []
    for paragraph in load_prose().splitlines():
        parts = _SENTENCE_END.split(paragraph.strip())
        out += [p + " " for p in parts[:-1]] + [parts[-1] + "\n"]
    return tuple(s for s in out if s.strip())


@functools.lru_cache(maxsize=None)
def _prose_words() -> frozenset[str]:
    return frozenset(re.findall(r"[a-z]+", load_prose().lower()))


def _absent(candidates: Sequence[str]) -> tuple[str, ...]:
    """The candidates none of whose words occurs in the prose (ignoring case)."""
    words = _prose_words()
    return tuple(c for c in candidates
                 if not any(w in words for w in re.findall(r"[a-z]+", c.lower())))


@functools.lru_cache(maxsize=None)
def _cwe_vocabulary() -> tuple[str, ...]:
    """Prose words of 4-10 lower-case letters, each once, in order of first appearance."""
    return tuple(dict.fromkeys(w for w in re.findall(r"\b[a-z]{4,10}\b", load_prose())))


_ADJECTIVES = ("amber", "brisk", "cobalt", "dusky", "fizzy", "gritty", "hazy", "icy", "jolly",
               "knotty", "leafy", "minty", "nutty", "oaken", "peppery", "quirky", "rusty",
               "salty", "tangy", "velvet", "wiry", "zesty", "frosty", "grumpy", "sleepy",
               "chunky", "glossy", "spicy", "fluffy", "sticky")
_NOUNS = ("pelican", "walrus", "trombone", "teapot", "cactus", "kayak", "lantern", "pretzel",
          "mongoose", "tractor", "saxophone", "toaster", "zebra", "avocado", "penguin",
          "scooter", "umbrella", "waffle", "yak", "koala", "bagel", "ferret", "hammock",
          "igloo", "jigsaw", "moped", "noodle", "octopus", "parrot", "robot")
_FIRST_NAMES = ("Ambrosine", "Cornelio", "Philippina", "Barnabus", "Octavius", "Leopoldine",
                "Wilhelmina", "Thaddeus", "Seraphina", "Ignatius", "Clementine", "Evander",
                "Rosalind", "Mortimer", "Ottoline", "Percival", "Winifred", "Augustin")
_LAST_NAMES = ("Quillfeather", "Thistlewood", "Marchbank", "Pennyworth", "Ashcombe",
               "Fairbrother", "Hollingsworth", "Kettlewell", "Brambleby", "Oakenshaw",
               "Pumphrey", "Wetherall", "Crabtree", "Dunmore", "Galbraith")
_FACTS = {
    "city": ("Montevideo", "Reykjavik", "Nairobi", "Kyoto", "Valparaiso", "Marrakesh",
             "Helsinki", "Tbilisi", "Cartagena", "Ljubljana", "Osaka", "Wellington"),
    "instrument": ("accordion", "bagpipes", "banjo", "cello", "clarinet", "marimba",
                   "oboe", "sitar", "tuba", "ukulele", "xylophone", "zither"),
    "vegetable": ("artichoke", "asparagus", "aubergine", "broccoli", "cauliflower",
                  "courgette", "kohlrabi", "okra", "parsnip", "radicchio", "rhubarb", "zucchini"),
}


# ---- building -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Spec:
    """What a task puts around its haystack."""
    instruction: str           # before the document
    question: str              # after it
    answer_prefix: str         # after the generation prompt, the answer's start
    answers: list[str]
    needles: tuple[str, ...]   # hidden in the prose at `depths` (a share of its sentences)
    depths: tuple[float, ...]
    units: Callable[[int], list[str]] | None = None   # cwe: the document's pieces, not prose


def _number(rng: np.random.Generator, digits: int, taken: set[str]) -> str:
    """A `digits`-digit number not in `taken` and nowhere in the prose."""
    prose = load_prose()
    while True:
        n = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
        if n not in taken and n not in prose:
            taken.add(n)
            return n


def _keys(rng: np.random.Generator, n: int) -> list[str]:
    adjectives, nouns = _absent(_ADJECTIVES), _absent(_NOUNS)
    pairs = rng.choice(len(adjectives) * len(nouns), size=n, replace=False)
    return [f"{adjectives[p // len(nouns)]}-{nouns[p % len(nouns)]}" for p in pairs]


def _depths(rng: np.random.Generator, n: int) -> tuple[float, ...]:
    return tuple(sorted(float(d) for d in rng.uniform(0.0, 1.0, n)))


_MAGIC = ("Some special magic numbers are hidden within the following text. Make sure to "
          "memorize them. I will quiz you about the numbers afterwards.")


def _magic(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _magic_question(key: str, several: bool) -> tuple[str, str]:
    word = "numbers" if several else "number"
    return (f"What {'are all the' if several else 'is the'} special magic {word} for {key} "
            "mentioned in the provided text?",
            f"The special magic {word} for {key} mentioned in the provided text "
            f"{'are' if several else 'is'}")


def _passkey(rng: np.random.Generator) -> _Spec:
    key = _number(rng, 5, set())
    return _Spec("There is an important piece of information hidden inside a lot of irrelevant "
                 "text. Find it and memorize it. I will quiz you about it afterwards.",
                 "What is the pass key?", "The pass key is", [key],
                 (f"The pass key is {key}. Remember it.",), _depths(rng, 1))


def _niah(rng: np.random.Generator) -> _Spec:
    key, value = _keys(rng, 1)[0], _number(rng, 7, set())
    question, prefix = _magic_question(key, False)
    return _Spec(_MAGIC, question, prefix, [value], (_magic(key, value),), _depths(rng, 1))


def _multikey(rng: np.random.Generator) -> _Spec:
    keys, taken = _keys(rng, NEEDLES), set()
    values = [_number(rng, 7, taken) for _ in keys]
    asked = int(rng.integers(NEEDLES))
    question, prefix = _magic_question(keys[asked], False)
    return _Spec(_MAGIC, question, prefix, [values[asked]],
                 tuple(_magic(k, v) for k, v in zip(keys, values)), _depths(rng, NEEDLES))


def _multivalue(rng: np.random.Generator) -> _Spec:
    key, taken = _keys(rng, 1)[0], set()
    values = [_number(rng, 7, taken) for _ in range(NEEDLES)]
    question, prefix = _magic_question(key, True)
    return _Spec(_MAGIC, question, prefix, values, tuple(_magic(key, v) for v in values),
                 _depths(rng, NEEDLES))


def _variable(rng: np.random.Generator, taken: set[str]) -> str:
    prose = load_prose()
    while True:
        name = "".join(chr(ord("A") + int(i)) for i in rng.integers(26, size=5))
        if name not in taken and name not in prose:
            taken.add(name)
            return name


def _vt(rng: np.random.Generator) -> _Spec:
    taken: set[str] = set()
    names = [_variable(rng, taken) for _ in range(VT_VARIABLES)]
    value = _number(rng, 5, set())
    needles = (f"VAR {names[0]} = {value}.",) + tuple(
        f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:]))
    return _Spec("Memorize and track the chain of variable assignments hidden in the "
                 "following text.",
                 f"Question: Find all variables that are assigned the value {value} in the "
                 "text above.",
                 f"Answer: According to the chain of variable assignments in the text above, "
                 f"{VT_VARIABLES} variables are assigned the value {value}, they are:",
                 names, needles, _depths(rng, VT_VARIABLES))


def _cwe(rng: np.random.Generator, context: int) -> _Spec:
    vocabulary = _cwe_vocabulary()
    joined = "\n".join(vocabulary)
    order = [vocabulary[i] for i in rng.permutation(len(vocabulary))]
    # a frequent word part of no other word ("mode" of "modest"), which containment would match
    common = list(itertools.islice((w for w in order if joined.count(w) == 1), CWE_COMMON))
    rare_pool = [w for w in order if w not in common]
    repeats = min(30, max(CWE_RARE_REPEATS + 2, context // 128))   # RULER: 30 at 4k and more
    shuffle_seed = int(rng.integers(2 ** 31))

    def units(rare: int) -> list[str]:
        words = common * repeats + rare_pool[:rare] * CWE_RARE_REPEATS
        words = [words[i] for i in np.random.default_rng(shuffle_seed).permutation(len(words))]
        return [f"{i}. {w}\n" for i, w in enumerate(words, 1)]

    return _Spec("Below is a numbered list of words. In these words, some appear more often "
                 "than others. Memorize the ones that appear most often.",
                 f"Question: What are the {CWE_COMMON} most common words in the above list?",
                 f"Answer: The top {CWE_COMMON} words that appear most often in the list are:",
                 common, (), (), units)


def _qa(rng: np.random.Generator) -> _Spec:
    first, last = _absent(_FIRST_NAMES), _absent(_LAST_NAMES)
    # distinct first and last names, so that no name is part of another's
    people, used = [], set()
    for p in rng.permutation(len(first) * len(last)):
        f, l_ = first[p // len(last)], last[p % len(last)]
        if f not in used and l_ not in used:
            people.append(f"{f} {l_}")
            used |= {f, l_}
        if len(people) == QA_PEOPLE:
            break
    thing = sorted(_FACTS)[int(rng.integers(len(_FACTS)))]
    values = _absent(_FACTS[thing])
    chosen = [values[i] for i in rng.choice(len(values), size=QA_PEOPLE, replace=False)]
    asked = int(rng.integers(QA_PEOPLE))
    facts = tuple(f"{p}'s favourite {thing} is {v}." for p, v in zip(people, chosen))
    return _Spec("Answer the question based on the given document. Only give me the answer "
                 "and do not output any other words.",
                 f"Question: What is {people[asked]}'s favourite {thing}?", "Answer:",
                 [chosen[asked]], facts, _depths(rng, QA_PEOPLE))


_BUILDERS: dict[str, Callable] = {
    "passkey": _passkey, "niah": _niah, "multikey": _multikey, "multivalue": _multivalue,
    "vt": _vt, "qa": _qa}


def _spec(task: str, rng: np.random.Generator, context: int) -> _Spec:
    return _cwe(rng, context) if task == "cwe" else _BUILDERS[task](rng)


def _document(spec: _Spec, start: int, sentences: int, words: int) -> str:
    """`sentences` prose sentences from `start` (wrapping around the prose), then `words`
    words of the next, with the needles in at their depths."""
    prose = _sentences()
    units = [prose[(start + i) % len(prose)] for i in range(sentences)]
    if words:
        tail = prose[(start + sentences) % len(prose)].split()[:words]
        units.append(" ".join(tail) + "\n")
    for depth, needle in sorted(zip(spec.depths, spec.needles), reverse=True):
        units.insert(round(depth * sentences), needle + " ")
    return "".join(units).strip()


def _render(tokenizer, spec: _Spec, document: str, chat: bool) -> tuple[str, list[int]]:
    """The prompt's text and token ids."""
    content = f"{spec.instruction}\n\n{document}\n\n{spec.question}"
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             add_generation_prompt=True, tokenize=False)
        text += spec.answer_prefix
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = f"{content}\n{spec.answer_prefix}"
    return text, list(tokenizer(text)["input_ids"])


def _largest(fits: Callable[[int], bool], guess: int, step: int) -> int:
    """The largest n >= 0 with fits(n) (fits(0) holds, and fits is monotone), searched from
    `guess` in steps that double, then by bisection."""
    lo, hi = 0, None
    if fits(guess):
        lo = guess
        while hi is None:
            if fits(lo + step):
                lo, step = lo + step, step * 2
            else:
                hi = lo + step
    else:
        hi = guess
        while hi - step > lo:
            if fits(hi - step):
                lo = hi - step
                break
            hi, step = hi - step, step * 2
    return _bisect(fits, lo, hi)


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in [lo, hi) with fits(n), given fits(lo) and not fits(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _sentence_tokens(tokenizer, start: int, tokens: int) -> np.ndarray:
    """Cumulative tokens of the prose sentences from `start`, each counted alone (one batched
    call per 256), until they pass `tokens` by a tenth."""
    prose, counts = _sentences(), []
    while sum(counts) <= 1.1 * tokens + 64:
        chunk = [prose[(start + len(counts) + i) % len(prose)] for i in range(256)]
        counts += [len(ids) for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]]
    return np.cumsum(counts)


def build(task_name: str, tokenizer, context: int, seed: int, *, chat: bool = True) -> Sample:
    """Sample `seed` of `task_name` (one of `TASKS`) as a prompt of at most `context` tokens of
    `tokenizer` (a transformers tokenizer), filled as far as whole words allow.

    chat: format it with the tokenizer's chat template (when it has one) as one user message
    and the generation prompt, then the answer prefix; else plain text with the tokenizer's
    special tokens. Deterministic in (task_name, seed, context) for a given tokenizer.
    """
    if task_name not in TASKS:
        raise ValueError(f"task_name={task_name!r}: expected one of {TASKS}")
    for name, value in (("context", context), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name}={value!r}: expected an int >= 0")
    rng = np.random.default_rng([int(seed), TASKS.index(task_name), int(context)])
    spec = _spec(task_name, rng, int(context))
    start = int(rng.integers(len(_sentences())))
    rendered: dict[tuple[int, int], tuple[str, str, list[int]]] = {}

    def render(sentences: int, words: int = 0):
        if (sentences, words) not in rendered:
            document = ("".join(spec.units(sentences)).strip() if spec.units is not None
                        else _document(spec, start, sentences, words))
            rendered[sentences, words] = (document, *_render(tokenizer, spec, document, chat))
        return rendered[sentences, words]

    def fits(sentences: int, words: int = 0) -> bool:
        return len(render(sentences, words)[2]) <= context

    if not fits(0):
        raise ValueError(f"context={context} is too short for task {task_name!r}: its prompt "
                         f"without any haystack takes {len(render(0)[2])} tokens of this "
                         "tokenizer")
    # a first guess of the units that fit, then a search around it with each try measured
    base = len(render(0)[2])
    room = context - base
    if spec.units is None:
        # sentences counted alone miss how tokens join across their boundaries: scale the
        # count by what one measured prompt shows
        cum = _sentence_tokens(tokenizer, start, room)
        first = max(1, int(np.searchsorted(cum, room, side="right")))
        scale = (len(render(first)[2]) - base) / cum[first - 1]
        guess = max(1, int(np.searchsorted(cum * scale, room, side="right")))
    else:
        probe = 64
        guess = max(1, int(probe * room / max(1, len(render(probe)[2]) - base)))
    sentences = _largest(fits, guess, max(1, guess // 512))
    words = 0
    if spec.units is None:      # then as many words of the next sentence as fit
        tail = len(_sentences()[(start + sentences) % len(_sentences())].split())
        left = context - len(render(sentences)[2])
        words = _largest(lambda w: w < tail and fits(sentences, w),
                         min(tail - 1, max(0, left * 2 // 3)), 1)
    document, text, ids = render(sentences, words)
    answer_tokens = len(tokenizer(" " + ", ".join(spec.answers), add_special_tokens=False)
                        ["input_ids"])
    return Sample(task=task_name, prompt_ids=np.asarray(ids, np.int32), answers=list(spec.answers),
                  prompt=text, document=document, needles=spec.needles, context=int(context),
                  seed=int(seed), max_new_tokens=answer_tokens + ANSWER_MARGIN_TOKENS)


def right_pad(rows: Sequence[np.ndarray], pad_id: int = 0, length: int | None = None):
    """Token rows right-padded for `sparsejax.generate`: ids [B, T] int32 (T = `length`,
    default the longest row), lengths [B] int32."""
    lengths = np.asarray([len(r) for r in rows], np.int32)
    T = int(lengths.max()) if length is None else length
    if lengths.max() > T:
        raise ValueError(f"length={T} is shorter than the longest prompt ({lengths.max()})")
    ids = np.full((len(rows), T), pad_id, np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    return ids, lengths


def prompt_batch(samples: Sequence[Sample], pad_id: int = 0, length: int | None = None):
    """The samples' prompts right-padded (`right_pad`)."""
    return right_pad([s.prompt_ids[:s.length] for s in samples], pad_id, length)
