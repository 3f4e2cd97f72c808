"""Every --data kind reaches the corpus as documents: text files, JSONL, parquet and saved `datasets` folders."""

import json

import pytest

from trainers.data import DOC_SEPARATOR, check_data, load_corpus
from trainers.documents import is_saved_dataset, source_files

RECORDS = [f"record {i}: " + "lorem ipsum " * 20 for i in range(40)]


def documents_of(corpus) -> list[bytes]:
    return (bytes(corpus.train.tolist()) + DOC_SEPARATOR + bytes(corpus.val.tolist())).split(DOC_SEPARATOR)


def write_jsonl(path, rows, field="text"):
    path.write_text("".join(json.dumps({field: r, "id": i}) + "\n" for i, r in enumerate(rows)))


def test_jsonl_records_are_documents_split_by_the_held_out_rule(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", RECORDS)
    corpus = load_corpus(str(tmp_path / "d.jsonl"))
    assert sorted(documents_of(corpus)) == sorted(r.encode() for r in RECORDS)
    # Every 20th record is held out: 2 of 40.
    assert len(bytes(corpus.val.tolist()).split(DOC_SEPARATOR)) == 2
    assert "40 documents from 1 of 1 sources" in corpus.source and "held out: every 20th document" in corpus.source


def test_the_text_field_is_configurable(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", RECORDS, field="body")
    with pytest.raises(ValueError, match="line 1 has no 'text' field .it has 'body', 'id'.; pass --data-field"):
        check_data(str(tmp_path / "d.jsonl"), 16, 2)
    assert len(documents_of(load_corpus(str(tmp_path / "d.jsonl"), text_field="body"))) == len(RECORDS)


def test_a_parquet_file_is_read(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(
        pa.table({"text": RECORDS, "n": list(range(len(RECORDS)))}), tmp_path / "d.parquet", row_group_size=7
    )
    corpus = load_corpus(str(tmp_path / "d.parquet"))
    assert sorted(documents_of(corpus)) == sorted(r.encode() for r in RECORDS)
    with pytest.raises(ValueError, match="has no 'body' field .it has 'text', 'n'."):
        check_data(str(tmp_path / "d.parquet"), 16, 2, text_field="body")


def test_a_saved_dataset_and_a_dataset_dict_are_read(tmp_path):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"text": RECORDS})
    dataset.save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(3))}).save_to_disk(str(tmp_path / "dd"))
    assert is_saved_dataset(tmp_path / "ds") and is_saved_dataset(tmp_path / "dd")
    for folder in ("ds", "dd"):
        corpus = load_corpus(str(tmp_path / folder))
        assert sorted(documents_of(corpus)) == sorted(r.encode() for r in RECORDS)
    datasets.DatasetDict({"test": dataset}).save_to_disk(str(tmp_path / "no-train"))
    with pytest.raises(ValueError, match="without a 'train' split .it has test."):
        check_data(str(tmp_path / "no-train"), 16, 2)


def test_a_folder_mixes_text_records_and_datasets_in_a_fixed_order(tmp_path):
    datasets = pytest.importorskip("datasets")
    (tmp_path / "b.txt").write_text("plain text " * 30)
    write_jsonl(tmp_path / "a.jsonl", RECORDS[:5])
    datasets.Dataset.from_dict({"text": RECORDS[5:9]}).save_to_disk(str(tmp_path / "c"))
    (tmp_path / ".hidden.txt").write_text("never read")
    sources = source_files(tmp_path)
    assert [p.name for p in sources] == ["a.jsonl", "b.txt", "c"]
    docs = documents_of(load_corpus(str(tmp_path)))
    assert len(docs) == 10 and b"never read" not in b"".join(docs)


def test_the_byte_budget_stops_reading_records(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", RECORDS)
    corpus = load_corpus(str(tmp_path / "d.jsonl"), max_bytes=1000)
    # Each split joins its documents with one separator, so the two splits hold at most two more bytes.
    assert corpus.train_bytes + corpus.val_bytes <= 1000 + 2 * len(DOC_SEPARATOR)
    assert "capped" in corpus.source
