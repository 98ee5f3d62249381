"""Fixtures every test shares: fresh random inputs from a seed a failure report prints.

Each test seeds torch and Python's ``random`` with a new seed (a different one each run), so
randomized tests see fresh inputs; when a test fails, its report has a ``random seed`` section
naming the seed. Replay it with ``MOEC_TEST_SEED``::

    MOEC_TEST_SEED=1234567 python3 -m pytest -q tests/test_recompute.py -k gradients

Tests marked ``slow`` (the long multi-process and Inductor ones) are skipped unless ``--slow`` is
given, a ``-m`` expression chooses by marker, or the test is named by its node id: the default
run stays within the suite's budget (CONTRIBUTING.md), and CI runs ``-m slow`` after it.

Inductor's compiled graphs are cached in a directory of this test session (unless
``TORCHINDUCTOR_CACHE_DIR`` is set): its cache key knows a custom op by name only, so code cached
before a moec op changed its layout would run against the new op (stale stride asserts). moec's
cache (``MOEC_CACHE_DIR``) is one of the session's too, and each test keeps compiled programs
(:mod:`moec.program_cache`) in a folder of its own, whether or not the cache was set up in its
process: a test that compiles one program twice loads it the second time, and no test loads a
program another built (one may have patched a pass).
"""

import os
import random
import tempfile

import pytest
import torch

SEED_ENV = "MOEC_TEST_SEED"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="moec_inductor_"))
os.environ.setdefault("MOEC_CACHE_DIR", tempfile.mkdtemp(prefix="moec_cache_"))


@pytest.fixture(autouse=True)
def _programs_cached_per_test(tmp_path_factory, monkeypatch):
    """Each test's compiled programs in a folder of its own (see module)."""
    from moec import program_cache

    folder = tmp_path_factory.mktemp("programs")
    monkeypatch.setattr(program_cache, "active_folder", lambda: folder)


def _test_seed() -> int:
    """``MOEC_TEST_SEED`` when set, else a fresh seed."""
    value = os.environ.get(SEED_ENV)
    if value is None:
        return torch.seed() % (2**31)
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV}={value!r}: expected an integer seed") from None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", help="also run the tests marked slow (skipped by default)"
    )


def _named(item: pytest.Item, node_ids: list[str]) -> bool:
    """Whether ``item`` was asked for by its node id (``path::test``, with or without params)."""
    return any(item.nodeid == n or item.nodeid.startswith(f"{n}[") for n in node_ids)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``slow`` tests unless ``--slow``, a ``-m`` expression or their node id asks."""
    if config.getoption("--slow") or config.getoption("markexpr"):
        return
    node_ids = [arg.replace(os.sep, "/") for arg in config.args if "::" in arg]
    skip = pytest.mark.skip(reason="slow: --slow or -m slow runs it")
    for item in items:
        if "slow" in item.keywords and not _named(item, node_ids):
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` runs in one process where CUDA is visible: GPU tests share the device."""
    return 0 if torch.cuda.is_available() else None


@pytest.fixture(autouse=True)
def _fresh_seed(request: pytest.FixtureRequest) -> int:
    """Seed torch and ``random`` for this test; the seed is recorded on the test item."""
    seed = _test_seed()
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Add the test's seed to the report of a failed setup, call or teardown."""
    outcome = yield
    report = outcome.get_result()
    seeds = [value for name, value in item.user_properties if name == "seed"]
    if report.failed and seeds:
        report.sections.append(
            ("random seed", f"{SEED_ENV}={seeds[-1]} replays this test's random inputs")
        )
