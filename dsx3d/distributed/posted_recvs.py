"""Pipeline receives posted before the instruction that needs them.

Gloo's TCP transport writes a send's payload only once the receiver has posted the matching receive: the
sender announces the send, the receiver answers when it posts its receive, and only then does the sender's
transport thread write the data (gloo/transport/tcp/pair.cc, `Pair::send` and `Pair::recv`). A receive posted
at the moment its pass needs the data therefore starts the transfer then, from a transport thread that competes
for the sender's core with the sender's next pass, and the receiver waits for it. A receive posted as soon as
its buffer is free lets the payload travel when the sender sends it.

`PostedRecvs.post` posts, for each given tensor, a receive into a fresh tensor of its shape and dtype; within
`receiving(p2p)`, DeepSpeed's `p2p.recv` into one of the given tensors waits for that receive and copies the
message in. The given tensor is thus written when DeepSpeed receives into it, never earlier: DeepSpeed's
pipeline engine receives activations and gradients into views of the same buffers (`_allocate_or_extend_buffers`),
so a receive posted into them directly could overwrite one while the other is in use. A receive into any other
tensor while receives are posted is refused: messages from one peer arrive in the order their receives were
posted, so it would take the posted message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist


class PostedRecvs:
    def __init__(self) -> None:
        self.works: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}

    def post(self, tensors: Iterable[torch.Tensor], src_rank: int) -> None:
        """Post a receive from `src_rank` for each of `tensors`, in order, each into a tensor of its own."""
        for tensor in tensors:
            landing = torch.empty_like(tensor)
            self.works[id(tensor)] = (dist.irecv(landing, src_rank), tensor, landing)

    def pending(self) -> int:
        return len(self.works)

    @contextlib.contextmanager
    def receiving(self, p2p: Any) -> Iterator[None]:
        """Within the block, `p2p.recv(tensor, src_stage)` (DeepSpeed's pipe p2p module) waits for the receive
        posted into `tensor`, or receives as usual when none is posted."""
        blocking = p2p.recv

        def recv(tensor: torch.Tensor, src_stage: int, async_op: bool = False) -> None:
            posted = self.works.pop(id(tensor), None)
            if posted is not None and posted[1] is tensor:
                posted[0].wait()
                tensor.copy_(posted[2])
                return None
            if posted is not None or self.works:
                raise RuntimeError(
                    "pipeline receive into a tensor without a posted receive while other receives are posted: "
                    "it would take their message"
                )
            return blocking(tensor, src_stage, async_op)

        p2p.recv = recv
        try:
            yield
        finally:
            p2p.recv = blocking
