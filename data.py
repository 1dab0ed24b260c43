"""Data: tokenizers, a tokenized corpus on disk, and deterministic batch sampling.

How this axis is parallelised
-----------------------------
Split: the global batch. Every step has one global batch of `global_batch` sequences, chosen by
`BatchSampler` from nothing but (seed, step, global_batch). Data-parallel rank d of dp_size takes
rows [d * B_local, (d + 1) * B_local) of it, B_local = global_batch // dp_size, and reads from disk
only the tokens of those rows. Gradient accumulation cuts a rank's rows once more into micro-batches.
Concatenating the pieces (over ranks, then micro-batches) gives back exactly the global batch, so the
data a run sees is the same for any dp_size and micro-batch split: only the arithmetic is divided.

Replicated: the corpus files, the tokenizer and the sampler's state (seed, cursor). Every rank
computes all `global_batch` start offsets (a few hundred integers, cheap) and keeps its own rows.

Memory: the corpus is tokenized once into uint16 files (`train.bin`, `val.bin`) and opened as a
numpy memmap, never loaded whole; the OS pages in just the windows a batch touches.

Messages: none. Because every rank can compute every batch on its own, this module never
communicates. (Several ranks may call `prepare_corpus` at once: the cache is written atomically, so
they agree on the result; a trainer can still let rank 0 prepare it and the others wait at a barrier.)

Restart: save `BatchSampler.state_dict()` (the cursor: the next step to draw, plus the seed and shapes
it is valid for). The corpus cache needs nothing: it is rebuilt identically, or reused, from the same
inputs. Loading the cursor makes a resumed run draw exactly the batches the uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch

# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------

TOKENIZERS = ("byte", "gpt2")


class ByteTokenizer:
    """Tokens are the text's UTF-8 bytes: no files, no training, and any text round-trips."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        # A model can emit a byte sequence that is not valid UTF-8 (half of a multi-byte character):
        # show it as U+FFFD rather than fail in the middle of sampling.
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50257 tokens) via tiktoken; needs tiktoken's downloaded files."""

    name = "gpt2"
    vocab_size = 50257
    eot_token = 50256  # <|endoftext|>

    def __init__(self, encoding):
        self._encoding = encoding

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: a corpus that happens to contain the text "<|endoftext|>" is tokenized as
        # ordinary text instead of raising (tiktoken's encode() refuses special-token text by default).
        return self._encoding.encode_ordinary(text)

    def decode(self, tokens: list[int]) -> str:
        return self._encoding.decode([int(t) for t in tokens])  # tiktoken decodes with errors="replace"


