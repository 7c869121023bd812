"""The engine's hook for one-token steps on the GPU: `kernel_decoder_for` gives a model whose
features the decode kernels cover a GraphDecode, which builds ds4/model/gpu_decode.py's
KernelDecoder on its first step and sends every step through its CUDA graphs."""

from __future__ import annotations

from ds4.model import gpu_weights
from ds4.model.gpu_decode import KernelDecoder


def kernel_decoder_for(model) -> GraphDecode | None:
    """A GraphDecode for a model on the GPU whose features the kernels cover, else None."""
    if not model.backend.is_gpu or gpu_weights.supported(model) is not None:
        return None
    return GraphDecode(model)


class GraphDecode:
    """The engine's hook for one-token steps: builds the KernelDecoder on first use."""

    def __init__(self, model):
        self.model = model
        self.decoder: KernelDecoder | None = None

    def decode(self, state, token: int):
        """Logits (device array) of token appended at state.n, through a replayed CUDA graph."""
        return self.decode_batch([state], [token])[0]

    def decode_batch(self, states: list, tokens: list[int]) -> list:
        """Logits per session of one token each, one graph replay per (at most 8) sessions."""
        if self.decoder is None:
            self.decoder = KernelDecoder.from_model(self.model)
        return self.decoder.decode_batch(states, tokens)

    def verify(self, state, tokens: list[int]):
        """Logits [T, V] of tokens appended to one session as consecutive steps, one graph
        replay (see KernelDecoder.verify)."""
        if self.decoder is None:
            self.decoder = KernelDecoder.from_model(self.model)
        return self.decoder.verify(state, tokens)

    def last_streams(self, row: int = 0):
        """A copy of the final streams [hc, D] of the last step's member `row` (of a verify:
        its token `row`), what MTP drafts from."""
        return self.decoder.buf["X"][row].copy()
