"""microengine: a small LLM inference engine for Llama models.

    from engine import LLM, SamplingParams
    llm = LLM("llama")
    print(llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))[0].text)
"""
from engine.config import EngineConfig
from engine.engine import StreamChunk
from engine.llm import LLM, RequestOutput, RequestStream
from engine.sampling import SamplingParams, TokenLogprob
from engine.scheduler import ContextLengthError

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "RequestStream", "StreamChunk",
           "TokenLogprob", "ContextLengthError"]
