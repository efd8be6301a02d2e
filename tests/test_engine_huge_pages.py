"""Model weights on transparent huge pages (`tetriinfer.engine.huge_pages`): the move copies every value bit for
bit, keeps tied parameters tied, leaves weights already there alone, asks the kernel for huge pages, and the
switch turns it off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tetriinfer.engine import huge_pages
from tetriinfer.engine.huge_pages import HUGE_PAGE, huge_page_buffer, move_weights_to_huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.huge_pages_available(),
                               reason="no transparent huge pages here (not Linux, or set to never)")


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 24)
        self.proj = torch.nn.Linear(24, 7)
        self.head = torch.nn.Linear(24, 100, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM2's LM head
        self.half = torch.nn.Linear(5, 3).to(torch.bfloat16)


@needs_thp
def test_moved_weights_keep_their_values_and_ties_and_live_in_one_aligned_buffer() -> None:
    model = _Tied()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    moved = move_weights_to_huge_pages(model)
    assert moved >= sum(p.numel() * p.element_size() for p in model.parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.dtype == before[name].dtype, name
        assert p.data_ptr() % 64 == 0, name
    assert model.head.weight is model.embed.weight
    (lo, hi), = model.huge_page_ranges
    assert lo % HUGE_PAGE == 0 and all(lo <= p.data_ptr() < hi for p in model.parameters())
    model.head.weight.data[0, 0] = 5.0  # still one storage
    assert model.embed.weight[0, 0].item() == 5.0
    assert move_weights_to_huge_pages(model) == 0  # already there
    shared = _Tied()
    shared.shared_weight_mapping = True  # fast-shm: one host copy shared by every instance stays shared
    ptrs = [p.data_ptr() for p in shared.parameters()]
    assert move_weights_to_huge_pages(shared) == 0 and [p.data_ptr() for p in shared.parameters()] == ptrs


@needs_thp
def test_the_buffer_is_advised_for_huge_pages() -> None:
    buf = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert buf.numel() == 3 * HUGE_PAGE + 5 and buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(1)
    start = buf.data_ptr()
    flags = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():  # the mapping holding the buffer
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= start < hi
        elif inside and line.startswith("VmFlags:"):
            flags = line
            break
    assert " hg" in flags, flags  # MADV_HUGEPAGE recorded on the mapping


def test_the_switch_turns_the_move_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETRIINFER_HUGE_PAGES", "0")
    model = _Tied()
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert move_weights_to_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert huge_page_buffer(10).numel() == 10
    with pytest.raises(ValueError, match="nbytes"):
        huge_page_buffer(-1)


@needs_thp
def test_an_engine_runs_on_huge_page_weights_and_generates_as_without(tiny_llama: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tetriinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 40)]
    llm = LLM(model=str(tiny_llama), num_threads=1)
    model = llm.engine.runner.model
    assert getattr(model, "huge_page_ranges", None)
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setenv("TETRIINFER_HUGE_PAGES", "0")
    off_llm = LLM(model=str(tiny_llama), num_threads=1)
    assert not getattr(off_llm.engine.runner.model, "huge_page_ranges", None)
    assert [o.outputs[0].token_ids for o in off_llm.generate(prompts, params)] == on
