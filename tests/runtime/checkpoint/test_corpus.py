import pytest

from mtp_runtime.checkpoint.corpus import corpus_files, corpus_texts


def test_split_is_fixed_and_disjoint():
    train, heldout = corpus_files("train"), corpus_files("heldout")
    assert train == corpus_files("train")
    assert not set(train) & set(heldout)
    assert 0.05 < len(heldout) / (len(train) + len(heldout)) < 0.15
    assert not any("site-packages" in p.parts for p in train)


def test_max_bytes():
    texts = corpus_texts("heldout", max_bytes=100_000)
    assert 0 < sum(len(t.encode()) for t in texts) <= 100_000
    assert corpus_texts("heldout", max_bytes=100_000) == texts
    assert len("".join(corpus_texts("train", max_bytes=10))) <= 10


def test_bad_split():
    with pytest.raises(ValueError, match="split must be one of"):
        corpus_files("test")
