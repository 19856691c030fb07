"""One interface for every engine the server drives (specserve.engine.protocol): the
single-process `Engine`/`LLM` and the tensor-parallel `TPEngineView`/`TPLLM` offer every
member of `ServingEngine`/`ServingLLM`, down to the policy and runner facts, and the TP view
reports what the engine it mirrors reports. The checker itself is tested first: it must see
a missing nested member (the `engine.policy.k_max` that once stopped `serve --tp 2`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve.distributed.tp_llm import TPEngineView, WorkerLLM, engine_facts
from specserve.engine.llm import LLM
from specserve.engine.protocol import ServingEngine, ServingLLM, SpeculationPolicy, missing_members
from specserve.engine.sampling import SamplingParams


def test_checker_finds_missing_nested_and_stub_members():
    class OldPolicyView:  # the TP policy view before k_max was part of the interface
        choices: dict = {}

        def acceptance(self, tree=False):
            return []

        def snapshot(self):
            return {}

    engine = SimpleNamespace(
        **{
            n: None
            for n in (
                "cfg",
                "device",
                "max_model_len",
                "graph_seconds",
                "totals",
                "tokens_generated",
                "last_k",
                "n_running",
                "free_rows",
                "waiting",
                "profile",
                "add_request",
                "step",
                "abort",
                "has_work",
                "kv_usage",
                "check_idle_integrity",
            )
        },
        runner=SimpleNamespace(model_cfg=1, dtype=1, rows=1, load_seconds=0.0, drafter=None),
        policy=OldPolicyView(),
    )
    assert missing_members(engine, ServingEngine) == ["policy.k_max"]
    engine.policy = None  # no drafter: nothing to follow
    assert missing_members(engine, ServingEngine) == []

    class Declared(SpeculationPolicy):  # an explicit subclass inherits the protocol's stubs: still missing
        k_max = 3
        choices: dict = {}

    assert missing_members(Declared(), SpeculationPolicy) == ["acceptance", "snapshot"]


@pytest.fixture(scope="module")
def stepped(demo_pair):
    """An LLM with the demo drafter mid-way through more requests than it has rows."""
    llm = LLM(
        model=demo_pair[0],
        draft=demo_pair[1],
        spec_steps=3,
        spec_topk=2,
        device="cpu",
        max_num_seqs=2,
        max_model_len=128,
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for ids in llm.encode_prompts(["def add(a, b):", "import os\n", "class A:", "for i in x:"]):
        llm.engine.add_request(ids, params)
    for _ in range(4):
        llm.engine.step()
    return llm


def _view_of(llm: LLM) -> TPEngineView:
    """The driver's view over one rank, fed with what that rank's worker sends (`engine_facts` when
    ready, `light_stats` with every reply): the messages without the processes."""
    e = llm.engine
    driver = SimpleNamespace(
        config=llm.config,
        info=engine_facts(e),
        device=e.device,
        model_cfg=e.runner.model_cfg,
        _stats=WorkerLLM.light_stats(llm),
        _seqs=dict(e.by_id),
        add_request=e.add_request,
        step=e.step,
        abort=e.abort,
        has_work=e.has_work,
    )
    return TPEngineView(driver)


def test_single_process_and_tp_view_offer_the_whole_interface(stepped):
    e, view = stepped.engine, _view_of(stepped)
    assert e.policy is not None and e.waiting and e.n_running  # every nested member is really reached
    assert missing_members(e, ServingEngine) == []
    assert missing_members(view, ServingEngine) == []
    assert missing_members(stepped, ServingLLM) == []


def test_tp_view_reports_what_its_engine_reports(stepped):
    e, view = stepped.engine, _view_of(stepped)
    assert view.policy.k_max == e.policy.k_max == 3
    assert view.policy.choices == e.policy.choices and sum(view.policy.choices.values()) > 0
    assert view.policy.acceptance() == e.policy.acceptance()
    assert view.policy.acceptance(True) == e.policy.acceptance(True)
    assert [s.seq_id for s in view.waiting] == [s.seq_id for s in e.waiting]
    for name in ("max_model_len", "graph_seconds", "totals", "tokens_generated", "last_k", "n_running", "free_rows"):
        assert getattr(view, name) == getattr(e, name), name
    assert view.kv_usage() == e.kv_usage()
    assert view.runner.model_cfg == e.runner.model_cfg and view.runner.rows == e.runner.rows
    assert view.runner.dtype == e.runner.dtype == torch.float32
    assert view.runner.load_seconds == e.runner.load_seconds and view.runner.drafter is not None
