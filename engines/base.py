"""Re-export of the Engine ABC and its value types (defined in core.engine)."""

from core.engine import Engine, EngineInfo, OutputOptions, ReadoutManifest, SamplingParams, Step

__all__ = ["Engine", "EngineInfo", "OutputOptions", "ReadoutManifest", "SamplingParams", "Step"]
