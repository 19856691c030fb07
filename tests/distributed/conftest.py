import pytest

from tiny import make_lagging_drafter


@pytest.fixture(scope="module")
def pair(make_pair):
    # The demo tokenizer (vocab 4096) so that LLM and TPLLM can take text prompts.
    return make_pair(
        vocab=4096, hidden=64, layers=4, heads=4, kv_heads=2, tokenizer="demo", drafter=make_lagging_drafter
    )
