"""The model side of generation, below the engine (it imports nothing of ``models.generation``):

- :mod:`.layers`: the shared pre-norm decoder every family runs (``State``, ``forward`` over ragged
  rows, ``compiled_decode``, ``hidden_states``);
- :mod:`.attention`: the KV-cache seam a forward calls (``Rows``, ``make_step``, ``attend``) and
  the ``DecodeBackend`` protocol;
- :mod:`.kv_cache`: the paged KV cache's device arrays and its memory budget;
- :mod:`.decode_backends`: how one-token rows attend, chosen once (generic or the fused CUDA
  kernels of :mod:`.cuda_kernels`, built by :mod:`.cuda_build`).

The engine (``models.generation``) drives it through a ``SchedulerOutput``'s plain values.
"""
