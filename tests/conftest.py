import os
import warnings

import pytest

os.environ.setdefault("WEAVE_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=r".*past_key_values.*")


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.bench_vllm` tests start a vLLM server of their own (~2 min each): opt-in."""
    if os.environ.get("DRMAS_VLLM_PYTHON") and os.environ.get("DRMAS_BENCH_VLLM") == "1":
        return
    skip = pytest.mark.skip(reason="opt-in (it starts a vLLM server, ~2 min): DRMAS_BENCH_VLLM=1 and DRMAS_VLLM_PYTHON "
                                   "set to the python of the vLLM venv (scripts/setup_vllm.sh)")
    for item in items:
        if "bench_vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def policy():
    from drmas_graph.testing import tiny_policy

    p = tiny_policy(seed=0)
    yield p
    p.close()


def _hypothesis_profiles():
    """Profiles of the property suite (tests/property): 'ci' (default: bounded, reproducible), 'long'
    (`pytest tests/property --hypothesis-profile=long`, a hunt of hours) and 'hunt' (the ci size with random
    seeds: `bash scripts/property_hunt.sh MINUTES` runs it round after round)."""
    from hypothesis import HealthCheck, Phase, settings

    slow = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]  # no 'explain': slow here
    settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, suppress_health_check=slow,
                              print_blob=True, phases=phases)
    settings.register_profile("long", max_examples=3000, deadline=None, suppress_health_check=slow,
                              print_blob=True)
    # scripts/property_hunt.sh: rounds of the ci size with fresh random seeds, until a time is up
    settings.register_profile("hunt", max_examples=40, deadline=None, suppress_health_check=slow,
                              print_blob=True, phases=phases)
    settings.load_profile("ci")


_hypothesis_profiles()
