"""Training and validation data: the on-disk token cache (built in resumable shards, its bytes independent of
the worker count), packed windows, a mixture sampler that is a function of (seed, position), validation streams."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import unicodedata
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from dilforge_shared.configs import DataSource
from dilforge_shared.corpus import iter_located_records, iter_texts
from dilforge_shared.errors import DilforgeError, InputError
from dilforge_shared.families import FAMILIES, Family, detect_family
from dilforge_shared.identity import data_digest
from dilforge_shared.manifest import sha256_file
from dilforge_shared.specials import special_token_in, special_token_pattern, special_tokens
from dilforge_shared.workers import die_with_parent
from tokenizers import Tokenizer

from .config import CptDataSource

if TYPE_CHECKING:  # bpb imports torch: the token cache's worker processes import this module without it
    from dilforge_shared.bpb import TokenStream

log = logging.getLogger("dilforge.cpt.data")

TOKEN_DTYPE = np.uint32
TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize
SAMPLER_BLOCK = 4096
SHARD_CHARS = 4_000_000  # characters of text per shard: the unit of parallel work and of resumption


@dataclass(frozen=True)
class TokenIds:
    """The ids of the tokenizer family's special tokens this stage uses."""

    family: str
    bos: int | None  # before every document (None: the family uses none, e.g. ChatML)
    doc_end: int  # after every document: the packing separator
    pad: int | None  # written into the model config for later stages


def load_tokenizer(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise InputError("no tokenizer.json (a fast HF tokenizer is required)", path=str(folder))
    tok = Tokenizer.from_file(str(path))
    tok.encode_special_tokens = True  # see pack_stream
    return tok


def special_ids(tok: Tokenizer, source: str) -> TokenIds:
    """The family's document separators (InputError naming `source` for an unknown family)."""
    family = detect_family(tok.get_vocab(with_added_tokens=True), source)
    bos = tok.token_to_id(family.bos) if family.bos is not None else None
    return TokenIds(
        family=family.name, bos=bos, doc_end=tok.token_to_id(family.doc_end), pad=tok.token_to_id(family.pad)
    )


class Conversation(str):
    """A document rendered in the chat template (`chat_documents`): its markup is parsed as the control tokens it
    names, where in any other document a control token's text is encoded as text."""

    __slots__ = ()


def chat_documents(
    source: CptDataSource, family: Family, tok: Tokenizer, endpoint_url: str | None
) -> Iterator[Conversation]:
    """Each record of a `chat` corpus as one conversation in the family's chat template, turns filled from its
    fields (NFC). A missing field or a special token in a turn (a forged turn) is an InputError naming file and
    line; a blank answer is skipped."""
    from transformers import PreTrainedTokenizerFast

    renderer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.to_str()))
    specials = special_token_pattern(special_tokens(tok))  # the render parses them: text holding one is that id
    chat = source.chat
    if chat.system_prompt is not None and (token := special_token_in(chat.system_prompt, specials)) is not None:
        raise InputError(f"chat.system_prompt holds the control token {token} of this tokenizer", path=source.uri)
    for file_uri, lineno, record in iter_located_records(source.uri, endpoint_url, **source.bounds):
        fields = {k: unicodedata.normalize("NFC", str(v)) for k, v in record.items() if v is not None}
        try:
            user, answer = chat.user.format_map(fields), chat.assistant.format_map(fields)
        except KeyError as exc:
            raise InputError(
                f"chat: the record has no field {exc.args[0]!r} (fields: {sorted(fields)})", path=file_uri, line=lineno
            ) from None
        if not answer.strip():
            continue
        for text in (user, answer):
            if (token := special_token_in(text, specials)) is not None:
                raise InputError(f"chat: a turn holds the control token {token}", path=file_uri, line=lineno)
        turns = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        if chat.system_prompt is not None:
            turns.insert(0, {"role": "system", "content": chat.system_prompt})
        yield Conversation(renderer.apply_chat_template(turns, chat_template=family.chat_template, tokenize=False))


def batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch


