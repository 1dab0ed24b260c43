"""Tests for data.py: tokenizers, the corpus cache, and layout-independent, resumable batch sampling."""

import os

import numpy as np
import pytest
import torch

import data

# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tokenizer = data.get_tokenizer("byte")
    assert tokenizer.name == "byte" and tokenizer.vocab_size == 256
    text = "def f(x):\n    return x  # ünïcödé ✓ 🐍\n"
    tokens = tokenizer.encode(text)
    assert tokens == list(text.encode("utf-8"))
    assert tokenizer.decode(tokens) == text
    # Half of a multi-byte character (a model can emit one) decodes to U+FFFD instead of raising.
    assert tokenizer.decode([0xF0, 0x9F]) == "\ufffd"


def test_gpt2_tokenizer_works_or_explains():
    """With tiktoken's files present it must work; without them (no network here) it must say what to do."""
    try:
        tokenizer = data.get_tokenizer("gpt2")
    except RuntimeError as error:
        assert "--tokenizer" in str(error)
        return
    assert tokenizer.vocab_size == 50257 and tokenizer.eot_token == 50256
    text = "hello world <|endoftext|> is ordinary text here"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_gpt2_tokenizer_error_message(monkeypatch):
    import tiktoken

    def offline(name):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "/some/cache")
    with pytest.raises(RuntimeError) as info:
        data.get_tokenizer("gpt2")
    message = str(info.value)
    assert "--tokenizer gpt2" in message
    assert "TIKTOKEN_CACHE_DIR" in message and "/some/cache" in message
    assert "--tokenizer byte" in message
    assert isinstance(info.value.__cause__, ConnectionError)


def test_unknown_tokenizer():
    with pytest.raises(ValueError, match="--tokenizer"):
        data.get_tokenizer("sentencepiece")


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------


def test_prepare_corpus_from_file_and_reuse(tmp_path):
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    cache = tmp_path / "cache"

    logs = []
    corpus = data.prepare_corpus(str(path), "byte", str(cache), val_fraction=0.1, log=logs.append)
    total = len(text.encode("utf-8"))
    assert corpus.vocab_size == 256 and corpus.tokenizer_name == "byte"
    assert corpus.num_val_tokens == round(total * 0.1)
    assert corpus.num_train_tokens + corpus.num_val_tokens == total
    train, val = data.TokenFile(corpus.train_path), data.TokenFile(corpus.val_path)
    assert len(train) == corpus.num_train_tokens and len(val) == corpus.num_val_tokens
    # The split is a plain cut: train then val gives back the text's bytes in order.
    joined = np.concatenate([train[:], val[:]])
    assert bytes(joined.astype(np.uint8)) == text.encode("utf-8")
    assert any("tokenized 100%" in line for line in logs)
    # Only the finished directory is left: the temporary one was renamed into place.
    assert [p.name for p in cache.iterdir()] == [os.path.basename(os.path.dirname(corpus.train_path))]

    # Second call: same inputs, so the cache is reused and nothing is rewritten.
    mtime = os.stat(corpus.train_path).st_mtime_ns
    logs.clear()
    again = data.prepare_corpus(str(path), "byte", str(cache), val_fraction=0.1, log=logs.append)
    assert again == corpus
    assert os.stat(corpus.train_path).st_mtime_ns == mtime
    assert any("reusing" in line for line in logs) and not any("tokenized" in line for line in logs)

    # A different val_fraction is a different cache entry.
    other = data.prepare_corpus(str(path), "byte", str(cache), val_fraction=0.2, log=logs.append)
    assert other.train_path != corpus.train_path


def test_prepare_corpus_splits_large_file_at_line_ends(tmp_path, monkeypatch):
    """Chunked reading must not lose or duplicate text, including multi-byte characters near a cut."""
    monkeypatch.setattr(data, "READ_CHUNK_BYTES", 64)
    text = "".join(f"{i} héllo wörld ✓\n" for i in range(300))
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    corpus = data.prepare_corpus(str(path), "byte", str(tmp_path / "cache"), log=lambda _: None)
    joined = np.concatenate([data.TokenFile(corpus.train_path)[:], data.TokenFile(corpus.val_path)[:]])
    assert bytes(joined.astype(np.uint8)).decode("utf-8") == text


def test_prepare_corpus_missing_file(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="--data") as info:
        data.prepare_corpus(str(missing), "byte", str(tmp_path / "cache"), log=lambda _: None)
    assert str(missing) in str(info.value)
    with pytest.raises(ValueError, match="--data"):
        data.prepare_corpus(str(tmp_path), "byte", str(tmp_path / "cache"), log=lambda _: None)  # a directory


def test_prepare_corpus_default_stdlib(tmp_path):
    logs = []
    corpus = data.prepare_corpus(None, "byte", str(tmp_path), log=logs.append)
    assert "stdlib" in logs[0]
    assert corpus.num_train_tokens > 1_000_000 and corpus.num_val_tokens > 10_000
    # Roughly every 10%, not once per file.
    assert 5 <= sum("tokenized" in line for line in logs) <= 12
    text = data.get_tokenizer("byte").decode(data.TokenFile(corpus.train_path)[:2000].tolist())
    assert "# ==== " in text  # the separator between files


