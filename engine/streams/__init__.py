"""Multi-stream scheduling: the step's compute / H2D / D2H streams ordered by events, sampled tokens
read back without a device sync, and decoder-layer weights streamed from pinned host memory."""
from engine.streams.offload import LayerStreamer, OffloadPlan, layer_stream_bytes, plan_offload
from engine.streams.streams import FakeStreams, StepStreams, TokenReadback

__all__ = ["FakeStreams", "LayerStreamer", "OffloadPlan", "StepStreams", "TokenReadback",
           "layer_stream_bytes", "plan_offload"]
