"""The model engine's model side: the architectures it runs (engine.model.llama with its linear and
attention kernels, the feature head of engine.model.drafts), dtypes and the loader."""
