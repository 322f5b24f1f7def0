"""turbomq.worker.model: the model and everything made of tensors below the
engine.

The LLaMA forward over the paged KV cache (`llama`), its ops (`ops`: CUDA
kernels or the pure-PyTorch reference), checkpoint formats and the demo
model (`weights`, `config`, `demo`), rotary tables, the KV pool's tensors
(`kv_cache`), decode CUDA graphs (`cuda_graphs`), tensor-parallel weight
slices and collectives (`parallel`) and the batched token sampler
(`sampler`). Nothing here imports the engine."""
