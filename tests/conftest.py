import os

import pytest
import torch

# 2 CPU cores in CI: one intra-op thread per test process keeps runs predictable.
torch.set_num_threads(int(os.environ.get("SPARSEKIT_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
