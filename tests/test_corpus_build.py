"""``moec data build``: a corpus from a folder of text, deterministic, split by content hash,
its byte-level BPE round-tripping, its manifest true to its files, ``moec train --data DIR``
training on the train split with the tokenizer's vocabulary, and the errors for bad inputs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from moec.cli import main
from moec.corpus import CorpusError, TokenCorpus, built_corpus, parse_spec
from moec.corpus_build import EOS, BuildOptions, CorpusBuildError, build_corpus, parse_bytes
from moec.models import Llama, LlamaConfig
from moec.models.zoo import load_model
from moec.train import train
from tests.test_run_reliability import PLAN, _cfg

OPTIONS = BuildOptions(vocab_size=400, eval_fraction=0.25, max_file_bytes=4000)
WORDS = (
    "the expert router token batch gradient def return class import self None True for in if "
    "else while yield lambda héllo naïve 漢字 🙂 {} () [] : = == -> # \\t"
).split()
OUTPUTS = ("manifest.json", "tokenizer.json", "tokenizer_config.json")


def _text(seed: int, lines: int = 40) -> str:
    """Code-like text with indentation, unicode and blank lines, the same for a seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        indent = " " * 4 * rng.randrange(3)
        out.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(12))))
    return "\n".join(out) + "\n"


