"""Real models: import GGUF files and Hugging Face checkpoints into the ONNX engine's format.

Importing this package imports nothing heavy; each module imports ``gguf``,
``safetensors``, ``tokenizers`` or ``jinja2`` when it is used.
"""
