"""``moec train --data``: token files and ``datasets`` folders train and resume bit for bit;
packing and EOS, weights, the background prefetch, and the errors for bad corpora."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from moec.corpus import CorpusError, TokenCorpus, parse_spec
from moec.data import Prefetcher, TextBatches
from moec.plan import Plan
from moec.train import TrainConfig, TrainConfigError, Trainer, train
from tests.test_run_reliability import PLAN, tiny_llama
from tests.test_run_reliability import _cfg as synthetic_cfg

VOCAB = 256  # tiny_llama's


def _cfg(out: Path, **kw) -> TrainConfig:
    """The reliability tests' small run, reading a corpus instead of synthetic tokens."""
    return synthetic_cfg(out, **{"synthetic": False, **kw})


def _token_files(root: Path) -> str:
    """A uint16 .bin, a NumPy .npy (uint32, dtype from its header) and a header-less .npy of
    raw uint16 ids (OLMo-core's layout); a spec weighting the .bin source 0.7, the .npy's 0.3."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    rng.integers(0, VOCAB, 3000, dtype=np.uint16).tofile(root / "a.bin")
    (root / "shards").mkdir()
    np.save(root / "shards" / "b.npy", rng.integers(0, VOCAB, 2000).astype(np.uint32))
    rng.integers(0, VOCAB, 1000, dtype=np.uint16).tofile(root / "shards" / "c.npy")
    return f"{root / 'a.bin'}:0.7,{root / 'shards' / '*.npy'}:0.3"


def _resumes_bit_for_bit(out: Path, **kw) -> list[float]:
    """Train 4 steps (checkpoint at 2), drop the last checkpoint, resume: the resumed steps
    equal the uninterrupted run's."""
    cfg = dict(steps=4, checkpoint_every=2, **kw)
    full = train(tiny_llama(), PLAN, _cfg(out, **cfg))
    shutil.rmtree(out / "checkpoints" / "step_4")
    torch.manual_seed(1234)  # the resumed model starts elsewhere: the checkpoint decides
    resumed = train(tiny_llama(), PLAN, _cfg(out, resume=True, **cfg))
    assert len(resumed.losses) == 2
    assert resumed.losses == full.losses[2:]
    return full.losses


def test_token_files_train_and_resume_bit_for_bit(tmp_path):
    spec = _token_files(tmp_path / "data")
    losses = _resumes_bit_for_bit(tmp_path / "run", data=spec)
    assert all(np.isfinite(losses))
    identity = json.loads((tmp_path / "run" / "run.json").read_text())["data"]
    assert identity["source"] == "corpus" and len(identity["corpus"]["files"]) == 3
    assert identity["corpus"]["weights"] == [0.7, 0.3]