def _sources(root: Path, n: int = 24, first: int = 0) -> Path:
    """``n`` text documents (.py/.md/.rst/.txt, some in sub-folders) and one of each kind of
    file the build leaves out."""
    suffixes = (".py", ".md", ".rst", ".txt")
    for i in range(first, first + n):
        path = root / f"pkg{i % 3}" / f"doc{i}{suffixes[i % 4]}"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = _text(i).replace("\n", "\r\n") if i % 5 == 4 else _text(i)  # some CRLF
        path.write_bytes(text.encode())
    if first == 0:
        (root / "pkg0" / "empty.py").write_text("")
        (root / "pkg0" / "blank.md").write_text("  \n\n")
        (root / "pkg1" / "binary.txt").write_bytes(b"abc\0def")
        (root / "pkg1" / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
        (root / "pkg2" / "copy.py").write_text(_text(0))  # the same bytes as pkg0/doc0.py
        (root / "pkg2" / "big.txt").write_text("x" * 5000)
        (root / "pkg2" / "lib.so").write_bytes(b"\x7fELF")
        (root / "__pycache__").mkdir()
        (root / "__pycache__" / "cached.py").write_text(_text(100))
        (root / ".hidden").mkdir()
        (root / ".hidden" / "secret.py").write_text(_text(101))
        os.symlink(root / "pkg0" / "doc0.py", root / "link.py")
    return root


def _build(tmp_path: Path, name: str = "corpus", **options) -> tuple[Path, dict]:
    out = tmp_path / name
    return out, build_corpus(out, _options(**options))


def _options(**options) -> BuildOptions:
    return dataclasses.replace(OPTIONS, **options)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return _sources(tmp_path / "src")


def test_a_build_is_deterministic_and_its_manifest_is_true_to_its_files(tmp_path, src):
    options = _options(sources=(str(src),))
    out = tmp_path / "corpus"
    manifest = build_corpus(out, options)
    first = {p: (out / p).read_bytes() for p in (*OUTPUTS, "train/tokens.bin", "eval/tokens.bin")}
    again = build_corpus(out, options, force=True)
    assert {p: (out / p).read_bytes() for p in first} == first
    elsewhere, other = _build(tmp_path, "corpus2", sources=(str(src),))
    assert {k: v for k, v in other.items() if k != "command"} == {
        k: v for k, v in again.items() if k != "command"
    }
    # the files: every document once, the left-out ones counted by reason
    files = manifest["files"]
    assert manifest["skipped"] == {
        "binary": 1,
        "duplicate": 1,
        "empty": 2,
        "not_utf8": 1,
        "over_max_file_bytes": 1,
    }
    assert sorted(f["path"] for f in files) == [f["path"] for f in files]  # sorted order
    assert len(files) == 24 and {f["path"].split("/")[0] for f in files} == {"pkg0", "pkg1", "pkg2"}
    for f in files:
        data = (src / f["path"]).read_bytes()
        assert f["bytes"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest()
    sizes = {s: sum(f["bytes"] for f in files if f["split"] == s) for s in ("train", "eval")}
    assert manifest["bytes"] == {**sizes, "total": sum(sizes.values())}
    # token files and tokenizer: sha256s and sizes as recorded
    for split in ("train", "eval"):
        entry = manifest["token_files"][split]
        path = out / entry["path"]
        assert entry["sha256"] == _sha256(path) and entry["dtype"] == "uint16"
        assert path.stat().st_size == 2 * entry["tokens"] == 2 * manifest["tokens"][split]
    assert manifest["tokenizer"]["sha256"] == _sha256(out / "tokenizer.json")
    assert manifest["tokenizer"]["vocab_size"] <= 400 and manifest["tokenizer"]["eos_id"] == 0
    assert manifest["command"].startswith(f"moec data build {out} --source {src} --max-bytes")


def test_the_split_follows_each_files_content_hash_and_survives_added_files(tmp_path, src):
    _, before = _build(tmp_path, "before", sources=(str(src),))
    splits = {f["path"]: f["split"] for f in before["files"]}
    assert set(splits.values()) == {"train", "eval"}
    for f in before["files"]:
        fraction = int(f["sha256"][:16], 16) / 2**64
        assert f["split"] == ("eval" if fraction < 0.25 else "train")
    _sources(src, n=30, first=24)
    _, after = _build(tmp_path, "after", sources=(str(src),))
    moved = {f["path"] for f in after["files"] if splits.get(f["path"], f["split"]) != f["split"]}
    assert len(after["files"]) == 54 and not moved
    by_split = {
        s: {f["sha256"] for f in after["files"] if f["split"] == s} for s in splits.values()
    }
    assert not by_split["train"] & by_split["eval"]


def test_the_cap_takes_files_in_path_hash_order(tmp_path, src):
    _, full = _build(tmp_path, "full", sources=(str(src),))
    _, capped = _build(tmp_path, "capped", sources=(str(src),), max_bytes=20_000)
    assert capped["bytes"]["total"] <= 20_000 < full["bytes"]["total"]
    by_key = sorted(full["files"], key=lambda f: hashlib.sha256(f["path"].encode()).digest())
    taken = {f["path"] for f in capped["files"]}
    assert taken == {f["path"] for f in by_key[: len(taken)]}  # a prefix of the hash order
    assert capped["skipped"]["over_max_bytes"] >= len(full["files"]) - len(taken)


def test_the_tokenizer_round_trips_and_the_token_files_decode_to_the_documents(tmp_path, src):
    from tokenizers import Tokenizer

    out, manifest = _build(tmp_path, sources=(str(src),))
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.token_to_id(EOS) == 0
    for text in (_text(7), "  \tx\r\n 漢字🙂 ", f"a{EOS}b", "", "\0\x7f"):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    for split in ("train", "eval"):
        ids = np.fromfile(out / split / "tokens.bin", dtype=np.uint16)
        assert ids[-1] == 0 and ids.max() < manifest["tokenizer"]["vocab_size"]
        docs = np.split(ids, np.flatnonzero(ids == 0) + 1)[:-1]  # each ends with its EOS
        expected = [f["path"] for f in manifest["files"] if f["split"] == split]
        assert len(docs) == len(expected) == manifest["documents"][split]
        for doc, path in zip(docs, expected, strict=True):
            assert tokenizer.decode(doc[:-1].tolist()) == (src / path).read_bytes().decode()


def test_a_literal_eos_in_a_document_is_text(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"d{i}.md").write_text(f"{_text(i, 5)}say {EOS} here\n")
    out, manifest = _build(tmp_path, sources=(str(src),), eval_fraction=0.5)
    ids = np.concatenate(
        [np.fromfile(out / s / "tokens.bin", np.uint16) for s in ("train", "eval")]
    )
    assert (ids == 0).sum() == 8  # one EOS per document, none from the text


@pytest.mark.slow
def test_transformers_loads_the_tokenizer_folder(tmp_path, src):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    out, _ = _build(tmp_path, sources=(str(src),))
    hf = AutoTokenizer.from_pretrained(str(out))
    fast = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = _text(3) + " spaces . , ?"
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert ids == fast.encode(text).ids and hf.eos_token_id == 0
    assert hf.decode(ids) == text
    model = load_model("hf-qwen2", vocab_size=1000)[0]  # the transformers models are sized too
    assert model.get_input_embeddings().num_embeddings == 1000


def test_train_reads_the_train_split_with_the_tokenizers_vocabulary(tmp_path, src):
    out, manifest = _build(tmp_path, sources=(str(src),))
    built = built_corpus(out)
    vocab = manifest["tokenizer"]["vocab_size"]
    assert built.vocab_size == vocab
    assert [s.path for s in parse_spec(str(out))] == [built.train.path]
    assert built.eval.path.endswith("eval/tokens.bin") and built.eval.built.split == "eval"
    corpus = TokenCorpus(parse_spec(f"{out}:2"), 64, 8, vocab_size=vocab)
    train_ids = np.fromfile(built.train.path, np.uint16).astype(np.int64)
    windows = torch.from_numpy(train_ids[: len(train_ids) // 9 * 9].reshape(-1, 9))
    rows = torch.cat(corpus.batch(0), 1)[:, [*range(8), 15]]  # inputs and the last target
    assert all((windows == row).all(1).any() for row in rows)  # every row a train window
    with pytest.raises(CorpusError, match=f"tokenizer .* has {vocab} ids.*vocabulary has 256"):
        TokenCorpus(parse_spec(str(out)), 4, 8, vocab_size=256)
    config = LlamaConfig(
        vocab_size=vocab, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32
    )
    model = Llama(config)
    result = train(model, PLAN, _cfg(tmp_path / "run", data=str(out), synthetic=False, steps=2))
    assert len(result.losses) == 2 and all(np.isfinite(result.losses))
    identity = json.loads((tmp_path / "run" / "run.json").read_text())["data"]["corpus"]
    assert identity["built"][0]["sha256"] == manifest["token_files"]["train"]["sha256"]
    assert identity["files"] == [[built.train.path, manifest["tokens"]["train"]]]


def test_the_named_models_take_the_vocabulary_asked_for():
    for name in ("llama", "gpt2"):
        model, (tokens,), _ = load_model(name, vocab_size=1000)
        embedding = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
        assert embedding.num_embeddings == 1000 and model(tokens) is not None
    assert load_model("llama")[0].cfg.vocab_size == 256


@pytest.mark.slow
def test_moec_train_data_dir_sizes_the_named_model_to_the_corpus(tmp_path, src):
    out, manifest = _build(tmp_path, sources=(str(src),))
    run = tmp_path / "run"
    args = ["train", "--data", str(out), "--steps", "2", "--batch-size", "2", "--seq-len", "16"]
    assert main([*args, "--out", str(run), "--device", "cpu", "--log-every", "1"]) == 0
    identity = json.loads((run / "run.json").read_text())["data"]
    assert identity["vocab"] == manifest["tokenizer"]["vocab_size"]


def test_the_cli_builds_and_refuses_bad_inputs_in_one_line(tmp_path, src, capsys):
    out = tmp_path / "cli"
    build = ["data", "build", str(out), "--source", str(src), "--vocab-size", "300"]
    assert main([*build, "--eval-fraction", "0.3", "--max-file-bytes", "4k"]) == 0
    assert built_corpus(out).vocab_size <= 300
    capsys.readouterr()
    binaries = tmp_path / "bin"
    binaries.mkdir()
    (binaries / "lib.so").write_bytes(b"\x7fELF")
    bad = {
        "not empty; give an empty or new folder, or --force": build,
        "--source .*missing: no such folder or file": [
            "data",
            "build",
            str(tmp_path / "new"),
            "--source",
            str(tmp_path / "missing"),
        ],
        "no text to build a corpus from": [
            "data",
            "build",
            str(tmp_path / "n2"),
            "--source",
            str(binaries),
        ],
        "the eval split is empty": [
            *build[:2],
            str(tmp_path / "n3"),
            *build[3:5],
            "--eval-fraction",
            "1e-9",
        ],
        "--eval-fraction 1.5: must be in": [*build, "--eval-fraction", "1.5", "--force"],
        r"--vocab-size 100: must be in \[257": [*build[:5], "--vocab-size", "100", "--force"],
        "is a file": ["data", "build", str(src / "pkg0" / "doc0.py"), "--source", str(src)],
    }
    for message, argv in bad.items():
        assert main(argv) == 2, message
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("moec: error: "), err
        assert re.search(message, err), (message, err)
    assert not (tmp_path / "new").exists() and not (tmp_path / "n3").exists()
    assert parse_bytes("300M") == 300 * 10**6 and parse_bytes("1.5k") == 1500


def test_a_build_writes_only_in_its_folder(tmp_path, src):
    def snapshot() -> dict[str, tuple[int, int]]:
        return {
            str(p): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in tmp_path.rglob("*")
            if p.is_file() and not p.is_symlink() and "corpus" not in p.parts
        }

    before = snapshot()
    out = src / "pkg1" / "corpus"  # inside the source: not read back as text
    build_corpus(out, BuildOptions(sources=(str(src),), vocab_size=300, eval_fraction=0.25))
    assert snapshot() == before
    (out / "notes.txt").write_text("mine")
    manifest = build_corpus(
        out, BuildOptions(sources=(str(src),), vocab_size=300, eval_fraction=0.25), force=True
    )
    assert (out / "notes.txt").read_text() == "mine"
    assert not any("corpus" in f["path"] for f in manifest["files"])


def test_a_changed_or_mixed_corpus_is_refused(tmp_path, src):
    out, _ = _build(tmp_path, sources=(str(src),))
    other, _ = _build(tmp_path, "other", sources=(str(src / "pkg0"), str(src / "pkg1")))
    with pytest.raises(CorpusError, match="different tokenizers"):
        TokenCorpus(parse_spec(f"{out},{other}"), 2, 8, vocab_size=1000)
    shutil.copy(out / "eval" / "tokens.bin", out / "train" / "tokens.bin")
    with pytest.raises(CorpusError, match="train/tokens.bin has .* bytes, but the manifest"):
        parse_spec(str(out))
    (out / "manifest.json").write_text("{}")
    with pytest.raises(CorpusError, match="manifest.json is not a manifest moec data build"):
        built_corpus(out)
    with pytest.raises(CorpusError, match="no manifest.json"):
        built_corpus(tmp_path)
    with pytest.raises(CorpusBuildError, match="--source .*nowhere: no such"):
        build_corpus(tmp_path / "x", BuildOptions(sources=(str(tmp_path / "nowhere"),)))
