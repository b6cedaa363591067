"""Reading your own documents for the fitting jobs (`sparsejax.train.documents`)."""
import json

import numpy as np
import pytest

from sparsejax.train import documents as D


class CharTokenizer:
    """One token per character (its code point), BOS 1, pad 0: windows are easy to count."""
    bos_token_id = 1
    pad_token_id = 0

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_txt_is_one_document_whatever_its_blank_lines(tmp_path):
    text = "First paragraph.\n\nSecond paragraph,\nsame document.\n\n\nThird.\n"
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.md").write_text("another file")
    assert D.read_documents([tmp_path / "a.txt", tmp_path / "b.md"]) == [text, "another file"]


def test_jsonl_reads_the_text_field_of_each_line(tmp_path):
    rows = [{"text": "one", "id": 1}, {"text": "two\n\nlines"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert D.read_documents([tmp_path / "d.jsonl"]) == ["one", "two\n\nlines"]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object with a string "
                                         r"\"text\" field"):
        D.read_documents([tmp_path / "bad.jsonl"])
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2 is not JSON"):
        D.read_documents([tmp_path / "broken.jsonl"])


@pytest.mark.parametrize("name,content", [("empty.txt", ""), ("blank.txt", "\n  \n"),
                                          ("empty.jsonl", "\n"),
                                          ("blank.jsonl", '{"text": "  "}\n')])
def test_a_file_without_text_is_refused(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=rf"--text '.*{name}' holds no text"):
        D.read_documents([tmp_path / name])


def test_missing_file_and_directory_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        D.read_documents([tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match="is a directory"):
        D.read_documents([tmp_path])
    with pytest.raises(ValueError, match="at least one file"):
        D.read_documents([])


def test_windows_of_long_and_short_documents():
    """A 25-character document in 10-token windows (BOS + 9 characters): 9 + 9 + 7 characters;
    a 5-character one: one short window; windows round-robin over the documents."""
    long, short = "abcdefghijklmnopqrstuvwxy", "12345"
    ids, lengths = D.token_windows([long, short], CharTokenizer(), 10, min_tokens=3)
    want = [long[0:9], short, long[9:18], long[18:25]]
    assert lengths.tolist() == [1 + len(w) for w in want]
    assert ids.shape == (4, 10)
    for row, w in zip(ids, want):
        np.testing.assert_array_equal(row, [1] + [ord(c) for c in w] + [0] * (9 - len(w)))


def test_windows_below_min_tokens_are_dropped_and_count_spreads_the_choice():
    text = "x" * 95        # windows of 1 + 9: ten full windows and a tail of 5 characters
    ids, lengths = D.token_windows([text], CharTokenizer(), 10, min_tokens=8)
    assert lengths.tolist() == [10] * 10           # the 6-token tail is under min_tokens
    doc = "".join(chr(65 + i) * 9 for i in range(10))   # window i holds letter i
    ids, _ = D.token_windows([doc], CharTokenizer(), 10, count=3)
    assert [chr(r[1]) for r in ids] == ["A", "E", "J"]   # windows 0, 4.5 -> 4, 9: spread out
    with pytest.raises(ValueError, match=r"no window of 64 tokens or more \(the longest has 5"):
        D.token_windows(["short"], CharTokenizer(), 128)


@pytest.mark.parametrize("kw,match", [(dict(context=1), "context=1"),
                                      (dict(context=8, count=0), "count=0")])
def test_window_arguments_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        D.token_windows(["text"], CharTokenizer(), **kw)
