"""RequestOutputCollector: what a consumer slower than the engine receives."""

from __future__ import annotations

import asyncio

import pytest

from jaxllm.engine.async_llm import RequestOutputCollector
from jaxllm.errors import EngineDeadError
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.sampling_params import RequestOutputKind


def _out(index: int, text: str, ids: list[int], finished: bool = False,
         logprobs: bool = False) -> RequestOutput:
    lps = [{t: Logprob(-1.0)} for t in ids] if logprobs else None
    comp = CompletionOutput(index=index, text=text, token_ids=ids, cumulative_logprob=None,
                            logprobs=lps, finish_reason="length" if finished else None)
    return RequestOutput("r", "p", [1], None, [comp], finished)


def test_missed_deltas_are_merged_in_order_per_choice():
    c = RequestOutputCollector(RequestOutputKind.DELTA)
    c.put(_out(0, "a", [1], logprobs=True))
    c.put(_out(1, "x", [9]))
    c.put(_out(0, "b", [2], logprobs=True))
    c.put(_out(0, "c", [3], finished=True, logprobs=True))
    merged = asyncio.run(c.get())
    by_index = {o.index: o for o in merged.outputs}
    assert (by_index[0].text, by_index[0].token_ids) == ("abc", [1, 2, 3])
    assert len(by_index[0].logprobs) == 3 and by_index[0].finish_reason == "length"
    assert (by_index[1].text, by_index[1].token_ids) == ("x", [9])
    assert merged.finished and c.get_nowait() is None


def test_cumulative_and_final_outputs_replace_the_pending_one():
    c = RequestOutputCollector(RequestOutputKind.FINAL_ONLY)
    c.put(_out(0, "ab", [1, 2]))
    c.put(_out(0, "abc", [1, 2, 3], finished=True))
    assert c.get_nowait().outputs[0].text == "abc"


def test_an_error_sticks_and_wakes_the_waiter():
    async def run():
        c = RequestOutputCollector(RequestOutputKind.DELTA)
        waiter = asyncio.ensure_future(c.get())
        await asyncio.sleep(0)
        c.put(EngineDeadError("gone"))
        c.put(_out(0, "late", [5]))
        with pytest.raises(EngineDeadError):
            await waiter
        with pytest.raises(EngineDeadError):
            await c.get()

    asyncio.run(run())
