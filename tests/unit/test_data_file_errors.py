"""Bad ``data=files`` inputs fail with one short ConfigError naming the file and the line or byte,
before ``datasets`` (whose own tracebacks run 48-84 lines and name neither) reads them."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from merak.config import ConfigError
from recipes import text
from recipes.gpt import data as gpt_data

REPO = Path(__file__).resolve().parents[2]
SENTENCE = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    """datasets' own cache of the files it read goes to the test's folder, not the user's."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def _prepare(tmp_path: Path, path: Path, text_column: str = "text") -> str:
    model_cfg = OmegaConf.load(REPO / "recipes/gpt/conf/model/toy.yaml")
    data_cfg = OmegaConf.merge(OmegaConf.load(REPO / "recipes/gpt/conf/data/files.yaml"),
                               {"files": [str(path)], "text_column": text_column,
                                "cache_dir": str(tmp_path / "cache")})
    return gpt_data.prepare(data_cfg, model_cfg)


def _error(tmp_path: Path, path: Path, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        _prepare(tmp_path, path, **kwargs)
    message = str(caught.value)
    assert str(path) in message and len(message.splitlines()) == 2, message  # the header, one problem
    assert not list((tmp_path / "cache").glob("*.npy"))  # no token cache from a bad file
    return message.splitlines()[-1]


def _write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def _jsonl(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_empty_txt(tmp_path):
    assert _error(tmp_path, _write(tmp_path / "empty.txt", "")).endswith("empty.txt: is empty (0 bytes)")


def test_blank_txt(tmp_path):
    line = _error(tmp_path, _write(tmp_path / "blank.txt", "\n  \n\n"))
    assert line.endswith("blank.txt: no text (3 lines, all blank or empty)")


def test_empty_jsonl(tmp_path):
    assert _error(tmp_path, _write(tmp_path / "empty.jsonl", "")).endswith("empty.jsonl: is empty (0 bytes)")


def test_non_utf8_txt_names_the_byte(tmp_path):
    good = f"{SENTENCE}\n".encode()
    path = _write(tmp_path / "latin1.txt", good + good + "caf\u00e9 au lait\n".encode("latin-1"))
    line = _error(tmp_path, path)
    offset = 2 * len(good) + 3  # the é, one latin-1 byte 0xe9
    assert f"latin1.txt: not UTF-8 at byte {offset} (line 3): cannot decode 0xe9" in line


def test_malformed_jsonl_names_the_line(tmp_path):
    path = _write(tmp_path / "bad.jsonl", _jsonl({"text": SENTENCE}, {"text": SENTENCE}) + '{"text": "x",}\n')
    line = _error(tmp_path, path)
    assert "bad.jsonl: line 3 is not valid JSON: Expecting property name enclosed in double quotes" in line


def test_json_lines_that_are_not_objects(tmp_path):
    path = _write(tmp_path / "values.json", _jsonl({"text": SENTENCE}, SENTENCE, [1, 2]))
    line = _error(tmp_path, path)
    assert "values.json: line 2 is a string, not a JSON object" in line


def test_json_text_that_is_not_a_string(tmp_path):
    path = _write(tmp_path / "numbers.jsonl", _jsonl({"text": SENTENCE}, {"text": 7}))
    assert "numbers.jsonl: line 2: the text column 'text' holds a number, not a string" in _error(tmp_path, path)


def test_jsonl_without_the_text_column(tmp_path):
    path = _write(tmp_path / "body.jsonl", _jsonl({"id": 1, "body": SENTENCE}))
    line = _error(tmp_path, path)
    assert "body.jsonl: data.text_column='text' is not a column; columns: id, body" in line


def test_csv_with_a_ragged_row(tmp_path):
    path = _write(tmp_path / "ragged.csv", f'id,title,text\n1,a,"{SENTENCE}"\n2,b,{SENTENCE}, and more\n3,c,x\n')
    line = _error(tmp_path, path)
    assert "ragged.csv: line 3 has 4 fields, the header (line 1) has 3" in line


def test_csv_ragged_row_after_a_multi_line_field(tmp_path):
    path = _write(tmp_path / "multi.csv", f'id,text\n1,"{SENTENCE}\nsecond line"\n2,a,b\n')
    assert "multi.csv: line 4 has 3 fields, the header (line 1) has 2" in _error(tmp_path, path)


def test_csv_without_the_text_column(tmp_path):
    path = _write(tmp_path / "body.csv", f"id,body\n1,{SENTENCE}\n")
    line = _error(tmp_path, path)
    assert "body.csv: data.text_column='text' is not a column; columns: id, body" in line


def test_csv_with_an_unclosed_quote(tmp_path):
    path = _write(tmp_path / "quote.csv", f'id,text\n1,"{SENTENCE}\n2,{SENTENCE}\n')
    assert "quote.csv: line 2: a quoted field is not closed before the end of the file" in _error(tmp_path, path)


def test_csv_with_an_empty_text_column(tmp_path):
    path = _write(tmp_path / "hollow.csv", "id,text\n1,\n2, \n")
    assert "hollow.csv: no text in the column 'text' (2 rows, all blank or empty)" in _error(tmp_path, path)


def test_the_bad_file_among_good_ones_is_named(tmp_path):
    good = _write(tmp_path / "good.txt", f"{SENTENCE}\n")
    bad = _write(tmp_path / "bad.txt", b"ok\n\xff\n")
    with pytest.raises(ConfigError, match=r"bad\.txt: not UTF-8 at byte 3 \(line 2\)") as caught:
        text.file_texts([good, bad], "text")
    assert "good.txt" not in str(caught.value)


def test_datasets_failures_name_the_files(tmp_path, monkeypatch):
    """The backstop: whatever datasets raises, the message names the files and the reader's reason."""
    path = _write(tmp_path / "bad.jsonl", '{"text": "a"}\n{"text": "b",}\n')
    monkeypatch.setattr(text, "check_data_file", lambda *args: None)
    with pytest.raises(ConfigError) as caught:
        text.file_texts([path], "text")
    message = str(caught.value)
    assert f"data.files: datasets cannot read {path} as json: " in message
    assert "DatasetGenerationError" not in message  # the reader's own error, not the wrapper's


def test_good_files_still_work(tmp_path):
    """What datasets reads, the checks accept: a BOM, quoted commas and line breaks, blank lines,
    JSON arrays of objects or strings, and text columns with some empty cells."""
    files = {
        "a.csv": f'\ufeffid,title,text\n1,"a, b","{SENTENCE}\nline two"\n\n2,c,\n3,"d ""e""",{SENTENCE}\n',
        "a.jsonl": _jsonl({"text": SENTENCE, "id": 1}, {"text": None}) + "\n" + _jsonl({"text": "third"}),
        "objects.json": json.dumps([{"text": SENTENCE}, {"text": "two"}], indent=2),
        "strings.json": json.dumps([SENTENCE, "two"]),
        "a.txt": f"{SENTENCE}\n\ncaf\u00e9\n",
    }
    expected = {"a.csv": [f"{SENTENCE}\nline two", SENTENCE], "a.jsonl": [SENTENCE, "third"],
                "objects.json": [SENTENCE, "two"], "strings.json": [SENTENCE, "two"],
                "a.txt": [SENTENCE, "caf\u00e9"]}
    for name, content in files.items():
        assert text.file_texts([_write(tmp_path / name, content)], "text") == expected[name], name


def test_good_file_prepares_tokens(tmp_path):
    import numpy as np

    path = _write(tmp_path / "good.jsonl", _jsonl(*({"text": f"{i}: {SENTENCE}"} for i in range(50))))
    tokens = np.load(_prepare(tmp_path, path))
    assert len(tokens) > 400 and (tokens == gpt_data.END_OF_TEXT).sum() == 50


@pytest.mark.timeout(180)
def test_a_run_fails_short_naming_the_file_and_line(tmp_path, monkeypatch):
    """The gpt recipe's run (merak.run, in this process) stops before any worker, with the checks' message and
    no frame of datasets (train.py logs a ConfigError as one message: tests/recipes/test_console.py)."""
    import hydra

    import merak
    from merak.recipe import load_spec

    bad = _write(tmp_path / "bad.jsonl", _jsonl({"text": SENTENCE}, {"text": SENTENCE}) + "{not json}\n")
    monkeypatch.setenv("MERAK_CACHE_DIR", str(tmp_path / "cache"))
    with hydra.initialize_config_dir(config_dir=str(REPO / "recipes/gpt/conf"), version_base=None):
        cfg = hydra.compose("train", overrides=["model=toy", "data=files", f"data.files=['{bad}']",
                                                "trainer.max_steps=1", f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as caught:
        merak.run(load_spec(REPO / "recipes/gpt/train.py"), cfg)
    assert f"{bad}: line 3 is not valid JSON" in str(caught.value)
    printed = "".join(traceback.format_exception(caught.value))
    assert "site-packages/datasets" not in printed and "DatasetGenerationError" not in printed  # never in datasets
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