def pack_stream(docs: Iterable[str], tok: Tokenizer, ids: TokenIds, batch_size: int) -> Iterator[np.ndarray]:
    """`[bos] doc doc_end` token runs, one array per encode_batch call.

    Text is encoded as text: `<|eot_id|>` in a document becomes the ids of its characters, never the control token
    (a forged turn or document end); only a `Conversation`'s markup is parsed as control tokens."""
    lead = 0 if ids.bos is None else 1
    for batch in batched(docs, batch_size):
        # one stream is one source, all conversations or none; the flag is not serialised with the tokenizer,
        # so it is set here, in every process
        tok.encode_special_tokens = not isinstance(batch[0], Conversation)
        encs = tok.encode_batch_fast(batch, add_special_tokens=False)
        lengths = [len(e.ids) + lead + 1 for e in encs]
        out = np.empty(sum(lengths), dtype=TOKEN_DTYPE)
        pos = 0
        for enc, n in zip(encs, lengths, strict=False):
            if lead:
                out[pos] = ids.bos
            out[pos + lead : pos + n - 1] = enc.ids
            out[pos + n - 1] = ids.doc_end
            pos += n
        yield out


@dataclass
class TokenFile:
    """A tokenised corpus on disk, cut into windows of seq_len tokens."""

    path: Path
    num_tokens: int
    num_docs: int
    label: str

    def windows(self, seq_len: int) -> int:
        return self.num_tokens // seq_len

    def open(self) -> np.ndarray:
        return np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r", shape=(self.num_tokens,))


CACHE_FORMAT = b"2: special tokens encoded as text"  # change it whenever the tokenisation of a cached entry changes


def cache_key(source: DataSource, tokenizer_json: Path, max_docs: int | None, endpoint_url: str | None) -> str:
    """The entry's name: its source, data, tokenizer and encoding, so an entry of another encoding is never reused."""
    h = hashlib.sha256(CACHE_FORMAT)
    h.update(source.model_dump_json(exclude={"weight", "name"}).encode())
    h.update(data_digest(source.uri, endpoint_url).encode())
    h.update(hashlib.sha256(tokenizer_json.read_bytes()).hexdigest().encode())
    h.update(str(max_docs).encode())
    return h.hexdigest()[:24]


def tokenize_to_file(
    source: DataSource,
    tok: Tokenizer,
    ids: TokenIds,
    cache_dir: Path,
    key: str,
    max_docs: int | None,
    batch_size: int,
    endpoint_url: str | None,
    workers: int = 1,
    shard_chars: int = SHARD_CHARS,
) -> TokenFile:
    """Tokenise a corpus into `<cache_dir>/<key>.u32` (atomic) unless an entry whose tokens match its recorded
    sha256 exists: the cache is restored from S3, so a damaged one is rebuilt with a warning."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path, meta_path = cache_dir / f"{key}.u32", cache_dir / f"{key}.json"
    if meta_path.is_file() and path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            whole = _intact(path, meta["num_tokens"], meta["sha256"])
        except (ValueError, KeyError, TypeError):
            whole = False
        if whole:
            log.info("corpus %s: reusing token cache %s (%d tokens)", source.label, path.name, meta["num_tokens"])
            return TokenFile(path, meta["num_tokens"], meta["num_docs"], source.label)
        log.warning("corpus %s: token cache %s is damaged; tokenising again", source.label, path.name)
    docs = (
        chat_documents(source, FAMILIES[ids.family], tok, endpoint_url)
        if getattr(source, "chat", None) is not None
        else iter_texts(source.uri, source.format, source.text_field, endpoint_url, **source.bounds)
    )
    if max_docs is not None:
        docs = islice(docs, max_docs)
    per_doc = getattr(source, "num_lines_per_document", 1)
    if per_doc > 1:  # every `per_doc` consecutive texts as one document
        docs = (" ".join(group) for group in batched(docs, per_doc))
    shard_dir = cache_dir / f"{key}.shards"
    for stale in cache_dir.glob(f"{key}.tmp*"):  # a build killed while assembling (one builder per folder)
        stale.unlink(missing_ok=True)
    num_docs = 0

    def shard_bytes() -> Iterator[bytes]:  # the shards' files in stream order, each as it is finished
        nonlocal num_docs
        for shard in build_shards(docs, tok, ids, shard_dir, batch_size, workers, shard_chars, source.label):
            num_docs += shard.num_docs
            with open(shard_dir / shard_file(shard.index), "rb") as part:
                yield from iter(lambda: part.read(1 << 24), b"")

    sha256 = _write_tokens(path, shard_bytes())
    num_tokens = path.stat().st_size // TOKEN_BYTES
    write_json(meta_path, {"num_tokens": num_tokens, "num_docs": num_docs, "source": source.uri, "sha256": sha256})
    shutil.rmtree(shard_dir, ignore_errors=True)
    log.info("corpus %s: tokenised %d documents into %d tokens", source.label, num_docs, num_tokens)
    return TokenFile(path, num_tokens, num_docs, source.label)


# ---- the sharded build ------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """One finished shard: `shard-<index>.u32` in the shard folder holds the packed tokens of documents
    [first_doc, first_doc + num_docs) of the stream; its sidecar `<file>.json` records this."""

    index: int
    first_doc: int
    num_docs: int
    num_tokens: int
    sha256: str


def shard_file(index: int) -> str:
    return f"shard-{index:06d}.u32"


def build_shards(
    docs: Iterable[str],
    tok: Tokenizer,
    ids: TokenIds,
    shard_dir: Path,
    batch_size: int,
    workers: int,
    shard_chars: int,
    label: str,
) -> Iterator[Shard]:
    """The stream's shards in order, each tokenised by one of `workers` processes (in this one when 1).

    A shard ends at the document that brings it to `shard_chars` characters, so its contents depend only on the
    stream; one whose sidecar names the same documents and matches its bytes is done, so an interrupted build
    resumes (whatever shard size or token width built it). At most `workers + 2` shards of text are held in memory."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    for stale in shard_dir.glob("*.tmp*"):  # written by a build that was killed
        stale.unlink(missing_ok=True)
    reused = 0
    pool = _pool(tok, ids, workers) if workers > 1 else None
    queue: deque = deque()  # (index, Shard or its future), in stream order
    try:
        for index, first_doc, texts in _cut(docs, shard_chars):
            shard = _finished(shard_dir, index, first_doc, len(texts))
            if shard is not None:
                reused += 1
            elif pool is None:
                shard = tokenize_shard(texts, tok, ids, batch_size, shard_dir, index, first_doc)
            else:
                shard = pool.submit(_tokenize_in_worker, texts, batch_size, shard_dir, index, first_doc)
            queue.append((index, shard))
            while queue and (len(queue) > workers + 1 or isinstance(queue[0][1], Shard)):
                yield _result(*queue.popleft())
        while queue:
            yield _result(*queue.popleft())
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    if reused:
        log.info("corpus %s: %d of %d shards reused from an interrupted build", label, reused, index + 1)


