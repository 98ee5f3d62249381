import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Every test draws fresh random inputs (a different seed each run), printed on failure."""
    seed = torch.seed() % (2**31)
    torch.manual_seed(seed)
    yield seed
