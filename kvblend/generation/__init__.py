"""Generation from a fused KV: the first token from the fusor's logits, then batched decode steps.

decode.py    the model's half: the prompt's KV in preallocated buffers, and one forward pass that
             decodes a token for each of several sequences (ragged lengths, no padding)
sampling.py  the next token (greedy, or temperature + top-p) and OpenAI-style log-probabilities
sequence.py  the output processor: one sequence's sampler, stop rules, incremental detokenizing
             (tokenizers' DecodeStream) and log-probabilities
loop.py      `step` (one decode step over a batch of sequences) and `generate` (one sequence to its
             end), the one decode loop that `kvblend query` and the server share
"""

from kvblend.generation.decode import DecodeState, decode_step
from kvblend.generation.loop import generate, step
from kvblend.generation.sampling import logprobs_of, next_token
from kvblend.generation.sequence import Delta, Generation, OutputParams, Sequence, token_bytes
from kvblend.options import SamplingConfig

__all__ = [
    "DecodeState",
    "Delta",
    "Generation",
    "OutputParams",
    "SamplingConfig",
    "Sequence",
    "decode_step",
    "generate",
    "logprobs_of",
    "next_token",
    "step",
    "token_bytes",
]