def _tiktoken_cache_dir() -> str:
    """Where tiktoken looks for its files (mirrors tiktoken.load.read_file_cached)."""
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if variable in os.environ:
            return os.environ[variable]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def get_tokenizer(name: str = "byte") -> ByteTokenizer | GPT2Tokenizer:
    """Return the tokenizer called `name` ("byte" or "gpt2"), with name, vocab_size, encode, decode."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        try:
            import tiktoken

            encoding = tiktoken.get_encoding("gpt2")
        except Exception as error:  # no network, no tiktoken, a corrupt cache: all need the same advice
            raise RuntimeError(
                f"--tokenizer gpt2: could not load tiktoken's GPT-2 BPE files ({type(error).__name__}: {error}). "
                "tiktoken downloads them on first use and this machine cannot. Either run "
                "`python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"` once on a machine with internet, "
                f"copy its tiktoken cache directory here and point TIKTOKEN_CACHE_DIR at it (looked in: "
                f"{_tiktoken_cache_dir()}), or use --tokenizer byte, which needs no files."
            ) from error
        return GPT2Tokenizer(encoding)
    raise ValueError(f"--tokenizer {name!r}: unknown tokenizer, choose one of {', '.join(TOKENIZERS)}")


# --------------------------------------------------------------------------------------------------
# Corpus: text -> train.bin / val.bin (uint16 tokens) in a content-addressed cache directory
# --------------------------------------------------------------------------------------------------

# Bump when the way text becomes tokens changes, so old caches are not silently reused.
CACHE_FORMAT = 1
TOKEN_DTYPE = np.uint16  # every supported vocabulary fits in 16 bits: half the disk and page cache of int32
STDLIB_MAX_BYTES = 8_000_000  # enough text to train on, small enough to tokenize in seconds
READ_CHUNK_BYTES = 1 << 20  # tokenize --data files a chunk at a time so memory stays bounded
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class Corpus:
    """A prepared corpus: where its token files are and what they hold."""

    train_path: str
    val_path: str
    vocab_size: int
    tokenizer_name: str
    num_train_tokens: int
    num_val_tokens: int


class _Source(NamedTuple):
    """Text to tokenize: a description for logs, what identifies it for the cache, and its chunks."""

    description: str
    identity: dict  # hashed into the cache directory name: change it and the cache is rebuilt
    total_bytes: int  # for progress reports
    chunks: Iterator[tuple[str, int]]  # (text, bytes of input it came from); lazy, read only on a miss


def _stdlib_source() -> _Source:
    """The standard library's own .py files, sorted by path, up to STDLIB_MAX_BYTES: a corpus every
    Python install has, so the trainer runs with no download."""
    root = sysconfig.get_paths()["stdlib"]
    candidates = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]  # prune in place: os.walk skips them
        for file in files:
            if file.endswith(".py"):
                candidates.append(os.path.relpath(os.path.join(directory, file), root))
    candidates.sort()  # os.walk order depends on the filesystem; sorted paths make the corpus reproducible

    chosen, total = [], 0  # (relative path, size, mtime) of the first files that fit under the cap
    for relative in candidates:
        try:
            status = os.stat(os.path.join(root, relative))
        except OSError:
            continue
        if total + status.st_size > STDLIB_MAX_BYTES:
            break
        chosen.append((relative, status.st_size, status.st_mtime_ns))
        total += status.st_size

    def chunks() -> Iterator[tuple[str, int]]:
        for relative, size, _ in chosen:
            try:
                with open(os.path.join(root, relative), encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                yield "", size  # unreadable: skip it, but still count it for progress
                continue
            # A visible separator marks where one file ends and the next begins.
            yield f"\n\n# ==== {relative} ====\n\n" + text, size

    description = f"Python stdlib sources ({len(chosen)} files, {total / 1e6:.1f} MB, from {root})"
    identity = {"source": "stdlib", "root": root, "files": chosen}
    return _Source(description, identity, total, chunks())


def _file_source(data_path: str) -> _Source:
    """One UTF-8 text file given with --data, read in chunks that end at line ends."""
    path = os.path.abspath(data_path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"--data {data_path}: no such file")
    if not os.path.isfile(path):
        raise ValueError(f"--data {data_path}: not a regular file (expected one text file)")
    status = os.stat(path)

    def chunks() -> Iterator[tuple[str, int]]:
        with open(path, "rb") as f:
            while True:
                # Finish the current line so no word is cut in two: BPE would tokenize each half apart.
                # Cutting after b"\n" is also safe for UTF-8, where that byte never appears mid-character.
                block = f.read(READ_CHUNK_BYTES) + f.readline()
                if not block:
                    return
                try:
                    text = block.decode("utf-8")
                except UnicodeDecodeError as error:
                    offset = f.tell() - len(block) + error.start
                    raise ValueError(f"--data {data_path}: not UTF-8 text (bad byte at offset {offset})") from error
                yield text, len(block)

    description = f"{path} ({status.st_size / 1e6:.1f} MB)"
    identity = {"source": "file", "path": path, "size": status.st_size, "mtime_ns": status.st_mtime_ns}
    return _Source(description, identity, status.st_size, chunks())


def _tokenize_to_file(source: _Source, tokenizer, out_path: str, log: Callable[[str], None]) -> int:
    """Append the tokens of every chunk of `source` to `out_path`; return how many were written."""
    num_tokens, done_bytes, next_report = 0, 0, 10
    with open(out_path, "wb") as out:
        for text, size in source.chunks:
            tokens = np.asarray(tokenizer.encode(text), dtype=TOKEN_DTYPE)
            tokens.tofile(out)
            num_tokens += len(tokens)
            done_bytes += size
            percent = 100 * done_bytes // max(source.total_bytes, 1)
            if percent >= next_report:  # about every 10%, whatever the chunk sizes
                log(f"data: tokenized {percent}% ({done_bytes / 1e6:.1f} MB, {num_tokens:,} tokens)")
                next_report = (percent // 10 + 1) * 10
    return num_tokens


def prepare_corpus(
    data_path: str | None,
    tokenizer_name: str,
    cache_dir: str,
    val_fraction: float = 0.05,
    log: Callable[[str], None] = print,
) -> Corpus:
    """Tokenize the corpus once into `cache_dir/<name>/{train,val}.bin` and return where it is.

    data_path None uses the Python standard library's sources; otherwise it is one UTF-8 text file.
    The last `val_fraction` of the tokens is the validation split. The subdirectory name is a hash of
    everything the tokens depend on (source identity, tokenizer, val_fraction), so a second call with
    the same inputs reuses the files and a changed input gets a fresh directory.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    source = _stdlib_source() if data_path is None else _file_source(data_path)
    tokenizer = get_tokenizer(tokenizer_name)
    if tokenizer.vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"--tokenizer {tokenizer_name}: vocab_size {tokenizer.vocab_size} does not fit in uint16")

    key = json.dumps(
        {"format": CACHE_FORMAT, "source": source.identity, "tokenizer": tokenizer.name, "val_fraction": val_fraction},
        sort_keys=True,
    )
    name = f"{source.identity['source']}-{tokenizer.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    final_dir = os.path.join(cache_dir, name)
    meta_path = os.path.join(final_dir, "meta.json")

    if not os.path.exists(meta_path):
        log(f"data: tokenizing {source.description} with the {tokenizer.name} tokenizer into {final_dir}")
        _build_cache(source, tokenizer, cache_dir, final_dir, val_fraction, log)
    else:
        log(f"data: reusing cached tokens in {final_dir}")

    with open(meta_path) as f:
        meta = json.load(f)
    return Corpus(
        train_path=os.path.join(final_dir, "train.bin"),
        val_path=os.path.join(final_dir, "val.bin"),
        vocab_size=meta["vocab_size"],
        tokenizer_name=meta["tokenizer_name"],
        num_train_tokens=meta["num_train_tokens"],
        num_val_tokens=meta["num_val_tokens"],
    )


