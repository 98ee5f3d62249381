"""The README is true to the tree: every repository path it names exists, and it points at
nothing a clone does not have."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_every_path_the_readme_names_exists():
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`((?:moec|benchmarks|tests|examples|\.ci)/[\w/.\-]+)", text))
    assert len(named) > 20  # the pattern still finds the README's paths
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"README names paths that do not exist: {missing}"
    assert "../" not in re.sub(r"```.*?```", "", text, flags=re.S), "a path outside the clone"
