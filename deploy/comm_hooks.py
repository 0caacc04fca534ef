"""DDP communication hooks: PyTorch's own (fp16/bf16, PowerSGD) and Fedge's codecs over allgather.

A hook is ``hook(state, bucket) -> Future[Tensor]`` (``torch.distributed.algorithms.ddp_comm_hooks``).
Quantizers and sparsifiers are not allreduce-compatible (the sum of two encodings is not an
encoding), so the Fedge hook encodes each bucket with error feedback (one residual per bucket index,
kept in the hook state), all-gathers every rank's payload and decodes the average. Traffic grows with
the number of ranks, which is why aggressive codecs belong on the edge uplink rather than in a data
centre (Agarwal et al., MLSys 2022); the hook exists to measure exactly that.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime and
# rejects string annotations ("bucket annotation should be dist.GradBucket").
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fedge.compression import Codec, ErrorFeedback

__all__ = ["CodecHookState", "codec_hook"]


@dataclass
class CodecHookState:
    codec: Codec
    process_group: "dist.ProcessGroup | None" = None
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    bytes_sent: int = 0  # this rank's encoded payload bytes, headers included
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))

    def __setstate__(self, state: "dict") -> None:  # checkpointable like PowerSGDState
        self.__dict__.update(state)


def codec_hook(state: CodecHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Encode this rank's bucket (on the host: the codecs are CPU code), all-gather every rank's
    payload on the bucket's own device (what the backend carries: CUDA tensors for NCCL, which
    refuses CPU ones, CPU tensors for gloo), and decode their average back onto that device."""
    grad = bucket.buffer()
    wire = grad.device  # where the collectives' tensors must live
    world = dist.get_world_size(state.process_group)
    ef = ErrorFeedback(state.codec, grad.numel(), state.residuals.get(bucket.index()))
    payload = ef.encode(grad.detach().float().cpu(), state.generator)
    state.residuals[bucket.index()] = ef.residual
    state.bytes_sent += len(payload)

    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    # Sparse payloads differ in length across ranks: agree on the longest, pad, gather, trim.
    length = torch.tensor([data.numel()], dtype=torch.long, device=wire)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=state.process_group)
    longest = int(max(int(n) for n in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8, device=wire)
    padded[: data.numel()] = data.to(wire)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=wire) for _ in range(world)]
    dist.all_gather(gathered, padded, group=state.process_group)

    mean = torch.zeros(grad.numel(), dtype=torch.float32)
    for received, n in zip(gathered, lengths):
        state.codec.decode_into(received[: int(n)].cpu().numpy().tobytes(), mean, 1.0 / world)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(mean.to(device=grad.device, dtype=grad.dtype).view_as(grad))
    return future