def _build_cache(source: _Source, tokenizer, cache_dir: str, final_dir: str, val_fraction: float, log) -> None:
    """Write train.bin, val.bin and meta.json into a temporary directory, then rename it into place.

    The rename is atomic, so a reader sees either no directory or a complete one: an interrupted run
    leaves only a stray `.tmp-*` directory, and of two concurrent runs the first rename wins.
    """
    os.makedirs(cache_dir, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir)  # same filesystem as final_dir: rename works
    try:
        all_path, train_path = os.path.join(tmp_dir, "all.bin"), os.path.join(tmp_dir, "train.bin")
        num_tokens = _tokenize_to_file(source, tokenizer, all_path, log)
        num_val = round(num_tokens * val_fraction)
        num_train = num_tokens - num_val
        if num_val == 0 or num_train == 0:
            raise ValueError(
                f"corpus {source.description} has only {num_tokens} tokens: too few to split with "
                f"val_fraction {val_fraction}; use a larger --data file"
            )

        # Split without loading: copy the tail into val.bin, then cut it off all.bin, which becomes train.bin.
        tokens = np.memmap(all_path, dtype=TOKEN_DTYPE, mode="r")
        tokens[num_train:].tofile(os.path.join(tmp_dir, "val.bin"))
        del tokens  # close the map before truncating the file under it
        os.truncate(all_path, num_train * np.dtype(TOKEN_DTYPE).itemsize)
        os.rename(all_path, train_path)

        meta = {
            "source": source.description,
            "identity": source.identity,
            "tokenizer_name": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "dtype": np.dtype(TOKEN_DTYPE).name,
            "val_fraction": val_fraction,
            "num_train_tokens": num_train,
            "num_val_tokens": num_val,
        }
        with open(os.path.join(tmp_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)

        try:
            os.replace(tmp_dir, final_dir)
        except OSError:
            # Another run renamed its (identical) directory into place first: keep theirs.
            if not os.path.exists(os.path.join(final_dir, "meta.json")):
                raise
        log(f"data: wrote {num_train:,} train and {num_val:,} val tokens")
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # gone already after a successful rename


class TokenFile:
    """A read-only uint16 memmap of a token file: slicing reads only the pages it touches."""

    def __init__(self, path: str):
        self.path = path
        self.tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index]


