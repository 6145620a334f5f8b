"""Prefill / decode disaggregation behind the data-parallel coordinator (docs/DISAGGREGATION.md):
a prefill engine computes a request's prompt and first token, then hands the request, with its KV
blocks (and a hybrid model's Mamba state), to a decode engine, so a long prompt never stretches
the decode steps of requests already running.

- messages.py: the hand-off's messages on the coordinator's wire (no torch);
- handoffs.py: the coordinator's side, a state machine per transfer (no torch);
- engine_side.py: an engine's side (prefill and decode), beside its coordinator link;
- kv_import.py: the engine entry points (cap a request at its first token and keep its blocks;
  admit a request decoding with given blocks and tokens);
- kv_layout.py: a request's blocks and state as one flat buffer;
- transfer.py: the pair connections (gloo, NCCL) and their threads;
- pair_auth.py: the two engines of a pair prove its key to each other on connecting;
- ipc_share.py: "ipc" transfers, the blocks shared in memory (CUDA IPC, or shared memory on the CPU)."""