def test_token_files_windows_weights_and_dtypes(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    np.arange(0, 1700, dtype=np.uint16).tofile(root / "low.bin")  # ids < 2000
    np.save(root / "high.npy", np.arange(5000, 5850, dtype=np.uint32))  # ids >= 5000
    sources = parse_spec(f"{root / 'low.bin'}:1,{root / 'high.npy'}:3")
    corpus = TokenCorpus(sources, 400, 16, vocab_size=8000, seed=3)
    inputs, targets = corpus.batch(7)
    assert inputs.shape == targets.shape == (400, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    starts = inputs[:, 0]  # packed windows of seq_len + 1 = 17 tokens
    assert (starts[starts < 5000] % 17 == 0).all()
    assert ((starts[starts >= 5000] - 5000) % 17 == 0).all()
    share_high = (starts >= 5000).float().mean().item()
    assert 0.65 < share_high < 0.85  # weight 3 of 4
    assert torch.equal(corpus.batch(7)[0], inputs)  # a pure function of (seed, step)
    assert not torch.equal(TokenCorpus(sources, 400, 16, 8000, seed=4).batch(7)[0], inputs)
    # without weights: in proportion to the windows (100 of low.bin, 50 of high.npy)
    by_size = TokenCorpus(parse_spec(f"{root}"), 600, 16, vocab_size=8000).batch(0)[0]
    assert 0.25 < (by_size[:, 0] >= 5000).float().mean().item() < 0.42
    # uint32 ids read as uint16 are two ids each: --data-dtype decides
    np.arange(70000, 70100, dtype=np.uint32).tofile(root / "wide.bin")
    wide = TokenCorpus(parse_spec(str(root / "wide.bin"), "uint32"), 2, 8, vocab_size=80000)
    assert wide.batch(0)[0].min() >= 70000


def test_a_data_spec_file_and_its_errors(tmp_path):
    spec = _token_files(tmp_path)
    spec_file = tmp_path / "data.json"
    spec_file.write_text(
        json.dumps({"sources": [{"path": "a.bin", "weight": 2}, {"path": "shards/b.npy"}]})
    )
    with pytest.raises(CorpusError, match="weight is given for some sources but not all"):
        parse_spec(str(spec_file))
    spec_file.write_text(
        json.dumps([{"path": "a.bin", "weight": 2}, {"path": "shards/*.npy", "weight": 1}])
    )
    yaml_file = tmp_path / "data.yaml"
    yaml_file.write_text(
        "sources:\n  - {path: a.bin, weight: 2}\n  - {path: shards/*.npy, weight: 1}\n"
    )
    for file in (spec_file, yaml_file):
        corpus = TokenCorpus(parse_spec(str(file)), 2, 16, VOCAB)
        assert [round(float(w), 3) for w in corpus.source_probs] == [0.667, 0.333]
    assert parse_spec(spec)[0].weight == 0.7
    with pytest.raises(CorpusError, match="source 0 is.*'path'"):
        spec_file.write_text(json.dumps([{"file": "a.bin"}]))
        parse_spec(str(spec_file))
    with pytest.raises(CorpusError, match="weight -1.0: must be > 0"):
        parse_spec(f"{tmp_path / 'a.bin'}:-1")


def test_bad_corpora_give_errors_that_name_the_file(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    np.arange(0, 100, dtype=np.uint16).tofile(root / "short.bin")
    with pytest.raises(CorpusError, match=r"missing.bin: no such file"):
        TokenCorpus(parse_spec(str(root / "missing.bin")), 2, 16, VOCAB)
    with pytest.raises(CorpusError, match=r"\*.npy: the pattern matches no file"):
        TokenCorpus(parse_spec(str(root / "*.npy")), 2, 16, VOCAB)
    with pytest.raises(CorpusError, match=r"short.bin: 100 tokens, fewer than one sequence"):
        TokenCorpus(parse_spec(str(root / "short.bin")), 2, 128, VOCAB)
    (root / "odd.bin").write_bytes(b"\x00" * 33)
    with pytest.raises(CorpusError, match=r"odd.bin: 33 bytes is not a whole number of uint16"):
        TokenCorpus(parse_spec(str(root / "odd.bin")), 2, 4, VOCAB)
    with pytest.raises(CorpusError, match=r"--data-dtype = 'int8': must be one of"):
        parse_spec(str(root / "short.bin"), "int8")
    with pytest.raises(CorpusError, match=r"short.bin holds token id \d+ .* vocabulary has 50 ids"):
        TokenCorpus(parse_spec(str(root / "short.bin")), 20, 16, vocab_size=50).batch(0)
    with pytest.raises(TrainConfigError, match=r"--data\) and .*synthetic"):
        _cfg(tmp_path, data=str(root), synthetic=True)


def test_a_token_beyond_the_vocabulary_stops_the_step_that_reads_it(tmp_path):
    """The check runs on the host in the prefetch thread; its error surfaces in the step."""
    tokens = np.zeros(17 * 64, dtype=np.uint16)
    tokens[17 * 40 + 5] = 300  # one id past tiny_llama's 256, in window 40 of 64
    tokens.tofile(tmp_path / "bad.bin")
    cfg = _cfg(tmp_path / "run", data=str(tmp_path / "bad.bin"))
    with pytest.raises(
        CorpusError, match=r"bad.bin holds token id 300 at token offset 685 \(window 40, read at"
    ):
        trainer = Trainer(tiny_llama(), Plan.from_dict(PLAN), cfg)
        for _ in range(200):  # some step draws window 40
            trainer.train_step()


@pytest.mark.parametrize(
    "ids, shown",
    [
        (np.array([-3], dtype=np.int64), "-3"),
        (np.array([-1], dtype=np.int16), "-1"),
        (np.array([2**63 + 5], dtype=np.uint64), str(2**63 + 5)),  # int64 would wrap it to < 0
        (np.array([2**64 - 1], dtype=np.uint64), str(2**64 - 1)),  # ... and this one to -1
    ],
)
def test_ids_below_zero_or_wrapped_are_errors_naming_the_file_and_offset(tmp_path, ids, shown):
    """Before: negative and wrapped uint64 ids passed the check (IndexError in the step)."""
    tokens = np.concatenate([np.full(17 * 3 + 4, 7, dtype=ids.dtype), ids])
    np.save(tmp_path / "ids.npy", np.concatenate([tokens, np.full(30, 7, dtype=ids.dtype)]))
    corpus = TokenCorpus(parse_spec(str(tmp_path / "ids.npy")), 64, 16, VOCAB)
    with pytest.raises(CorpusError) as info:
        corpus.batch(0)  # 64 draws of 5 windows: window 3 is read
    assert f"ids.npy holds token id {shown} at token offset {17 * 3 + 4} (window 3" in str(
        info.value
    )


class _TouchOnLoad:
    """Unpickling it creates the file ``path`` (a harmless payload)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_npy_of_python_objects_is_refused_without_unpickling(tmp_path):
    """Before: a traceback from NumPy's loader."""
    marker = tmp_path / "payload_ran"
    objects = np.array([1, _TouchOnLoad(marker)] * 40, dtype=object)
    np.save(tmp_path / "objects.npy", objects, allow_pickle=True)
    with pytest.raises(CorpusError, match=r"objects.npy: not a .npy of integer token ids"):
        TokenCorpus(parse_spec(str(tmp_path / "objects.npy")), 2, 8, VOCAB)
    assert not marker.exists()


@pytest.mark.parametrize(
    "entry, named",
    [
        ("{path: a.bin, weight: heavy}", r"source 0 weight = 'heavy': must be a number"),
        ("{path: a.bin, weight: true}", r"source 0 weight = True: must be a number"),
        ("{path: a.bin, weight: [1]}", r"source 0 weight = \[1\]: must be a number"),
        ("{path: 5}", r"source 0 path = 5: must be a file, folder or glob"),
        ("{path: a.bin, dtype: [1]}", r"source 0 dtype = \[1\]: must be one of"),
        ("{path: a.bin, weight: [1", r"data.yaml: not valid YAML"),
    ],
)
def test_bad_values_in_a_data_spec_name_the_file_and_field(tmp_path, entry, named):
    """Before: a traceback (float('heavy'), Path(5), a YAML error not caught)."""
    spec = tmp_path / "data.yaml"
    spec.write_text(f"sources:\n  - {entry}\n")
    with pytest.raises(CorpusError, match=named) as info:
        parse_spec(str(spec))
    assert str(spec) in str(info.value)


def test_the_prefetcher_returns_the_batches_of_the_steps_asked_for():
    data = TextBatches(lambda step: 2 + step % 3, 8, seed=5, synthetic=True, vocab_size=100)
    fetch = Prefetcher(data, torch.device("cpu"), depth=3)
    for step in [0, 1, 2, 3, 7, 8, 2, 3]:  # a jump (resume) restarts the read-ahead
        got, want = fetch.batch(step), data.batch(step)
        assert got[0].shape[0] == 2 + step % 3
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    fetch.close()


class _Gated:
    """Batches that load only once their step is released (a loader slower than the steps)."""

    def __init__(self, data: TextBatches):
        self.data, self.released = data, threading.Semaphore(0)

    def batch(self, step: int):
        self.released.acquire()
        return self.data.batch(step)


def test_the_prefetcher_counts_the_steps_that_waited_for_their_batch():
    data = TextBatches(2, 8, seed=5, synthetic=True, vocab_size=100)
    fetch = Prefetcher(data, torch.device("cpu"), depth=2)
    fetch.batch(0)
    fetch._ahead[-1][1].result()  # the read-ahead has caught up: the next steps do not wait
    for step in (1, 2):
        fetch.batch(step)
        fetch._ahead[-1][1].result()
    assert fetch.stalls == 0
    gated = _Gated(data)
    slow = Prefetcher(gated, torch.device("cpu"), depth=1)
    gated.released.release()
    slow.batch(0)  # the first call starts the read-ahead: never a stall
    timer = threading.Timer(0.2, gated.released.release)
    timer.start()  # step 1's batch is loaded only after the step asked for it
    slow.batch(1)
    assert slow.stalls == 1
    gated.released.release()  # let the read-ahead of step 2 finish before closing
    slow.close()
    fetch.close()


# --- Hugging Face datasets ---------------------------------------------------------------------

DOCS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the bird sang a song",
    "experts route the tokens",
] * 12


def _tokenizer(root: Path) -> str:
    """A WordLevel tokenizer over DOCS' words, saved as a transformers tokenizer folder."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    model = tokenizers.models.WordLevel(unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator(DOCS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(root / "tokenizer")
    return str(root / "tokenizer")


def _dataset(root: Path, **splits) -> str:
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    target = datasets.DatasetDict({"train": data}) if splits.get("dict") else data
    target.save_to_disk(str(root / "ds"))
    return str(root / "ds")


def test_a_datasets_folder_is_tokenized_with_eos_packed_and_resumes_bit_for_bit(tmp_path):
    folder, tokenizer = _dataset(tmp_path, dict=True), _tokenizer(tmp_path)
    corpus = TokenCorpus(parse_spec(folder), 2, 8, VOCAB, tokenizer=tokenizer)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    stream = np.asarray(corpus.sources[0][0].tokens)
    expected = [i for doc in DOCS for i in [*tok(doc, add_special_tokens=False)["input_ids"], 1]]
    assert stream.tolist() == expected  # documents + EOS (id 1), concatenated
    assert corpus.batch(0)[0].shape == (2, 8)
    losses = _resumes_bit_for_bit(tmp_path / "run", data=folder, tokenizer=tokenizer, seq_len=8)
    assert all(np.isfinite(losses))


def test_datasets_errors(tmp_path):
    folder = _dataset(tmp_path)
    with pytest.raises(CorpusError, match=r"ds: a datasets folder holds text.*--tokenizer"):
        TokenCorpus(parse_spec(folder), 2, 8, VOCAB)
    tokenizer = _tokenizer(tmp_path)
    with pytest.raises(CorpusError, match=r"no column 'body' \(--text-column\).*text, id"):
        TokenCorpus(parse_spec(folder), 2, 8, VOCAB, tokenizer=tokenizer, text_column="body")
    with pytest.raises(CorpusError, match=r"fewer than one sequence of --seq-len 4096"):
        TokenCorpus(parse_spec(folder), 2, 4096, VOCAB, tokenizer=tokenizer)