# --------------------------------------------------------------------------------------------------
# Batches: which windows of the token file make up a step's global batch, and which rows are mine
# --------------------------------------------------------------------------------------------------


def _local_rows(global_batch: int, dp_rank: int, dp_size: int, micro_batch: int, micro_index: int) -> slice:
    """The rows of the global batch that data rank `dp_rank` uses for micro-batch `micro_index`."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"data rank {dp_rank} is out of range for {dp_size} data-parallel ranks")
    if global_batch % dp_size != 0:
        raise ValueError(f"--global-batch {global_batch} must be divisible by the data-parallel size {dp_size}")
    local_batch = global_batch // dp_size
    if micro_batch < 1 or local_batch % micro_batch != 0:
        raise ValueError(
            f"--micro-batch {micro_batch} must divide the per-rank batch {local_batch} "
            f"(--global-batch {global_batch} / data-parallel size {dp_size})"
        )
    if not 0 <= micro_index < local_batch // micro_batch:
        raise ValueError(f"micro-batch index {micro_index} is out of range ({local_batch // micro_batch} per step)")
    start = dp_rank * local_batch + micro_index * micro_batch
    return slice(start, start + micro_batch)


def _read_windows(tokens: TokenFile, offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x = tokens[o : o + seq_len] and targets y = tokens[o + 1 : o + seq_len + 1] per offset."""
    windows = np.stack([tokens[o : o + seq_len + 1] for o in offsets.tolist()]).astype(np.int64)
    windows = torch.from_numpy(windows)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class BatchSampler:
    """Random training batches where step s's global batch depends only on (seed, s, global_batch).

    Nothing about the run's layout (dp_size, micro-batch) enters the draw, which is why every layout
    trains on the same data, and why resuming needs only the step number (the cursor).
    """

    def __init__(self, num_tokens: int, seq_len: int, global_batch: int, seed: int):
        if num_tokens < seq_len + 2:
            raise ValueError(f"the token file has {num_tokens} tokens: too few for --seq-len {seq_len}")
        if global_batch < 1:
            raise ValueError(f"--global-batch must be positive, got {global_batch}")
        self.num_tokens = num_tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.step = 0  # the cursor: the next step next_step() hands out

    def global_offsets(self, step: int) -> torch.Tensor:
        """Start offsets of the `global_batch` windows of `step`, each in [0, num_tokens - seq_len - 1]."""
        generator = torch.Generator()
        # A fresh generator per step, seeded from (seed, step): step s is drawn identically whether the
        # run got there directly or resumed at it. The modulo keeps huge seeds in manual_seed's range.
        generator.manual_seed((self.seed * 1_000_003 + step) % 2**63)
        # The window also needs the target token after it, so the last valid start is num_tokens - seq_len - 1.
        return torch.randint(0, self.num_tokens - self.seq_len, (self.global_batch,), generator=generator)

    def get_batch(
        self, tokens: TokenFile, step: int, dp_rank: int, dp_size: int, micro_batch: int, micro_index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch `micro_index` of step `step`: int64 (x, y) of shape (micro_batch, seq_len)."""
        if len(tokens) != self.num_tokens:
            raise ValueError(f"sampler built for {self.num_tokens} tokens but {tokens.path} has {len(tokens)}")
        rows = _local_rows(self.global_batch, dp_rank, dp_size, micro_batch, micro_index)
        return _read_windows(tokens, self.global_offsets(step)[rows], self.seq_len)

    def next_step(self) -> int:
        """Return the step to train now and advance the cursor past it."""
        step = self.step
        self.step += 1
        return step

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved step. A different seed or seq_len would silently change the data the run
        sees, so it is refused; a different global batch is allowed (step s then draws the new size)."""
        for field in ("seed", "seq_len"):
            if state[field] != getattr(self, field):
                raise ValueError(
                    f"cannot resume the data sampler: the checkpoint has {field}={state[field]} "
                    f"but this run has {field}={getattr(self, field)}"
                )
        self.step = int(state["step"])


class EvalSampler:
    """Deterministic validation batches: batch i is windows i*global_batch ... of the token file, laid
    end to end without overlap, so `num_batches` batches cover the file (the tail that does not fill a
    batch is left out). Sliced across data ranks and micro-batches exactly like `BatchSampler`."""

    def __init__(self, num_tokens: int, seq_len: int, global_batch: int):
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.num_tokens = num_tokens
        num_windows = (num_tokens - 1) // seq_len  # each window also needs its last target token
        self.num_batches = num_windows // global_batch
        if self.num_batches == 0:
            raise ValueError(
                f"the validation split has {num_tokens} tokens: too few for one batch of "
                f"--global-batch {global_batch} x --seq-len {seq_len}; raise val_fraction or use more data"
            )

    def global_offsets(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_batches:
            raise ValueError(f"validation batch {index} is out of range ({self.num_batches} batches)")
        first = index * self.global_batch
        return torch.arange(first, first + self.global_batch, dtype=torch.long) * self.seq_len

    def get_batch(
        self, tokens: TokenFile, index: int, dp_rank: int, dp_size: int, micro_batch: int, micro_index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch of validation batch `index`: int64 (x, y) of shape (micro_batch, seq_len)."""
        if len(tokens) != self.num_tokens:
            raise ValueError(f"sampler built for {self.num_tokens} tokens but {tokens.path} has {len(tokens)}")
        rows = _local_rows(self.global_batch, dp_rank, dp_size, micro_batch, micro_index)
        return _read_windows(tokens, self.global_offsets(index)[rows], self.seq_len)


class Prefetcher:
    """Micro-batches read ahead: step s+1's are read (and cut by the axes) on a background thread while step s
    trains, into page-locked (pinned) host memory on CUDA, and copied to the device without blocking the host.

        batches = Prefetcher(read, device, last_step)   # read(step) -> [(x, y, pos)] host tensors
        for step in range(start, last_step + 1):
            micro_batches = batches.get(step)            # on the device; step + 1's reading has begun
        batches.close()

    Why: a blocking copy from pageable memory makes the host wait for the transfer, and reading the memmapped
    token file on the training thread leaves the GPU idle meanwhile. From pinned memory the copy is a DMA
    the host does not wait for; PyTorch's pinned-memory allocator keeps a block until the copies that read
    it are done, so the host tensors may be dropped at once. On CPU there is nothing to pin or copy: the
    read-ahead alone remains. The batches are exactly what read(step) returns (a test checks it).
    """

    def __init__(self, read, device, last_step: int):
        self.read, self.device, self.last_step = read, torch.device(device), last_step
        self.pin = self.device.type == "cuda"
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self.pending = {}  # step -> Future of its host batches

    def _host(self, step: int) -> list:
        batches = self.read(step)
        if self.pin:
            batches = [tuple(t.pin_memory() if t is not None else None for t in batch) for batch in batches]
        return batches

    def get(self, step: int) -> list:
        """Step `step`'s micro-batches on the device; starts reading step + 1's."""
        future = self.pending.pop(step, None) or self.pool.submit(self._host, step)
        if step < self.last_step and step + 1 not in self.pending:
            self.pending[step + 1] = self.pool.submit(self._host, step + 1)
        return [tuple(t.to(self.device, non_blocking=self.pin) if t is not None else None for t in batch)
                for batch in future.result()]

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pending = {}

