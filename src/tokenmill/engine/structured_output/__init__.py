"""Structured output (constrained decoding) in the engine core, with xgrammar.

backend.py compiles grammars on a thread pool with a cache; request_grammar.py is one request's
matcher; bitmask.py fills a step's allowed-token rows; manager.py ties them to the scheduler
(through core/structured_output.py's hooks) and to the two-phase step. The mask is applied to
the logits on the device by sample/grammar_mask.py.
"""

from tokenmill.engine.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
