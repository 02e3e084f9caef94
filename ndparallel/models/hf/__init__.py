"""The Hugging Face family folder; its public names are re-exported by :mod:`ndparallel.hf`."""
