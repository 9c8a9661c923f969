from fthsdp.models.transformer import DecoderLM

__all__ = ["DecoderLM"]
