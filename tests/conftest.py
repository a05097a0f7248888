import os
import warnings

import pytest

os.environ.setdefault("WEAVE_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=r".*past_key_values.*")


@pytest.fixture
def policy():
    from drmas_graph.testing import tiny_policy

    p = tiny_policy(seed=0)
    yield p
    p.close()
