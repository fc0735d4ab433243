"""StructuredOutputManager: grammars compiled off the step's path, one matcher per request.

Beside the scheduler, as vLLM v1's manager: a request with structured
outputs waits outside the scheduler until its grammar is compiled (a thread
pool; compiled grammars are cached by (kind, spec) and each request gets a
copy of the cached matcher). Each step the manager fills the packed int32
token bitmask `[scheduled requests, ceil(vocab / 32)]` for the scheduled
requests (bit j of word i allows token 32 i + j; unconstrained rows allow
everything, as do those of a request still reasoning under a reasoning parser), and
advances every matcher with the tokens sampled for it (past the reasoning). A
matcher that has reached the end of its grammar allows only EOS, so the
request then stops on EOS as any other.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy as llnp
import numpy as np

from jaxllm.errors import ParameterError
from jaxllm.reasoning import ReasoningGate
from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured_output.grammar import grammar_key, grammar_text

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (requests with the same schema share one).
CACHE_SIZE = 256


class StructuredOutputManager:
    """Compiles, holds and advances the grammars of the engine's structured requests."""

    def __init__(self, make_tokenizer: Callable[[], llguidance.LLTokenizer], vocab_size: int,
                 max_workers: int = 2,
                 reasoning_tags: tuple[list[int], list[int], list[int] | None] | None = None):
        """`reasoning_tags`: a reasoning parser's start and end tags (and its turn
        marker, or None) as token ids; a request's grammar then waits until its
        reasoning has ended (`ReasoningGate`)."""
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self._make_tokenizer = make_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pending: dict[str, Future] = {}  # req_id -> compile, until `take_ready`
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        self.reasoning_tags = reasoning_tags
        self.gates: dict[str, ReasoningGate] = {}  # requests still reasoning
        self._executor: llguidance.LLExecutor | None = None

    # ---- compilation ------------------------------------------------------

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def _compile(self, kind: str, spec: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar_text(kind, spec), log_level=0)
        if matcher.is_error():
            raise ParameterError(f"structured_outputs.{kind}", matcher.get_error())
        return matcher

    def submit(self, req_id: str, params: StructuredOutputsParams,
               prompt_token_ids: list[int] = ()) -> None:
        """Starts compiling the request's grammar (or reuses a compiled one)."""
        if self.reasoning_tags is not None:
            start, end, *turn = self.reasoning_tags
            gate = ReasoningGate.for_prompt(start, end, list(prompt_token_ids),
                                            turn[0] if turn else None)
            if not gate.ended:
                self.gates[req_id] = gate
        key = grammar_key(params)
        with self._lock:
            fut = self._compiled.get(key)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._pool.submit(self._compile, *key)
                self._compiled[key] = fut
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        self._pending[req_id] = fut

    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait_any(self, timeout: float) -> None:
        """Blocks until some pending grammar is compiled (or `timeout` seconds)."""
        futures = list(self._pending.values())
        if futures:
            from concurrent.futures import FIRST_COMPLETED, wait
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def take_ready(self) -> tuple[list[str], dict[str, str]]:
        """Requests whose grammar is compiled now (each gets its own matcher), and
        those whose grammar failed to compile, with the reason."""
        ready, failed = [], {}
        for req_id, fut in list(self._pending.items()):
            if not fut.done():
                continue
            del self._pending[req_id]
            if fut.exception() is not None:
                failed[req_id] = str(fut.exception())
                continue
            self.matchers[req_id] = fut.result().deep_copy()
            ready.append(req_id)
        return ready, failed

    def remove(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._pending.pop(req_id, None)
            self.matchers.pop(req_id, None)
            self.gates.pop(req_id, None)

    # ---- per step ---------------------------------------------------------

    def fill_bitmask(self, req_ids: list[str], samples: np.ndarray) -> np.ndarray | None:
        """The step's bitmask, row j for `req_ids[j]`; None when no scheduled request
        that samples this step is constrained."""
        matchers = self.matchers
        rows = [(matchers[r], j) for j, r in enumerate(req_ids)
                if samples[j] and r in matchers and r not in self.gates]
        if not rows:
            return None
        words = -(-self.tokenizer().vocab_size // 32)
        mask = np.full((len(req_ids), words), -1, np.int32)
        if len(rows) == 1:
            llnp.fill_next_token_bitmask(rows[0][0], mask, rows[0][1])
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llnp.fill_next_token_bitmask_par(self._executor, rows, mask)
        if words == self.num_words:
            return mask
        # The tokenizer and the model disagree on the vocabulary's size: ids the
        # tokenizer lacks are never allowed in a constrained row.
        out = np.full((len(req_ids), self.num_words), -1, np.int32)
        w = min(words, self.num_words)
        out[:, :w] = mask[:, :w]
        out[[j for _, j in rows], w:] = 0
        return out

    def accept(self, req_id: str, token_ids: list[int]) -> None:
        """Advances the request's matcher with its newly sampled tokens."""
        matcher = self.matchers.get(req_id)
        gate = self.gates.get(req_id)
        if gate is not None:  # tokens of the reasoning are not the grammar's
            token_ids = gate.feed(token_ids)
            if gate.ended:
                del self.gates[req_id]
        if matcher is None or not token_ids or matcher.is_stopped():
            return  # a stopped grammar has consumed all it takes; the EOS after it ends it
        if not matcher.consume_tokens(token_ids):
            logger.warning("request %s: the grammar rejected tokens %s (%s)", req_id,
                           token_ids, matcher.get_error())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