# --------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def tokens(tmp_path):
    # Token i is (7i + i // 256) mod 256: varied enough that different windows hold different tokens.
    values = (np.arange(10_000) * 7 + np.arange(10_000) // 256).astype(np.uint16) % 256
    path = tmp_path / "tokens.bin"
    values.tofile(path)
    return data.TokenFile(str(path))


def _global_batch(sampler, tokens, step, dp_size, micro_batch):
    """Reassemble a step's global batch from every (rank, micro-batch) piece, in rank-then-micro order."""
    xs, ys = [], []
    for rank in range(dp_size):
        for micro in range(sampler.global_batch // dp_size // micro_batch):
            x, y = sampler.get_batch(tokens, step, rank, dp_size, micro_batch, micro)
            assert x.dtype == torch.int64 and x.shape == (micro_batch, sampler.seq_len)
            xs.append(x)
            ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def test_same_global_batch_for_every_layout(tokens):
    sampler = data.BatchSampler(len(tokens), seq_len=32, global_batch=8, seed=1234)
    for step in (0, 1, 17):
        reference_x, reference_y = _global_batch(sampler, tokens, step, dp_size=1, micro_batch=8)
        # The reference itself is the windows at the global offsets, y shifted by one token.
        offsets = sampler.global_offsets(step)
        assert offsets.min() >= 0 and offsets.max() <= len(tokens) - 32 - 1
        for row, offset in enumerate(offsets.tolist()):
            window = torch.from_numpy(tokens[offset : offset + 33].astype(np.int64))
            assert torch.equal(reference_x[row], window[:-1]) and torch.equal(reference_y[row], window[1:])
        for dp_size, micro_batch in [(1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)]:
            x, y = _global_batch(sampler, tokens, step, dp_size, micro_batch)
            assert torch.equal(x, reference_x) and torch.equal(y, reference_y), (dp_size, micro_batch)


def test_batches_depend_only_on_seed_and_step(tokens):
    a = data.BatchSampler(len(tokens), seq_len=16, global_batch=4, seed=0)
    b = data.BatchSampler(len(tokens), seq_len=16, global_batch=4, seed=0)
    assert torch.equal(a.global_offsets(5), b.global_offsets(5))
    assert not torch.equal(a.global_offsets(0), a.global_offsets(1))
    assert not torch.equal(a.global_offsets(0), data.BatchSampler(len(tokens), 16, 4, seed=1).global_offsets(0))


def test_resume_continues_with_identical_batches(tokens):
    def run(sampler, steps):
        return [sampler.get_batch(tokens, sampler.next_step(), 0, 1, 4, 0)[0] for _ in range(steps)]

    uninterrupted = run(data.BatchSampler(len(tokens), 16, 4, seed=7), 6)

    first = data.BatchSampler(len(tokens), 16, 4, seed=7)
    before = run(first, 3)
    state = first.state_dict()
    assert state == {"step": 3, "seed": 7, "global_batch": 4, "seq_len": 16}

    resumed = data.BatchSampler(len(tokens), 16, 4, seed=7)
    resumed.load_state_dict(state)
    after = run(resumed, 3)
    assert all(torch.equal(p, q) for p, q in zip(before + after, uninterrupted))

    with pytest.raises(ValueError, match="seed"):
        data.BatchSampler(len(tokens), 16, 4, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        data.BatchSampler(len(tokens), 32, 4, seed=7).load_state_dict(state)


def test_bad_divisibility_raises(tokens):
    sampler = data.BatchSampler(len(tokens), seq_len=16, global_batch=6, seed=0)
    with pytest.raises(ValueError, match="--global-batch"):
        sampler.get_batch(tokens, 0, dp_rank=0, dp_size=4, micro_batch=1, micro_index=0)
    with pytest.raises(ValueError, match="--micro-batch"):
        sampler.get_batch(tokens, 0, dp_rank=0, dp_size=2, micro_batch=2, micro_index=0)
    with pytest.raises(ValueError, match="micro-batch index"):
        sampler.get_batch(tokens, 0, dp_rank=0, dp_size=2, micro_batch=3, micro_index=1)


def test_eval_batches_are_deterministic_and_layout_independent(tokens):
    sampler = data.EvalSampler(len(tokens), seq_len=32, global_batch=8)
    assert sampler.num_batches == (len(tokens) - 1) // 32 // 8
    reference_x, reference_y = _global_batch(sampler, tokens, 2, dp_size=1, micro_batch=8)
    # Batch 2 is the 8 consecutive, non-overlapping windows after batches 0 and 1.
    start = 2 * 8 * 32
    expected = torch.from_numpy(tokens[start : start + 8 * 32 + 1].astype(np.int64))
    assert torch.equal(reference_x.flatten(), expected[:-1])
    for dp_size, micro_batch in [(2, 2), (4, 1), (8, 1)]:
        x, y = _global_batch(sampler, tokens, 2, dp_size, micro_batch)
        assert torch.equal(x, reference_x) and torch.equal(y, reference_y)
    with pytest.raises(ValueError, match="out of range"):
        sampler.global_offsets(sampler.num_batches)


def test_prefetched_batches_are_the_ones_read_in_step_order():
    """The read-ahead hands back exactly read(step) for each step (a resumed run starts late), reads each step
    once, in order, and never reads past the last step."""
    from data import Prefetcher

    reads = []

    def read(step):
        reads.append(step)
        x = torch.arange(6).view(2, 3) + 10 * step
        return [(x, x + 1, None), (x * 2, x * 2 + 1, torch.arange(3))]

    batches = Prefetcher(read, "cpu", last_step=6)
    for step in range(3, 7):
        (x, y, pos), (x2, y2, pos2) = batches.get(step)
        expected = torch.arange(6).view(2, 3) + 10 * step
        assert torch.equal(x, expected) and torch.equal(y, expected + 1) and pos is None
        assert torch.equal(x2, expected * 2) and torch.equal(y2, expected * 2 + 1)
        assert torch.equal(pos2, torch.arange(3))
    batches.close()
    assert reads == [3, 4, 5, 6]
