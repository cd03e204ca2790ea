"""Model loading for pdserve: the model registry (aliases, the embedded SmolLM2 model), GGUF → HF
conversion, the HF-directory / dummy-weight loader, and the paged-attention plug-in for transformers'
model classes.

Kept import-light: import the submodules (``engine.models.loader`` etc.) for the heavy parts.
"""