def _cut(docs: Iterable[str], shard_chars: int) -> Iterator[tuple[int, int, list[str]]]:
    """(index, first document, documents) of consecutive shards of about `shard_chars` characters."""
    index = first = size = 0
    texts: list[str] = []
    for doc in docs:
        texts.append(doc)
        size += len(doc)
        if size >= shard_chars:
            yield index, first, texts
            index, first, size, texts = index + 1, first + len(texts), 0, []
    if texts:
        yield index, first, texts


def tokenize_shard(
    texts: list[str],
    tok: Tokenizer,
    ids: TokenIds,
    batch_size: int,
    shard_dir: Path,
    index: int,
    first_doc: int,
) -> Shard:
    """Pack one shard's documents into its file, then its sidecar."""
    path = shard_dir / shard_file(index)
    sha256 = _write_tokens(path, (chunk.tobytes() for chunk in pack_stream(texts, tok, ids, batch_size)))
    shard = Shard(index, first_doc, len(texts), path.stat().st_size // TOKEN_BYTES, sha256)
    write_json(path.with_name(f"{path.name}.json"), asdict(shard))
    return shard


def _finished(shard_dir: Path, index: int, first_doc: int, num_docs: int) -> Shard | None:
    """The shard at `index` if its sidecar describes these documents and its file matches it, else None."""
    path = shard_dir / shard_file(index)
    try:
        shard = Shard(**json.loads(path.with_name(f"{path.name}.json").read_text()))
        whole = (shard.index, shard.first_doc, shard.num_docs) == (index, first_doc, num_docs) and _intact(
            path, shard.num_tokens, shard.sha256
        )
    except (OSError, ValueError, TypeError):
        return None
    return shard if whole else None


def _intact(path: Path, num_tokens: int, sha256: str) -> bool:
    """The token file holds `num_tokens` tokens whose bytes hash to `sha256` (OSError when it is missing)."""
    return path.stat().st_size == num_tokens * TOKEN_BYTES and sha256_file(path) == sha256


def _write_tokens(path: Path, chunks: Iterable[bytes]) -> str:
    """`chunks` into `path` atomically (temporary name, fsync, rename); their sha256."""
    tmp, digest = path.with_suffix(f".tmp{os.getpid()}"), hashlib.sha256()
    with open(tmp, "wb") as f:
        for raw in chunks:
            f.write(raw)
            digest.update(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return digest.hexdigest()


def write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _pool(tok: Tokenizer, ids: TokenIds, workers: int):
    """`workers` spawned processes, each holding the tokenizer and encoding on one thread.

    Spawned, not forked: the stage may already hold CUDA and process-group threads; a worker imports only this
    module, not torch. An executor, so a dead worker raises BrokenProcessPool instead of hanging."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(os.getpid(), tok.to_str(), ids),
    )


def _result(index: int, shard) -> Shard:
    """The finished shard, waiting for its worker when it is still a future."""
    from concurrent.futures.process import BrokenProcessPool

    if isinstance(shard, Shard):
        return shard
    try:
        return shard.result()
    except BrokenProcessPool:
        raise DilforgeError(
            f"a tokenizer worker died while tokenising shard {index} (killed, e.g. out of memory: "
            "lower cpt.tokenize_workers; or it failed to start: see the error above); a rerun "
            "resumes from the finished shards"
        ) from None


_WORKER: tuple | None = None


def _init_worker(parent: int, tok_json: str, ids: TokenIds) -> None:
    global _WORKER  # noqa: PLW0603 - the worker process's tokenizer, built once
    die_with_parent(parent)  # a stage killed even by `kill -9` leaves no tokenising worker behind
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER = (Tokenizer.from_str(tok_json), ids)


def _tokenize_in_worker(texts: list[str], batch_size: int, shard_dir: Path, index: int, first_doc: int) -> Shard:
    tok, ids = _WORKER
    return tokenize_shard(texts, tok, ids, batch_size, shard_dir, index, first_doc)


def write_ready(path: Path, files: list[TokenFile] | None, error: str | None = None) -> None:
    """The builder's word to the processes waiting on its cache folder: the finished files, or its error."""
    write_json(path, {"files": [{**asdict(tf), "path": str(tf.path)} for tf in files or []], "error": error})


def wait_ready(path: Path, poll_s: float = 1.0) -> list[TokenFile]:
    """The builder's files once its ready marker appears (its error raised here). No collective is held, so a
    long build cannot time out the process group."""
    waited = 0.0
    while not path.is_file():
        time.sleep(poll_s)
        waited += poll_s
        if waited % 300 < poll_s:
            log.info("waiting for the token cache (%s), %.0f s so far", path.parent, waited)
    ready = json.loads(path.read_text())
    if ready["error"] is not None:
        raise DilforgeError(f"the token cache builder failed: {ready['error']}")
    return [TokenFile(**{**e, "path": Path(e["path"])}) for e in ready["files"]]


class MixtureSampler:
    """Global sequence of (corpus, window) picks: the corpus of positions [b·B, (b+1)·B) from rng(seed, b), windows
    by rng(seed, corpus, epoch).permutation. State = position + per-corpus cursors."""

    def __init__(self, num_windows: list[int], weights: list[float], seed: int):
        self.num_windows = num_windows
        total = float(sum(weights))
        self.p = np.asarray([w / total for w in weights])
        self.seed = seed
        self.position = 0
        self.cursors = [0] * len(num_windows)
        self._block: tuple[int, np.ndarray] | None = None
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def _choices(self, block: int) -> np.ndarray:
        if self._block is None or self._block[0] != block:
            choices = np.random.default_rng([self.seed, 0, block]).choice(len(self.p), size=SAMPLER_BLOCK, p=self.p)
            self._block = (block, choices)
        return self._block[1]

    def _perm(self, corpus: int, epoch: int) -> np.ndarray:
        cached = self._perms.get(corpus)
        if cached is None or cached[0] != epoch:
            perm = np.random.default_rng([self.seed, 1 + corpus, epoch]).permutation(self.num_windows[corpus])
            self._perms[corpus] = cached = (epoch, perm)
        return cached[1]

    def next(self) -> tuple[int, int]:
        block, offset = divmod(self.position, SAMPLER_BLOCK)
        corpus = int(self._choices(block)[offset])
        epoch, index = divmod(self.cursors[corpus], self.num_windows[corpus])
        window = int(self._perm(corpus, epoch)[index])
        self.cursors[corpus] += 1
        self.position += 1
        return corpus, window

    def take(self, n: int) -> list[tuple[int, int]]:
        return [self.next() for _ in range(n)]

    def state_dict(self) -> dict:
        return {"position": self.position, "cursors": list(self.cursors)}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.cursors = [int(c) for c in state["cursors"]]


class PackedData:
    """Windows of every corpus, sampled by the mixture; each rank reads only its share of a step."""

    def __init__(self, files: list[TokenFile], weights: list[float], seq_len: int, seed: int):
        for tf in files:
            if tf.windows(seq_len) == 0:
                raise InputError(
                    f"corpus has {tf.num_tokens} tokens ({tf.num_docs} documents), fewer than one "
                    f"training window of seq_len={seq_len}; add text or lower seq_len",
                    path=tf.label,
                )
        self.files, self.seq_len = files, seq_len
        self.arrays = [tf.open() for tf in files]
        self.sampler = MixtureSampler([tf.windows(seq_len) for tf in files], weights, seed)

    def window(self, corpus: int, index: int) -> np.ndarray:
        start = index * self.seq_len
        return np.asarray(self.arrays[corpus][start : start + self.seq_len], dtype=np.int64)

    def next_step(self, global_batch: int, micro_batch: int, rank: int, world: int) -> list[np.ndarray]:
        """This rank's [accum] arrays of [micro, seq_len] for one step: sample i goes to micro-step
        i // (micro·world), rank (i // micro) % world, so the global batch does not depend on the process count."""
        picks, first = self.sampler.take(global_batch), rank * micro_batch
        return [
            np.stack([self.window(c, w) for c, w in picks[start + first : start + first + micro_batch]])
            for start in range(0, global_batch, micro_batch * world)
        ]


@dataclass(frozen=True)
class ValidationSet:
    """One validation text set as a token stream (`dilforge_shared.bpb`), under its report name."""

    name: str
    stream: TokenStream


def build_validation(
    sources: list[DataSource],
    tok: Tokenizer,
    ids: TokenIds,
    max_docs: int,
    endpoint_url: str | None,
    encode: Callable[[list[str]], list[list[int]]] | None = None,
) -> list[ValidationSet]:
    """The first `max_docs` documents of each source (distinct labels: config.py), framed by the family's
    separators; `encode` replaces the tokenizer's (the leakage probe encodes with the base tokenizer, in the stage's
    ids)."""
    from dilforge_shared.bpb import build_stream

    tok.encode_special_tokens = True  # text is text, whatever pack_stream last set for a conversation corpus
    encode = encode or (lambda docs: [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)])
    sets = []
    for source in sources:
        docs = list(
            islice(iter_texts(source.uri, source.format, source.text_field, endpoint_url, **source.bounds), max_docs)
        )
        if not docs:
            raise InputError("validation source holds no text", path=source.uri)
        sets.append(ValidationSet(source.label, build_stream(docs, encode(docs), ids.bos, ids.doc_end)))
    return sets


class Prefetcher:
    """Assembles the next `depth` steps' batches on a background thread (pinned on CUDA) while the device trains;
    `close()` rewinds the sampler to the last step the loop took."""

    def __init__(
        self, data: PackedData, global_batch: int, micro_batch: int, rank: int, world: int, device, depth: int = 2
    ):
        from dilforge_shared.prefetch import read_ahead

        self.data, self.device, self.pin = data, device, device.type == "cuda"
        self.consumed = data.sampler.state_dict()
        self._steps = read_ahead(self._produce((global_batch, micro_batch, rank, world)), depth, name="cpt-prefetch")

    def _produce(self, args: tuple) -> Iterator[tuple]:
        import torch

        while True:
            before = self.data.sampler.state_dict()
            host = [torch.from_numpy(a) for a in self.data.next_step(*args)]
            if self.pin:
                host = [t.pin_memory() for t in host]
            yield host, before, self.data.sampler.state_dict()

    def next(self) -> tuple[list, dict, dict]:
        """One step's [accum] int64 [micro, seq_len] tensors on the device and the sampler state before and after
        them, so a checkpoint never counts a batch still waiting in the queue."""
        host, before, after = next(self._steps)
        self.consumed = after
        return [t.to(self.device, non_blocking=self.pin) for t in host], before, after

    def close(self) -> None:
        """Stop the worker and rewind the sampler to what the loop consumed (idempotent)."""
        self._steps.close()
        self.data.sampler.load_state_dict(self.consumed)
